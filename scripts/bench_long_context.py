#!/usr/bin/env python
"""Long context: one LoRA training step at batch 1 (--batch) and seq 512 / 2048 / 4096, its planned device memory
(O(S): no S x S attention buffer) and its speed against PyTorch bf16 SDPA eager of the same shape.

    python scripts/bench_long_context.py export --model smollm2-135m   # here: bench/long_context_<model>_1x<S>[_ckpt].pte
    python scripts/bench_long_context.py export --model llama-3.2-1b   #   and bench/results/long_context_cpu_<model>.json
    python3 scripts/bench_long_context.py run bench/long_context_*.pte --machine h100   # the GPU machine

export (torch + executorch): the step of scripts/bench_step.py (SmolLM2-135M's or Llama-3.2-1B's shapes,
q4gsw bases, LoRA rank 16 on q/k/v/o/gate/up/down, synthetic constants: a .pte of a few MiB) for each
--seqs at batch 1 (or --batch B: files _<B>x<S>), without and with `--activation-checkpointing every-layer`
(the `_ckpt` files), the rope
tables as long as the longest sequence. For each it reads the lowered blob's memory plan: the planned
bytes (what `vktrain inspect` prints), the largest planned tensors, and every tensor with two dimensions
of S (an attention score matrix would be [.., S, S]); the table is written as JSON to
bench/results/long_context_cpu_<model>.json (the plan is the host's: no device is involved).

run (numpy + vulkan; torch for the baseline): each .pte through scripts/bench_step.py's run_one (vktrain
step ms by wall clock and GPU timestamps, device buffers), and PyTorch's bf16 autocast eager step of the
same model (scripts/bench_step_torch.py: SDPA attention, the same q4gsw codes dequantized, LoRA, fused
AdamW) with its peak CUDA memory; JSON per model to bench/results/long_context_<machine>_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step  # noqa: E402
from bench_results import RESULTS_DIR, result_name, write_run  # noqa: E402

BENCHMARK = "long_context"
MODELS = (bench_step.FULL_PRESET, *bench_step.DERIVED_MODELS)
DEFAULT_SEQS = (512, 2048, 4096)
CHECKPOINTING = "every-layer"
PTE_LIMIT_BYTES = 30 * 1024 * 1024


def _seqs(text: str) -> list[int]:
    values = [item.strip() for item in text.split(",")]
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise argparse.ArgumentTypeError(f"--seqs {text!r}: expected a comma-separated list of positive integers")
    return [int(v) for v in values]


def plan_report(graph, seq: int, top: int = 6) -> dict:
    """What the blob's memory plan holds: planned bytes, the `top` largest planned tensors, and every
    non-constant tensor with two dimensions of S (an S x S score matrix would be one; so is a [1, S, dim]
    activation where the model's dim equals S: read the names)."""
    from vktrain.serialization import graph as vk

    tensors = []
    for value_id, value in enumerate(graph.values):
        if not isinstance(value, vk.TensorValue) or value.constant_id >= 0 or value.is_view:
            continue
        tensors.append((value.nbytes, value_id, value))
    planned = [t for t in tensors if t[2].mem_obj_id >= 0]
    planned.sort(key=lambda t: -t[0])
    square = [t for t in tensors if list(t[2].shape).count(seq) >= 2]
    return {
        "planned_bytes": int(graph.metadata.get("planned_memory_bytes", 0)),
        "unplanned_bytes": int(graph.metadata.get("unplanned_memory_bytes", 0)),
        "state_bytes": int(graph.metadata.get("state_bytes", 0)),
        "memory_objects": len(graph.memory_objects),
        "largest_planned": [{"name": v.name, "shape": list(v.shape), "bytes": n} for n, _, v in planned[:top]],
        "tensors_with_two_dims_of_seq": group_by_shape([v for _, _, v in square]),
    }


def group_by_shape(values) -> list[dict]:
    """[{"shape", "count", "names": the first three}] of tensor values, by shape."""
    groups: dict[tuple, list[str]] = {}
    for value in values:
        groups.setdefault(tuple(value.shape), []).append(value.name)
    return [{"shape": list(shape), "count": len(names), "names": names[:3]} for shape, names in groups.items()]


def export_command(args) -> int:
    from vktrain.backend import metadata_spec, synthetic_constants_spec
    from vktrain.contract import METADATA_ACTIVATION_CHECKPOINTING
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.serialization import deserialize_blob
    from vktrain.serialization.pte import PteFile

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model = bench_step.build_bench_model(args.model, max_seq_len=max(args.seqs))
    fields = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in asdict(model.config).items()}
    rows = []
    for seq in args.seqs:
        for checkpointing in (None, CHECKPOINTING):
            config = bench_step.BenchConfig(args.model, fields, args.batch, seq, bench_step.LORA_RANK,
                                            bench_step.LORA_ALPHA,
                                            list(bench_step.LORA_TARGETS), bench_step.GROUP_SIZE, args.min_bytes)
            start = time.perf_counter()
            program = export_training_step(model, (args.batch, seq), activation_checkpointing=checkpointing)
            specs = synthetic_constants_spec(args.min_bytes) + [
                metadata_spec(bench_step.BENCH_CONFIG_KEY, json.dumps(asdict(config)))]
            if checkpointing:
                specs.append(metadata_spec(METADATA_ACTIVATION_CHECKPOINTING, checkpointing))
            data = lower_to_pte(program, VktrainPartitioner(compile_specs=specs))
            del program
            path = args.out_dir / f"{BENCHMARK}_{args.model}_{args.batch}x{seq}{'_ckpt' if checkpointing else ''}.pte"
            path.write_bytes(data)
            graph = deserialize_blob(PteFile.load(path).execution_plan("forward").delegates[0].data)
            row = {"pte": str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path),
                   "seq": seq, "batch": args.batch, "activation_checkpointing": checkpointing or "none",
                   "pte_bytes": len(data), "export_s": round(time.perf_counter() - start, 1),
                   **plan_report(graph, seq)}
            rows.append(row)
            print(f"{path}: {len(data) / 2**20:.1f} MiB; planned {row['planned_bytes'] / 2**30:.3f} GiB, "
                  f"largest {row['largest_planned'][0]['name']} {row['largest_planned'][0]['shape']}; "
                  f"tensors with two dims of S: {sum(g['count'] for g in row['tensors_with_two_dims_of_seq'])}", flush=True)
            if len(data) > PTE_LIMIT_BYTES:
                print(f"WARNING: {path} is over {PTE_LIMIT_BYTES / 2**20:.0f} MiB", file=sys.stderr)
    for checkpointing in ("none", CHECKPOINTING):  # O(S): planned bytes per token, seq to seq
        series = [r for r in rows if r["activation_checkpointing"] == checkpointing]
        print(f"{checkpointing}: planned bytes per token " + ", ".join(
            f"{r['batch']}x{r['seq']}: {r['planned_bytes'] / (r['batch'] * r['seq']) / 2**20:.2f} MiB" for r in series))
    out = args.out or RESULTS_DIR / result_name(BENCHMARK, "cpu", args.model)
    out.write_text(json.dumps({"meta": {"model": args.model, "what": "planned device memory of the lowered step "
                                        "(host-side memory plan; no device)",
                                        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                               "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def run_command(args) -> int:
    from vktrain.runtime import Device

    torch, torch_device, note = bench_step.load_torch(None)
    options = SimpleNamespace(precision=args.precision, batches=1, load_only=False, warmup=args.warmup,
                              steps=args.steps, top=8, torch_device=None, torch_variants=["bf16"])
    by_model: dict[str, list] = {}
    cache: dict = {}  # one model's host arrays for the baseline, built once for its steps
    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "torch": None if torch is None else torch.__version__,
                "torch_device_name": torch.cuda.get_device_name(torch_device)
                if torch is not None and torch_device.type == "cuda" else note,
                "warmup": args.warmup, "steps": args.steps, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
                "note": "synthetic constants: speed and memory only; torch: bf16 autocast eager, SDPA attention"}
        for path in args.pte:
            record = bench_step.run_one(Path(path), device, options, torch, torch_device, note, cache)
            bf16 = record.get("torch_variants", {}).get("bf16", {})
            summary = {"vk_ms": record["vk"]["ms_per_step"], "vk_device_buffers_bytes":
                       record["vk_memory"]["device_buffers_bytes"], "torch_bf16_ms": bf16.get("ms_per_step"),
                       "torch_bf16_peak_bytes": bf16.get("peak_memory_bytes")}
            record["summary"] = summary
            print(f"{path}: {json.dumps(summary)}", flush=True)
            by_model.setdefault(record["preset"], []).append(record)
    for model, records in by_model.items():
        out = args.out_dir / result_name(BENCHMARK, args.machine, model)
        write_run(out, {"meta": meta, "results": records}, key=lambda r: r["pte"])
        print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export the steps and their memory plans (needs executorch)")
    export.add_argument("--model", choices=MODELS, default="smollm2-135m")
    export.add_argument("--seqs", type=_seqs, default=list(DEFAULT_SEQS))
    export.add_argument("--batch", type=int, default=1, help="the steps' batch (default 1; 4 with --seqs 512: "
                        "the 4 x 512 shape of activation checkpointing's step-time goal)")
    export.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench")
    export.add_argument("--min-bytes", type=int, default=bench_step.FULL_SYNTHETIC_MIN_BYTES)
    export.add_argument("--out", type=Path, default=None, help="the planned-memory JSON (default: "
                        "bench/results/long_context_cpu_<model>.json)")
    run = commands.add_parser("run", help="time the steps on Vulkan and PyTorch bf16 SDPA eager (GPU machine)")
    run.add_argument("pte", nargs="+")
    run.add_argument("--machine", required=True, choices=("h200", "h100", "lavapipe"))
    run.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    run.add_argument("--steps", type=int, default=3)
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--precision", default="auto", help="vktrain's GEMM precision policy (default auto)")
    args = parser.parse_args(argv)
    return export_command(args) if args.command == "export" else run_command(args)


if __name__ == "__main__":
    sys.exit(main())

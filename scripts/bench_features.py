#!/usr/bin/env python
"""Issue 27's training features on SmolLM2-135M-Instruct (the bundled GGUF), measured through the user's commands.

    python scripts/bench_features.py export                          # here (needs executorch): .dev_gpu/features/
    python3 scripts/bench_features.py run .dev_gpu/features --out features.json   # the GPU machine (< 4 min, H100)
    python scripts/bench_features.py plot features.json              # the PNG, where `run` found no matplotlib
    python scripts/bench_features.py export --smoke                  # lavapipe: a one-layer model with SmolLM2's
    python scripts/bench_features.py run .dev_gpu/features_smoke --smoke --out smoke.json   # tokenizer, 1-2 steps

export (`vktrain export`, --lora-rank 16 --lora-alpha 32, --calibration-data none, into --out-dir):
  grad_accum_micro.pte   4 x 256 with --grad-accum (its accumulate method)    | gradient accumulation:
  grad_accum_full.pte   16 x 256 without                                     |   4 micro-batches = 1 batch
  packing_{documents,none}_4x512.pte   scripts/bench_packing.py's export (document-masked packing vs padding)
  dpo.pte, orpo.pte      --objective dpo / orpo --batch 1 --seq 128 --grad-accum (preference pairs)

run (numpy + the vulkan binding; no torch, no executorch): each feature through the command a user types,
`python3 -m vktrain.cli train|eval ... --json F` as a subprocess (this checkout first on PYTHONPATH), the
bundled unit-conversion chats (vktrain/data/unit_conversions.*.jsonl):
  * grad_accum: `train grad_accum_micro.pte --grad-accum 4` against `train grad_accum_full.pte`, same steps, lr,
    seed: both loss curves and their largest relative difference (the same 16 windows each optimizer step:
    TokenBatcher's window order does not depend on the batch size), tokens/s per step (the median of the
    records' step seconds) and end to end (the command's wall clock, load included); and, in this process on a
    fresh Device each, the device memory after one optimizer step (4 micro-batches: accumulate x 3, step;
    the one full step; and the micro-batch's step alone, without the accumulate method): the allocator's bytes
    in use and peak reserved, the step executor's buffers, the memory plan's bytes;
  * packing: scripts/bench_packing.py's run (trained tokens/s packed against padded, one device);
  * dpo, orpo: pairs by scripts/conversion_pairs.py (the answer's number wrong by ten is the rejected one) of the
    training chats and of the held-out chats, written to a temporary folder; `vktrain eval PREF --data
    held-out` before, `vktrain train PREF --data train-pairs --grad-accum 2 --steps 16 --eval-data held-out
    --eval-every 8 --out-adapters DIR`, `vktrain eval PREF --data held-out --adapters DIR` after: preference
    loss and reward accuracy before / after (and whether train's evaluations equal eval's), seconds per step,
    window tokens/s (2 sides x S tokens a pair).
One JSON (--out), and its plot (--out's .png) where matplotlib imports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

import bench_packing  # noqa: E402
from vktrain.contract import CHOSEN_IDS  # noqa: E402
from conversion_pairs import conversion_pairs  # noqa: E402

DATA = REPO_ROOT / "vktrain" / "data"
CHATS, HELD_OUT = DATA / "unit_conversions.train.jsonl", DATA / "unit_conversions.heldout.jsonl"
MODEL = "smollm2-135m-instruct"
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
MICRO, FULL, PREFERENCE = "grad_accum_micro.pte", "grad_accum_full.pte", {"dpo": "dpo.pte", "orpo": "orpo.pte"}
# (micro-batch, full batch, packing shape, preference window) of the real run and of the lavapipe smoke run
SHAPES = {"real": ((4, 256), (16, 256), (4, 512), 128), "smoke": ((1, 32), (4, 32), (2, 64), 96)}
HPARAMS = np.array([1e-3, 0.9, 0.999, 1e-8, 0.01], np.float32)  # the memory probe's one step (values do not matter)


# ===================================================================================================
# export (torch + executorch)
# ===================================================================================================

def smoke_gguf(path: Path) -> None:
    """A one-layer llama of width 64 (random float32 weights) with SmolLM2-135M-Instruct's tokenizer and chat
    template copied from the bundled GGUF: the bundled chats tokenize as for the real model."""
    import gguf

    from vktrain.models.bundled import bundled_checkpoint

    source = gguf.GGUFReader(str(bundled_checkpoint(MODEL)))
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in (("context_length", 512), ("embedding_length", 64), ("block_count", 1),
                        ("feed_forward_length", 128), ("head_count", 2)):
        getattr(writer, f"add_{name}")(value)
    vocab = 0
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, kind, sub_type=sub)
            vocab = len(value) if name == "tokenizer.ggml.tokens" else vocab
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.ffn_norm.weight": (64,), "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64),
              "blk.0.ffn_down.weight": (64, 128),
              **{f"blk.0.attn_{n}.weight": (64, 64) for n in ("q", "k", "v", "output")}}
    for name, shape in shapes.items():  # norms 1, the rest small: finite logits
        array = np.ones(shape) if name.endswith("norm.weight") else 0.1 * rng.standard_normal(shape)
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_command(args) -> None:
    from vktrain.cli import main

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.smoke:
        model = str(out / "smoke.gguf")
        smoke_gguf(Path(model))
    micro, full, packing, window = SHAPES["smoke" if args.smoke else "real"]
    common = ["--model", model, *LORA, "--calibration-data", "none", "--overwrite"]
    exports = [(MICRO, ["--batch", str(micro[0]), "--seq", str(micro[1]), "--grad-accum"]),
               (FULL, ["--batch", str(full[0]), "--seq", str(full[1])])]
    exports += [(name, ["--batch", "1", "--seq", str(window), "--objective", objective, "--grad-accum"])
                for objective, name in PREFERENCE.items()]
    for name, flags in exports:
        started = time.perf_counter()
        if main(["export", *common, *flags, "--out", str(out / name)]):
            sys.exit(f"vktrain export {name} failed")
        print(f"{out / name}: {(out / name).stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s",
              flush=True)
    started = time.perf_counter()
    bench_packing.export(SimpleNamespace(model=model, shape=packing, out_dir=str(out), lora_alpha=32.0))
    print(f"packing: {time.perf_counter() - started:.0f} s", flush=True)


# ===================================================================================================
# run (numpy + vulkan: the GPU machine)
# ===================================================================================================

def vktrain(*arguments: str) -> float:
    """Run `python -m vktrain.cli ARGUMENTS` (this checkout first on the path); its wall-clock seconds."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vktrain.cli", *arguments], env=environment, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    print(done.stdout, end="", flush=True)
    if done.returncode:
        sys.exit(f"vktrain {' '.join(arguments)}: exit {done.returncode}")
    return seconds


def device_memory(path: Path, grad_accum: int, precision: str) -> dict:
    """Device memory after one optimizer step of `path` (grad_accum micro-batches), on a fresh Device."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime import Device
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.serialization.tokenizer import program_tokenizer
    from vktrain.train.data import TokenBatcher, load_data

    with Device(validation=False) as device:
        with TrainingRunner.from_pte(path, device, planner=plan_schedule, precision=precision, timing=False) as runner:
            batch, seq = runner.batch_shape
            data = load_data(CHATS, runner.vocab_size, program_tokenizer(runner, str(path)))
            batcher = TokenBatcher(data.tokens, batch, seq, labels=data.labels)
            micro = [batcher.batch(position) for position in range(grad_accum)]
            n_valid = float(sum(np.count_nonzero(labels >= 0) for _, labels in micro))
            for token_ids, labels in micro[:-1]:
                runner.accumulate(token_ids, labels, n_valid)
            runner.step(*micro[-1], HPARAMS, n_valid=n_valid)
            stats = device.memory_stats()
            metadata = runner.graph.metadata
            return {"batch_shape": [batch, seq], "grad_accum": grad_accum, "device": device.name,
                    "bytes_in_use": stats.bytes_in_use, "peak_bytes_reserved": stats.peak_bytes_reserved,
                    "step_executor_buffer_bytes": int(sum(runner.executor.buffer_bytes.values())),
                    "planned_bytes": int(metadata.get("planned_memory_bytes", 0)),
                    "state_bytes": int(metadata.get("state_bytes", 0))}


def step_rates(records: list[dict], tokens_per_step: int, wall_s: float) -> dict:
    """ms per optimizer step (median of the records' step seconds, evaluations excluded) and tokens/s."""
    steps = [record for record in records if "loss" in record]
    seconds = [record["seconds"] for record in steps]
    median = statistics.median(seconds)
    return {"steps": len(steps), "tokens_per_step": tokens_per_step, "step_ms_median": 1e3 * median,
            "tokens_per_s_per_step": tokens_per_step / median,
            "tokens_per_s_loop": tokens_per_step * len(steps) / sum(seconds),
            "command_wall_s": wall_s, "tokens_per_s_end_to_end": tokens_per_step * len(steps) / wall_s}


def run_grad_accum(folder: Path, work: Path, args) -> dict:
    """`train micro --grad-accum N` against `train full`: losses, speed, device memory (module docstring)."""
    micro_path, full_path = folder / MICRO, folder / FULL
    full = device_memory(full_path, 1, args.precision)
    (micro_batch, seq), (full_batch, full_seq) = input_shape(micro_path, "token_ids"), full["batch_shape"]
    if full_seq != seq or full_batch % micro_batch:
        sys.exit(f"{full_path} ({full_batch} x {full_seq}) is not a whole number of {micro_path}'s micro-batches "
                 f"({micro_batch} x {seq})")
    grad_accum = full_batch // micro_batch
    accumulated = device_memory(micro_path, grad_accum, args.precision)
    micro_alone = device_memory(micro_path, 1, args.precision)  # its step alone: no accumulate method loaded
    common = ["--data", str(CHATS), "--steps", str(args.grad_accum_steps), "--lr", str(args.lr), "--seed", "0",
              "--no-progress", "--log-every", "0", "--precision", args.precision, "--overwrite"]
    runs = {}
    for name, path, flags, memory in (("accumulated", micro_path, ["--grad-accum", str(grad_accum)], accumulated),
                                      ("full", full_path, [], full)):
        records_path = work / f"grad_accum_{name}.json"
        wall = vktrain("train", str(path), *common, *flags, "--json", str(records_path))
        records = json.loads(records_path.read_text())
        runs[name] = {"pte": path.name, "command": f"vktrain train {path.name} {' '.join(flags)}".strip(),
                      "losses": [record["loss"] for record in records], "memory": memory,
                      **step_rates(records, full_batch * seq, wall)}
    pairs = list(zip(runs["accumulated"]["losses"], runs["full"]["losses"]))
    return {"micro_batch": [micro_batch, seq], "batch": [full_batch, seq], "grad_accum": grad_accum,
            "steps": args.grad_accum_steps, "lr": args.lr,
            "loss_max_relative_difference": max(abs(a - b) / abs(b) for a, b in pairs),
            "memory_in_use_accumulated_over_full": accumulated["bytes_in_use"] / full["bytes_in_use"],
            "memory_in_use_accumulated_over_micro_step_alone":
                accumulated["bytes_in_use"] / micro_alone["bytes_in_use"],
            "micro_step_alone_memory": micro_alone,
            "tokens_per_s_accumulated_over_full": runs["accumulated"]["tokens_per_s_per_step"]
            / runs["full"]["tokens_per_s_per_step"], **runs}


def input_shape(path: Path, name: str) -> list[int]:
    """The shape of the training step's input `name` in a .pte, read without a device."""
    from vktrain.contract import TRAIN_METHOD
    from vktrain.serialization import deserialize_blob
    from vktrain.serialization.pte import PteFile

    pte = PteFile.load(path)
    graph = deserialize_blob(pte.execution_plan(TRAIN_METHOD).delegates[0].data, verify_constants=False,
                             named_data=pte.named_data)
    (value,) = [graph.values[i] for i in graph.inputs if graph.values[i].name == name]
    return list(value.shape)


def run_packing(folder: Path, args) -> dict:
    """scripts/bench_packing.py's run on the two packing files of `folder`."""
    (packed,), (padded,) = (sorted(folder.glob(f"packing_{kind}_*.pte")) for kind in ("documents", "none"))
    return bench_packing.run(SimpleNamespace(packed=packed, padded=padded, steps=args.packing_steps,
                                             warmup=args.packing_warmup, precision=args.precision, out=None))


def write_pairs(work: Path, limit: int | None, held_out_limit: int | None) -> tuple[Path, Path]:
    """The training chats' and the held-out chats' pairs (scripts/conversion_pairs.py) as .jsonl in `work`."""
    paths = []
    for chats, name, count in ((CHATS, "train_pairs.jsonl", limit), (HELD_OUT, "heldout_pairs.jsonl", held_out_limit)):
        path = work / name
        path.write_text("".join(json.dumps(row) + "\n" for row in conversion_pairs(chats, count)), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def run_preference(objective: str, folder: Path, work: Path, train_pairs: Path, held_out: Path, args) -> dict:
    """eval before, train with held-out evaluations, eval after, of one preference .pte (module docstring)."""
    path = folder / PREFERENCE[objective]
    before, after, records_path = (work / f"{objective}_{name}.json" for name in ("before", "after", "train"))
    adapters = work / f"{objective}_adapters"
    eval_before_s = vktrain("eval", str(path), "--data", str(held_out), "--precision", args.precision,
                            "--json", str(before), "--overwrite")
    wall = vktrain("train", str(path), "--data", str(train_pairs), "--grad-accum", str(args.pairs_per_step),
                   "--steps", str(args.preference_steps), "--lr", str(args.lr), "--eval-data", str(held_out),
                   "--eval-every", str(args.preference_eval_every), "--out-adapters", str(adapters),
                   "--precision", args.precision, "--no-progress", "--log-every", "0", "--json", str(records_path),
                   "--overwrite")
    eval_after_s = vktrain("eval", str(path), "--data", str(held_out), "--adapters", str(adapters),
                           "--precision", args.precision, "--json", str(after), "--overwrite")
    records = json.loads(records_path.read_text())
    first, last = json.loads(before.read_text()), json.loads(after.read_text())
    evaluated = [{key: record[key] for key in ("step", "eval_loss", "eval_reward_accuracy")}
                 for record in records if "eval_loss" in record]
    window = input_shape(path, CHOSEN_IDS)[-1]
    return {"pte": path.name, "window": window, "pairs_per_step": args.pairs_per_step,
            "steps": args.preference_steps, "lr": args.lr,
            "held_out_pairs": first["pairs"], "before": first, "after": last, "evaluations": evaluated,
            "losses": [record["loss"] for record in records if "loss" in record],
            "train_eval_equals_vktrain_eval": (evaluated[0]["eval_loss"], evaluated[0]["eval_reward_accuracy"],
                                               evaluated[-1]["eval_loss"], evaluated[-1]["eval_reward_accuracy"])
            == (first["loss"], first["reward_accuracy"], last["loss"], last["reward_accuracy"]),
            "eval_before_s": eval_before_s, "eval_after_s": eval_after_s,
            **step_rates(records, args.pairs_per_step * 2 * window, wall)}


def run_command(args) -> int:
    from bench_results import out_error

    folder = Path(args.folder)
    if out_error(Path(args.out)):
        sys.exit(out_error(Path(args.out)))
    if args.smoke:
        args.grad_accum_steps, args.packing_steps, args.packing_warmup = 2, 1, 1
        args.preference_steps, args.preference_eval_every, args.train_pairs, args.held_out_pairs = 2, 1, 8, 3
    started = time.perf_counter()
    result = {"meta": {"script": "scripts/bench_features.py", "folder": str(folder), "host": platform.node(),
                       "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "precision": args.precision,
                       "python": platform.python_version(), "smoke": args.smoke,
                       "pte_bytes": {p.name: p.stat().st_size for p in sorted(folder.glob("*.pte"))}}}
    with tempfile.TemporaryDirectory(prefix="bench_features_") as temporary:
        work = Path(temporary)
        result["grad_accum"] = run_grad_accum(folder, work, args)
        result["packing"] = run_packing(folder, args)
        train_pairs, held_out = write_pairs(work, args.train_pairs, args.held_out_pairs)
        for objective in PREFERENCE:
            result[objective] = run_preference(objective, folder, work, train_pairs, held_out, args)
    result["meta"]["device"] = result["grad_accum"]["full"]["memory"]["device"]
    result["meta"]["total_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"wrote {out} in {result['meta']['total_s']:.0f} s")
    try:
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    except ImportError as exc:
        print(f"no plot ({exc}): python scripts/bench_features.py plot {out} makes it where matplotlib is")
    return 0


def summary(result: dict) -> str:
    accumulated, full = result["grad_accum"]["accumulated"], result["grad_accum"]["full"]
    lines = [f"grad-accum {result['grad_accum']['grad_accum']} x {result['grad_accum']['micro_batch']}: loss max rel. "
             f"difference {result['grad_accum']['loss_max_relative_difference']:.2e}; device memory in use "
             f"{accumulated['memory']['bytes_in_use'] / 2**30:.3f} vs "
             f"{full['memory']['bytes_in_use'] / 2**30:.3f} GiB (the micro-batch's step alone "
             f"{result['grad_accum']['micro_step_alone_memory']['bytes_in_use'] / 2**30:.3f}); "
             f"tokens/s {accumulated['tokens_per_s_per_step']:.0f} vs {full['tokens_per_s_per_step']:.0f} per step, "
             f"{accumulated['tokens_per_s_end_to_end']:.0f} vs {full['tokens_per_s_end_to_end']:.0f} end to end",
             f"packing: trained tokens/s packed / padded "
             f"{result['packing']['packed_over_padded_trained_tokens_per_s']:.2f}"]
    for objective in PREFERENCE:
        r = result[objective]
        lines.append(f"{objective}: held-out loss {r['before']['loss']:.4f} -> {r['after']['loss']:.4f}, reward "
                     f"accuracy {r['before']['reward_accuracy']:.1%} -> {r['after']['reward_accuracy']:.1%} "
                     f"({r['held_out_pairs']} pairs); {r['step_ms_median']:.0f} ms a step of {r['pairs_per_step']} "
                     f"pairs; train's evals equal eval's: {r['train_eval_equals_vktrain_eval']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 + len(PREFERENCE), figsize=(18, 4), dpi=100)
    grad = result["grad_accum"]
    for name, style in (("full", "-"), ("accumulated", "--")):
        losses = grad[name]["losses"]
        axes[0].plot(range(1, len(losses) + 1), losses, style, label=grad[name]["command"])
    axes[0].set(title=f"gradient accumulation (max rel. diff {grad['loss_max_relative_difference']:.1e})",
                xlabel="step", ylabel="training loss")
    axes[0].legend(fontsize=7)
    packing = result["packing"]
    axes[1].bar(["packed (documents)", "padded"], [packing["packed"]["trained_tokens_per_s"],
                                                   packing["padded"]["trained_tokens_per_s"]], color=["C2", "C7"])
    axes[1].set(title="packing: trained tokens/s", ylabel="trained tokens / s")
    for ax, objective in zip(axes[2:], PREFERENCE):
        evaluated = result[objective]["evaluations"]
        steps = [e["step"] for e in evaluated]
        ax.plot(steps, [e["eval_loss"] for e in evaluated], "o-", color="C3", label="held-out loss")
        right = ax.twinx()
        right.plot(steps, [e["eval_reward_accuracy"] for e in evaluated], "s:", color="C0", label="reward accuracy")
        right.set(ylim=(0, 1), ylabel="held-out reward accuracy")
        ax.set(title=f"{objective.upper()}: {result[objective]['held_out_pairs']} held-out pairs", xlabel="step",
               ylabel="held-out preference loss")
        ax.legend(*[sum(x, []) for x in zip(ax.get_legend_handles_labels(), right.get_legend_handles_labels())],
                  fontsize=7, loc="center right")
    fig.suptitle(f"{result['meta'].get('device', '')}: vktrain's training features on the bundled chats", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="here (needs executorch): the .pte files")
    exporting.add_argument("--model", default=MODEL)
    exporting.add_argument("--out-dir", type=Path, default=None,
                           help="default .dev_gpu/features (with --smoke: .dev_gpu/features_smoke)")
    exporting.add_argument("--smoke", action="store_true", help="a one-layer model with SmolLM2's tokenizer, small "
                           "shapes (the lavapipe smoke test of `run`)")
    running = commands.add_parser("run", help="the GPU machine: the commands, one JSON (+ PNG)")
    running.add_argument("folder", help="the folder `export` wrote")
    running.add_argument("--out", required=True, help="the JSON to write (the plot: its .png)")
    running.add_argument("--precision", default="auto")
    running.add_argument("--lr", type=float, default=1e-3)
    running.add_argument("--grad-accum-steps", type=int, default=30)
    running.add_argument("--packing-steps", type=int, default=20)
    running.add_argument("--packing-warmup", type=int, default=3)
    running.add_argument("--preference-steps", type=int, default=16)
    running.add_argument("--preference-eval-every", type=int, default=8)
    running.add_argument("--pairs-per-step", type=int, default=2, help="train's --grad-accum on the pairs")
    running.add_argument("--train-pairs", type=int, default=None, help="the first N training chats (default all)")
    running.add_argument("--held-out-pairs", type=int, default=None, help="the first N held-out chats (default all)")
    running.add_argument("--smoke", action="store_true", help="1-2 steps each, a few pairs (lavapipe)")
    plotting = commands.add_parser("plot", help="the PNG of a run's JSON (needs matplotlib)")
    plotting.add_argument("json")
    plotting.add_argument("--out", default=None, help="default: the JSON's .png")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args)
    if args.command == "plot":
        path = Path(args.json)
        plot(json.loads(path.read_text()), Path(args.out) if args.out else path.with_suffix(".png"))
        return 0
    if args.command == "export":
        args.out_dir = args.out_dir or REPO_ROOT / ".dev_gpu" / ("features_smoke" if args.smoke else "features")
        export_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

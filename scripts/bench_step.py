#!/usr/bin/env python
"""Benchmark one LoRA training step at Llama-3.2-1B shapes: vktrain on Vulkan vs PyTorch eager (CUDA).

    python scripts/bench_step.py export                      # here (needs executorch): bench/step_1x128.pte,
                                                             #   bench/step_4x512.pte
    python scripts/bench_step.py export --model smollm2-135m # bench/step_smollm2-135m_{1x512,4x512}.pte
    python3 scripts/bench_step.py run bench/step_*.pte --precisions fp16-tc,fp32 \
        --out-dir bench/results --machine h200 --budget-s 540  # GPU machine: the whole table, one call
    python scripts/bench_step.py --quick                     # tiny-llama shapes, export + run (lavapipe, CI)

export: builds Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied
embeddings; or, with --model smollm2-135m, SmolLM2-135M's shapes: hidden 576, 30 layers, 9/3 heads,
MLP 1536, vocab 49152, tied) with q4gsw bases (group 32) and LoRA rank 16 on q/k/v/o/gate/up/down, exports the whole
training step (forward, fused CE, backward, AdamW) for each batch x seq and lowers it with SYNTHETIC
constants (vktrain.backend.synthetic_constants_spec): the weights, scales and embedding are generated
from seeds when the .pte is loaded, so a 1B step travels as a few MiB. The numbers measure speed, not a
trained model. The base weights are random codes from the start (no fp32 weights are built and
quantized): the graph, shapes and dtypes are exactly those of build_llama + apply_lora. Each .pte must
stay under 64 MiB (what travels to the GPU machine); the 1B ones are ~21 MiB (the LoRA init is real).

run: loads each .pte with TrainingRunner once per precision policy (`--precisions`), warms up, times steps
(wall clock per step, tokens/s, GPU timestamps aggregated by op kind and GEMM shape), reports device memory (the
executor's buffers and the blob's planned memory), then, once per .pte, in the first policy's record, the same
step in PyTorch eager (scripts/bench_step_torch.py): a Llama written with standard ops (q4gsw bases
dequantized on the GPU every step from the same packed codes and scales, LoRA adapters, RMSNorm, rope,
SDPA with GQA by repeat_interleave, SwiGLU, F.cross_entropy), fused AdamW on the LoRA tensors, timed
with CUDA events, in each of the precisions a user of the GPU would pick (`--torch-variants`, written
under `torch_variants`): fp32 with TF32 off (`fp32`, also written as `torch`), TF32 matmuls (`tf32`),
bf16 autocast (`bf16`) and bf16 autocast with the loss compiled by torch.compile (`bf16_compile`; its
compilation happens in the warm-up steps and is reported as `first_step_s`). Both sides start from the
same weights (the synthetic constants, the exported LoRA init), take the same batches and
hyper-parameters, so their losses must agree: the report gives the largest relative loss difference
of fp32 (and of each variant, which for bf16 measures bf16's own drift), against vktrain's fp32 losses
where the call timed fp32. Needs numpy, vulkan, flatbuffers; torch and
matplotlib are optional (no baseline / no plot without them). `run --load-only` only loads each .pte
(generates the constants, builds every pipeline, records the step): with no shader compiler around, it
proves the prebuilt SPIR-V cache holds every shader the step needs. The .pte files may be of several models:
`--out-dir DIR --machine M` writes each model's records to DIR/step_M_<model>.json and the whole table to
DIR/step_table_M.json (bench_step_table.py: phases, budget, files, table); the compiled PyTorch variants run
after every .pte's other phases, and `--budget-s` starts no phase past it.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

STARTED = time.monotonic()  # the budget and the elapsed time printed at the end count from here

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its PyTorch and report halves, when imported by path

from vktrain import quant  # noqa: E402
from vktrain.contract import PRECISION_CHOICES, PRECISION_FP32, PRECISIONS  # noqa: E402
from vktrain.train.interrupts import Interrupted, StopOnSignal  # noqa: E402

from bench_step_gemm_rates import add_rates, add_torch_rates, gemm_shapes  # noqa: E402
from bench_step_report import print_report  # noqa: E402
from bench_step_table import Clock, ResultFiles, output_paths, print_table, table_rows  # noqa: E402
from bench_results import MACHINES, out_error  # noqa: E402
from bench_step_torch import TORCH_VARIANTS, load_torch, time_torch  # noqa: E402

FULL_PRESET, QUICK_PRESET = "llama-3.2-1b", "tiny-llama"
FULL_SHAPES, QUICK_SHAPES = ((1, 128), (4, 512)), ((1, 16), (2, 32))
# Benchmark models that are a Llama preset with other shapes: name -> (preset, LlamaConfig overrides,
# default batch x seq shapes). SmolLM2-135M's config.json: hidden 576, 30 layers, 9 heads / 3 kv heads,
# intermediate 1536, vocab 49152, rope_theta 100000 (no scaling), rms eps 1e-5, tied embeddings.
DERIVED_MODELS = {
    "smollm2-135m": ("llama-3.2-1b", dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                          hidden=1536, rope_theta=100000.0, rope_scaling=None),
                     ((1, 512), (4, 512))),
}
QUICK_OVERRIDES = dict(dim=64, n_layers=2, hidden=192)  # a smaller tiny-llama: quick mode runs in CI on lavapipe
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA, GROUP_SIZE = 16, 32.0, 32
# Constants at least this big (as stored) become synthetic. Full: every weight, scale and the embedding
# (the smallest scales are 128 KiB); norm weights (8 KiB), rope tables and the LoRA init stay real.
# Quick: low enough that norm weights and scales of tiny-llama take the synthetic path too.
FULL_SYNTHETIC_MIN_BYTES, QUICK_SYNTHETIC_MIN_BYTES = 64 * 1024, 256
PTE_LIMIT_BYTES = 64 * 1024 * 1024  # what travels to the GPU machine
BENCH_CONFIG_KEY = "bench_config"  # blob metadata: the JSON of BenchConfig
HPARAMS = (1e-3, 0.9, 0.999, 1e-8, 0.0)  # lr, beta1, beta2, eps, weight_decay (both sides)
# A CPU baseline of a model this big would take minutes per step: only on explicit request.
CPU_BASELINE_MAX_PARAMS = 100_000_000


@dataclass(frozen=True)
class BenchConfig:
    """What was exported; stored in the blob metadata so `run` needs nothing but the .pte."""

    preset: str
    model: dict  # LlamaConfig fields (rope_scaling as a dict or None)
    batch: int
    seq: int
    lora_rank: int
    lora_alpha: float
    lora_targets: list
    group_size: int
    synthetic_min_bytes: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.seq}"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"1x128,4x512" -> [(1, 128), (4, 512)]."""
    shapes = []
    for item in text.split(","):
        batch, sep, seq = item.strip().partition("x")
        if not (sep and batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not BATCHxSEQ with positive integers (e.g. 4x512)")
        shapes.append((int(batch), int(seq)))
    return shapes


# ===================================================================================================
# export (torch + executorch, on the build machine)
# ===================================================================================================

def random_flat_codes(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random q4gsw codes in the flat layout uint8 [N, Kp/2], padding codes 8 (vktrain.quant)."""
    flat = rng.integers(0, 256, size=(n, quant.padded_k(k) // 2), dtype=np.uint8)
    if quant.padded_k(k) != k:  # columns k >= K are padding and must hold code 8
        flat = quant.pack_flat(quant.unpack_flat(flat, k))
    return flat


def build_bench_model(preset: str, seed: int = 0, **overrides):
    """A Llama of `preset` with LoRA on LORA_TARGETS over random q4gsw bases, built cheaply.

    The module tree, names, shapes and dtypes equal build_llama(preset) + apply_lora(LoRAConfig(
    rank=LORA_RANK, alpha=LORA_ALPHA, targets=LORA_TARGETS, group_size=GROUP_SIZE)). The float weights
    are never built: the model is created on the meta device, each target linear becomes a LoRAQ4Linear
    over random codes with scales SYNTHETIC_SCALE (what the synthetic constants generate anyway), and
    the remaining parameters are materialised: 1-D (norm weights) as ones, others as N(0, 0.02).
    """
    import torch
    from torch import nn

    from vktrain.backend.preprocess import SYNTHETIC_SCALE, SYNTHETIC_WEIGHT_STD
    from vktrain.lora import LoRAQ4Linear
    from vktrain.models.llama import PRESETS, LlamaForCausalLM

    base, derived_overrides, _ = DERIVED_MODELS.get(preset, (preset, {}, ()))
    if base not in PRESETS:
        raise ValueError(f"unknown Llama preset {preset!r}; presets: {sorted(PRESETS) + sorted(DERIVED_MODELS)}")
    config = replace(PRESETS[base], **{**derived_overrides, **overrides})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    lora_generator = torch.Generator().manual_seed(seed)
    for path, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and path.rpartition(".")[2] in LORA_TARGETS):
            continue
        n, k = module.out_features, module.in_features
        quant.check_q4gsw_shapes(n, k, GROUP_SIZE)
        weights = torch.from_numpy(random_flat_codes(n, k, rng))
        scales = torch.full((k // GROUP_SIZE, n), SYNTHETIC_SCALE, dtype=torch.float32)
        adapter = LoRAQ4Linear(k, n, weights, scales, GROUP_SIZE, LORA_RANK, LORA_ALPHA, generator=lora_generator)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, adapter)

    weight_generator = torch.Generator().manual_seed(seed + 1)
    materialised: dict[int, nn.Parameter] = {}  # id of the meta parameter -> its replacement (keeps ties)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            if id(param) not in materialised:
                data = torch.empty(param.shape, dtype=param.dtype)
                if data.dim() == 1:
                    data.fill_(1.0)
                else:
                    data.normal_(0.0, SYNTHETIC_WEIGHT_STD, generator=weight_generator)
                materialised[id(param)] = nn.Parameter(data, requires_grad=False)
            setattr(module, name, materialised[id(param)])
    leftovers = [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
                 if t.device.type == "meta"]
    if leftovers:
        raise RuntimeError(f"build_bench_model left tensors on the meta device: {leftovers}")
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith((".lora_A", ".lora_B")))
    return model


def export_configs(preset: str, shapes: list[tuple[int, int]], out_dir: Path, min_bytes: int,
                   prefix: str = "step", target: str = "none", **overrides) -> list[dict[str, Any]]:
    """Export and lower one training step per (batch, seq); write <out_dir>/<prefix>_<B>x<S>.pte, with the
    schedules of `target` embedded (`vktrain export --target`; default none: the runtime plans at load)."""
    from tqdm import tqdm

    from vktrain.backend import metadata_spec, synthetic_constants_spec
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.serialization.pte import PteFile
    from vktrain.serialization import deserialize_blob
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tqdm(total=1 + 2 * len(shapes), desc="export", unit="stage") as progress:
        progress.set_postfix_str(f"building {preset}")
        start = time.perf_counter()
        model = build_bench_model(preset, **overrides)
        build_s = time.perf_counter() - start
        progress.update()
        model_fields = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                        for k, v in asdict(model.config).items()}
        for batch, seq in shapes:
            config = BenchConfig(preset, model_fields, batch, seq, LORA_RANK, LORA_ALPHA, list(LORA_TARGETS),
                                 GROUP_SIZE, min_bytes)
            progress.set_postfix_str(f"{config.label}: torch.export")
            start = time.perf_counter()
            program = export_training_step(model, (batch, seq))
            export_s = time.perf_counter() - start
            progress.update()
            progress.set_postfix_str(f"{config.label}: lowering")
            start = time.perf_counter()
            specs = synthetic_constants_spec(min_bytes) + [metadata_spec(BENCH_CONFIG_KEY, json.dumps(asdict(config)))]
            embedder = TargetEmbedder(resolve_targets(target)) if target != "none" else None
            data = lower_to_pte(program, VktrainPartitioner(compile_specs=specs), rewrite_blobs=embedder)
            lower_s = time.perf_counter() - start
            del program
            path = out_dir / f"{prefix}_{config.label}.pte"
            path.write_bytes(data)
            progress.update()
            graph = deserialize_blob(PteFile.load(path).execution_plan("forward").delegates[0].data)
            synthetic = json.loads(graph.metadata.get("synthetic_constants", "{}"))
            written.append({"path": str(path), "config": config.label, "pte_bytes": len(data),
                            "build_model_s": build_s, "export_s": export_s, "lower_s": lower_s,
                            "ops": len(graph.ops), "synthetic_constants": synthetic.get("count", 0),
                            "synthetic_bytes": synthetic.get("bytes", 0),
                            "kept_real": synthetic.get("kept_real", {})})
    for entry in written:
        size_mib = entry["pte_bytes"] / 2**20
        print(f"wrote {entry['path']}: {size_mib:.1f} MiB, {entry['ops']} ops, {entry['synthetic_constants']} "
              f"synthetic constants ({entry['synthetic_bytes'] / 2**30:.2f} GiB generated at load); "
              f"export {entry['export_s']:.0f} s, lower {entry['lower_s']:.0f} s (model built in "
              f"{entry['build_model_s']:.0f} s)")
        if entry["pte_bytes"] > PTE_LIMIT_BYTES:
            print(f"WARNING: {entry['path']} is {size_mib:.1f} MiB, over the {PTE_LIMIT_BYTES / 2**20:.0f} MiB "
                  f"that travel to the GPU machine; lower --min-bytes", file=sys.stderr)
    return written


# ===================================================================================================
# run (GPU machine: numpy + vulkan; torch optional)
# ===================================================================================================

def make_batch(config: BenchConfig, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, vocab, size=(config.batch, config.seq), dtype=np.int64)
    labels = rng.integers(0, vocab, size=(config.batch, config.seq), dtype=np.int64)
    return token_ids, labels


def op_kind(label: str) -> str:
    """Dispatch label -> the op it belongs to: "12:vktrain.adamw.default.vec4" -> "vktrain.adamw.default"
    (an op's dispatches carry a suffix after the op name), "state_update:<name>" -> "state_update"."""
    head, _, rest = label.partition(":")
    return ".".join(rest.split(".")[:3]) if head.isdigit() else head


def _top(totals: dict[str, list[float]], steps: int, limit: int) -> list[dict[str, Any]]:
    """The `limit` most expensive entries of `totals` (name -> seconds of every timed dispatch), each as
    {name, dispatches per step, mean ms per step, share of the GPU time}, most expensive first."""
    grand = sum(sum(v) for v in totals.values()) or 1.0
    rows = [{"name": name, "dispatches": len(times) // steps, "ms": 1e3 * sum(times) / steps,
             "share": sum(times) / grand} for name, times in totals.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:limit]


def time_vulkan(runner, config: BenchConfig, batches, warmup: int, steps: int, top: int) -> dict[str, Any]:
    """Warm up, then time `steps` steps: wall clock per step and GPU timestamps by op kind, shader and
    GEMM shape."""
    hparams = np.array(HPARAMS, dtype=np.float32)
    losses, wall = [], []
    by_op: dict[str, list[float]] = {}
    by_shader: dict[str, list[float]] = {}
    by_gemm: dict[str, list[float]] = {}
    gpu_step_s = []
    shaders = [d.shader for d in runner.executor.dispatches]
    shapes = gemm_shapes(runner.executor)
    for index in range(warmup + steps):
        token_ids, labels = batches[index % len(batches)]
        start = time.perf_counter()
        losses.append(runner.step(token_ids, labels, hparams))
        elapsed = time.perf_counter() - start
        if index < warmup:
            continue
        wall.append(elapsed)
        timings = runner.timings()
        if timings is None:
            continue
        gpu_step_s.append(sum(seconds for _, seconds in timings))
        for (label, seconds), shader in zip(timings, shaders):
            by_op.setdefault(op_kind(label), []).append(seconds)
            by_shader.setdefault(shader, []).append(seconds)
            head = label.partition(":")[0]
            if head.isdigit() and int(head) in shapes:
                by_gemm.setdefault(shapes[int(head)], []).append(seconds)
    median_s = statistics.median(wall)
    return {
        "ms_per_step": 1e3 * median_s, "ms_per_step_mean": 1e3 * statistics.fmean(wall),
        "ms_per_step_min": 1e3 * min(wall), "tokens_per_s": config.tokens / median_s,
        "gpu_ms_per_step": 1e3 * statistics.median(gpu_step_s) if gpu_step_s else None,
        "timing": "GPU timestamps" if gpu_step_s else "wall clock only (no timestamps on this queue)",
        "dispatches_per_step": len(shaders),
        "top_ops": _top(by_op, steps, top) if by_op else [],
        "top_shaders": _top(by_shader, steps, top) if by_shader else [],
        "top_gemms": add_rates(_top(by_gemm, steps, top), shapes) if by_gemm else [],
        "losses": losses,
    }


def baseline_arrays(graph, executor, config: BenchConfig) -> dict[str, np.ndarray]:
    """The host arrays the eager baseline starts from, read from the blob: flat q4gsw codes (unpacked from
    the W_4X8 constants with vktrain.quant), scales, embedding, norms, rope tables, LoRA init."""
    constants = {}
    for value_id, value in enumerate(graph.values):
        if getattr(value, "constant_id", -1) >= 0 and value.name:
            constants.setdefault(value.name, value_id)
    model = config.model
    arrays: dict[str, np.ndarray] = {}
    missing = []

    def constant(name: str) -> np.ndarray | None:
        if name not in constants:
            missing.append(name)
            return None
        return graph.constant_array(constants[name])

    embed_name = next((n for n in ("model.model.embed_tokens.weight", "model.lm_head.weight") if n in constants),
                      "model.model.embed_tokens.weight")
    arrays["embed"] = constant(embed_name)
    if not model["tie_embeddings"]:
        arrays["lm_head"] = constant("model.lm_head.weight")
    arrays["norm"] = constant("model.model.norm.weight")
    arrays["rope_cos"], arrays["rope_sin"] = constant("model.rope_cos"), constant("model.rope_sin")
    for layer in range(model["n_layers"]):
        prefix = f"model.model.layers.{layer}"
        arrays[f"{layer}.input_norm"] = constant(f"{prefix}.input_layernorm.weight")
        arrays[f"{layer}.post_norm"] = constant(f"{prefix}.post_attention_layernorm.weight")
        for target in config.lora_targets:
            part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            path = f"{prefix}.{part}.{target}"
            scales = constant(f"{path}.scales")
            words = constant(f"{path}.weights")
            if scales is None or words is None:
                continue
            n, k = scales.shape[1], scales.shape[0] * config.group_size
            arrays[f"{layer}.{target}.weights"] = quant.unpack_w4x8(words, n, k)
            arrays[f"{layer}.{target}.scales"] = np.array(scales)
            arrays[f"{layer}.{target}.lora_A"] = executor.initial_state(f"{path}.lora_A")
            arrays[f"{layer}.{target}.lora_B"] = executor.initial_state(f"{path}.lora_B")
    if missing:
        raise KeyError(f"the blob lacks constants the eager baseline needs: {missing[:6]}"
                       + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    return arrays


def _parameter_count(config: BenchConfig) -> int:
    m = config.model
    head = m["dim"] // m["n_heads"]
    attention = m["dim"] * head * (2 * m["n_heads"] + 2 * m["n_kv_heads"])
    mlp = 3 * m["dim"] * m["hidden"]
    embeddings = m["vocab_size"] * m["dim"] * (1 if m["tie_embeddings"] else 2)
    return m["n_layers"] * (attention + mlp) + embeddings


def _baseline_key(graph, config: BenchConfig) -> str:
    """Steps exported from one model share their constants (same names, seeds and LoRA init): the eager
    baseline's arrays are then built once (unpacking 1B codes takes a while)."""
    from vktrain.serialization import SyntheticConstant

    records = [repr(c) for c in graph.constants if isinstance(c, SyntheticConstant)]
    return json.dumps([config.preset, config.model, config.lora_rank, config.lora_alpha, config.lora_targets,
                       config.group_size, records])


def _bench_config(graph, path: Path) -> BenchConfig:
    if BENCH_CONFIG_KEY not in graph.metadata:
        raise SystemExit(f"{path}: the blob has no {BENCH_CONFIG_KEY!r} metadata; export it with "
                         f"scripts/bench_step.py export")
    return BenchConfig(**json.loads(graph.metadata[BENCH_CONFIG_KEY]))


def read_config(path: Path) -> BenchConfig:
    """What `export` stored in the .pte, read without loading it (its model names its results file)."""
    from vktrain.serialization import deserialize_blob
    from vktrain.serialization.pte import PteFile

    return _bench_config(deserialize_blob(PteFile.load(path).execution_plan("forward").delegates[0].data), path)


def _vk_record(path: Path, runner, config: BenchConfig, precision: str, load_s: float, device) -> dict[str, Any]:
    """The loaded step's description: shape, GEMM route, constants and device memory."""
    graph = runner.graph
    buffers = runner.executor.buffer_bytes
    record: dict[str, Any] = {
        "pte": str(path), "config": config.label, "batch": config.batch, "seq": config.seq,
        "tokens_per_step": config.tokens, "preset": config.preset, "load_s": load_s,
        "graph_ops": len(graph.ops), "precision": precision, "gemm_route": runner.gemm_report(),
        "synthetic_constants": json.loads(graph.metadata.get("synthetic_constants", "{}")),
        "synthetic_constant_bytes": runner.executor.synthetic_constant_bytes,
        "vk_memory": {
            "device_buffers_bytes": sum(buffers.values()),
            "planned_bytes": int(graph.metadata.get("planned_memory_bytes", 0)),
            "unplanned_bytes": int(graph.metadata.get("unplanned_memory_bytes", 0)),
            "state_bytes": int(graph.metadata.get("state_bytes", 0)),
            "buffers": len(buffers),
            "device_memory": asdict(device.memory_stats()),
        },
        "shaders": sorted({d.shader for d in runner.executor.dispatches}),
    }
    print(f"{path.name}: {config.preset} {config.label} {precision}, loaded in {load_s:.1f} s "
          f"({record['synthetic_constant_bytes'] / 2**30:.2f} GiB generated), "
          f"{len(runner.executor.dispatches)} dispatches per step; {device.memory_stats().describe()}\n"
          f"  {record['gemm_route']}", flush=True)
    return record


def _cpu_baseline_note(torch_device, args, config: BenchConfig) -> str | None:
    if torch_device.type == "cpu" and args.torch_device != "cpu" and _parameter_count(config) > CPU_BASELINE_MAX_PARAMS:
        return (f"no CUDA; a CPU baseline of {_parameter_count(config) / 1e9:.1f}B parameters is "
                f"skipped (pass --torch-device cpu to force it)")
    return None


@dataclass
class PteRun:
    """One .pte's records (one per precision timed; the PyTorch variants go in the first) and what its
    variants need: the batches both sides take and the eager baseline's weights."""

    path: Path
    records: list[dict[str, Any]]
    config: BenchConfig | None = None
    batches: list | None = None
    arrays: dict[str, np.ndarray] | None = None


def time_vk(run: PteRun, device, args, torch, torch_device, baseline_cache: dict[str, dict[str, np.ndarray]],
            clock: Clock) -> None:
    """Each of args.precisions loaded (a load each) and timed, into run.records; the baseline's weights read
    from the first load when a PyTorch baseline will run. A phase the budget skips leaves no record (an
    earlier call's stays in the results file)."""
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule

    path = run.path
    for precision in args.precisions:
        if not clock.begin(path.name, f"load {precision}"):
            continue
        start = time.perf_counter()
        planner = functools.partial(plan_schedule, rank_epilogues=True) if getattr(args, "rank_epilogues", False) \
            else plan_schedule
        runner = TrainingRunner.from_pte(path, device, planner=planner, precision=precision)  # gemm_route says which schedule
        load_s = time.perf_counter() - start
        clock.end()
        try:
            run.config = config = _bench_config(runner.graph, path)
            record = _vk_record(path, runner, config, precision, load_s, device)
            if getattr(args, "rank_epilogues", False):
                record["rank_epilogues"] = True
            run.batches = [make_batch(config, runner.vocab_size, seed) for seed in range(args.batches)]
            if args.load_only:
                run.records.append(record)
                continue
            if not clock.begin(path.name, f"vk {precision}"):
                continue
            record["vk"] = time_vulkan(runner, config, run.batches, args.warmup, args.steps, args.top)
            run.records.append(record)
            clock.end()
            if torch is not None and run.arrays is None and not _cpu_baseline_note(torch_device, args, config) \
                    and clock.begin(path.name, "PyTorch weights"):
                key = _baseline_key(runner.graph, config)
                if key not in baseline_cache:
                    baseline_cache.clear()  # one model's arrays at a time (a PteRun keeps its own)
                    baseline_cache[key] = baseline_arrays(runner.graph, runner.executor, config)
                run.arrays = baseline_cache[key]
                clock.end()
        finally:
            runner.close()  # frees the Vulkan buffers before the next load or the baseline allocates its own


def start_torch(run: PteRun, args, torch, torch_device, torch_note: str | None, clock: Clock) -> bool:
    """Whether run's PyTorch variants can be timed (else the first record says why not); where they can, each
    precision's GEMMs are rated against torch's matmul (CUDA) and the records say where the baseline is."""
    if not run.records or args.load_only:
        return False
    record = run.records[0]
    note = torch_note if torch is None else _cpu_baseline_note(torch_device, args, run.config)
    if note or torch is None:
        record["torch_skipped"] = note or "no baseline"
        return False
    if torch_device.type == "cuda" and clock.begin(run.path.name, "PyTorch GEMM rates"):
        for each in run.records:
            add_torch_rates(torch, each["vk"]["top_gemms"])
        clock.end()
    for other in run.records[1:]:
        other["torch_baseline_in"] = record["precision"]  # the record of this .pte that holds it
    reference = next((r for r in run.records if r["precision"] == PRECISION_FP32), record)
    record["torch_losses_against"] = f"vk {reference['precision']}"
    record["torch_variants"] = {}
    return True


def time_torch_variants(run: PteRun, variants: list[str], torch, torch_device, args, clock: Clock) -> None:
    """Each of `variants` once, into the first record's torch_variants (fp32's also as `torch`, the losses
    compared with vktrain's fp32 losses where this call timed them); a skipped one is listed."""
    record = run.records[0]
    reference = next((r for r in run.records if r["precision"] == PRECISION_FP32), record)
    results = record["torch_variants"]
    for variant in variants:
        if run.arrays is None or not clock.begin(run.path.name, f"PyTorch {variant}"):
            record.setdefault("torch_skipped_variants", []).append(variant)
            continue
        try:
            result = time_torch(torch, torch_device, run.config, run.arrays, run.batches, args.warmup, args.steps,
                                variant, hparams=HPARAMS)
        except Exception as exc:  # e.g. torch.compile without a working toolchain: keep the other variants
            result = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            print(f"PyTorch {variant} failed: {result['error'][:300]}", flush=True)
        else:
            result["over_vk"] = result["ms_per_step"] / record["vk"]["ms_per_step"]
            result["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                                              for a, b in zip(reference["vk"]["losses"], result["losses"]))
            if variant == "fp32":  # the reference the losses must match
                record.update(torch=result, torch_over_vk=result["over_vk"],
                              max_rel_loss_diff=result["max_rel_loss_diff"])
        results[variant] = result
        clock.end()  # after the result is kept: a signal from here on loses nothing


def run_one(path: Path, device, args, torch, torch_device, torch_note: str | None,
            baseline_cache: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """One .pte at args.precision with args.torch_variants, no budget (scripts/bench_long_context.py)."""
    options = argparse.Namespace(**{**vars(args), "precisions": [args.precision]})
    clock = Clock(None, time.monotonic())
    run = PteRun(path, [])
    time_vk(run, device, options, torch, torch_device, baseline_cache, clock)
    if start_torch(run, options, torch, torch_device, torch_note, clock):
        time_torch_variants(run, options.torch_variants, torch, torch_device, options, clock)
    return run.records[0]


def run_command(args) -> int:
    from vktrain.runtime import Device

    clock = Clock(args.budget_s, STARTED)
    configs = {path: read_config(path) for path in args.pte}
    models = list(dict.fromkeys(config.preset for config in configs.values()))
    outputs = output_paths(args.out_dir, args.machine, args.out, models)
    if isinstance(outputs, str):
        print(f"bench_step.py run: error: {outputs}", file=sys.stderr)
        return 2
    files = ResultFiles(*outputs, {(c.preset, c.label) for c in configs.values()}, args.precisions,
                        draw=not args.no_plot, precision_order=PRECISIONS)
    torch, torch_device, torch_note = None, None, "--no-torch"
    if not args.no_torch:
        torch, torch_device, torch_note = load_torch(args.torch_device)
    pte_runs: list[PteRun] = []  # in the order they started: a stopped call still saves what they finished
    baseline_cache: dict[str, dict[str, np.ndarray]] = {}

    def records_of(model: str) -> list[dict[str, Any]]:
        return [r for run in pte_runs if configs[run.path].preset == model for r in run.records]

    def save(model: str) -> None:  # after each .pte: a cut run keeps what finished
        ptes = {p.name for p, c in configs.items() if c.preset == model}
        files.save(model, {**meta, **clock.of(ptes)}, records_of(model), args.load_only)

    # torch.compile's cold compilation takes minutes a shape: the compiled variants run after every .pte's
    # other phases, so a budget cuts them first.
    compiled = [v for v in args.torch_variants if TORCH_VARIANTS[v][2]]
    eager = [v for v in args.torch_variants if v not in compiled]
    exit_code = 0
    try:
        with StopOnSignal("bench_step.py run"), Device(validation=False) as device:
            meta = {"vk_device": device.name, "vk_device_type": device.device_type,
                    "torch": None if torch is None else torch.__version__,
                    "torch_device": None if torch_device is None else str(torch_device),
                    "host": platform.node(), "python": platform.python_version(), "warmup": args.warmup,
                    "steps": args.steps, "hparams": list(HPARAMS), "precisions": args.precisions,
                    "budget_s": args.budget_s, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "note": "synthetic constants: weights are random, results measure speed only"}
            if torch_device is not None and torch_device.type == "cuda":
                meta["torch_device_name"] = torch.cuda.get_device_name(torch_device)
            print(f"Vulkan: {device.name} ({device.device_type}); PyTorch: "
                  f"{meta.get('torch_device_name', meta['torch_device']) or torch_note}", flush=True)
            pending = []
            for path in args.pte:
                pte_runs.append(run := PteRun(path, []))
                time_vk(run, device, args, torch, torch_device, baseline_cache, clock)
                if start_torch(run, args, torch, torch_device, torch_note, clock):
                    time_torch_variants(run, eager, torch, torch_device, args, clock)
                    pending.append(run)
                save(configs[path].preset)
            for run in pending if compiled else []:
                time_torch_variants(run, compiled, torch, torch_device, args, clock)
                run.arrays = None
                save(configs[run.path].preset)
    except Interrupted as stop:  # SIGTERM (a device call's time limit) or Ctrl-C: the phase in flight is lost
        clock.cut(stop.args[0])
        for model in models:
            save(model)
        exit_code = stop.exit_code
    records = [r for model in models for r in records_of(model)]
    if clock.skipped:
        budget = f"; budget {args.budget_s:g} s" if args.budget_s is not None else ""
        print(f"\nnot run ({len(clock.skipped)} phases{budget}): "
              + "; ".join(f"{s['pte']} {s['phase']}" + (" (stopped)" if "cut_at_s" in s else "") for s in clock.skipped))
    if not args.load_only and records:
        print_report(records, args.top)
        print_table(table_rows(records), PRECISIONS)
    print(f"elapsed {clock.elapsed():.0f} s" + (f" (budget {args.budget_s:g} s)" if args.budget_s is not None else ""))
    return exit_code


# ===================================================================================================
# command line
# ===================================================================================================

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="without a command: export tiny-llama steps to --out-dir and run them (lavapipe, CI)")
    parser.add_argument("--out-dir", type=Path, default=None, help="with --quick: where the .pte files go "
                        "(default: a temporary folder)")
    parser.add_argument("--torch-variants", type=parse_torch_variants, default=None,
                        help="with --quick: the PyTorch baselines (see `run --help`)")
    commands = parser.add_subparsers(dest="command")

    export = commands.add_parser("export", help="export and lower the training steps (needs executorch)")
    export.add_argument("--quick", action="store_true", help=f"{QUICK_PRESET} shapes {QUICK_SHAPES}")
    export.add_argument("--model", choices=(FULL_PRESET, *DERIVED_MODELS), default=FULL_PRESET,
                        help="the shapes exported (default Llama-3.2-1B; smollm2-135m: SmolLM2-135M's)")
    export.add_argument("--shapes", type=parse_shapes, default=None, help="BATCHxSEQ list, e.g. 1x128,4x512")
    export.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench")
    export.add_argument("--min-bytes", type=int, default=None,
                        help="constants of at least this many bytes become synthetic (default: "
                             f"{FULL_SYNTHETIC_MIN_BYTES}, quick {QUICK_SYNTHETIC_MIN_BYTES})")
    export.add_argument("--out", type=Path, default=None, help="also write what was exported as JSON")
    export.add_argument("--target", default="none",
                        help="device profiles whose schedules are embedded (`vktrain export --target`); default "
                             "none: the runtime plans at load")
    export.add_argument("--prefix", default="step", help="file names <prefix>_<B>x<S>.pte (default step)")

    run = commands.add_parser("run", help="time the exported steps on Vulkan and in PyTorch eager")
    run.add_argument("pte", nargs="+", help=".pte files written by `export`")
    run.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--batches", type=int, default=2, help="distinct random batches, cycled")
    run.add_argument("--top", type=int, default=15, help="op kinds listed")
    run.add_argument("--out", type=Path, default=None,
                     help="JSON results of one model (and a .png plot next to it); an existing file keeps its other "
                          "shapes (bench/results/step_<machine>_<model>.json: bench/README.md)")
    run.add_argument("--out-dir", type=Path, default=None,
                     help="with --machine: each model's results to DIR/step_<machine>_<model>.json (merged like "
                          "--out) with its plot, and the whole table to DIR/step_table_<machine>.json and .png")
    run.add_argument("--machine", choices=MACHINES, default=None, help="the machine word of --out-dir's file names")
    run.add_argument("--budget-s", type=float, default=None,
                     help="start no new phase (a load, a precision's timing, a PyTorch variant) after this many "
                          "seconds from the start; what is skipped is printed and written under meta.skipped")
    run.add_argument("--torch-device", choices=("cuda", "cpu"), default=None,
                     help="baseline device (default: cuda when available, else cpu for small models)")
    run.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    run.add_argument("--torch-variants", type=parse_torch_variants, default=None,
                     help=f"comma-separated PyTorch baselines out of {','.join(TORCH_VARIANTS)} (default: all "
                          f"on CUDA; fp32 on the CPU, where TF32 does not exist and compilation is slow)")
    run.add_argument("--precision", choices=PRECISION_CHOICES, default=None,
                     help="vktrain's GEMM precision policy (docs/PRECISION.md; default fp32); fp16-tc: tensor cores "
                          "where the device has them; auto: a schedule embedded for this device (`export --target`) "
                          "if the .pte has one, else the runtime's choice (an explicit policy always plans at load)")
    run.add_argument("--precisions", type=parse_precisions, default=None,
                     help="several policies, e.g. fp16-tc,fp32: each .pte is loaded and timed once per policy, the "
                          "PyTorch variants run once per .pte (in the first policy's record)")
    run.add_argument("--no-plot", action="store_true")
    run.add_argument("--rank-epilogues", action="store_true",
                     help="plan each LoRA up-product in its base GEMM's epilogue on the tensor cores (off by default: "
                          "measured slower, kernel_planning/rank_epilogue.py); records say so")
    run.add_argument("--load-only", action="store_true",
                     help="only load each .pte (generate constants, build pipelines, record): checks that "
                          "every shader the step needs is available, without running it")
    args = parser.parse_args(argv)

    if args.command is None:
        if not args.quick:
            parser.error("give a command (export or run), or --quick for a small export + run")
        with tempfile.TemporaryDirectory(prefix="vktrain-bench-step-") as scratch:
            out_dir = args.out_dir or Path(scratch)
            written = export_configs(QUICK_PRESET, list(QUICK_SHAPES), out_dir, QUICK_SYNTHETIC_MIN_BYTES,
                                     prefix="step_quick", **QUICK_OVERRIDES)
            variants = ["--torch-variants", ",".join(args.torch_variants)] if args.torch_variants else []
            return main(["run", *[w["path"] for w in written], "--steps", "3", "--warmup", "1",
                         "--out", str(out_dir / "step_quick.json"), *variants])
    if args.command == "export":
        quick = args.quick
        model = QUICK_PRESET if quick else args.model
        default_shapes = QUICK_SHAPES if quick else DERIVED_MODELS.get(model, (None, None, FULL_SHAPES))[2]
        prefix = "step_quick" if quick else ("step" if model == FULL_PRESET else f"step_{model}")
        if args.prefix != "step":
            prefix = args.prefix
        written = export_configs(model, args.shapes or list(default_shapes), args.out_dir,
                                 args.min_bytes if args.min_bytes is not None else
                                 (QUICK_SYNTHETIC_MIN_BYTES if quick else FULL_SYNTHETIC_MIN_BYTES),
                                 prefix=prefix, target=args.target, **(QUICK_OVERRIDES if quick else {}))
        if args.out:
            args.out.write_text(json.dumps(written, indent=1))
        return 0
    if args.steps <= 0 or args.warmup < 0 or args.batches <= 0:
        parser.error("--steps and --batches must be positive, --warmup >= 0")
    if out_error(args.out):
        parser.error(out_error(args.out))
    if args.out is not None and args.out_dir is not None:
        run.error("give --out (one model's file) or --out-dir with --machine (a file per model), not both")
    if args.precision is not None and args.precisions is not None:
        run.error("give --precision or --precisions, not both")
    missing = [path for path in args.pte if not Path(path).is_file()]
    if missing:
        run.error(f"no such .pte file: {', '.join(missing)}")
    args.pte = [Path(path) for path in args.pte]
    args.precisions = args.precisions or [args.precision or PRECISION_FP32]
    args.precision = args.precisions[0]
    if args.torch_variants is None:
        cuda = not args.no_torch and args.torch_device != "cpu" and _cuda_available()
        args.torch_variants = list(TORCH_VARIANTS) if cuda else ["fp32"]
    return run_command(args)


def parse_torch_variants(text: str) -> list[str]:
    """"fp32,bf16" -> ["fp32", "bf16"]; names outside TORCH_VARIANTS are refused by name."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TORCH_VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--torch-variants {text!r}: unknown {unknown or 'empty list'}; choose "
                                         f"from {','.join(TORCH_VARIANTS)}")
    return names


def parse_precisions(text: str) -> list[str]:
    """"fp16-tc,fp32" -> ["fp16-tc", "fp32"]; unknown or repeated policies are refused by name."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PRECISION_CHOICES]
    if unknown or not names or len(set(names)) < len(names):
        why = f"unknown {unknown}" if unknown else "empty or repeated"
        raise argparse.ArgumentTypeError(f"--precisions {text!r}: {why}; choose from {','.join(PRECISION_CHOICES)}, "
                                         f"each once")
    return names


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())

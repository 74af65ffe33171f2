#!/usr/bin/env python
"""Benchmark the user's command: `vktrain train` end to end beside the step alone, in one run.

    python scripts/bench_train.py export --model smollm2-135m --shape 16x256   # here (needs executorch):
                                                     #   bench/train_smollm2-135m_16x256.pte (train + eval)
    python3 scripts/bench_train.py run bench/train_*.pte --out train.json      # on the GPU machine
    # bench/results keeps one file per model: train_<machine>_<model>.json (bench/README.md)
    python scripts/bench_train.py --quick                                       # tiny-llama, lavapipe (CI-sized)
    python scripts/bench_train.py export --model smollm2-135m --shape 4x512 --target nvidia-coopmat
                                                     # schedules embedded at export: ..._target-nvidia-coopmat.pte

Activation checkpointing's cost: ms/step with and without (the step alone's `ms_per_step`, same device):
    python scripts/bench_train.py export --model smollm2-135m --shape 4x512   # and --model llama-3.2-1b
    python scripts/bench_train.py export --model smollm2-135m --shape 4x512 --activation-checkpointing every-layer
    python3 scripts/bench_train.py run bench/train_smollm2-135m_4x512.pte \
        bench/train_smollm2-135m_4x512_ckpt-every-layer.pte --step-steps 20 --setting 10,0,10 --out ckpt.json

export: the training step AND its eval method (vktrain.export.export_training_and_eval_steps, as
`vktrain export` writes them) of bench_step.py's model (Llama-3.2-1B or SmolLM2-135M shapes, rank 16 on
q/k/v/o/gate/up/down, q4gsw bases) with bench_step.py's synthetic constants, so the .pte travels small.

run, per .pte, on one device:
  * the step alone: TrainingRunner.step on batches of the default corpus, `--warmup` then `--step-steps`
    steps timed by the wall clock (what bench_step.py reports, without its GPU timestamps);
  * the command: `vktrain train PTE --data CORPUS --steps N --eval-data CORPUS --eval-every E --eval-batches B
    --checkpoint C --checkpoint-every K --json J` run in this process (vktrain.cli.main), timed as a whole
    (program load included) and its loop alone (the `train` call: every step, the evals every E steps and
    the checkpoints every K, the last one included), the time before the loop (`before_loop_s`: arguments,
    data, the program's load, the eval before training) and in it the load (`load_s`: TrainingRunner's and the
    eval method's, phases `program_load` and `eval_load`; per-phase detail: scripts/bench_load.py), and the
    median of the `seconds` its JSON records (CORPUS: the default corpus's bytes as a .npy of token ids, which
    any vocabulary accepts), and the
    phases (PHASES: the state's read to the host, the checkpoint write on its thread and its parts --
    serialisation, checksums, atomic write, fsync --, the loop's waits for it, the JSON log, each eval,
    its batches and batch preparation, the eval method's load), each timed on the thread that runs it.
    `--setting STEPS,EVAL_EVERY,CKPT_EVERY` (repeatable) times several runs per .pte in one call.
    tokens/s of the loop over the step alone's is the figure `vktrain train` is judged by (issue 30: >= 0.9).
Only vktrain.cli, TrainingRunner and vktrain.train.command.train are used, so the same script times an
older checkout (PYTHONPATH) for a before / after pair.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUICK_SHAPE = (2, 32)


def parse_shape(text: str) -> tuple[int, int]:
    batch, sep, seq = text.partition("x")
    if not (sep and batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BATCHxSEQ with positive integers (e.g. 16x256)")
    return int(batch), int(seq)


# ===================================================================================================
# export (torch + executorch, on the build machine)
# ===================================================================================================

def export_command(model_name: str, shape: tuple[int, int], out_dir: Path, min_bytes: int | None,
                   activation_checkpointing: str | None = None, target: str | None = None, **overrides) -> Path:
    from dataclasses import asdict

    import bench_step
    from vktrain.backend import metadata_spec, synthetic_constants_spec
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.export.training import activation_checkpointing_spec
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    embedder = TargetEmbedder(resolve_targets(target)) if target not in (None, "none") else None
    quick = model_name == bench_step.QUICK_PRESET
    min_bytes = min_bytes if min_bytes is not None else (
        bench_step.QUICK_SYNTHETIC_MIN_BYTES if quick else bench_step.FULL_SYNTHETIC_MIN_BYTES)
    model = bench_step.build_bench_model(model_name, **overrides)
    model_fields = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                    for k, v in asdict(model.config).items()}
    config = bench_step.BenchConfig(model_name, model_fields, shape[0], shape[1], bench_step.LORA_RANK,
                                    bench_step.LORA_ALPHA, list(bench_step.LORA_TARGETS), bench_step.GROUP_SIZE,
                                    min_bytes)
    start = time.perf_counter()
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(
        model, shape, activation_checkpointing=activation_checkpointing)))
    specs = synthetic_constants_spec(min_bytes) + [metadata_spec(bench_step.BENCH_CONFIG_KEY,
                                                                 json.dumps(asdict(config)))]
    if activation_checkpointing is not None:
        specs.append(activation_checkpointing_spec(activation_checkpointing))
    data = lower_methods_to_pte(methods, {name: VktrainPartitioner(compile_specs=specs) for name in methods},
                                rewrite_blobs=embedder)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if activation_checkpointing is None else f"_ckpt-{activation_checkpointing}"
    if embedder:  # a local profile is named after the device ("llvmpipe (LLVM 15.0.6, 256 bits)")
        suffix += "_target-" + re.sub(r"[^A-Za-z0-9.]+", "-", "-".join(embedder.embedded)).strip("-")
    path = out_dir / f"train_{model_name}_{config.label}{suffix}.pte"
    path.write_bytes(data)
    print(f"wrote {path}: {len(data) / 2**20:.1f} MiB (train + eval), export + lowering "
          f"{time.perf_counter() - start:.0f} s")
    return path


# ===================================================================================================
# run (GPU machine: numpy + vulkan)
# ===================================================================================================

def time_step_alone(path: Path, warmup: int, steps: int) -> dict[str, Any]:
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.train.data import TokenBatcher, default_dataset_path, load_tokens

    start = time.perf_counter()
    runner = TrainingRunner.from_pte(path, planner=plan_schedule, timing=False)
    load_s = time.perf_counter() - start
    with runner:
        batch, seq = runner.batch_shape
        batches = TokenBatcher(load_tokens(default_dataset_path()), batch, seq, seed=0)
        hparams = np.array([1e-4, 0.9, 0.999, 1e-8, 0.0], np.float32)
        wall = []
        for index in range(warmup + steps):
            tokens, labels = batches.batch(index)
            start = time.perf_counter()
            runner.step(tokens, labels, hparams)
            if index >= warmup:
                wall.append(time.perf_counter() - start)
        median = statistics.median(wall)
        return {"load_s": load_s, "ms_per_step": 1e3 * median, "tokens_per_s": batch * seq / median,
                "steps": steps, "gpu_report": runner.gemm_report(), "tokens_per_step": batch * seq}


# Where the loop's time goes besides the steps: (module, owner attribute path, function, phase). Each is timed
# on whatever thread calls it (checkpoint writes run on the writer's thread); missing ones (an older
# checkout) are skipped.
PHASES = [
    ("vktrain.train.command", "", "train", "loop"),
    ("vktrain.train.last_good", "DeviceCopies", "tensors", "checkpoint_read"),  # the state to the host
    ("vktrain.train.train_loop", "", "capture_state", "checkpoint_read"),        # without device copies
    ("vktrain.train.checkpoint_writer", "CheckpointWriter", "submit", "checkpoint_submit"),  # waits for the previous
    ("vktrain.train.checkpoint_writer", "CheckpointWriter", "wait", "checkpoint_wait"),
    ("vktrain.train.checkpoint", "CheckpointSeries", "save", "checkpoint_write"),  # whole write (writer's thread)
    ("vktrain.train.checkpoint", "safetensors.numpy", "save", "checkpoint_serialise"),
    ("vktrain.train.checkpoint", "", "tensor_checksum", "checkpoint_checksums"),
    ("vktrain.train.checkpoint", "", "atomic_write", "atomic_write"),  # every file: checkpoints and --json
    ("vktrain.train.checkpoint", "os", "fsync", "fsync"),                # every file's fsync (os.fsync)
    ("vktrain.train.train_loop", "", "atomic_write_json", "json"),
    ("vktrain.train.eval_command", "", "evaluate_batches", "evals"),
    ("vktrain.train.eval_command", "", "evaluate_data", "evals"),  # an older checkout's (batches made per eval)
    ("vktrain.train.eval_command", "", "prepare_eval_batches", "eval_prep"),
    ("vktrain.runtime.program.runner", "TrainingRunner", "__init__", "program_load"),  # the step's load
    ("vktrain.runtime.program.evaluation", "EvalMethod", "__init__", "eval_load"),
    ("vktrain.runtime.program.evaluation", "EvalMethod", "loss_sum", "eval_batch"),
    ("vktrain.runtime.program.runner", "TrainingRunner", "step_inputs", "program_step"),
    ("vktrain.train.train_loop", "", "last_good_states", "loop_setup_copies"),  # the device copies' recording
    ("vktrain.train.last_good", "DeviceCopies", "close", "loop_end_copies"),
]


def _patch_phases(spent: dict[str, list[tuple[float, float]]]) -> list[tuple[Any, str, Any]]:
    """Wrap every PHASES function with a timer appending (start, seconds) to spent[phase]; returns what to
    put back."""
    import importlib

    def timed(function, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent.setdefault(key, []).append((start, time.perf_counter() - start))
        return wrapper

    undo = []
    for module_name, owner_path, name, key in PHASES:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part, None)
        function = getattr(owner, name, None) if owner is not None else None
        if function is None or any(o is owner and n == name for o, n, _ in undo):
            continue
        undo.append((owner, name, function))
        setattr(owner, name, timed(function, key))
    return undo


def time_command(path: Path, setting: tuple[int, int, int], args, workdir: Path) -> dict[str, Any]:
    from vktrain import cli
    from vktrain.train.data import default_dataset_path, load_tokens

    steps, eval_every, checkpoint_every = setting
    spent: dict[str, list[tuple[float, float]]] = {}
    json_path = workdir / f"{path.stem}.json"
    # The default corpus as token ids (bytes): a program without a tokenizer refuses byte-level text when its
    # vocabulary is not 256 (the synthetic models have their model's 49152 or 128256).
    corpus = workdir / "default_corpus.npy"
    np.save(corpus, load_tokens(default_dataset_path()))
    checkpoint = workdir / f"{path.stem}.ckpt"
    for stale in workdir.glob(f"{path.stem}*.ckpt"):
        stale.unlink()
    argv = ["train", str(path), "--data", str(corpus), "--steps", str(steps), "--lr", "1e-4", "--no-progress",
            "--checkpoint", str(checkpoint), "--checkpoint-every", str(checkpoint_every), "--json", str(json_path)]
    if eval_every:
        argv += ["--eval-data", str(corpus), "--eval-every", str(eval_every), "--eval-batches", str(args.eval_batches)]
    undo = _patch_phases(spent)
    try:
        start = time.perf_counter()
        code = cli.main(argv)
        command_s = time.perf_counter() - start
    finally:
        for owner, name, function in reversed(undo):
            setattr(owner, name, function)
    if code != 0:
        raise RuntimeError(f"vktrain {' '.join(argv)} exited with {code}")
    records = [r for r in json.loads(json_path.read_text()) if r.get("step", 0) > 0]
    step_s = sum(r["seconds"] for r in records)
    loop_start, loop_s = spent.pop("loop")[0]
    before_loop_s = loop_start - start  # the command's start: arguments, data, the program's load, the first eval
    phases = {key: {"calls": len(values), "total_s": sum(v for _, v in values), "max_s": max(v for _, v in values)}
              for key, values in sorted(spent.items())}
    # The loop's seconds outside its records' steps, on the loop's thread (the writer's phases run beside);
    # only calls inside the loop (the eval before training is the command's).
    on_loop = {key: sum(v for start, v in spent[key] if loop_start <= start <= loop_start + loop_s)
               for key in ("loop_setup_copies", "evals", "checkpoint_read", "checkpoint_submit", "checkpoint_wait",
                           "json", "loop_end_copies") if key in spent}
    on_loop["rest"] = loop_s - step_s - sum(on_loop.values())
    return {"argv": argv[2:], "setting": {"steps": steps, "eval_every": eval_every,
                                          "checkpoint_every": checkpoint_every, "eval_batches": args.eval_batches},
            "command_s": command_s, "loop_s": loop_s, "steps_s": step_s, "before_loop_s": before_loop_s,
            "after_loop_s": command_s - before_loop_s - loop_s,
            "load_s": sum(spent.get(key, [(0, 0.0)])[0][1] for key in ("program_load", "eval_load")), "outside_steps_s": loop_s - step_s,
            "outside_steps_on_loop_thread": on_loop, "phases": phases,
            "checkpoint_s": [v for _, v in spent.get("checkpoint_write", [])],  # each call
            "eval_s": [v for _, v in spent.get("evals", [])],
            "record_seconds_median_ms": 1e3 * statistics.median(r["seconds"] for r in records),
            "losses_first_last": [records[0]["loss"], records[-1]["loss"]],
            "eval_losses": [r["eval_loss"] for r in records if "eval_loss" in r]}


def parse_setting(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1:
        raise argparse.ArgumentTypeError(f"setting {text!r} is not STEPS,EVAL_EVERY,CHECKPOINT_EVERY (e.g. 40,20,20)")
    return int(parts[0]), int(parts[1]), int(parts[2])


def run_command(args) -> int:
    from vktrain.runtime import Device

    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "host": platform.node(), "python": platform.python_version(),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "label": args.label,
                "note": "synthetic constants: weights are random, results measure speed only"}
    settings = args.setting or [(args.steps, args.eval_every, args.checkpoint_every)]
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for path in map(Path, args.pte):
            step = time_step_alone(path, args.warmup, args.step_steps)
            runs = []
            for setting in settings:
                train = time_command(path, setting, args, Path(tmp))
                tokens = step["tokens_per_step"] * setting[0]
                train["loop_tokens_per_s"] = tokens / train["loop_s"]
                train["command_tokens_per_s"] = tokens / train["command_s"]
                train["loop_over_step"] = ratio = train["loop_tokens_per_s"] / step["tokens_per_s"]
                runs.append(train)
                phases = ", ".join(f"{key} {value['total_s']:.2f} s/{value['calls']}"
                                   for key, value in train["phases"].items())
                print(f"{path.name} [{args.label}] {setting}: step alone {step['ms_per_step']:.1f} ms "
                      f"({step['tokens_per_s']:.0f} tokens/s); loop {train['loop_s']:.2f} s "
                      f"({train['loop_tokens_per_s']:.0f} tokens/s, {ratio:.3f}x the step alone; steps "
                      f"{train['steps_s']:.2f} s, outside them {train['outside_steps_s']:.2f} s), command "
                      f"{train['command_s']:.1f} s (before the loop {train['before_loop_s']:.1f} s, of which the "
                      f"step's and eval method's load {train['load_s']:.1f} s), record median {train['record_seconds_median_ms']:.1f} ms\n"
                      f"  phases: {phases}", flush=True)
            results.append({"pte": path.name, "step_alone": step, "runs": runs})
    summary = {"meta": meta, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama: export + run here (lavapipe)")
    sub = parser.add_subparsers(dest="command")
    export = sub.add_parser("export", help="write bench/train_<model>_<B>x<S>.pte (needs executorch)")
    export.add_argument("--model", default="smollm2-135m", help="llama-3.2-1b, smollm2-135m or tiny-llama")
    export.add_argument("--shape", type=parse_shape, required=True, help="BATCHxSEQ, e.g. 16x256")
    export.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench")
    export.add_argument("--min-bytes", type=int, default=None, help="constants this big become synthetic")
    export.add_argument("--activation-checkpointing", metavar="every-layer|N", default=None,
                        help="as `vktrain export` takes it (the file name gets _ckpt-<value>)")
    export.add_argument("--target", metavar="NAME[,NAME...]", default=None,
                        help="embed schedules for these device profiles, as `vktrain export --target` does (default: "
                             "none, planned at load; the file name gets _target-<profiles>), e.g. nvidia-coopmat")
    run = sub.add_parser("run", help="time the step alone and `vktrain train` on each .pte")
    for p in (run, parser):
        p.add_argument("--steps", type=int, default=30, help="steps of the `vktrain train` run")
        p.add_argument("--eval-every", type=int, default=10)
        p.add_argument("--eval-batches", type=int, default=4)
        p.add_argument("--checkpoint-every", type=int, default=10)
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--step-steps", type=int, default=10, help="timed steps of the step alone (median)")
        p.add_argument("--label", default="", help="names the code measured (e.g. before / after)")
        p.add_argument("--out", type=Path, default=None)
        p.add_argument("--setting", type=parse_setting, action="append", metavar="STEPS,EVAL_EVERY,CKPT_EVERY",
                       help="a `vktrain train` run to time (repeatable; default: --steps, --eval-every, "
                            "--checkpoint-every)")
        p.add_argument("--workdir", type=Path, default=None, help="where checkpoints are written (default: /tmp)")
    run.add_argument("pte", nargs="+")
    args = parser.parse_args(argv)
    from bench_results import out_error
    if out_error(getattr(args, "out", None)):
        parser.error(out_error(args.out))
    if args.command == "export":
        export_command(args.model, args.shape, args.out_dir, args.min_bytes, args.activation_checkpointing,
                       args.target)
        return 0
    if args.command == "run":
        return run_command(args)
    if args.quick:
        import bench_step

        with tempfile.TemporaryDirectory() as tmp:
            path = export_command(bench_step.QUICK_PRESET, QUICK_SHAPE, Path(tmp), None, **bench_step.QUICK_OVERRIDES)
            args.pte = [str(path)]
            return run_command(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

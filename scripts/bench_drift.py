#!/usr/bin/env python
"""Loss drift of a GEMM precision policy against fp32 over a training run (docs/PRECISION.md).

    python scripts/bench_step.py export --model smollm2-135m --shapes 4x512  # here: bench/step_smollm2-135m_4x512.pte
    python scripts/bench_drift.py bench/step_smollm2-135m_4x512.pte --steps 100 \
        --out bench/results/drift_h200_smollm2-135m.json

Loads one .pte written by `bench_step.py export` once per policy (fp32, then each of `--precisions`, by
default fp16-tc), trains `--steps` steps from the same start (the blob's synthetic constants and LoRA
init) on the same batches (`--batches` distinct random ones, cycled, so the adapters have something to
fit and the loss falls), with bench_step's hyper-parameters, and writes every step's loss per policy and
the drift: per step |loss_p - loss_fp32| and its relative value, the largest over the run, the last
one, and the mean over the last 10 steps. Each run records which GEMMs ran on tensor cores (the route's
report); a policy that falls back to the fp32 kernels on this device reproduces fp32 bit for bit.
Needs only the runtime (numpy, vulkan, flatbuffers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_results import out_error  # noqa: E402
from bench_step import BENCH_CONFIG_KEY, HPARAMS, BenchConfig, make_batch  # noqa: E402
from vktrain.contract import PRECISION_FP16_TC, PRECISION_FP32, PRECISIONS  # noqa: E402

TAIL_STEPS = 10


def train(path: Path, device, precision: str, steps: int, batch_count: int) -> dict:
    """`steps` losses of the .pte at `path` trained under `precision`, with its route report."""
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule

    with TrainingRunner.from_pte(path, device, planner=plan_schedule, precision=precision) as runner:
        if BENCH_CONFIG_KEY not in runner.graph.metadata:
            raise SystemExit(f"{path}: no {BENCH_CONFIG_KEY!r} metadata; export it with scripts/bench_step.py export")
        config = BenchConfig(**json.loads(runner.graph.metadata[BENCH_CONFIG_KEY]))
        batches = [make_batch(config, runner.vocab_size, seed) for seed in range(batch_count)]
        hparams = np.array(HPARAMS, dtype=np.float32)
        start = time.perf_counter()
        losses = [float(runner.step(*batches[i % batch_count], hparams)) for i in range(steps)]
        return {"precision": precision, "gemm_route": runner.gemm_report(),
                "tensor_core_ops": len(runner.executor.tensor_core_ops), "config": config.label,
                "preset": config.preset, "model": config.model, "seconds": time.perf_counter() - start,
                "losses": losses}


def drift(reference: list[float], losses: list[float]) -> dict:
    absolute = [abs(a - b) for a, b in zip(losses, reference)]
    relative = [d / abs(r) for d, r in zip(absolute, reference)]
    return {"abs_per_step": absolute, "max_abs": max(absolute), "max_rel": max(relative),
            "last_abs": absolute[-1], "last_rel": relative[-1],
            f"mean_abs_last_{TAIL_STEPS}": statistics.fmean(absolute[-TAIL_STEPS:]),
            "first_step_abs": absolute[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pte", type=Path, help="a .pte written by scripts/bench_step.py export")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batches", type=int, default=4, help="distinct random batches, cycled")
    parser.add_argument("--precisions", nargs="+", choices=[p for p in PRECISIONS if p != PRECISION_FP32],
                        default=[PRECISION_FP16_TC], help="policies compared with fp32")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batches < 1:
        parser.error("--steps and --batches must be >= 1")
    if out_error(args.out):
        parser.error(out_error(args.out))

    from vktrain.runtime import Device

    with Device(validation=False) as device:
        runs = [train(args.pte, device, p, args.steps, args.batches) for p in (PRECISION_FP32, *args.precisions)]
        meta = {"vk_device": device.name, "pte": str(args.pte), "steps": args.steps, "batches": args.batches,
                "hparams": list(HPARAMS), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "note": "synthetic constants (random 4-bit base), random token batches cycled"}
    reference = runs[0]["losses"]
    summary = {"meta": meta, "runs": runs,
               "drift_vs_fp32": {run["precision"]: drift(reference, run["losses"]) for run in runs[1:]}}
    print(f"{meta['vk_device']}: {runs[0]['preset']} {runs[0]['config']}, {args.steps} steps; fp32 loss "
          f"{reference[0]:.4f} -> {reference[-1]:.4f}")
    for run in runs[1:]:
        d = summary["drift_vs_fp32"][run["precision"]]
        print(f"  {run['precision']}: loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}; |drift| max "
              f"{d['max_abs']:.2e} (rel {d['max_rel']:.2e}), last {d['last_abs']:.2e}, step 1 {d['first_step_abs']:.2e}; "
              f"{run['gemm_route']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

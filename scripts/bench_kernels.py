#!/usr/bin/env python
"""Benchmark vktrain's Vulkan kernels against the same computation in PyTorch on the same machine.

For every kernel and shape: GPU time from Vulkan timestamps (median over replays of one recorded
Program), the achieved GB/s (minimum traffic: every input read once, every output written once) and
GFLOP/s (GEMM-shaped kernels: 2*M*N*K), then PyTorch doing the same work (CUDA when available: timed
with CUDA events, fp32 with TF32 off; CPU otherwise, wall clock), the ratio torch_time / vk_time
(> 1: Vulkan faster) and the relative error ||vk - torch|| / ||torch|| as a sanity check.

    python scripts/bench_kernels.py                 # realistic shapes (Llama-3.2-1B: K=2048, group 32)
    python scripts/bench_kernels.py --quick         # small shapes (runs on lavapipe in under a minute)
    python scripts/bench_kernels.py --out bench.json --kernels linear_q4gsw,fused_ce --replays 20
    python scripts/bench_kernels.py --sweep --out bench/results/kernels_h200_llama-3.2-1b.json  # on the H200
    python scripts/bench_kernels.py --smollm2 --tunings gpu,cpu --no-torch   # CPU vs GPU tuning, one run

`--smollm2` times the GEMM shapes of a SmolLM2-135M LoRA training step (M = 64 tokens: the base
linears, the rank-8 LoRA products, the tied 49152 x 576 head) instead of the defaults. `--tunings`
times every linear-family and aten.mm case once per listed device tuning (kernels/gemm_tuning.py) and
reports, per case, each tuning's time and its relative difference from the first tuning's result.

Kernels come from the registry (vktrain.backend.kernel_planning.kernels); families that are not importable are
reported as skipped. The cases (shapes, the Vulkan and PyTorch work) are in bench_kernel_cases.py, the
CUDA-event timing in bench_timing.py. Needs numpy, torch and the `vulkan` binding; never imports executorch.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernel_cases import (CASE_BUILDERS, PRESET_BUILDERS, TUNED_KERNELS, Case, linear_sweep,  # noqa: E402
                                mm_sweep)
from bench_results import out_error, write_run  # noqa: E402
from bench_timing import median_cuda_ms  # noqa: E402
from vktrain.runtime import Device, Program  # noqa: E402
from vktrain.backend.kernel_planning.kernels import KERNELS  # noqa: E402

# Families registered by modules that kernels/__init__ may not import yet; imported here if present.
_FAMILY_MODULES = ("linear", "cross_entropy", "optimizer", "requant", "attention")

H200_FP32_TFLOPS = 51.0  # the lead's target reference (non-tensor fp32)
H200_HBM_TBPS = 4.2


def _rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    actual = np.asarray(actual, dtype=np.float64).reshape(-1)
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    denom = np.linalg.norm(expected)
    diff = np.linalg.norm(actual - expected)
    return float(diff / denom) if denom > 0 else float(diff)



# ----------------------------------------------------------------------------------- timing
def time_vulkan(device, case: Case, replays: int, warmup: int, **overrides) -> dict[str, Any]:
    dispatches, buffers, read_result = case.setup_vk(device, device.limits, **overrides)
    try:
        with Program(device, dispatches, buffers, timing=True) as program:
            program.replay()
            first_result = read_result()
            for _ in range(warmup):
                program.replay()
            samples, source = [], "timestamps"
            for _ in range(replays):
                start = time.perf_counter()
                program.replay()
                wall = time.perf_counter() - start
                timings = program.timings()
                if timings is None:
                    source = "wall clock (no timestamps on this queue)"
                    samples.append(wall)
                else:
                    samples.append(sum(timings))
        return {"vk_s": statistics.median(samples), "vk_timing": source,
                "shaders": [d.shader for d in dispatches],
                "spec_constants": [dict(d.spec_constants) for d in dispatches],
                "local_size": [d.local_size for d in dispatches],
                "groups": [d.groups for d in dispatches], "result": first_result}
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def time_torch(torch, dev, case: Case, replays: int, warmup: int) -> dict[str, Any]:
    run, to_numpy = case.setup_torch(torch, dev)
    first_result = np.array(to_numpy(run()), copy=True)  # a CPU tensor's numpy view would change with later runs
    if dev.type == "cuda":
        return {"torch_s": 1e-3 * median_cuda_ms(torch, run, replays, warmup), "result": first_result}
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(replays):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return {"torch_s": statistics.median(samples), "result": first_result}


def _compare(case: Case, vk_result: np.ndarray, torch_result: np.ndarray) -> float:
    if case.kernel == "q4gsw_requant":
        return float(np.mean(vk_result != torch_result))
    return _rel_err(vk_result, torch_result)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _print_record(record: dict[str, Any], prefix: str = "") -> None:
    shape = " ".join(f"{k}={v}" for k, v in record["shape"].items())
    config = "" if record.get("config") == "default" else f"  {record['config']}"
    print(f"{prefix + record['kernel']:22s} {shape:38s} {record['vk_ms']:9.4f} {record['vk_gbps']:8.1f} "
          f"{_fmt(record['vk_gflops']):>9s} {_fmt(record.get('torch_ms'), 4):>9s} "
          f"{_fmt(record.get('torch_over_vk'), 2):>8s} {record.get('error_vs_torch', record.get('diff_vs_first_config', float('nan'))):8.1e}"
          f"  {','.join(record['shaders'])}{config}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (lavapipe, CI)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (an existing file keeps the "
                        "cases this run does not time: bench/results/kernels_<machine>_<model>.json)")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--replays", type=int, default=10, help="timed replays per case (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true",
                        help="also time alternative tilings / split-K of the linear kernels (for tuning)")
    parser.add_argument("--smollm2", action="store_true",
                        help="the GEMM shapes of a SmolLM2-135M LoRA step (linear family, aten.mm) instead of the defaults")
    parser.add_argument("--tunings", default="",
                        help="comma-separated device tunings (gpu,cpu: kernels/gemm_tuning.py) to time every "
                             "linear-family and aten.mm case with (default: the plans' default)")
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    from vktrain.backend.kernel_planning.kernels.gemm_tuning import check_tuning
    tunings = [check_tuning(t.strip(), "--tunings") for t in args.tunings.split(",") if t.strip()]
    preset = "smollm2" if args.smollm2 else "quick" if args.quick else "full"

    for module in _FAMILY_MODULES:
        try:
            importlib.import_module(f"vktrain.backend.kernel_planning.kernels.{module}")
        except ImportError as exc:
            print(f"note: kernel family {module!r} not importable ({exc}); its kernels are skipped")
    default_kernels = TUNED_KERNELS if args.smollm2 else list(CASE_BUILDERS)
    wanted = [k for k in args.kernels.split(",") if k] or list(default_kernels)
    unknown = [k for k in wanted if k not in CASE_BUILDERS]
    if unknown:
        parser.error(f"unknown kernels {unknown}; known: {sorted(CASE_BUILDERS)}")

    torch = None
    torch_dev = None
    if not args.no_torch:
        import torch  # noqa: F811  (optional dependency, imported only when comparing)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch_dev = torch.device(args.torch_device or ("cuda" if torch.cuda.is_available() else "cpu"))

    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    built_builders: dict[Callable, list[Case]] = {}
    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "vk_device_type": device.device_type,
                "torch_device": None if torch_dev is None else str(torch_dev),
                "torch": None if torch is None else torch.__version__,
                "host": platform.node(), "quick": args.quick, "replays": args.replays,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if torch_dev is not None and torch_dev.type == "cuda":
            meta["torch_device_name"] = torch.cuda.get_device_name(torch_dev)
        print(f"Vulkan: {device.name} ({device.device_type}); PyTorch: {meta['torch_device']}")
        header = (f"{'kernel':22s} {'shape':38s} {'vk ms':>9s} {'GB/s':>8s} {'GFLOP/s':>9s} "
                  f"{'torch ms':>9s} {'torch/vk':>8s} {'err':>8s}  shaders")
        print(header)
        for kernel in wanted:
            if (kernel if "." in kernel else f"vktrain.{kernel}.default") not in KERNELS:  # KERNELS keys are op keys
                skipped.append(kernel)
                print(f"{kernel:22s} skipped: no plan function registered")
                continue
            builder = CASE_BUILDERS[kernel]
            if builder not in built_builders:
                built_builders[builder] = builder(preset if builder in PRESET_BUILDERS else args.quick, rng)
            configs = [dict(tuning=t) for t in tunings] if tunings and kernel in TUNED_KERNELS else [{}]
            for case, config in ((c, o) for c in built_builders[builder] if c.kernel == kernel for o in configs):
                try:
                    vk = time_vulkan(device, case, args.replays, args.warmup, **config)
                except Exception as exc:  # e.g. out of device memory: report it and go on
                    error = f"{type(exc).__name__}: {exc}"
                    results.append({"kernel": case.kernel, "shape": case.shape, "config": config or "default",
                                    "error": error})
                    print(f"{case.kernel:22s} {case.shape}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    continue
                if config is configs[0]:
                    first_result = vk["result"]
                record: dict[str, Any] = {
                    "kernel": case.kernel, "shape": case.shape, "bytes": case.nbytes, "flops": case.flops,
                    "config": config or "default",
                    "vk_ms": vk["vk_s"] * 1e3, "vk_timing": vk["vk_timing"], "shaders": vk["shaders"],
                    "local_size": vk["local_size"], "groups": vk["groups"], "spec_constants": vk["spec_constants"],
                    "vk_gbps": case.nbytes / vk["vk_s"] / 1e9,
                    "vk_gflops": None if case.flops is None else case.flops / vk["vk_s"] / 1e9, **case.notes}
                if len(configs) > 1:
                    record["diff_vs_first_config"] = _rel_err(vk["result"], first_result)
                if torch is not None:
                    ref = time_torch(torch, torch_dev, case, args.replays, args.warmup)
                    record.update(torch_ms=ref["torch_s"] * 1e3, torch_over_vk=ref["torch_s"] / vk["vk_s"],
                                  torch_gbps=case.nbytes / ref["torch_s"] / 1e9,
                                  error_vs_torch=_compare(case, vk["result"], ref["result"]))
                    if torch_dev.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(record)
                _print_record(record)
                if args.sweep and (case.kernel.startswith("linear") or case.kernel == "aten.mm.default"):
                    sweep = (linear_sweep(case.kernel, case.shape) if case.kernel.startswith("linear")
                             else mm_sweep(case.shape))
                    for overrides in sweep:
                        try:
                            alt = time_vulkan(device, case, args.replays, args.warmup, **overrides)
                        except Exception as exc:  # a configuration the device refuses: report, go on
                            print(f"  sweep {overrides}: failed: {exc}")
                            continue
                        variant = {k: v for k, v in record.items() if k not in ("torch_over_vk", "error_vs_torch")}
                        variant.update(
                            config={k: (v.__dict__ if hasattr(v, "__dict__") else v) for k, v in overrides.items()},
                            vk_ms=alt["vk_s"] * 1e3, shaders=alt["shaders"], local_size=alt["local_size"],
                            groups=alt["groups"], spec_constants=alt["spec_constants"],
                            vk_gbps=case.nbytes / alt["vk_s"] / 1e9,
                            vk_gflops=None if case.flops is None else case.flops / alt["vk_s"] / 1e9)
                        if torch is not None:
                            variant.update(torch_over_vk=record["torch_ms"] / variant["vk_ms"],
                                           error_vs_torch=_compare(case, alt["result"], ref["result"]))
                        results.append(variant)
                        _print_record(variant, prefix="  sweep ")
        meta["vk_memory"] = asdict(device.memory_stats())
        print(f"device memory: {device.memory_stats().describe()}")
    summary = {"meta": meta, "results": results, "skipped": skipped,
               "targets": {"gemm_fp32_tflops_ref": H200_FP32_TFLOPS, "hbm_tbps_ref": H200_HBM_TBPS}}
    if args.out:  # an existing file keeps the cases (kernel, shape, tiling) this call did not time
        write_run(args.out, summary, key=lambda r: tuple(json.dumps(r[k], sort_keys=True, default=str)
                                                          for k in ("kernel", "shape", "config")))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

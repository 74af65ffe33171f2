#!/usr/bin/env python
"""Benchmark the tensor-core (cooperative-matrix) GEMMs against vktrain's fp32 SIMT kernels and PyTorch's
matmuls, all in the same run, at Llama-3.2-1B projection shapes.

    python scripts/bench_coopmat.py --out bench/results/coopmat_h200.json     # on the GPU machine
    python scripts/bench_coopmat.py --quick --emulate                         # small shapes, lavapipe

For every M in --ms and (K, N) in --kn (default M = 512..4096, (K, N) of q/o, gate/up and down):
  vk  simt_linear_q4gsw       kernels.linear default plan (split-K scratch when it wants one)
  vk  coopmat_linear_q4gsw    each variant (tile_m 128 / 64, prefetch off / on)
  vk  simt_mm                 aten.mm (kernels.matmul) of x @ deq(W).T materialised as [K, N]
  vk  coopmat_mm              each variant, B [K, N]; and B^T [N, K] (b_transposed) default variant (both with
                              their per-tensor operand scales: the absmax passes are in the time)
  torch (CUDA events)         bf16, fp16, TF32 and fp32 (TF32 off) matmuls x @ W.T of the same data
GPU times are medians over --replays (Vulkan timestamps; CUDA events). TFLOP/s = 2 M N K / time; MFU
is against the dense fp16/bf16 tensor peak given by --peak-tflops (H200 SXM datasheet: 989.4). Each
vk result is checked against an fp32 matmul (torch's, else numpy's): relative Frobenius error, ~1e-4..1e-3
for fp16 inputs, ~1e-7 for the SIMT kernels. Needs numpy,
the `vulkan` binding and (for the baselines) torch; never imports executorch.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vktrain import quant  # noqa: E402
from vktrain.runtime import Buffer, Device, Program  # noqa: E402
from vktrain.runtime.delegate.kernels.coopmat import (  # noqa: E402
    absmax_scratch_nbytes,
    coopmat_supported,
    plan_coopmat_linear_q4gsw,
    plan_coopmat_mm,
)
from vktrain.runtime.delegate.kernels.linear import plan_linear_q4gsw, plan_scratch_nbytes, prepack_weights  # noqa: E402
from vktrain.runtime.delegate.kernels.matmul import gemm_scratch_nbytes, plan_mm  # noqa: E402

GROUP_SIZE = 32
FULL_MS = (512, 1024, 2048, 4096)
FULL_KN = ((2048, 2048), (2048, 8192), (8192, 2048))  # q/o proj, gate/up proj, down proj of Llama-3.2-1B
QUICK_MS, QUICK_KN = (64, 130), ((96, 132), (256, 64))
H200_DENSE_16BIT_TFLOPS = 989.4
VARIANTS = [dict(tile_m=128, prefetch=False), dict(tile_m=64, prefetch=False),
            dict(tile_m=128, prefetch=True), dict(tile_m=64, prefetch=True)]


def variant_name(variant: dict[str, Any]) -> str:
    return f"bm{variant['tile_m']}" + ("+prefetch" if variant["prefetch"] else "")


def time_program(device, dispatches, buffers, replays: int, warmup: int) -> float:
    """Median GPU seconds of the dispatches (Vulkan timestamps; wall clock without them)."""
    with Program(device, dispatches, buffers, timing=True) as program:
        for _ in range(1 + warmup):
            program.replay()
        samples = []
        for _ in range(replays):
            start = time.perf_counter()
            program.replay()
            wall = time.perf_counter() - start
            timings = program.timings()
            samples.append(wall if timings is None else sum(timings))
    return statistics.median(samples)


def time_torch(torch, run: Callable[[], Any], replays: int, warmup: int) -> float:
    for _ in range(1 + warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(samples)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def bench_shape(device, torch, M: int, K: int, N: int, args, rng) -> dict[str, Any]:
    flops = 2 * M * N * K
    flat, scales = quant.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), GROUP_SIZE)
    deq = quant.dequantize(flat, scales, GROUP_SIZE)  # [N, K] float32
    x = rng.standard_normal((M, K)).astype(np.float32)
    arrays = {"x": x, "w": prepack_weights(flat, K), "s": scales, "deq_t": np.ascontiguousarray(deq.T), "deq": deq}
    buffers = {key: Buffer.from_array(device, a, name=key) for key, a in arrays.items()}
    buffers["out"] = Buffer(device, 4 * M * N, name="out")
    buffers["absmax"] = Buffer(device, absmax_scratch_nbytes(M * K, K * N), name="absmax")
    scratch = max(plan_scratch_nbytes("linear_q4gsw", M=M, N=N, K=K), gemm_scratch_nbytes(1, M, N, K))
    if scratch:
        buffers["scratch"] = Buffer(device, scratch, name="scratch")
    record: dict[str, Any] = {"M": M, "K": K, "N": N, "gflop": flops / 1e9, "vk": {}, "torch": {}}
    reference = None
    if torch is not None:
        x_t = torch.from_numpy(x).cuda()
        w_t = torch.from_numpy(deq).cuda()
        torch.backends.cuda.matmul.allow_tf32 = False
        reference = (x_t @ w_t.t()).cpu().numpy()
        for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                                  ("tf32", torch.float32, True), ("fp32", torch.float32, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            xs, ws = x_t.to(dtype), w_t.to(dtype)
            seconds = time_torch(torch, lambda: xs @ ws.t(), args.replays, args.warmup)
            record["torch"][name] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
        torch.backends.cuda.matmul.allow_tf32 = False
        del x_t, w_t, xs, ws
    else:
        reference = x @ deq.T  # numpy fp32: the sanity check without torch (slow at full sizes)

    def vk_case(name: str, dispatches) -> None:
        seconds = time_program(device, dispatches, buffers, args.replays, args.warmup)
        entry = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12, "shaders": [d.shader for d in dispatches]}
        if reference is not None:
            entry["rel_err_vs_fp32"] = rel_err(buffers["out"].read(np.float32, (M, N)), reference)
        record["vk"][name] = entry

    linear_args = dict(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", x="x", weights="w", scales="s")
    simt_scratch = "scratch" if plan_scratch_nbytes("linear_q4gsw", M=M, N=N, K=K) else None
    vk_case("simt_linear_q4gsw", plan_linear_q4gsw(**linear_args, scratch=simt_scratch,
                                                   shared_memory_bytes=device.limits.max_compute_shared_memory_size))
    extra = dict(emulate=args.emulate, subgroup_size=device.subgroup_size)
    for variant in VARIANTS:
        vk_case(f"coopmat_linear_q4gsw.{variant_name(variant)}",
                plan_coopmat_linear_q4gsw(**linear_args, **variant, **extra))
    mm_scratch = "scratch" if gemm_scratch_nbytes(1, M, N, K) else None
    vk_case("simt_mm", plan_mm(out="out", self="x", self_shape=(M, K), mat2="deq_t", mat2_shape=(K, N),
                               scratch=mm_scratch))
    for variant in VARIANTS:
        vk_case(f"coopmat_mm.{variant_name(variant)}",
                plan_coopmat_mm(M=M, N=N, K=K, out="out", a="x", b="deq_t", absmax="absmax", **variant, **extra))
    vk_case("coopmat_mm_b_transposed.default",
            plan_coopmat_mm(M=M, N=N, K=K, out="out", a="x", b="deq", absmax="absmax", b_transposed=True, **extra))
    for buffer in buffers.values():
        buffer.destroy()

    best = {family: min((v for k, v in record["vk"].items() if k.startswith(family + ".")), key=lambda v: v["ms"])
            for family in ("coopmat_linear_q4gsw", "coopmat_mm")}
    record["best"] = {family: {"variant": next(k for k, v in record["vk"].items() if v is entry), **entry}
                      for family, entry in best.items()}
    for entry in record["best"].values():
        entry["mfu"] = entry["tflops"] / args.peak_tflops
        if "bf16" in record["torch"]:
            entry["of_torch_bf16"] = entry["tflops"] / record["torch"]["bf16"]["tflops"]
    return record


def print_record(record: dict[str, Any]) -> None:
    head = f"M={record['M']:5d} K={record['K']:5d} N={record['N']:5d}"
    torch_part = "  ".join(f"{k} {v['tflops']:6.1f}" for k, v in record["torch"].items())
    print(f"{head}  torch TFLOP/s: {torch_part}")
    for name, entry in record["vk"].items():
        err = entry.get("rel_err_vs_fp32")
        print(f"    {name:42s} {entry['ms']:8.3f} ms {entry['tflops']:7.1f} TFLOP/s"
              + (f"  rel err {err:.1e}" if err is not None else ""))
    for family, entry in record["best"].items():
        ratio = entry.get("of_torch_bf16")
        print(f"    best {family}: {entry['variant']} {entry['tflops']:.1f} TFLOP/s, MFU {100 * entry['mfu']:.1f} %"
              + (f", {100 * ratio:.0f} % of torch bf16" if ratio is not None else ""))


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        k, sep, n = item.strip().partition("x")
        if not (sep and k.isdigit() and n.isdigit()):
            raise argparse.ArgumentTypeError(f"{item!r} is not KxN (e.g. 2048x8192)")
        pairs.append((int(k), int(n)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"small shapes: M {QUICK_MS}, KxN {QUICK_KN}")
    parser.add_argument("--ms", type=lambda t: [int(v) for v in t.split(",")], default=None, help="M list, e.g. 512,4096")
    parser.add_argument("--kn", type=parse_pairs, default=None, help="KxN list, e.g. 2048x2048,2048x8192")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_16BIT_TFLOPS,
                        help="dense fp16/bf16 tensor peak the MFU is taken against")
    parser.add_argument("--emulate", action="store_true",
                        help="run the coopmat kernels' emulated variant (COOPMAT_EMULATE; correctness only)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    ms = args.ms or list(QUICK_MS if args.quick else FULL_MS)
    kns = args.kn or list(QUICK_KN if args.quick else FULL_KN)
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and not torch.cuda.is_available():
            torch = None
    rng = np.random.default_rng(0)
    with Device(validation=False) as device:
        if not args.emulate and not coopmat_supported(device.cooperative_matrix_properties):
            raise SystemExit(f"{device.name} has no 16x16x16 fp16 cooperative matrices; pass --emulate to run the "
                             f"emulated kernels (correctness only)")
        meta = {"vk_device": device.name, "subgroup_size": device.subgroup_size,
                "cooperative_matrix_properties": [s.describe() for s in device.cooperative_matrix_properties],
                "torch": None if torch is None else torch.__version__,
                "torch_device": None if torch is None else torch.cuda.get_device_name(),
                "emulate": args.emulate, "replays": args.replays, "peak_tflops": args.peak_tflops,
                "host": platform.node(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(f"Vulkan: {device.name}; PyTorch: {meta['torch_device'] or 'none'}", flush=True)
        records = []
        for K, N in kns:
            for M in ms:
                records.append(bench_shape(device, torch, M, K, N, args, rng))
                print_record(records[-1])
                sys.stdout.flush()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": records}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

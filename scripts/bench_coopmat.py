#!/usr/bin/env python
"""Benchmark the tensor-core (cooperative-matrix) GEMMs against vktrain's fp32 SIMT kernels and PyTorch's
matmuls, all in the same run, at Llama-3.2-1B projection shapes.

    python scripts/bench_coopmat.py --out bench/results/coopmat_h200.json     # on the GPU machine (merges)
    python scripts/bench_coopmat.py --quick --emulate                         # small shapes, lavapipe

For every M in --ms and (K, N) in --kn (default M = 512..4096, (K, N) of q/o, gate/up and down):
  vk  simt_linear_q4gsw                 kernels.linear default plan (split-K scratch when it wants one)
  vk  coopmat_linear_q4gsw.<tiling>     y = x @ deq(W).T, each tiling of kernels/coopmat_tiling.py TILINGS
  vk  coopmat_linear_q4gsw_backward.<tiling>   d_x = d_out @ deq(W) (M x K output, reduction N), with
                                        its absmax pass
  vk  simt_mm                           aten.mm (kernels.matmul) of x @ deq(W).T materialised as [K, N]
  vk  coopmat_mm.<tiling>               B [K, N] row-major; coopmat_mm_b_transposed.<tiling>: B^T [N, K]
                                        (both with their per-tensor operand scales: the absmax pass is in
                                        the time)
  torch (CUDA events)         bf16, fp16, TF32 and fp32 (TF32 off) matmuls x @ W.T of the same data, and
                              bf16 d_out @ W (`bf16_backward`, the d_x orientation)
--tilings / --kernels restrict the sweep. GPU times are medians over --replays (Vulkan timestamps; CUDA
events). TFLOP/s = 2 M N K / time; MFU is against the dense fp16/bf16 tensor peak given by
--peak-tflops (H200 SXM datasheet: 989.4). Each vk result is checked against an fp32 matmul (torch's,
else numpy's) on a sample of --check-rows rows: relative Frobenius error, ~1e-4..1e-3 for fp16 inputs,
~1e-7 for the SIMT kernels. The JSON is rewritten after every shape; --budget-s stops starting new
shapes past that many seconds (what was measured is kept, `meta.skipped_shapes` lists the rest).
Needs numpy, the `vulkan` binding and (for the baselines) torch; never imports executorch.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_results import out_error, write_run  # noqa: E402
from bench_timing import median_cuda_ms  # noqa: E402

from vktrain import quant  # noqa: E402
from vktrain.runtime import Buffer, Device, Program  # noqa: E402
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_scratch_nbytes  # noqa: E402
from vktrain.backend.kernel_planning.kernels.coopmat import (  # noqa: E402
    coopmat_supported,
    plan_coopmat_linear_q4gsw,
    plan_coopmat_linear_q4gsw_backward,
    plan_coopmat_mm,
)
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (  # noqa: E402
    KERNELS,
    TILING_BY_NAME,
    TILINGS,
    default_tiling,
)
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_scratch_nbytes  # noqa: E402
from vktrain.backend.kernel_planning.kernels.linear import plan_linear_q4gsw, plan_scratch_nbytes, prepack_weights  # noqa: E402
from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_mm  # noqa: E402

GROUP_SIZE = 32
FULL_MS = (512, 1024, 2048, 4096)
FULL_KN = ((2048, 2048), (2048, 8192), (8192, 2048))  # q/o proj, gate/up proj, down proj of Llama-3.2-1B
QUICK_MS, QUICK_KN = (64, 130), ((96, 132), (256, 64))
H200_DENSE_16BIT_TFLOPS = 989.4


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
    """Median CUDA seconds of `run` (one more warm-up call than asked, as time_program)."""
    return 1e-3 * median_cuda_ms(torch, run, replays, 1 + warmup)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


class Operands:
    """The data of one (K, N): a q4gsw weight W [N, K] (and its dequantized fp32 copies), made once for
    every M."""

    def __init__(self, K: int, N: int, rng):
        flat, self.scales = quant.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), GROUP_SIZE)
        self.deq = quant.dequantize(flat, self.scales, GROUP_SIZE)  # [N, K] float32
        self.packed = prepack_weights(flat, K)
        self.deq_t = np.ascontiguousarray(self.deq.T)


def bench_shape(device, torch, M: int, K: int, N: int, operands: Operands, args, rng) -> dict[str, Any]:
    flops = 2 * M * N * K
    x = rng.standard_normal((M, K)).astype(np.float32)
    d_out = (rng.standard_normal((M, N)) * 1e-6).astype(np.float32)  # a gradient's scale: the absmax pass matters
    arrays = {"x": x, "g": d_out, "w": operands.packed, "s": operands.scales, "deq_t": operands.deq_t,
              "deq": operands.deq}
    buffers = {key: Buffer.from_array(device, a, name=key) for key, a in arrays.items()}
    buffers["out"] = Buffer(device, 4 * M * max(N, K), name="out")
    buffers["absmax"] = Buffer(device, max(absmax_scratch_nbytes(M * K, K * N), absmax_scratch_nbytes(M * N)),
                               name="absmax")
    scratch = max(plan_scratch_nbytes("linear_q4gsw", M=M, N=N, K=K), gemm_scratch_nbytes(1, M, N, K))
    if scratch:
        buffers["scratch"] = Buffer(device, scratch, name="scratch")
    record: dict[str, Any] = {"M": M, "K": K, "N": N, "gflop": flops / 1e9, "vk": {}, "torch": {}}
    rows = np.unique(np.linspace(0, M - 1, min(M, args.check_rows)).astype(np.int64))
    if torch is not None:
        x_t, w_t, g_t = torch.from_numpy(x).cuda(), torch.from_numpy(operands.deq).cuda(), torch.from_numpy(d_out).cuda()
        torch.backends.cuda.matmul.allow_tf32 = False
        sample = torch.from_numpy(rows).to(x_t.device)
        references = {"forward": (x_t[sample] @ w_t.t()).cpu().numpy(), "backward": (g_t[sample] @ w_t).cpu().numpy()}
        cases = (("bf16", torch.bfloat16, False, False), ("fp16", torch.float16, False, False),
                 ("tf32", torch.float32, True, False), ("fp32", torch.float32, False, False),
                 ("bf16_backward", torch.bfloat16, False, True))
        for name, dtype, tf32, backward in cases:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            ws = w_t.to(dtype)
            if backward:
                gs = g_t.to(dtype)
                seconds = time_torch(torch, lambda: gs @ ws, args.replays, args.warmup)
            else:
                xs = x_t.to(dtype)
                seconds = time_torch(torch, lambda: xs @ ws.t(), args.replays, args.warmup)
            record["torch"][name] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
        torch.backends.cuda.matmul.allow_tf32 = False
        del x_t, w_t, g_t, xs, ws, gs
    else:  # numpy fp32: the sanity check without torch
        references = {"forward": x[rows] @ operands.deq.T, "backward": d_out[rows] @ operands.deq}

    def vk_case(name: str, dispatches, direction: str = "forward") -> None:
        seconds = time_program(device, dispatches, buffers, args.replays, args.warmup)
        entry = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12, "shaders": [d.shader for d in dispatches]}
        width = N if direction == "forward" else K
        # Only the sampled rows come back: a whole 4096 x 8192 output read per case made one shape take
        # minutes on the H200 (its host reads of device memory, not the GPU, were the time).
        sampled = np.stack([buffers["out"].read(np.float32, (width,), offset=4 * int(row) * width) for row in rows])
        entry["rel_err_vs_fp32"] = rel_err(sampled, references[direction])
        record["vk"][name] = entry

    kernels = args.kernels or list(KERNELS)
    tilings = [TILING_BY_NAME[name] for name in args.tilings] if args.tilings else list(TILINGS)
    extra = dict(emulate=args.emulate, subgroup_size=device.subgroup_size)
    linear_args = dict(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", x="x", weights="w", scales="s")
    backward_args = dict(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", d_out="g", weights="w", scales="s",
                         absmax="absmax")
    mm_args = dict(M=M, N=N, K=K, out="out", a="x", absmax="absmax")
    plans = {
        "coopmat_linear_q4gsw": lambda t: plan_coopmat_linear_q4gsw(**linear_args, tiling=t, **extra),
        "coopmat_linear_q4gsw_backward": lambda t: plan_coopmat_linear_q4gsw_backward(**backward_args, tiling=t, **extra),
        "coopmat_mm": lambda t: plan_coopmat_mm(**mm_args, b="deq_t", tiling=t, **extra),
        "coopmat_mm_b_transposed": lambda t: plan_coopmat_mm(**mm_args, b="deq", b_transposed=True, tiling=t, **extra),
    }
    if not args.no_simt:
        simt_scratch = "scratch" if plan_scratch_nbytes("linear_q4gsw", M=M, N=N, K=K) else None
        vk_case("simt_linear_q4gsw", plan_linear_q4gsw(**linear_args, scratch=simt_scratch,
                                                       shared_memory_bytes=device.limits.max_compute_shared_memory_size))
        mm_scratch = "scratch" if gemm_scratch_nbytes(1, M, N, K) else None
        vk_case("simt_mm", plan_mm(out="out", self="x", self_shape=(M, K), mat2="deq_t", mat2_shape=(K, N),
                                   scratch=mm_scratch))
    for kernel in kernels:
        direction = "backward" if kernel == "coopmat_linear_q4gsw_backward" else "forward"
        for tiling in tilings:
            vk_case(f"{kernel}.{tiling.name}", plans[kernel](tiling), direction)
    for buffer in buffers.values():
        buffer.destroy()

    record["best"], record["default"] = {}, {}
    for kernel in kernels:
        name = min((k for k in record["vk"] if k.startswith(kernel + ".")), key=lambda k: record["vk"][k]["ms"])
        record["best"][kernel] = {"variant": name, **record["vk"][name]}
        width, reduction = (K, N) if kernel == "coopmat_linear_q4gsw_backward" else (N, K)
        record["default"][kernel] = default_tiling(kernel, M, width, reduction, emulate=args.emulate).name
    for kernel, entry in record["best"].items():
        entry["mfu"] = entry["tflops"] / args.peak_tflops
        torch_key = "bf16_backward" if kernel == "coopmat_linear_q4gsw_backward" else "bf16"
        if torch_key in record["torch"]:
            entry["of_torch_bf16"] = entry["tflops"] / record["torch"][torch_key]["tflops"]
    return record


def print_record(record: dict[str, Any], verbose: bool) -> None:
    head = f"M={record['M']:5d} K={record['K']:5d} N={record['N']:5d}"
    torch_part = "  ".join(f"{k} {v['tflops']:.0f}" for k, v in record["torch"].items())
    print(f"{head}  torch TFLOP/s: {torch_part}")
    worst_err = max(entry["rel_err_vs_fp32"] for entry in record["vk"].values())
    for name, entry in record["vk"].items():
        if verbose:
            print(f"    {name:56s} {entry['ms']:8.3f} ms {entry['tflops']:7.1f} TFLOP/s  rel err {entry['rel_err_vs_fp32']:.1e}")
    for kernel, entry in record["best"].items():
        ratio = entry.get("of_torch_bf16")
        default = record["vk"].get(f"{kernel}.{record['default'][kernel]}")
        print(f"    best {kernel}: {entry['variant'].split('.', 1)[1]} {entry['tflops']:.0f} TFLOP/s"
              + (f" ({100 * ratio:.0f}% of bf16)" if ratio is not None else "")
              + (f"; default {record['default'][kernel]} {default['tflops']:.0f}" if default else ""))
    print(f"    worst rel err {worst_err:.1e}")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        k, sep, n = item.strip().partition("x")
        if not (sep and k.isdigit() and n.isdigit()):
            raise argparse.ArgumentTypeError(f"{item!r} is not KxN (e.g. 2048x8192)")
        pairs.append((int(k), int(n)))
    return pairs


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not MxKxN (e.g. 512x2048x8192)")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """This call's shapes replace theirs in an existing file; the shapes it did not measure stay."""
    write_run(path, payload, key=lambda record: (record["M"], record["K"], record["N"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"small shapes: M {QUICK_MS}, KxN {QUICK_KN}")
    parser.add_argument("--ms", type=lambda t: [int(v) for v in t.split(",")], default=None, help="M list, e.g. 512,4096")
    parser.add_argument("--kn", type=parse_pairs, default=None, help="KxN list, e.g. 2048x2048,2048x8192")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="MxKxN list in the order to run (instead of --ms x --kn), e.g. 512x2048x2048")
    parser.add_argument("--tilings", type=lambda t: t.split(","), default=None,
                        help=f"tiling names to run (default all: {', '.join(TILING_BY_NAME)})")
    parser.add_argument("--kernels", type=lambda t: t.split(","), default=None,
                        help=f"coopmat kernels to run (default all: {', '.join(KERNELS)})")
    parser.add_argument("--no-simt", action="store_true", help="skip vktrain's fp32 SIMT baselines")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-rows", type=int, default=64, help="rows of each output checked against fp32")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new shape after this many seconds")
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_16BIT_TFLOPS,
                        help="dense fp16/bf16 tensor peak the MFU is taken against")
    parser.add_argument("--emulate", action="store_true",
                        help="run the coopmat kernels' emulated variant (COOPMAT_EMULATE; correctness only)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print every case, not only the best per kernel")
    parser.add_argument("--commit", default=None, help="the source commit measured, recorded in meta")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    for name in args.tilings or ():
        if name not in TILING_BY_NAME:
            parser.error(f"--tilings: unknown tiling {name!r}; choose from {', '.join(TILING_BY_NAME)}")
    for name in args.kernels or ():
        if name not in KERNELS:
            parser.error(f"--kernels: unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
    if args.shapes:
        shapes = args.shapes
    else:
        ms = args.ms or list(QUICK_MS if args.quick else FULL_MS)
        kns = args.kn or list(QUICK_KN if args.quick else FULL_KN)
        shapes = [(M, K, N) for K, N in kns for M in ms]
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and not torch.cuda.is_available():
            torch = None
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    with Device(validation=False) as device:
        if not args.emulate and not coopmat_supported(device.cooperative_matrix_properties):
            raise SystemExit(f"{device.name} has no 16x16x16 fp16 cooperative matrices; pass --emulate to run the "
                             f"emulated kernels (correctness only)")
        meta = {"vk_device": device.name, "subgroup_size": device.subgroup_size,
                "cooperative_matrix_properties": [s.describe() for s in device.cooperative_matrix_properties],
                "torch": None if torch is None else torch.__version__,
                "torch_device": None if torch is None else torch.cuda.get_device_name(),
                "emulate": args.emulate, "replays": args.replays, "peak_tflops": args.peak_tflops,
                "commit": args.commit, "tilings": {t.name: t.defines for t in TILINGS},
                "host": platform.node(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(f"Vulkan: {device.name}; PyTorch: {meta['torch_device'] or 'none'}", flush=True)
        records: list[dict[str, Any]] = []
        operands: dict[tuple[int, int], Operands] = {}
        for index, (M, K, N) in enumerate(shapes):
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                meta["skipped_shapes"] = [list(shape) for shape in shapes[index:]]
                print(f"budget of {args.budget_s} s spent: skipping {len(shapes) - index} shapes", flush=True)
                break
            if (K, N) not in operands:
                operands[(K, N)] = Operands(K, N, rng)
            records.append(bench_shape(device, torch, M, K, N, operands[(K, N)], args, rng))
            print_record(records[-1], args.verbose)
            print(f"    ({time.perf_counter() - started:.0f} s)", flush=True)
            if args.out:
                write_json(args.out, {"meta": meta, "results": records})
    meta["seconds"] = time.perf_counter() - started
    if args.out:
        write_json(args.out, {"meta": meta, "results": records})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

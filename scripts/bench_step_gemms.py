#!/usr/bin/env python
"""Time the training step's small-output GEMMs (Llama-3.2-1B shapes at 1 x 128 tokens) on the SIMT split-K
kernels and on the tensor cores at each split-K factor, all in one run, to set the coopmat split policy
(kernels/coopmat_tiling.py SPLIT_TARGET_WORKGROUPS, MIN_SPLIT_SLICE, MAX_SPLIT_K and the route's MIN_WORKGROUPS).

    python3 scripts/bench_step_gemms.py --out bench/results/step_gemms_h200.json     # on the GPU machine
    python scripts/bench_step_gemms.py --emulate --tokens 16 --replays 1 --warmup 0   # smoke run, lavapipe

Cases (`kind output-rows x output-columns x reduction`): the base forward (`linear_q4gsw`), its d_x
(`linear_q4gsw_backward`, d_out scaled: its absmax pass is in the time) and the tied head's d_h =
d_logits @ W (`mm`, row-major B over the vocabulary). Each entry: `simt` (the fp32 kernels' default plan,
split-K reduce included), `simt_fp16` (the 4-bit base cases: the same plan's FP16 variant, what `--precision
fp16` runs where no tensor cores do; d_x's absmax pass included), `coopmat` {split_k: ms} for the default tiling (split reduce included), the
split the default plan picks (`default_split_k`) and whether the route takes the tensor cores. GPU times
are medians of --replays (Vulkan timestamps, summed over the case's dispatches; scripts/bench_coopmat.py
`time_program`). rel_err: Frobenius error of the first rows against numpy fp32 (~1e-3 for fp16 inputs).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_coopmat import GROUP_SIZE, rel_err, time_program  # noqa: E402
from bench_results import out_error  # noqa: E402
from vktrain import quant  # noqa: E402
from vktrain.contract import PRECISION_FP16_TC  # noqa: E402
from vktrain.runtime import Buffer, Device  # noqa: E402
from vktrain.backend.kernel_planning.kernels import coopmat, coopmat_tiling, gemm_passes  # noqa: E402
from vktrain.backend.kernel_planning.kernels.linear import (plan_linear_q4gsw, plan_linear_q4gsw_backward,  # noqa: E402
                                                     plan_scratch_nbytes, prepack_weights)
from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_mm  # noqa: E402

# (kind, output columns, reduction) of the step's GEMMs whose output at 128 tokens has fewer than
# MIN_WORKGROUPS size tiles (top_gemms of the step measured at commit 3781412: git show
# 3781412:bench/results/step_h200_fp16tc_final.json), plus the gate / up forward, already on the tensor
# cores, as the unsplit reference.
CASES = (("linear_q4gsw", 2048, 8192), ("linear_q4gsw", 2048, 2048), ("linear_q4gsw", 512, 2048),
         ("linear_q4gsw", 8192, 2048),
         ("linear_q4gsw_backward", 2048, 8192), ("linear_q4gsw_backward", 2048, 2048),
         ("linear_q4gsw_backward", 2048, 512),
         ("mm", 2048, 128256))
SPLITS = (1, 2, 4, 8, 16, 32)
CHECK_ROWS = 8


def bench_case(device, kind: str, M: int, N: int, K: int, args, rng) -> dict:
    """One GEMM with output [M, N] over a reduction of K."""
    kernel = "coopmat_mm" if kind == "mm" else f"coopmat_{kind}"
    if kind == "mm":  # d_h [M, N] = d_logits [M, K] @ W [K, N]
        a = (rng.standard_normal((M, K)) * 1e-6).astype(np.float32)
        b = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
        arrays, reference = {"a": a, "b": b}, a[:CHECK_ROWS] @ b
    else:  # the weight W [out, in]: [N, K] forward, [K, N] for d_x (its reduction runs along W's rows)
        rows, cols = (N, K) if kind == "linear_q4gsw" else (K, N)
        flat, scales = quant.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), GROUP_SIZE)
        deq = quant.dequantize(flat, scales, GROUP_SIZE)
        scale = 1.0 if kind == "linear_q4gsw" else 1e-6  # d_out: a gradient's scale
        a = (rng.standard_normal((M, K)) * scale).astype(np.float32)
        arrays = {"a": a, "w": prepack_weights(flat, cols), "s": scales}
        reference = a[:CHECK_ROWS] @ (deq.T if kind == "linear_q4gsw" else deq)
    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in arrays.items()}
    buffers["out"] = Buffer(device, 4 * M * N, name="out")
    buffers["absmax"] = Buffer(device, gemm_passes.absmax_scratch_nbytes(M * K, K * N), name="absmax")
    simt_scratch = (gemm_scratch_nbytes(1, M, N, K) if kind == "mm" else
                    plan_scratch_nbytes(kind, M=M, N=N if kind == "linear_q4gsw" else K,
                                        K=K if kind == "linear_q4gsw" else N, group_size=GROUP_SIZE))
    buffers["scratch"] = Buffer(device, max(4 * max(SPLITS) * M * N, simt_scratch, 4), name="scratch")
    extra = dict(emulate=args.emulate, subgroup_size=device.subgroup_size)

    def plan(split_k: int | None, simt: bool = False, fp16: bool = False):
        if kind == "mm":
            if simt:
                return plan_mm(out="out", self="a", self_shape=(M, K), mat2="b", mat2_shape=(K, N),
                               scratch="scratch" if simt_scratch else None)
            return coopmat.plan_coopmat_mm(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax",
                                           scratch="scratch", split_k=split_k, **extra)
        if kind == "linear_q4gsw":
            common = dict(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", x="a", weights="w", scales="s")
            if simt:
                return plan_linear_q4gsw(**common, scratch="scratch" if simt_scratch else None, fp16=fp16,
                                         shared_memory_bytes=device.limits.max_compute_shared_memory_size)
            return coopmat.plan_coopmat_linear_q4gsw(**common, scratch="scratch", split_k=split_k, **extra)
        common = dict(M=M, N=K, K=N, group_size=GROUP_SIZE, out="out", d_out="a", weights="w", scales="s")
        if simt:
            return plan_linear_q4gsw_backward(**common, scratch="scratch" if simt_scratch else None, fp16=fp16,
                                              absmax="absmax" if fp16 else None,
                                              shared_memory_bytes=device.limits.max_compute_shared_memory_size)
        return coopmat.plan_coopmat_linear_q4gsw_backward(**common, absmax="absmax", scratch="scratch",
                                                          split_k=split_k, **extra)

    def measure(dispatches) -> dict:
        seconds = time_program(device, dispatches, buffers, args.replays, args.warmup)
        sampled = buffers["out"].read(np.float32, (CHECK_ROWS, N))
        return {"ms": 1e3 * seconds, "dispatches": len(dispatches), "rel_err": rel_err(sampled, reference)}

    tiling = coopmat_tiling.default_tiling(kernel, M, N, K, emulate=args.emulate)
    record = {"name": f"{kind} {M}x{N}x{K}", "kind": kind, "M": M, "N": N, "K": K, "tiling": tiling.name,
              "default_split_k": coopmat_tiling.default_split_k(tiling, M, N, K),
              "route_takes_tensor_cores": coopmat.GemmRoute(PRECISION_FP16_TC, True, "bench").takes_tensor_cores(M, N, K),
              "simt": measure(plan(None, simt=True)), "coopmat": {}}
    if kind != "mm":
        record["simt_fp16"] = measure(plan(None, simt=True, fp16=True))
    for split_k in SPLITS:
        if split_k == 1 or coopmat_tiling.split_slice_length(tiling, K, split_k) * (split_k - 1) < K:
            record["coopmat"][split_k] = measure(plan(split_k))
    for buffer in buffers.values():
        buffer.destroy()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="M: tokens per step")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--emulate", action="store_true", help="the emulated coopmat shaders (lavapipe smoke run)")
    parser.add_argument("--max-reduction", type=int, default=None, help="cap K (smoke runs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    rng = np.random.default_rng(0)
    results = []
    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "host": platform.node(), "tokens": args.tokens, "replays": args.replays,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "emulate": args.emulate}
        for kind, N, K in CASES:
            K = min(K, args.max_reduction or K)
            record = bench_case(device, kind, args.tokens, N, K, args, rng)
            best = min(record["coopmat"], key=lambda s: record["coopmat"][s]["ms"])
            fp16 = f" fp16 {record['simt_fp16']['ms']:7.3f} ms" if "simt_fp16" in record else " " * 16
            print(f"{record['name']:34s} simt {record['simt']['ms']:7.3f} ms{fp16} | coopmat "
                  + " ".join(f"s{s}:{v['ms']:.3f}" for s, v in record["coopmat"].items())
                  + f" | best s{best}, default s{record['default_split_k']}"
                  + f", route {'tc' if record['route_takes_tensor_cores'] else 'simt'}", flush=True)
            results.append(record)
            if args.out:
                args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

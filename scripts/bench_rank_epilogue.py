#!/usr/bin/env python
"""Time a LoRA linear's base GEMM + up-product as two dispatches (the tensor-core base GEMM, then matmul.slang's
addmm(base, hs, Bt)) against one (the base kernel's RANK_EPILOGUE variant), at Llama-3.2-1B's shapes, and check
on the device that the fused output is the unfused one bit for bit.

    python3 scripts/bench_rank_epilogue.py --out /tmp/rank_epilogue.json           # GPU machine, < 1 min
    python scripts/bench_rank_epilogue.py --emulate --tokens 64 --sites 256:128 --replays 1 --warmup 0   # lavapipe

Per site x [T, in] -> [T, out] (W [out, in] 4-bit, A [r, in], B [out, r]; q / o 2048 -> 2048, k / v 2048 -> 512,
gate / up 2048 -> 8192, down 8192 -> 2048) two pairs:
  forward  y   = x @ deq(W)^T + hs @ B^T       coopmat_linear_q4gsw (+ matmul addmm)
  backward d_x = d_y @ deq(W) + d_hs @ A        coopmat_absmax + coopmat_linear_q4gsw_backward (+ matmul addmm)
Each as the planner plans it on this device (the fp16-tc route of its profile; the base's default tiling and
split-K, the addmm's fp32 tuning); a pair whose base GEMM splits its reduction is reported unfused (the planner
keeps it two dispatches). Per pair: median ms of the base plan, the addmm, both together and the fused plan
(Vulkan timestamps, scripts/bench_coopmat.py time_program), `bit_identical` (every output, as uint32) and the
mismatch count, rel_err of the fused output's first rows against float64 numpy. `totals`: the step's sum over
its 16 layers x 7 sites. Needs numpy, the vulkan binding and the prebuilt SPIR-V only.
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

from bench_coopmat import rel_err, time_program  # noqa: E402
from bench_lora_gemms import LAYERS, SITES, parse_sites  # noqa: E402
from bench_results import out_error  # noqa: E402
from vktrain import quant  # noqa: E402
from vktrain.backend.kernel_planning.kernels import coopmat, gemm_passes, matmul  # noqa: E402
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import RANK_TILINGS, default_tiling  # noqa: E402
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING  # noqa: E402
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights  # noqa: E402
from vktrain.contract import PRECISION_FP16_TC  # noqa: E402
from vktrain.runtime import Buffer, Device  # noqa: E402
from vktrain.runtime.device_profiles import profile_of  # noqa: E402
from vktrain.serialization.strided_view import StridedView  # noqa: E402

GROUP_SIZE = 32
CHECK_ROWS = 32


def _pairs(T: int, d_in: int, d_out: int, r: int) -> list[dict]:
    """The site's two pairs: kernel, output [M, N] over `reduction`, the base plan's keyword operands, hs and Bt."""
    row = StridedView.contiguous
    return [
        dict(direction="forward", kernel="coopmat_linear_q4gsw", M=T, N=d_out, reduction=d_in,
             base=dict(x="x"), hs="hs", bt="B", bt_view=row((d_out, r)).transpose(0, 1)),
        dict(direction="backward", kernel="coopmat_linear_q4gsw_backward", M=T, N=d_in, reduction=d_out,
             base=dict(d_out="dy", absmax="absmax"), hs="dhs", bt="A", bt_view=row((r, d_in))),
    ]


def _base_plan(pair: dict, route, out: str, rank=None, split: bool = True) -> list:
    M, N, reduction = pair["M"], pair["N"], pair["reduction"]
    shape = dict(M=M, N=reduction, K=N) if pair["direction"] == "backward" else dict(M=M, N=N, K=reduction)
    plan = (coopmat.plan_coopmat_linear_q4gsw_backward if pair["direction"] == "backward"
            else coopmat.plan_coopmat_linear_q4gsw)
    split_k = route.default_split_k(pair["kernel"], M, N, reduction) if split else 1
    scratch = dict(scratch="scratch", split_k=split_k) if split_k > 1 else {}
    return plan(**shape, group_size=GROUP_SIZE, out=out, weights="w", scales="s", **pair["base"], **scratch,
                rank_epilogue=rank, **route.plan_options)


def bench_site(device, route, tuning: str, T: int, d_in: int, d_out: int, args, rng) -> list[dict]:
    r = args.rank
    flat, scales = quant.quantize((rng.standard_normal((d_out, d_in)) * 0.02).astype(np.float32), GROUP_SIZE)
    deq = quant.dequantize(flat, scales, GROUP_SIZE).astype(np.float64)  # [out, in]

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    arrays = {"x": normal(T, d_in), "dy": normal(T, d_out, scale=1e-4), "hs": normal(T, r),
              "dhs": normal(T, r, scale=1e-4), "A": normal(r, d_in, scale=0.02), "B": normal(d_out, r, scale=0.02),
              "w": prepack_weights(flat, d_in), "s": scales}
    largest = T * max(d_in, d_out)
    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in arrays.items()}
    for key in ("base", "y", "fused"):
        buffers[key] = Buffer(device, 4 * largest, name=key)
    buffers["scratch"] = Buffer(device, 4 * 16 * largest, name="scratch")
    buffers["absmax"] = Buffer(device, gemm_passes.absmax_scratch_nbytes(T * d_out, 0), name="absmax")
    records = []
    try:
        for pair in _pairs(T, d_in, d_out, r):
            M, N, reduction = pair["M"], pair["N"], pair["reduction"]
            hs_view, bt_view = StridedView.contiguous((M, r)), pair["bt_view"]
            addmm = matmul.plan_gemm("y", pair["hs"], hs_view, pair["bt"], bt_view, bias="base",
                                     bias_view=StridedView.contiguous((M, N)), tuning=tuning, label="addmm")
            base = _base_plan(pair, route, "base")
            record = {"T": T, "site": f"{d_in}->{d_out}", "direction": pair["direction"], "M": M, "N": N,
                      "reduction": reduction, "rank": r, "base_shaders": [d.shader for d in base],
                      "addmm_shaders": [d.shader for d in addmm]}
            for label, plan in (("base", base), ("addmm", addmm), ("unfused", base + addmm)):
                record[f"{label}_ms"] = 1e3 * time_program(device, plan, buffers, args.replays, args.warmup)
            tiling = default_tiling(pair["kernel"], M, N, reduction, emulate=route.emulate)
            split_k = route.default_split_k(pair["kernel"], M, N, reduction)
            prebuilt = route.emulate or tiling.name in RANK_TILINGS[pair["kernel"]]
            record["fused"] = split_k == 1 and len(addmm) == 1 and prebuilt
            if not record["fused"]:
                record["why_unfused"] = (f"base split-K x{split_k}" if split_k > 1 else
                                         f"tiling {tiling.name} has no prebuilt variant" if not prebuilt else
                                         f"the addmm plans {len(addmm)} dispatches")
            else:
                rank = coopmat.RankEpilogue(pair["hs"], hs_view, pair["bt"], bt_view,
                                            fma="CPU_REGISTER_TILES" in addmm[0].shader)
                fused = _base_plan(pair, route, "fused", rank, split=False)
                record["fused_shaders"] = [d.shader for d in fused]
                record["fused_ms"] = 1e3 * time_program(device, fused, buffers, args.replays, args.warmup)
                record["speedup"] = record["unfused_ms"] / record["fused_ms"]
                got = buffers["fused"].read(np.float32, (M, N))
                want = buffers["y"].read(np.float32, (M, N))
                mismatches = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
                record.update(bit_identical=mismatches == 0, mismatches=mismatches,
                              max_abs_diff=float(np.max(np.abs(got.astype(np.float64) - want))))
                rows = min(CHECK_ROWS, M)
                if pair["direction"] == "forward":
                    reference = arrays["x"][:rows].astype(np.float64) @ deq.T + arrays["hs"][:rows] @ arrays["B"].T
                else:
                    reference = arrays["dy"][:rows].astype(np.float64) @ deq + arrays["dhs"][:rows] @ arrays["A"]
                record["rel_err"] = rel_err(got[:rows], reference)
            print(f"T={T} {record['site']:>10s} {pair['direction']:8s}: base {record['base_ms']:.4f} + addmm "
                  f"{record['addmm_ms']:.4f} = {record['unfused_ms']:.4f} ms; "
                  + (f"fused {record['fused_ms']:.4f} ms x{record['speedup']:.2f}, bit-identical "
                     f"{record['bit_identical']} ({record['mismatches']} differ), rel_err {record['rel_err']:.1e}"
                     if record["fused"] else f"not fused: {record['why_unfused']}"), flush=True)
            records.append(record)
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="T, the step's tokens (default 2048: 4 x 512)")
    parser.add_argument("--sites", type=parse_sites, default=list(SITES), help="in:out pairs (default: Llama-3.2-1B's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--emulate", action="store_true", help="the emulated coopmat shaders (lavapipe smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    rng = np.random.default_rng(0)
    results = []
    with Device(validation=False) as device:
        route = coopmat.select_gemm_route(PRECISION_FP16_TC, (PRECISION_FP16_TC,), device, emulate=args.emulate,
                                          profile=profile_of(device))
        if not route.tensor_cores:
            print(f"error: {device.name}: {route.reason} (pass --emulate for the emulated kernels)", file=sys.stderr)
            return 2
        tuning = CPU_TUNING if args.emulate else GPU_TUNING
        meta = {"vk_device": device.name, "host": platform.node(), "rank": args.rank, "tokens": args.tokens,
                "replays": args.replays, "route": route.describe(), "addmm_tuning": tuning,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "emulate": args.emulate}
        for d_in, d_out in args.sites:
            results += bench_site(device, route, tuning, args.tokens, d_in, d_out, args, rng)
    step = [(r, LAYERS * SITES.get(tuple(int(v) for v in r["site"].split("->")), 1)) for r in results]
    totals = {"unfused_ms_per_step": sum(r["unfused_ms"] * n for r, n in step),
              "planned_ms_per_step": sum(r["fused_ms" if r["fused"] else "unfused_ms"] * n for r, n in step),
              "pairs_per_step": sum(n for _, n in step), "fused_pairs_per_step": sum(n for r, n in step if r["fused"]),
              "all_bit_identical": all(r["bit_identical"] for r in results if r["fused"])}
    print(f"the step's base GEMM + LoRA up-product pairs ({LAYERS} layers): {totals['unfused_ms_per_step']:.2f} ms "
          f"unfused, {totals['planned_ms_per_step']:.2f} ms with {totals['fused_pairs_per_step']} of "
          f"{totals['pairs_per_step']} fused; bit-identical: {totals['all_bit_identical']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results, "totals": totals}, indent=1) + "\n")
    return 0 if totals["all_bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

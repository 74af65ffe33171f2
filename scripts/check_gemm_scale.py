#!/usr/bin/env python
"""Check and time vktrain.mm_scaled (the gemm_scale pass: a LoRA adapter's scaling folded into its GEMM) against
the pair it replaces, aten.mm then the elementwise mul by the scalar, at Llama-3.2-1B's LoRA shapes, on one device.

    python3 scripts/check_gemm_scale.py --out /tmp/gemm_scale.json            # GPU machine, < 1 min
    python scripts/check_gemm_scale.py --tokens 64 --sites 256:128 --replays 1 --warmup 0   # lavapipe smoke run

Per LoRA site x [T, in] -> [T, out] (rank r; the step's q / o: 2048 -> 2048, k / v: 2048 -> 512, gate / up:
2048 -> 8192, down: 8192 -> 2048) the two scaled products: h = x @ A^T [T, r] (K = in) and d_h = d_y @ B [T, r]
(K = out), each planned as the executor plans it (plan_gemm's default with its split-K scratch, the GPU tuning):
`pair` = the mm into a product buffer, then elementwise mul_scalar into the output; `fused` = plan_gemm(scale=)
(matmul_thin's SCALE store unsplit, the SCALE split-K reduce split). Each: shaders, dispatches, median ms (Vulkan
timestamps); `bit_identical`: the fused output equals the pair's bit for bit (the scale 1/3 is not a power of two,
so scaling a slice of a split sum would show). `totals`: the step's sums over 16 layers x 7 sites (two products
per site: forward and backward). Needs numpy, the vulkan binding and the prebuilt SPIR-V only.
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

from bench_coopmat import time_program  # noqa: E402
from bench_lora_gemms import LAYERS, SITES, parse_sites, parse_tokens  # noqa: E402
from bench_results import out_error  # noqa: E402
from vktrain.runtime import Buffer, Device  # noqa: E402
from vktrain.backend.kernel_planning.kernels import matmul  # noqa: E402
from vktrain.backend.kernel_planning.kernels.elementwise import plan_unary  # noqa: E402
from vktrain.serialization.strided_view import StridedView  # noqa: E402

SCALE = 1.0 / 3.0


def _plans(M, N, K, a, a_view, b, b_view, max_workgroup_size):
    """(pair dispatches, fused dispatches, scratch bytes) of out = (A @ B) * SCALE."""
    nbytes = matmul.gemm_scratch_nbytes(1, M, N, K)
    scratch = dict(scratch="scratch") if nbytes else {}
    pair = matmul.plan_gemm("product", a, a_view, b, b_view, max_workgroup_size=max_workgroup_size, **scratch) \
        + plan_unary("mul_scalar", "out", "product", StridedView.contiguous((M, N)), scalar0=SCALE,
                     max_workgroup_size=max_workgroup_size)
    fused = matmul.plan_gemm("out", a, a_view, b, b_view, scale=SCALE, max_workgroup_size=max_workgroup_size,
                             **scratch)
    return pair, fused, nbytes


def check_site(device, T: int, d_in: int, d_out: int, args, rng) -> list[dict]:
    r = args.rank
    row = StridedView.contiguous
    arrays = {"x": rng.standard_normal((T, d_in)).astype(np.float32),
              "A": (rng.standard_normal((r, d_in)) * 0.02).astype(np.float32),
              "dy": (rng.standard_normal((T, d_out)) * 1e-4).astype(np.float32),
              "B": (rng.standard_normal((d_out, r)) * 0.02).astype(np.float32)}
    products = [("h = x @ A^T", T, r, d_in, "x", row((T, d_in)), "A", row((r, d_in)).transpose(0, 1)),
                ("d_h = d_y @ B", T, r, d_out, "dy", row((T, d_out)), "B", row((d_out, r)))]
    limits = device.limits
    max_wg = min(int(limits.max_compute_work_group_invocations), int(limits.max_compute_work_group_size[0]))
    scratch = max([4] + [matmul.gemm_scratch_nbytes(1, M, N, K) for _, M, N, K, *_ in products])
    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in arrays.items()}
    for name in ("out", "product"):
        buffers[name] = Buffer(device, 4 * T * r, name=name)
    buffers["scratch"] = Buffer(device, scratch, name="scratch")
    records = []
    try:
        for name, M, N, K, a, a_view, b, b_view in products:
            record = {"T": T, "site": f"{d_in}->{d_out}", "in": d_in, "out": d_out, "product": name, "M": M, "N": N,
                      "K": K}
            pair, fused, _ = _plans(M, N, K, a, a_view, b, b_view, max_wg)
            outputs = {}
            for label, dispatches in (("pair", pair), ("fused", fused)):
                seconds = time_program(device, dispatches, buffers, args.replays, args.warmup)
                outputs[label] = buffers["out"].read(np.float32, (M, N))
                record[label] = {"shaders": [d.shader for d in dispatches], "dispatches": len(dispatches),
                                 "ms": 1e3 * seconds}
            record["bit_identical"] = outputs["pair"].tobytes() == outputs["fused"].tobytes()
            record["finite"] = bool(np.isfinite(outputs["fused"]).all())
            print(f"T={T:5d} {record['site']:>10s} {name:14s} {M}x{N}x{K}: pair {record['pair']['ms']:8.4f} ms "
                  f"({record['pair']['dispatches']} disp) fused {record['fused']['ms']:8.4f} ms "
                  f"({record['fused']['dispatches']} disp) {record['fused']['shaders']} "
                  f"bit_identical={record['bit_identical']}", flush=True)
            records.append(record)
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048", help="T values, comma-separated (default 2048: 4 x 512)")
    parser.add_argument("--sites", type=parse_sites, default=list(SITES),
                        help="in:out pairs (default: Llama-3.2-1B's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    tokens = parse_tokens(parser, args.tokens)
    rng = np.random.default_rng(0)
    results = []
    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "host": platform.node(), "rank": args.rank, "replays": args.replays,
                "scale": SCALE, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        for T in tokens:
            for d_in, d_out in args.sites:
                results += check_site(device, T, d_in, d_out, args, rng)
    totals = {}
    for T in tokens:  # each site's two products times its count per layer, times the layers
        step = [(r, LAYERS * SITES.get((r["in"], r["out"]), 1)) for r in results if r["T"] == T]
        totals[str(T)] = {f"{label}_{key}_per_step": sum(r[label][key] * count for r, count in step)
                          for label in ("pair", "fused") for key in ("ms", "dispatches")}
        totals[str(T)]["all_bit_identical"] = all(r["bit_identical"] for r, _ in step)
        total = totals[str(T)]
        print(f"T={T}: the step's scaled LoRA products ({LAYERS} layers): pair {total['pair_ms_per_step']:.3f} ms in "
              f"{total['pair_dispatches_per_step']} dispatches, fused {total['fused_ms_per_step']:.3f} ms in "
              f"{total['fused_dispatches_per_step']}; all bit identical: {total['all_bit_identical']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results, "totals": totals}, indent=1) + "\n")
    return 0 if all(r["bit_identical"] and r["finite"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

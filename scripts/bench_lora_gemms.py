#!/usr/bin/env python
"""Time the training step's LoRA GEMMs (Llama-3.2-1B, rank 16) as main planned them before issue 30 (`old`) and
as the planner plans them now (`new`), in one run on one device.

    python3 scripts/bench_lora_gemms.py --out /tmp/lora_gemms.json                     # GPU machine, < 2 min
    python scripts/bench_lora_gemms.py --emulate --tokens 64 --sites 256:128 --replays 1 --warmup 0   # lavapipe

Per LoRA site x [T, in] -> [T, out] (A [r, in], B [out, r]; the step's q / o: 2048 -> 2048, k / v: 2048 -> 512,
gate / up: 2048 -> 8192, down: 8192 -> 2048) six products:
  xa = x @ A^T [T, r]              old: matmul 64 x 16 tile + split-K       new: matmul_thin (rows)
  y  = base + xa @ B^T [T, out]    old: coopmat_absmax + coopmat_mm ADDEND  new: matmul.slang with the addend
  dB = d_y^T @ xa [out, r]         old: matmul 64 x 16 tile + split-K       new: matmul_thin (COLUMNS)
  dxa = d_y @ B [T, r]             old: matmul 64 x 16 tile + split-K       new: matmul_thin (rows)
  dA = dxa^T @ x [r, in]           old: matmul 16 x 64 tile + split-K       new: matmul_thin (COLUMNS, out^T)
  dx = dx_base + dxa @ A [T, in]   old: coopmat_absmax + coopmat_mm ADDEND  new: matmul.slang with the addend
`old` is what main planned: the fp32 tiles (plan_gemm with matmul's default tile and split, the executor's
scratch) for the thin ones, and for the K = r products the tensor cores where the route's output-size gate
took them (GemmRoute.takes_tensor_cores without the reduction: at 2048 tokens, not at 128). `new` is the
executor's choice on this branch (plan_gemm's default plan, the route refusing K <= STARVED_REDUCTION).
Each: dispatches, median ms (Vulkan timestamps, scripts/bench_coopmat.py time_program), GB/s (operand,
addend and output bytes over the time) and rel_err of the first rows against float64 numpy. `totals`: the
step's sum over its 16 layers x 7 sites. Needs numpy, the vulkan binding and the prebuilt SPIR-V only.
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
from bench_results import out_error  # noqa: E402
from vktrain.contract import PRECISION_FP16_TC  # noqa: E402
from vktrain.runtime import Buffer, Device  # noqa: E402
from vktrain.backend.kernel_planning.kernels import coopmat, gemm_passes, matmul  # noqa: E402
from vktrain.serialization.strided_view import StridedView  # noqa: E402

LAYERS = 16
# (in, out) -> LoRA sites of that shape per layer (q, o; k, v; gate, up; down).
SITES = {(2048, 2048): 2, (2048, 512): 2, (2048, 8192): 2, (8192, 2048): 1}
CHECK_ROWS = 64


def _products(T: int, d_in: int, d_out: int, r: int):
    """(name, M, N, K, A's buffer and view, B's buffer and view, addend buffer or None) of one site."""
    row = StridedView.contiguous
    return [
        ("xa = x @ A^T", T, r, d_in, "x", row((T, d_in)), "A", row((r, d_in)).transpose(0, 1), None),
        ("y = base + xa @ B^T", T, d_out, r, "xa", row((T, r)), "B", row((d_out, r)).transpose(0, 1), "base"),
        ("dB = d_y^T @ xa", d_out, r, T, "dy", row((T, d_out)).transpose(0, 1), "xa", row((T, r)), None),
        ("dxa = d_y @ B", T, r, d_out, "dy", row((T, d_out)), "B", row((d_out, r)), None),
        ("dA = dxa^T @ x", r, d_in, T, "dxa", row((T, r)).transpose(0, 1), "x", row((T, d_in)), None),
        ("dx = dx_base + dxa @ A", T, d_in, r, "dxa", row((T, r)), "A", row((r, d_in)), "dx_base"),
    ]


def _arrays(T: int, d_in: int, d_out: int, r: int, rng) -> dict[str, np.ndarray]:
    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return {"x": normal(T, d_in), "A": normal(r, d_in, scale=0.02), "B": normal(d_out, r, scale=0.02),
            "xa": normal(T, r), "dy": normal(T, d_out, scale=1e-4), "dxa": normal(T, r, scale=1e-4),
            "base": normal(T, d_out), "dx_base": normal(T, d_in, scale=1e-4)}


def _view_of(array: np.ndarray, view: StridedView) -> np.ndarray:
    """The matrix a view of `array`'s storage reads (a transposed view: the transpose)."""
    return array if view.strides[-1] == 1 else array.T


def plan_old(M, N, K, a, a_view, b, b_view, addend, route, emulate, subgroup_size, max_workgroup_size):
    """main's plan before issue 30 (module docstring); returns (dispatches, scratch bytes)."""
    b_transposed = b_view.strides != (N, 1)
    if addend is not None and route.takes_tensor_cores(M, N):  # the output-size gate alone: main's rule at K = r
        dispatches = coopmat.plan_coopmat_mm(M=M, N=N, K=K, out="out", a=a, b=b, absmax="absmax",
                                             b_transposed=b_transposed, addend=addend, emulate=emulate,
                                             subgroup_size=subgroup_size)
        return dispatches, 0
    tile = matmul.default_gemm_tile(M, N)
    split = matmul.default_split_k(1, M, N, K, tile)
    nbytes = matmul.split_k_scratch_nbytes(1, M, N, split)
    bias = dict(bias=addend, bias_view=StridedView.contiguous((M, N))) if addend else {}
    return matmul.plan_gemm("out", a, a_view, b, b_view, **bias, scratch="scratch" if nbytes else None, tile=tile,
                            max_workgroup_size=max_workgroup_size), nbytes


def plan_new(M, N, K, a, a_view, b, b_view, addend, max_workgroup_size):
    """The planner's choice now: plan_gemm's default with the executor's scratch (the route keeps K <= 64 off
    the tensor cores); returns (dispatches, scratch bytes)."""
    nbytes = matmul.gemm_scratch_nbytes(1, M, N, K)
    bias = dict(bias=addend, bias_view=StridedView.contiguous((M, N))) if addend else {}
    return matmul.plan_gemm("out", a, a_view, b, b_view, **bias, scratch="scratch" if nbytes else None,
                            max_workgroup_size=max_workgroup_size), nbytes


def bench_site(device, T: int, d_in: int, d_out: int, args, rng) -> list[dict]:
    arrays = _arrays(T, d_in, d_out, args.rank, rng)
    # --emulate (the smoke run) gates like the test path, every size (min_workgroups 1), so that it runs the
    # coopmat plans at small sizes too.
    route = coopmat.GemmRoute(PRECISION_FP16_TC, True, "bench", emulate=args.emulate,
                              subgroup_size=device.subgroup_size, min_workgroups=1 if args.emulate else coopmat.MIN_WORKGROUPS)
    limits = device.limits
    max_wg = min(int(limits.max_compute_work_group_invocations), int(limits.max_compute_work_group_size[0]))
    products = _products(T, d_in, d_out, args.rank)
    largest_out = max(M * N for _, M, N, *_ in products)
    scratch = max(max(4 * 32 * M * N, matmul.gemm_scratch_nbytes(1, M, N, K)) for _, M, N, K, *_ in products
                  if min(M, N) <= 16)
    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in arrays.items()}
    buffers["out"] = Buffer(device, 4 * largest_out, name="out")
    buffers["scratch"] = Buffer(device, scratch, name="scratch")
    buffers["absmax"] = Buffer(device, gemm_passes.absmax_scratch_nbytes(T * max(d_in, d_out), d_in * d_out),
                               name="absmax")
    records = []
    try:
        for name, M, N, K, a, a_view, b, b_view, addend in products:
            rows = min(CHECK_ROWS, M)
            reference = (_view_of(arrays[a], a_view)[:rows].astype(np.float64)
                         @ _view_of(arrays[b], b_view).astype(np.float64)
                         + (arrays[addend][:rows] if addend else 0.0))
            nbytes = 4 * (M * K + K * N + M * N + (M * N if addend else 0))
            record = {"T": T, "site": f"{d_in}->{d_out}", "in": d_in, "out": d_out, "product": name, "M": M, "N": N,
                      "K": K, "bytes": nbytes}
            for label, (dispatches, scratch_used) in (
                    ("old", plan_old(M, N, K, a, a_view, b, b_view, addend, route, args.emulate, device.subgroup_size,
                                     max_wg)),
                    ("new", plan_new(M, N, K, a, a_view, b, b_view, addend, max_wg))):
                assert scratch_used <= scratch, (name, label, scratch_used, scratch)
                seconds = time_program(device, dispatches, buffers, args.replays, args.warmup)
                got = buffers["out"].read(np.float32, (rows, N))
                record[label] = {"shaders": [d.shader for d in dispatches], "dispatches": len(dispatches),
                                 "ms": 1e3 * seconds, "GB_s": nbytes / seconds / 1e9,
                                 "rel_err": rel_err(got, reference)}
            record["speedup"] = record["old"]["ms"] / record["new"]["ms"]
            print(f"T={T:5d} {record['site']:>10s} {name:24s} {M}x{N}x{K}: old {record['old']['ms']:8.4f} ms "
                  f"({record['old']['dispatches']} disp, {record['old']['GB_s']:7.1f} GB/s) new "
                  f"{record['new']['ms']:8.4f} ms ({record['new']['dispatches']} disp, {record['new']['GB_s']:7.1f} "
                  f"GB/s) x{record['speedup']:.2f}  rel_err {record['old']['rel_err']:.1e} / "
                  f"{record['new']['rel_err']:.1e}", flush=True)
            records.append(record)
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    return records


def parse_sites(text: str) -> list[tuple[int, int]]:
    try:
        sites = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]
    except ValueError:
        sites = []
    if not sites or any(len(site) != 2 or min(site) < 1 for site in sites):
        raise argparse.ArgumentTypeError(f"--sites takes in:out pairs separated by commas (e.g. 2048:512), "
                                         f"got {text!r}")
    return sites


def parse_tokens(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """--tokens' comma-separated T values (a parser error otherwise)."""
    try:
        return [int(t) for t in text.split(",") if t]
    except ValueError:
        parser.error(f"--tokens takes integers separated by commas, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,128", help="T values, comma-separated (default 2048,128)")
    parser.add_argument("--sites", type=parse_sites, default=list(SITES),
                        help="in:out pairs (default: Llama-3.2-1B's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--emulate", action="store_true", help="the emulated coopmat shaders (lavapipe smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    tokens = parse_tokens(parser, args.tokens)
    rng = np.random.default_rng(0)
    results = []
    with Device(validation=False) as device:
        meta = {"vk_device": device.name, "host": platform.node(), "rank": args.rank, "replays": args.replays,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "emulate": args.emulate}
        for T in tokens:
            for d_in, d_out in args.sites:
                results += bench_site(device, T, d_in, d_out, args, rng)
    totals = {}
    for T in tokens:  # the step's LoRA GEMMs: each site's products times its count per layer, times the layers
        step = [(r, LAYERS * SITES.get((r["in"], r["out"]), 1)) for r in results if r["T"] == T]
        totals[str(T)] = {f"{label}_{key}_per_step": sum(r[label][key] * count for r, count in step)
                          for label in ("old", "new") for key in ("ms", "dispatches")}
        print(f"T={T}: the step's LoRA GEMMs ({LAYERS} layers): old {totals[str(T)]['old_ms_per_step']:.2f} ms in "
              f"{totals[str(T)]['old_dispatches_per_step']} dispatches, new {totals[str(T)]['new_ms_per_step']:.2f} ms "
              f"in {totals[str(T)]['new_dispatches_per_step']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results, "totals": totals}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

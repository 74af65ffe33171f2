#!/usr/bin/env python
"""GPU check of the Slang port of the tensor-core GEMMs (coopmat_mm, coopmat_linear_q4gsw,
coopmat_linear_q4gsw_backward; docs/ONE_SOURCE.md): each case runs the step's plan (default tiling and
split, the device's subgroup size) once with the GLSL-era SPIR-V (`old`, precompiled into
bench/gpu_check/coop_glsl/) and once with the Slang SPIR-V (`new`, bench/gpu_check/coop_slang/), the
shared kernels (coopmat_absmax, linear_splitk_reduce) from the same build in both; it asserts the two
wrote the same bits and reports the median GPU time of each (Vulkan timestamps, summed over the plan's
dispatches, medians over --replays in --rounds alternating rounds). The modules reach the Programs as
embedded modules, so the local SPIR-V cache plays no part (the GPU machine has no shader compiler).

    python3 scripts/check_slang_coop_kernels.py --out result.json
    python3 scripts/check_slang_coop_kernels.py --list-shaders     # the shader names the cases dispatch

Cases: SmolLM2-135M and Llama-3.2-1B at 4 x 512 tokens: the 4-bit base forward (q4) and input gradient
(q4_dx) of each projection shape, the tied head's logits (mm_bt: h @ W^T) and d_h (mm: d_logits @ W), and
LoRA rank-16 shapes (y + x_a @ B^T through the ADDEND variant, d_A^T = d_xa^T @ x). `rel_error` is the Frobenius error of the first rows
against float64 (~1e-3: fp16 operands). Exit 1 when old and new differ in a bit. Needs numpy and the
`vulkan` binding only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vktrain import quant  # noqa: E402
from vktrain.backend.kernel_planning.kernels import coopmat, coopmat_tiling, gemm_passes  # noqa: E402
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights  # noqa: E402
from vktrain.runtime_shaders.build import parse_shader_name  # noqa: E402

GLSL_DIR = ROOT / "bench" / "gpu_check" / "coop_glsl"
SLANG_DIR = ROOT / "bench" / "gpu_check" / "coop_slang"
TOKENS = 4 * 512
GROUP_SIZE = 32
CHECK_ROWS = 8
# model -> (hidden, intermediate, kv projection width, vocabulary)
MODELS = {"SmolLM2-135M": (576, 1536, 192, 49152), "Llama-3.2-1B": (2048, 8192, 512, 128256)}


def cases(tokens: int = TOKENS) -> list[tuple[str, str, int, int, int]]:
    """(label, kind, M, N, K): output [M, N], reduction K, in the kernels' terms."""
    rows = []
    for model, (hidden, inter, kv, vocab) in MODELS.items():
        for out_f, in_f in dict.fromkeys([(hidden, hidden), (kv, hidden), (inter, hidden), (hidden, inter)]):
            rows.append((f"{model} q4 {out_f}x{in_f}", "q4", tokens, out_f, in_f))
            rows.append((f"{model} q4_dx {out_f}x{in_f}", "q4_dx", tokens, in_f, out_f))
        rows.append((f"{model} head logits", "mm_bt", tokens, vocab, hidden))
        rows.append((f"{model} head d_h", "mm", tokens, hidden, vocab))
        rows.append((f"{model} lora y+x_a@B^T", "mm_bt_add", tokens, hidden, 16))
        rows.append((f"{model} lora d_A", "mm", 16, hidden, tokens))
    return rows


EMULATE = {"on": False}  # --emulate: the COOPMAT_EMULATE variants (a smoke run on a device without tensor cores)


def plan(kind: str, M: int, N: int, K: int, subgroup_size: int, scratch: bool):
    extra = dict(subgroup_size=subgroup_size, scratch="scratch" if scratch else None, emulate=EMULATE["on"])
    if kind == "q4":
        return coopmat.plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", x="a",
                                                 weights="w", scales="s", **extra)
    if kind == "q4_dx":  # d_x [M, N] = d_out [M, K] @ deq(W), W [K, N]: the plan's N is W's rows
        return coopmat.plan_coopmat_linear_q4gsw_backward(M=M, N=K, K=N, group_size=GROUP_SIZE, out="out",
                                                          d_out="a", weights="w", scales="s", absmax="absmax", **extra)
    return coopmat.plan_coopmat_mm(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax",
                                   b_transposed=kind.startswith("mm_bt"), addend="d" if kind == "mm_bt_add" else None,
                                   **extra)


def scratch_nbytes(kind: str, M: int, N: int, K: int) -> int:
    kernel = {"q4": "coopmat_linear_q4gsw", "q4_dx": "coopmat_linear_q4gsw_backward", "mm": "coopmat_mm",
              "mm_bt": "coopmat_mm_b_transposed",
              "mm_bt_add": "coopmat_mm_b_transposed"}[kind]
    return coopmat_tiling.split_k_scratch_nbytes(kernel, M, N, K, emulate=EMULATE["on"])


def inputs(kind: str, M: int, N: int, K: int, rng) -> tuple[dict, np.ndarray]:
    """The buffers' arrays and the float64 reference of the first CHECK_ROWS output rows."""
    scale = 1e-6 if kind in ("q4_dx", "mm") else 1.0  # gradients follow the loss divisor
    a = (rng.standard_normal((M, K)) * scale).astype(np.float32)
    if kind in ("q4", "q4_dx"):
        rows, cols = (N, K) if kind == "q4" else (K, N)  # W [out, in]
        flat, scales = quant.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), GROUP_SIZE)
        deq = quant.dequantize(flat, scales, GROUP_SIZE).astype(np.float64)
        reference = a[:CHECK_ROWS].astype(np.float64) @ (deq.T if kind == "q4" else deq)
        return {"a": a, "w": prepack_weights(flat, cols), "s": scales}, reference
    transposed = kind.startswith("mm_bt")
    b = (rng.standard_normal((N, K) if transposed else (K, N)) * 0.02).astype(np.float32)
    reference = a[:CHECK_ROWS].astype(np.float64) @ (b.T if transposed else b).astype(np.float64)
    if kind != "mm_bt_add":
        return {"a": a, "b": b}, reference
    d = rng.standard_normal((M, N)).astype(np.float32)  # the addmm's addend (the base's output)
    return {"a": a, "b": b, "d": d}, reference + d[:CHECK_ROWS]


def load_modules(shaders: set[str], glsl_dir: Path, slang_dir: Path) -> dict[str, dict[str, SimpleNamespace]]:
    """old / new: shader name -> an embedded-module stand-in (Program reads `.code`)."""
    modules = {"old": {}, "new": {}}
    for shader in shaders:
        stem = f"{parse_shader_name(shader).file_stem}.spv"
        ported = shader.startswith(("coopmat_mm", "coopmat_linear_q4gsw"))
        for side, folder in (("old", glsl_dir if ported else slang_dir), ("new", slang_dir)):
            path = folder / stem
            if not path.is_file():
                raise SystemExit(f"{path} missing: run --save-spirv SIDE where the shaders are built")
            modules[side][shader] = SimpleNamespace(code=path.read_bytes())
    return modules


def run_case(device, modules, case, args, rng) -> dict:
    from vktrain.runtime import Buffer, Program

    label, kind, M, N, K = case
    scratch = scratch_nbytes(kind, M, N, K)
    dispatches = plan(kind, M, N, K, device.subgroup_size, bool(scratch))
    arrays, reference = inputs(kind, M, N, K, rng)
    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in arrays.items()}
    buffers["out"] = Buffer(device, 4 * M * N, name="out")
    buffers["absmax"] = Buffer(device, gemm_passes.absmax_scratch_nbytes(M * K, K * N), name="absmax")
    if scratch:
        buffers["scratch"] = Buffer(device, scratch, name="scratch")
    outs, samples = {}, {"old": [], "new": []}
    try:
        for side in ("old", "new"):
            with Program(device, dispatches, buffers, modules=modules[side]) as program:
                buffers["out"].write(np.full(M * N, np.nan, np.float32))
                program.replay()
                outs[side] = buffers["out"].read(np.float32, (M, N))
        for _ in range(args.rounds):
            for side in ("old", "new"):
                with Program(device, dispatches, buffers, timing=True, modules=modules[side]) as program:
                    for _ in range(args.warmup):
                        program.replay()
                    for _ in range(args.replays):
                        start = time.perf_counter()
                        program.replay()
                        timings = program.timings()
                        samples[side].append(time.perf_counter() - start if timings is None else sum(timings))
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    first = outs["new"][:CHECK_ROWS].astype(np.float64)
    error = float(np.linalg.norm(first - reference) / max(np.linalg.norm(reference), 1e-300))
    old_ms, new_ms = (1e3 * statistics.median(samples[s]) for s in ("old", "new"))
    return {"case": label, "kind": kind, "M": M, "N": N, "K": K, "shaders": [d.shader for d in dispatches],
            "same_bits": outs["old"].tobytes() == outs["new"].tobytes(), "finite": bool(np.isfinite(outs["new"]).all()),
            "rel_error": error, "old_ms": old_ms, "new_ms": new_ms, "new_over_old_time": new_ms / old_ms}


def save_spirv(side: str, selected, subgroup_size: int, folder: Path) -> None:
    """Copy the locally built SPIR-V of every shader the `selected` cases dispatch into the side's folder."""
    from vktrain.runtime_shaders.build import load_spirv

    folder.mkdir(parents=True, exist_ok=True)
    for shader in sorted(all_shaders(selected, subgroup_size)):
        if side == "old" and not shader.startswith(("coopmat_mm", "coopmat_linear_q4gsw")):
            continue
        (folder / f"{parse_shader_name(shader).file_stem}.spv").write_bytes(load_spirv(shader))


def all_shaders(selected, subgroup_size: int) -> set[str]:
    return {d.shader for _, kind, M, N, K in selected
            for d in plan(kind, M, N, K, subgroup_size, bool(scratch_nbytes(kind, M, N, K)))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--subgroup-size", type=int, default=32, help="for --list-shaders / --save-spirv")
    parser.add_argument("--list-shaders", action="store_true")
    parser.add_argument("--save-spirv", choices=("old", "new"), help="copy the local build into the side's folder")
    parser.add_argument("--only", default="", help="run only the cases whose label contains this")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="M of the cases (smoke runs)")
    parser.add_argument("--emulate", action="store_true", help="the COOPMAT_EMULATE variants (lavapipe smoke run)")
    parser.add_argument("--glsl-dir", type=Path, default=GLSL_DIR)
    parser.add_argument("--slang-dir", type=Path, default=SLANG_DIR)
    args = parser.parse_args(argv)
    EMULATE["on"] = args.emulate
    selected = [c for c in cases(args.tokens) if args.only in c[0]]
    if args.list_shaders:
        print("\n".join(sorted(all_shaders(selected, args.subgroup_size))))
        return 0
    if args.save_spirv:
        save_spirv(args.save_spirv, selected, args.subgroup_size,
                   args.glsl_dir if args.save_spirv == "old" else args.slang_dir)
        return 0
    if args.out is None:
        parser.error("--out is required")
    from vktrain.runtime import Device

    results, failed = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cases": []}, False
    rng = np.random.default_rng(0)
    with Device(validation=False) as device:
        results["device"] = device.name
        modules = load_modules(all_shaders(selected, device.subgroup_size), args.glsl_dir, args.slang_dir)
        for case in selected:
            row = run_case(device, modules, case, args, rng)
            failed |= not row["same_bits"] or not row["finite"] or not row["rel_error"] < 3e-3
            results["cases"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

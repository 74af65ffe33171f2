#!/usr/bin/env python
"""GPU check of the Slang ports of matmul (its GPU-tuning shared-memory body and FP16 variants) and
coopmat_absmax (docs/ONE_SOURCE.md): each case runs from the Slang SPIR-V (`new`) and from the GLSL SPIR-V
they replaced (`old`), both precompiled into --spirv DIR/{old,new}/<cache stem>.spv (the GPU machine has no
shader compiler), against a float64 numpy reference, and times both (median of Vulkan timestamps). The
SPIR-V reaches each Program as embedded modules, so its pipelines are keyed by the side's bytes (a Device
caches a pipeline by shader name alone when no code is given: swapping `load_spirv` between the sides ran
the first side's kernels twice); every case checks the pipelines each side used were made from its bytes.

    python3 scripts/check_slang_gemm_kernels.py --spirv bench/gpu_check/slang_gemm --out result.json
    python3 scripts/check_slang_gemm_kernels.py --list-shaders          # the shader names the cases dispatch

Per case and side: `rel_error` (||C - C64|| / ||C64||; fp32 < 1e-4, fp16 < 3e-3), `seconds`, and whether
old and new wrote the same bits. Exit 1 when a check fails (exit 70 when the self-check does). Needs numpy and the `vulkan` binding only.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm  # noqa: E402
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_scratch_nbytes  # noqa: E402
from vktrain.runtime_shaders.build import parse_shader_name  # noqa: E402
from vktrain.serialization.strided_view import StridedView  # noqa: E402

# (label, M, N, K, B stored transposed, bias, fp16, forced tile)
CASES = [("mm", 37, 130, 96, False, False, False, None), ("mm_bt", 70, 260, 64, True, False, False, None),
         ("addmm", 130, 16, 20, False, True, False, None), ("mm_tile64x16", 100, 16, 300, False, False, False, (64, 16)),
         ("mm_tile16x64", 16, 101, 300, True, True, False, (16, 64)), ("mm_splitk", 64, 64, 2048, False, True, False, None),
         ("mm_fp16", 70, 259, 64, True, False, True, None), ("mm_fp16_bias", 64, 64, 1024, False, True, True, None),
         ("mm_2048", 2048, 2048, 2048, False, False, False, None), ("mm_2048_bt", 2048, 2048, 2048, True, True, False, None),
         ("mm_fp16_2048", 2048, 2048, 2048, False, False, True, None)]


def plan(case):
    _, M, N, K, transposed, bias, fp16, tile = case
    b_view = StridedView((K, N), (1, K)) if transposed else StridedView.contiguous((K, N))
    scratch = gemm_scratch_nbytes(1, M, N, K) if tile is None else 0
    dispatches = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", b_view, tile=tile,
                           bias="bias" if bias else None, bias_view=StridedView.contiguous((M, N)) if bias else None,
                           alpha=1.5 if bias else 1.0, beta=0.5, fp16=fp16, absmax="absmax" if fp16 else None,
                           scratch="scratch" if scratch else None)
    return dispatches, scratch


def inputs(case):
    _, M, N, K, transposed, bias, fp16, _ = case
    rng = np.random.default_rng(M * 7 + N * 3 + K)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32) if bias else None
    expected = a.astype(np.float64) @ b.astype(np.float64)
    if bias:
        expected = 1.5 * expected + 0.5 * c
    arrays = {"a": a, "b": np.ascontiguousarray(b.T) if transposed else b}
    if bias:
        arrays["bias"] = c
    return arrays, expected


class SelfCheckError(RuntimeError):
    """The comparison itself is wrong (a side ran other SPIR-V than its own): its results mean nothing."""


def load_modules(shaders, folder: Path) -> dict[str, dict[str, SimpleNamespace]]:
    """old / new: shader name -> an embedded-module stand-in (Program reads `.code`) of DIR/<side>/<stem>.spv."""
    modules = {"old": {}, "new": {}}
    for side in modules:
        for shader in sorted(shaders):
            path = folder / side / f"{parse_shader_name(shader).file_stem}.spv"
            if not path.is_file():
                raise SystemExit(f"{path} missing: --spirv must hold every shader of --list-shaders")
            modules[side][shader] = SimpleNamespace(code=path.read_bytes())
    ported = [s for s in shaders if s.startswith(("matmul", "coopmat_absmax"))]
    same = [s for s in ported if modules["old"][s].code == modules["new"][s].code]
    if not ported or same:
        raise SelfCheckError(f"old and new SPIR-V are the same bytes for {same or 'every shader'}: nothing to compare")
    return modules


def log_pipelines(device) -> list:
    """Record (shader, code, pipeline) of every pipeline a Program of `device` asks for from now on."""
    log, get = [], device.pipelines.get

    def logged(shader, specialization, push_size, code=None):
        pipeline = get(shader, specialization, push_size, code)
        log.append((shader, code, pipeline))
        return pipeline

    device.pipelines.get = logged
    return log


def run(device, case, replays, modules, log):
    """Run `case` with `modules` (one side's); return (out, error, seconds, shaders, {shader: pipeline})."""
    from vktrain.runtime import Buffer, Program

    dispatches, scratch = plan(case)
    arrays, expected = inputs(case)
    buffers = {k: Buffer.from_array(device, v, name=k) for k, v in arrays.items()}
    buffers["out"] = Buffer.from_array(device, np.full(expected.shape, np.nan, np.float32), name="out")
    if scratch:
        buffers["scratch"] = Buffer.from_array(device, np.zeros(scratch // 4, np.float32), name="scratch")
    if case[6]:
        buffers["absmax"] = Buffer.from_array(device, np.zeros(absmax_scratch_nbytes(case[1] * case[3], case[3] * case[2]) // 4, np.uint32), name="absmax")
    log.clear()
    try:
        with Program(device, dispatches, buffers, timing=True, modules=modules) as program:
            used = {shader: pipeline for shader, _, pipeline in log}
            wrong = sorted({shader for shader, code, _ in log if code is None or code != modules[shader].code})
            if wrong or set(used) != {d.shader for d in dispatches}:
                raise SelfCheckError(f"{case[0]}: pipelines not made from this side's SPIR-V: {wrong or sorted(used)}")
            program.replay()
            out = buffers["out"].read(np.float32, expected.shape)
            samples = []
            for _ in range(replays):
                start = time.perf_counter()
                program.replay()
                timings = program.timings()
                samples.append(time.perf_counter() - start if timings is None else sum(timings))
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    error = float(np.linalg.norm(out - expected) / np.linalg.norm(expected)) if np.isfinite(out).all() else float("inf")
    return out, error, statistics.median(samples), [d.shader for d in dispatches], used


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spirv", type=Path, help="folder with old/ and new/ <cache stem>.spv")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="skip the 2048^3 cases (lavapipe)")
    parser.add_argument("--list-shaders", action="store_true")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not (args.small and c[1] == 2048)]
    if args.list_shaders:
        print("\n".join(sorted({d.shader for case in cases for d in plan(case)[0]})))
        return 0
    if args.spirv is None or args.out is None:
        parser.error("--spirv and --out are required (or --list-shaders)")
    from vktrain.runtime import Device

    modules = load_modules({d.shader for case in cases for d in plan(case)[0]}, args.spirv)
    results, failed = {"device": None, "cases": []}, False
    device = Device()
    results["device"] = str(getattr(device, "name", device))
    log = log_pipelines(device)
    for case in cases:
        row = {"case": case[0], "M": case[1], "N": case[2], "K": case[3], "fp16": case[6]}
        outs, used = {}, {}
        for name in ("old", "new"):
            outs[name], error, seconds, shaders, used[name] = run(device, case, args.replays, modules[name], log)
            row[name] = {"rel_error": error, "seconds": seconds}
            row["shaders"] = shaders
            failed |= not error < (3e-3 if case[6] else 1e-4)
        # Where the sides' bytes differ, so must their pipelines (the bug this script once had: one pipeline).
        shared = [s for s in used["old"] if modules["old"][s].code != modules["new"][s].code
                  and used["old"][s] is used["new"][s]]
        if shared:
            raise SelfCheckError(f"{case[0]}: old and new ran the same pipeline of {shared}")
        row["same_bits"] = outs["old"].tobytes() == outs["new"].tobytes()
        row["new_over_old_time"] = row["new"]["seconds"] / row["old"]["seconds"]
        results["cases"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(results, indent=1))
    device.close()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SelfCheckError as exc:
        print(f"check_slang_gemm_kernels: self-check failed: {exc}", file=sys.stderr)
        sys.exit(70)

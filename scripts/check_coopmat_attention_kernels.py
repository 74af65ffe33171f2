#!/usr/bin/env python
"""GPU check of the Slang port of the tensor-core attention kernels (coopmat_attention_fwd.slang,
coopmat_attention_bwd.slang; docs/ONE_SOURCE.md): forward and backward run from the SPIR-V glslang made of
the GLSL they replaced and from the Slang SPIR-V, on the same inputs, at SmolLM2-135M (Hq 9, Hkv 3) and
Llama-3.2-1B (Hq 32, Hkv 8) heads (D 64), B x S = 1 x 512, 4 x 512, 1 x 2048; the outputs must be the
same bits, and both are timed.

    python3 scripts/check_coopmat_attention_kernels.py --out R.json      # on the NVIDIA GPU (< 3 minutes)
    python scripts/check_coopmat_attention_kernels.py --save-spirv glsl  # where the compilers are: this
                                                                         # tree's build into SET_DIRS[set]

The GPU machine has no shader compiler: both SPIR-V sets are committed (bench/gpu_check/coop_attention_glsl/,
saved before the GLSL was deleted, and bench/gpu_check/coop_attention_slang/), each with a manifest of
hashes, and given to the Programs as embedded modules, so the local SPIR-V cache plays no part. Each set
holds every prebuilt variant of the two kernels plus the backward's shared passes (attention_bwd_delta,
coopmat_absmax: the same bytes in both). Plans: the planner's (kernels/coopmat_attention.py) for the
device's shared memory and subgroup size.

Per case: `bit_identical` per output (out, lse, d_q, d_k, d_v), the relative Frobenius error of each set
against float64 numpy (a sanity bound, TOLERANCE: fp16 inputs give ~3e-4), and the median times (ms) of
the forward and the backward (sum of the dispatches' timestamps, median over REPLAYS replays of a
recorded Program, ROUNDS rounds alternating the sets, the median of the rounds' medians), with
slang_over_glsl. Exit 1 when a case is not bit-identical or out of tolerance, 2 without cooperative
matrices. Needs numpy and the `vulkan` binding only.
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
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_attention_kernels import _rel_err, reference  # noqa: E402  (float64 attention, the fp32 kernels' check)
from vktrain.backend.kernel_planning.kernels import attention, coopmat_attention  # noqa: E402
from vktrain.backend.kernel_planning.kernels.coopmat import coopmat_supported  # noqa: E402
from vktrain.runtime import Buffer, Device, Program  # noqa: E402

SET_DIRS = {"glsl": ROOT / "bench" / "gpu_check" / "coop_attention_glsl",
            "slang": ROOT / "bench" / "gpu_check" / "coop_attention_slang"}
KERNELS = ("coopmat_attention_fwd", "coopmat_attention_bwd")
SHARED_SHADERS = ("attention_bwd_delta", "coopmat_absmax")
MODELS = {"smollm2-135m": (9, 3), "llama-3.2-1b": (32, 8)}
SHAPES = ((1, 512), (4, 512), (1, 2048))
D = 64
ROUNDS = 3
REPLAYS = 10
WARMUP = 2
TOLERANCE = 5e-3
OUTPUTS = ("out", "lse", "d_q", "d_k", "d_v")


def _file_name(shader: str) -> str:
    return shader.replace("@", ".").replace("+", ".").replace("=", "-") + ".spv"


def save_spirv(kind: str) -> dict:
    """This tree's build of every prebuilt variant of KERNELS and of SHARED_SHADERS into SET_DIRS[kind]."""
    from vktrain.runtime_shaders import build

    directory = SET_DIRS[kind]
    directory.mkdir(parents=True, exist_ok=True)
    shaders = [name for base in KERNELS for name in build.declared_variants(base)] + list(SHARED_SHADERS)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    manifest = {"set": kind, "built_at_commit": commit, "sources": {}, "files": {}}
    for shader in shaders:
        code = build.load_spirv(shader)
        (directory / _file_name(shader)).write_bytes(code)
        manifest["sources"][shader] = build.parse_shader_name(shader).source_path.name
        manifest["files"][shader] = {"file": _file_name(shader), "sha256": hashlib.sha256(code).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_modules(kind: str) -> dict[str, SimpleNamespace]:
    """Shader name -> an embedded-module stand-in (Program reads `.code`), checked against the manifest."""
    directory = SET_DIRS[kind]
    manifest = json.loads((directory / "manifest.json").read_text())
    modules = {}
    for shader, entry in manifest["files"].items():
        code = (directory / entry["file"]).read_bytes()
        if hashlib.sha256(code).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{directory / entry['file']} is not the file its manifest names")
        modules[shader] = SimpleNamespace(code=code)
    return modules


def _median_ms(program, replays: int, warmup: int) -> float:
    for _ in range(warmup):
        program.replay()
    totals = []
    for _ in range(replays):
        program.replay()
        totals.append(sum(program.timings()))
    return 1e3 * statistics.median(totals)


def run_case(device, modules, model: str, B: int, S: int, rounds: int, replays: int, warmup: int, rng,
             check_reference: bool, emulate: bool = False) -> dict:
    """One shape: both sets' outputs compared bit for bit (and with float64), both timed. `emulate` (the
    COOPMAT_EMULATE variants, a lavapipe smoke run of this script with sets that hold them)."""
    Hq, Hkv = MODELS[model]
    dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    scale = 1.0 / math.sqrt(D)
    arrays = {"q": rng.standard_normal((B, S, Hq, D)), "k": rng.standard_normal((B, S, Hkv, D)),
              "v": rng.standard_normal((B, S, Hkv, D)), "d_out": rng.standard_normal((B, S, Hq, D))}
    arrays = {n: a.astype(np.float32) for n, a in arrays.items()}
    options = dict(shared_memory_bytes=device.limits.max_compute_shared_memory_size, emulate=emulate,
                   subgroup_size=device.subgroup_size)
    names = dict(q="q", k="k", v="v", out="out", lse="lse")
    forward = coopmat_attention.plan_coopmat_causal_attention(**dims, **names, scale=scale, **options)
    backward = coopmat_attention.plan_coopmat_causal_attention_backward(
        **dims, **names, d_out="d_out", d_q="d_q", d_k="d_k", d_v="d_v", delta="delta", absmax="absmax",
        scale=scale, **options)
    missing = sorted({d.shader for d in forward + backward} - set(modules["glsl"]))
    if missing:
        raise SystemExit(f"the plans run {missing}, which the saved SPIR-V sets lack (subgroup size "
                         f"{device.subgroup_size}?)")
    buffers = {name: Buffer.from_array(device, a) for name, a in arrays.items()}
    for name, like in (("out", "q"), ("d_q", "q"), ("d_k", "k"), ("d_v", "v")):
        buffers[name] = Buffer(device, arrays[like].nbytes)
    buffers["lse"] = Buffer(device, 4 * B * Hq * S)
    buffers["delta"] = Buffer(device, attention.causal_attention_backward_scratch_nbytes(B, S, Hq))
    buffers["absmax"] = Buffer(device, coopmat_attention.backward_absmax_scratch_nbytes(B, S, Hq, Hkv, D))
    shapes = {"out": (B, S, Hq, D), "lse": (B, Hq, S), "d_q": (B, S, Hq, D), "d_k": (B, S, Hkv, D),
              "d_v": (B, S, Hkv, D)}
    case = {"model": model, "shape": dims, "shaders": [d.shader for d in forward + backward], "sets": {}}
    outputs, programs = {}, {}
    try:
        for kind in SET_DIRS:
            programs[kind] = (Program(device, forward, buffers, timing=True, modules=modules[kind]),
                              Program(device, backward, buffers, timing=True, modules=modules[kind]))
            for name in ("out", "lse", "d_q", "d_k", "d_v"):  # NaN first: an unwritten element shows
                buffers[name].write(np.full(shapes[name], np.nan, np.float32))
            programs[kind][0].replay()  # out and lse feed the backward
            programs[kind][1].replay()
            outputs[kind] = {n: buffers[n].read(np.float32, shape) for n, shape in shapes.items()}
            case["sets"][kind] = {"forward_rounds_ms": [], "backward_rounds_ms": []}
        for _ in range(rounds):
            for kind in SET_DIRS:
                case["sets"][kind]["forward_rounds_ms"].append(_median_ms(programs[kind][0], replays, warmup))
                case["sets"][kind]["backward_rounds_ms"].append(_median_ms(programs[kind][1], replays, warmup))
    finally:
        for pair in programs.values():
            for program in pair:
                program.destroy()
        for buffer in buffers.values():
            buffer.destroy()
    for kind, entry in case["sets"].items():
        entry["forward_ms"] = statistics.median(entry["forward_rounds_ms"])
        entry["backward_ms"] = statistics.median(entry["backward_rounds_ms"])
    case["bit_identical"] = {n: bool(np.array_equal(outputs["glsl"][n].view(np.uint32),
                                                    outputs["slang"][n].view(np.uint32))) for n in OUTPUTS}
    case["finite"] = {kind: all(bool(np.isfinite(outputs[kind][n]).all()) for n in OUTPUTS) for kind in SET_DIRS}
    if check_reference:
        expected = reference(arrays["q"], arrays["k"], arrays["v"], arrays["d_out"], scale)
        for kind in SET_DIRS:
            case["sets"][kind]["rel_err_vs_float64"] = {n: _rel_err(outputs[kind][n], expected[n]) for n in OUTPUTS}
        case["within_tolerance"] = all(e <= TOLERANCE for kind in SET_DIRS
                                       for e in case["sets"][kind]["rel_err_vs_float64"].values())
    case["slang_over_glsl_time"] = {d: case["sets"]["slang"][f"{d}_ms"] / case["sets"]["glsl"][f"{d}_ms"]
                                    for d in ("forward", "backward")}
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--save-spirv", choices=sorted(SET_DIRS), help="save this tree's build as that set and stop")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--replays", type=int, default=REPLAYS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 reference (faster)")
    args = parser.parse_args(argv)
    if args.save_spirv:
        print(json.dumps(save_spirv(args.save_spirv), indent=2))
        return 0
    started = time.perf_counter()
    modules = {kind: load_modules(kind) for kind in SET_DIRS}
    device = Device()
    if not coopmat_supported(device.cooperative_matrix_properties):
        print(f"{device.name} has no 16x16x16 fp16 cooperative matrices: nothing to check here", file=sys.stderr)
        return 2
    report = {"device": device.name, "platform": platform.platform(), "subgroup_size": device.subgroup_size,
              "shared_memory_bytes": device.limits.max_compute_shared_memory_size,
              "manifests": {kind: json.loads((SET_DIRS[kind] / "manifest.json").read_text()) for kind in SET_DIRS},
              "rounds": args.rounds, "replays": args.replays, "cases": []}
    rng = np.random.default_rng(0)
    failed = False
    for model in MODELS:
        for B, S in SHAPES:
            case = run_case(device, modules, model, B, S, args.rounds, args.replays, args.warmup, rng,
                            not args.no_reference)
            report["cases"].append(case)
            ok = all(case["bit_identical"].values()) and all(case["finite"].values()) and case.get("within_tolerance", True)
            failed |= not ok
            print(json.dumps({"model": model, "B": B, "S": S, "ok": ok,
                              "bit_identical": all(case["bit_identical"].values()),
                              **{f"{kind}_{d}_ms": round(case["sets"][kind][f"{d}_ms"], 4) for kind in SET_DIRS
                                 for d in ("forward", "backward")},
                              **{f"slang_over_glsl_{d}": round(r, 3) for d, r in case["slang_over_glsl_time"].items()},
                              **({"max_rel_err": max(e for kind in SET_DIRS
                                                     for e in case["sets"][kind]["rel_err_vs_float64"].values())}
                                 if not args.no_reference else {})}), flush=True)
    report["all_ok"] = not failed
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

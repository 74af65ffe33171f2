#!/usr/bin/env python
"""Benchmark one LoRA training step through the WebGPU runtime against the Vulkan runtime (same .pte).

    python scripts/bench_step.py export                      # bench/step_1x128.pte, bench/step_4x512.pte
    python scripts/bench_webgpu.py run bench/step_1x128.pte bench/step_4x512.pte \\
        --out bench/results/webgpu_h200_llama-3.2-1b.json    # on the GPU machine (numpy, vulkan, wgpu)
    python scripts/bench_webgpu.py run bench/step_1x128.pte bench/step_4x512.pte \
        --precision fp32 fp16-tc                             # both runtimes in both GEMM precisions
    python scripts/bench_webgpu.py run bench/step_1x128.pte bench/step_4x512.pte \
        --webgpu-runtime-checks off on                       # WebGPU without and with naga's runtime checks
    python scripts/bench_webgpu.py --quick                   # tiny-llama shapes, export + run (lavapipe)
    python scripts/bench_webgpu.py kernels --shape 512x2048x2048 # the fp32 GEMM kernels alone, both runtimes

The programs are bench_step.py's (Llama-3.2-1B shapes, synthetic constants: speed only). Each runtime
loads each .pte with TrainingRunner and runs the same batches: load seconds, ms per step (median wall
clock), tokens/s, GPU ms per step (the sum of per-dispatch timestamps; WebGPU times each dispatch in a
pass of its own), replay ms (the dispatches alone, no host I/O; WebGPU untimed, in one pass) and, for
WebGPU, the host ms encoding one step (command buffers are single-use, so every step is re-encoded).
The report says where the difference goes: `encode_ms` (host encoding), `by_shader` (the same
shader's GPU ms on each runtime: kernels and their compilers), `gemm_route` (WebGPU has the fp32 GPU
tuning only: no tensor-core or subgroup bodies) and the largest relative loss difference between the
runtimes. A runtime that cannot load a program (wgpu not installed, a WGSL kernel missing, a tensor
over a binding limit) is recorded with its reason; the other still runs.

`--precision` lists the GEMM precision policies (docs/PRECISION.md) each runtime runs every program in
(default fp32 alone: both runtimes on the same kernels' precision). Records: `vulkan` / `webgpu` are the
fp32 runs, `vulkan:fp16-tc` / `webgpu:fp16-tc` the fp16-tc ones (Vulkan: tensor cores where the device
has them; WebGPU: the f16 WGSL kernels where the adapter has shader-f16; each run's `gemm_route` says
which). `comparison` is WebGPU against Vulkan in fp32; `comparisons` lists every pair measured: each
precision across the runtimes, and, with fp16-tc, WebGPU fp16-tc against Vulkan fp32 and against
WebGPU fp32 (whether the f16 WGSL pays: what `auto` on WebGPU would be decided by).

`--webgpu-runtime-checks off on` (run and kernels) runs the WebGPU side once per setting (naga's bounds
checks and loop bounding in vktrain's kernels, webgpu/device.py): the first keeps the `webgpu` keys,
each other one adds its own (`webgpu+checks-on`, `webgpu+checks-on:fp16-tc`) and, for run, a comparison
against the first; every WebGPU record says its `runtime_checks`. Default: one run, the device's default
(checks off where wgpu-native has trusted modules).

`kernels` times the GEMM kernels alone (plans of the GPU tuning, as WebGPU runs them; random data) at
MxNxK shapes on both runtimes: the median wall ms of a replay of each kernel's dispatches (a program of
`--repeat` copies of them, so submission overhead is spread) and the largest difference between the two
runtimes' outputs (0 where the WGSL keeps the GLSL's summation order and the compilers agree). With
`--precision fp32 fp16-tc` it also times the fp16-tc kernels (coopmat_linear_q4gsw, its d_x, coopmat_mm
with a transposed B) as each runtime's fp16-tc route plans them: Vulkan's tensor cores (a runtime whose
route falls back to fp32 is recorded with the route's reason), WebGPU's f16 WGSL.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402  (puts the repository root on sys.path)
from bench_results import out_error, write_run  # noqa: E402

from vktrain.contract import PRECISION_FP16_TC, PRECISION_FP32  # noqa: E402
from vktrain.errors import VktrainError  # noqa: E402
from vktrain.runtime.runtimes import RUNTIMES, open_device  # noqa: E402


def _replay_ms(program, repeats: int) -> tuple[float, float | None]:
    """(median ms of a bare replay, median host ms encoding it: WebGPU only, else None)."""
    replay, encode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        program.replay()
        replay.append(time.perf_counter() - start)
        if getattr(program, "last_encode_s", None) is not None:
            encode.append(program.last_encode_s)
    return 1e3 * statistics.median(replay), (1e3 * statistics.median(encode) if encode else None)


BENCH_PRECISIONS = (PRECISION_FP32, PRECISION_FP16_TC)


def run_key(runtime: str, precision: str) -> str:
    """The record key of a run: the runtime for fp32 (as before precisions were benchmarked), else
    runtime:precision."""
    return runtime if precision == PRECISION_FP32 else f"{runtime}:{precision}"


RUNTIME_CHECK_WORDS = {"on": True, "off": False}


def webgpu_variants(args) -> list[tuple[str, dict[str, Any]]]:
    """(runtime label, device options) of each WebGPU run --webgpu-runtime-checks asks for: the first
    labelled `webgpu`, the others `webgpu+checks-<setting>`; one default-device run when not given."""
    settings = list(dict.fromkeys(args.webgpu_runtime_checks or [None]))
    return [("webgpu" if index == 0 else f"webgpu+checks-{setting}",
             {} if setting is None else {"runtime_checks": RUNTIME_CHECK_WORDS[setting]})
            for index, setting in enumerate(settings)]


def bench_devices(args) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, runtime, device options) of every device the benchmark opens: Vulkan, then each WebGPU variant."""
    return [(label, runtime, options) for runtime in RUNTIMES
            for label, options in ([(runtime, {})] if runtime != "webgpu" else webgpu_variants(args))]


def run_runtime(runtime: str, device, path: Path, args, precision: str = PRECISION_FP32) -> dict[str, Any]:
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule

    start = time.perf_counter()
    try:
        # An explicit precision per run (never `auto`, which would take Vulkan's tensor cores only).
        runner = TrainingRunner.from_pte(path, device, planner=plan_schedule, precision=precision)
    except VktrainError as exc:  # e.g. a WGSL kernel missing, a tensor over max-storage-buffer-binding-size
        return {"error": f"{type(exc).__name__}: {exc}"}
    record: dict[str, Any] = {"load_s": time.perf_counter() - start, "precision": precision}
    if hasattr(device, "runtime_checks"):
        record["runtime_checks"] = device.runtime_checks
    with runner:
        config = bench_step.BenchConfig(**json.loads(runner.graph.metadata[bench_step.BENCH_CONFIG_KEY]))
        batches = [bench_step.make_batch(config, runner.vocab_size, seed) for seed in range(args.batches)]
        record.update(config=config.label, tokens_per_step=config.tokens, gemm_route=runner.gemm_report())
        record.update(bench_step.time_vulkan(runner, config, batches, args.warmup, args.steps, args.top))
        program = runner.executor.program
        record["last_step_ms_by_shader"] = _shader_ms(runner)
        if hasattr(program, "last_encode_s"):
            program.timing_enabled = False  # one pass, as an untimed training run encodes it
        record["replay_ms"], record["encode_ms"] = _replay_ms(program, args.steps)
    return record


def _shader_ms(runner) -> dict[str, float]:
    """GPU ms by shader of the last step (empty without timestamps)."""
    totals: dict[str, float] = {}
    for (_, seconds), dispatch in zip(runner.timings() or [], runner.executor.dispatches):
        totals[dispatch.shader] = totals.get(dispatch.shader, 0.0) + 1e3 * seconds
    return totals


def compare(base: dict[str, Any], other: dict[str, Any], top: int) -> dict[str, Any]:
    """Where `other`'s extra step time over `base`'s goes, from two run_runtime records (base: the Vulkan
    run, other: the WebGPU one, for `comparison`; `comparisons` names its pair)."""
    if "error" in base or "error" in other:
        return {}
    base_ms, other_ms = base["last_step_ms_by_shader"], other["last_step_ms_by_shader"]
    shaders = sorted(set(base_ms) | set(other_ms), key=lambda s: -(other_ms.get(s, 0.0) - base_ms.get(s, 0.0)))
    return {
        "other_over_base": other["ms_per_step"] / base["ms_per_step"],
        "max_rel_loss_diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(other["losses"], base["losses"])),
        "step_ms_difference": other["ms_per_step"] - base["ms_per_step"],
        "gpu_ms_difference": (None if None in (other["gpu_ms_per_step"], base["gpu_ms_per_step"])
                              else other["gpu_ms_per_step"] - base["gpu_ms_per_step"]),
        "encode_ms": other["encode_ms"],
        "by_shader": [{"shader": s, "base_ms": base_ms.get(s), "other_ms": other_ms.get(s)} for s in shaders[:top]],
    }


def compared_pairs(precisions, labels=RUNTIMES) -> list[tuple[str, str]]:
    """(base, other) run keys compared: each precision's Vulkan run against its WebGPU run, with fp16-tc
    WebGPU fp16-tc against Vulkan fp32 and against WebGPU fp32, and each further WebGPU variant (`labels`
    past the first two) against the first in each precision."""
    pairs = [(run_key("vulkan", p), run_key("webgpu", p)) for p in precisions]
    pairs += [(run_key("webgpu", p), run_key(label, p)) for label in labels[2:] for p in precisions]
    if PRECISION_FP16_TC in precisions and PRECISION_FP32 in precisions:
        pairs += [(run_key("vulkan", PRECISION_FP32), run_key("webgpu", PRECISION_FP16_TC)),
                  (run_key("webgpu", PRECISION_FP32), run_key("webgpu", PRECISION_FP16_TC))]
    return pairs


def print_report(records: list[dict[str, Any]], precisions, labels=RUNTIMES) -> None:
    for record in records:
        print(f"\n{record['pte']}")
        for key in (run_key(label, p) for p in precisions for label in labels):
            result = record[key]
            if "error" in result:
                print(f"  {key:15s} could not run it: {result['error'][:400]}")
                continue
            gpu = result["gpu_ms_per_step"]
            encode = result["encode_ms"]
            checks = "" if "runtime_checks" not in result else (
                f"  runtime checks {'on' if result['runtime_checks'] else 'off'}")
            print(f"  {key:15s} {result['ms_per_step']:9.2f} ms/step  {result['tokens_per_s']:9.1f} tokens/s  "
                  f"GPU {'-' if gpu is None else f'{gpu:.2f}'} ms  replay {result['replay_ms']:.2f} ms"
                  + ("" if encode is None else f"  encode {encode:.2f} ms") + f"  load {result['load_s']:.1f} s{checks}")
            print(f"  {'':15s} {result['gemm_route']}")
        for comparison in record["comparisons"]:
            if "other_over_base" not in comparison:
                continue
            base, other = comparison["base"], comparison["other"]
            print(f"  {other} / {base} {comparison['other_over_base']:.2f}x; losses agree to "
                  f"{comparison['max_rel_loss_diff']:.2e} relative; largest per-shader GPU differences:")
            for row in comparison["by_shader"][:8]:
                print(f"    {row['shader']:60s} {base} {row['base_ms'] or 0:8.3f} ms  {other} {row['other_ms'] or 0:8.3f} ms")


def run_command(args) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())  # wgpu warns without one
    records = [{"pte": str(path)} for path in args.pte]
    meta: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "warmup": args.warmup,
                            "steps": args.steps, "hparams": list(bench_step.HPARAMS),
                            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "note": "synthetic constants: weights are random, results measure speed only"}
    precisions = list(dict.fromkeys(args.precision))
    meta["precisions"] = precisions
    devices = bench_devices(args)
    labels = tuple(label for label, _, _ in devices)
    for label, runtime, options in devices:
        try:
            device = open_device(runtime, validation=False, **options)
        except VktrainError as exc:
            for record in records:
                for precision in precisions:
                    record[run_key(label, precision)] = {"error": f"no {label} device: {type(exc).__name__}: {exc}"}
            continue
        with device:
            meta[f"{label}_device"] = device.name
            print(f"{label}: {device.name}", flush=True)
            for path, record in zip(args.pte, records):
                for precision in precisions:
                    record[run_key(label, precision)] = run_runtime(runtime, device, Path(path), args, precision)
    for record in records:
        record["comparisons"] = [dict(base=base, other=other, **compare(record[base], record[other], args.top))
                                 for base, other in compared_pairs(precisions, labels)]
        fp32 = compare(record["vulkan"], record["webgpu"], args.top) if PRECISION_FP32 in precisions else {}
        # WebGPU against Vulkan in fp32 under the names this record had before precisions were benchmarked.
        record["comparison"] = fp32 and {"webgpu_over_vulkan": fp32["other_over_base"], **fp32}
    print_report(records, precisions, labels)
    if args.out:  # one file per machine and model: this call's .pte files replace theirs, others stay
        write_run(args.out, {"meta": meta, "results": records}, key=lambda r: Path(r["pte"]).name)
        print(f"wrote {args.out}")
    return 0


def _gemm_cases(M: int, N: int, K: int, group_size: int):
    """(name, dispatches, inputs {key: array}, output shape) of each timed GEMM kernel at one shape."""
    from vktrain.quant import quantize
    from vktrain.backend.kernel_planning.kernels.gemm_tuning import GPU_TUNING
    from vktrain.backend.kernel_planning.kernels.linear import (plan_linear_dw, plan_linear_q4gsw,
                                                         plan_linear_q4gsw_backward, prepack_weights)
    from vktrain.backend.kernel_planning.kernels.matmul import plan_mm

    rng = np.random.default_rng(0)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    w4x8 = prepack_weights(flat, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    d_out = rng.standard_normal((M, N)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    q4 = dict(M=M, N=N, K=K, group_size=group_size, weights="w", scales="s", out="out", tuning=GPU_TUNING)
    return [
        ("linear_q4gsw", plan_linear_q4gsw(x="x", **q4), {"x": x, "w": w4x8, "s": scales}, (M, N)),
        ("linear_q4gsw_backward", plan_linear_q4gsw_backward(d_out="d_out", **q4),
         {"d_out": d_out, "w": w4x8, "s": scales}, (M, K)),
        ("linear_dw", plan_linear_dw(M=M, N=N, K=K, out="out", d_out="d_out", x="x", tuning=GPU_TUNING),
         {"d_out": d_out, "x": x}, (N, K)),
        ("matmul", plan_mm(out="out", self="x", self_shape=(M, K), mat2="b", mat2_shape=(K, N), tuning=GPU_TUNING),
         {"x": x, "b": b}, (M, N)),
    ]


def _fp16_tc_cases(M: int, N: int, K: int, group_size: int, options: dict):
    """(name, dispatches, inputs, output shape) of each timed fp16-tc kernel at one shape, planned with a
    route's plan_options."""
    from vktrain.quant import quantize
    from vktrain.backend.kernel_planning.kernels.coopmat import (plan_coopmat_linear_q4gsw,
                                                                 plan_coopmat_linear_q4gsw_backward, plan_coopmat_mm)
    from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_scratch_nbytes
    from vktrain.backend.kernel_planning.kernels.linear import prepack_weights

    rng = np.random.default_rng(0)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    w4x8 = prepack_weights(flat, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    d_out = (rng.standard_normal((M, N)) * 1e-6).astype(np.float32)  # a gradient's magnitude
    weight = rng.standard_normal((N, K)).astype(np.float32)
    absmax = np.zeros(absmax_scratch_nbytes(M * K, N * K) // 4, np.uint32)
    q4 = dict(M=M, N=N, K=K, group_size=group_size, weights="w", scales="s", out="out", **options)
    return [
        ("coopmat_linear_q4gsw", plan_coopmat_linear_q4gsw(x="x", **q4), {"x": x, "w": w4x8, "s": scales}, (M, N)),
        ("coopmat_linear_q4gsw_backward", plan_coopmat_linear_q4gsw_backward(d_out="d_out", absmax="absmax", **q4),
         {"d_out": d_out, "w": w4x8, "s": scales, "absmax": absmax}, (M, K)),
        ("coopmat_mm_b_transposed", plan_coopmat_mm(M=M, N=N, K=K, out="out", a="x", b="b", absmax="absmax",
                                                    b_transposed=True, **options),
         {"x": x, "b": weight, "absmax": absmax}, (M, N)),
    ]


def _fp16_tc_rows(devices, M: int, N: int, K: int, args) -> list[dict[str, Any]]:
    """The fp16-tc kernels at one shape on each runtime whose fp16-tc route takes them."""
    from vktrain.contract import PRECISIONS
    from vktrain.backend.kernel_planning.kernels.coopmat import select_gemm_route

    routes = {runtime: select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device) for runtime, device in devices.items()}
    per_runtime = {runtime: _fp16_tc_cases(M, N, K, args.group_size, route.plan_options)
                   for runtime, route in routes.items() if route.tensor_cores}
    rows = []
    for index, (name, *_) in enumerate(_fp16_tc_cases(M, N, K, args.group_size, {})):
        row: dict[str, Any] = {"kernel": name, "shape": [M, N, K], "precision": PRECISION_FP16_TC}
        outputs = {}
        for runtime, route in routes.items():
            if runtime not in per_runtime:
                row[f"{runtime}_ms"], row[f"{runtime}_route"] = None, route.reason
                continue
            _, dispatches, inputs, out_shape = per_runtime[runtime][index]
            row[f"{runtime}_shaders"] = [d.shader for d in dispatches]
            row[f"{runtime}_ms"], outputs[runtime] = _time_kernel(devices[runtime], dispatches, inputs, out_shape,
                                                                  args.repeat, args.runs)
        if {"vulkan", "webgpu"} <= outputs.keys():
            row["max_abs_diff"] = float(np.max(np.abs(outputs["webgpu"] - outputs["vulkan"])))
        row["gflops"] = {runtime: 2e-6 * M * N * K / row[f"{runtime}_ms"] for runtime in outputs}
        rows.append(row)
        times = "  ".join(f"{runtime} " + ("fp32 fallback" if row[f"{runtime}_ms"] is None
                                           else f"{row[f'{runtime}_ms']:9.3f} ms") for runtime in routes)
        print(f"  {name:30s} {M}x{N}x{K} fp16-tc  {times}", flush=True)
    return rows


def _time_kernel(device, dispatches, inputs, out_shape, repeat: int, runs: int) -> tuple[float, np.ndarray]:
    """(median ms of one pass of `dispatches`, the output) on `device`."""
    from vktrain.runtime import Buffer, Program

    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.zeros(out_shape, np.float32), name="out")
    try:
        with Program(device, list(dispatches) * repeat, buffers) as program:
            program.replay()  # warm-up: pipelines, first-use costs
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                program.replay()
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times) / repeat, buffers["out"].read(np.float32, out_shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def kernels_command(args) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
    rows = []
    devices = {label: open_device(runtime, validation=False, **options) for label, runtime, options in bench_devices(args)}
    try:
        for runtime, device in devices.items():
            print(f"{runtime}: {device.name}", flush=True)
        for shape in args.shape:
            M, N, K = (int(v) for v in shape.lower().split("x"))
            if PRECISION_FP16_TC in args.precision:
                rows += _fp16_tc_rows(devices, M, N, K, args)
            if PRECISION_FP32 not in args.precision:
                continue
            for name, dispatches, inputs, out_shape in _gemm_cases(M, N, K, args.group_size):
                row: dict[str, Any] = {"kernel": name, "shape": [M, N, K], "precision": PRECISION_FP32,
                                       "shaders": [d.shader for d in dispatches]}
                outputs = {}
                for runtime, device in devices.items():
                    row[f"{runtime}_ms"], outputs[runtime] = _time_kernel(device, dispatches, inputs, out_shape,
                                                                          args.repeat, args.runs)
                row["max_abs_diff"] = float(np.max(np.abs(outputs["webgpu"] - outputs["vulkan"])))
                row["gflops"] = {runtime: 2e-6 * M * N * K / row[f"{runtime}_ms"] for runtime in devices}
                rows.append(row)
                variants = "".join(f"  {label} {row[f'{label}_ms']:9.3f} ms" for label in list(devices)[2:])
                print(f"  {name:22s} {M}x{N}x{K}  vulkan {row['vulkan_ms']:9.3f} ms  webgpu {row['webgpu_ms']:9.3f} ms"
                      f"  ({row['webgpu_ms'] / row['vulkan_ms']:.2f}x)  max |diff| {row['max_abs_diff']:.3g}{variants}",
                      flush=True)
    finally:
        for device in devices.values():
            device.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {label: device.name for label, device in devices.items()}
        meta["webgpu_runtime_checks"] = {label: device.runtime_checks for label, device in devices.items()
                                         if hasattr(device, "runtime_checks")}
        args.out.write_text(json.dumps({"devices": meta, "kernels": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="without a command: export tiny-llama steps to --out-dir and run them (lavapipe)")
    parser.add_argument("--out-dir", type=Path, default=None, help="with --quick: where the .pte files and "
                        "the JSON go (default: a temporary folder)")
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("run", help="time exported steps (scripts/bench_step.py export) on both runtimes")
    run.add_argument("pte", nargs="+", type=Path, help=".pte files written by `bench_step.py export`")
    run.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--batches", type=int, default=2, help="distinct random batches, cycled")
    run.add_argument("--top", type=int, default=15, help="op kinds and shaders listed")
    run.add_argument("--precision", nargs="+", choices=BENCH_PRECISIONS, default=[PRECISION_FP32],
                     help="GEMM precision policies each runtime runs every program in (default: fp32)")
    run.add_argument("--out", type=Path, default=None,
                     help="JSON results; an existing file keeps its other .pte files' records")
    run.add_argument("--webgpu-runtime-checks", nargs="+", choices=RUNTIME_CHECK_WORDS, default=None,
                     help="run the WebGPU side once per setting of naga's runtime checks in vktrain's kernels "
                          "(e.g. off on; default: the device's default)")
    kernels = commands.add_parser("kernels", help="time the GEMM kernels alone on both runtimes")
    kernels.add_argument("--shape", nargs="+", default=["256x512x512"], help="MxNxK shapes (N, K multiples of 8)")
    kernels.add_argument("--group-size", type=int, default=32, help="q4gsw group size")
    kernels.add_argument("--repeat", type=int, default=4, help="copies of each kernel's dispatches per replay")
    kernels.add_argument("--runs", type=int, default=5, help="timed replays (median reported)")
    kernels.add_argument("--precision", nargs="+", choices=BENCH_PRECISIONS, default=[PRECISION_FP32],
                         help="the fp32 GEMM kernels and/or the fp16-tc ones (default: fp32)")
    kernels.add_argument("--out", type=Path, default=None, help="JSON results")
    kernels.add_argument("--webgpu-runtime-checks", nargs="+", choices=RUNTIME_CHECK_WORDS, default=None,
                         help="time the WebGPU kernels once per setting of naga's runtime checks (e.g. off on)")
    args = parser.parse_args(argv)
    if out_error(getattr(args, "out", None)):
        parser.error(out_error(args.out))
    if args.command == "kernels":
        return kernels_command(args)
    if args.command is None:
        if not args.quick:
            parser.error("give a command (run), or --quick for a small export + run")
        with tempfile.TemporaryDirectory(prefix="vktrain-bench-webgpu-") as scratch:
            out_dir = args.out_dir or Path(scratch)
            written = bench_step.export_configs(bench_step.QUICK_PRESET, list(bench_step.QUICK_SHAPES), out_dir,
                                                bench_step.QUICK_SYNTHETIC_MIN_BYTES, prefix="step_quick",
                                                **bench_step.QUICK_OVERRIDES)
            return main(["run", *[w["path"] for w in written], "--steps", "3", "--warmup", "1",
                         "--out", str(out_dir / "webgpu_quick.json")])
    if args.steps <= 0 or args.warmup < 0 or args.batches <= 0:
        parser.error("--steps and --batches must be positive, --warmup >= 0")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

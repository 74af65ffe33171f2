#!/usr/bin/env python
"""Probe how fast a GEMM on NV cooperative_matrix2 (workgroup scope, tensor-addressed loads: the driver stages
the operands) runs on this GPU, beside torch's fp16 matmul at the same M x N x K, in one run. A measurement
for issue 30's "NV cooperative_matrix2 where the driver reports it" lever, before any product kernel: the
kernel is scripts/probe_coopmat2.slang (fp16 or fp32 A, B or B^T, fp32 accumulation), built here by slangc.

    python scripts/probe_coopmat2.py build --out-dir .dev_gpu/cm2        # here: SPIR-V of every variant
    python3 scripts/probe_coopmat2.py run .dev_gpu/cm2 --out $OUT/coopmat2_probe.json   # on the GPU machine

Each case: the median of --replays timestamped dispatches, TFLOP/s = 2 M N K / time, and the relative
Frobenius error of sampled rows against torch's fp32 matmul (TF32 off) of the same fp16-rounded operands
(~1e-6: fp16 products summed in fp32).
"""
from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SOURCE = Path(__file__).with_suffix(".slang")
# name -> defines: (BM, BN, BK, THREADS) tilings with fp16 A and B, then fp32 A, then B^T.
TILINGS = {"128x128x32t256": (128, 128, 32, 256), "128x128x64t256": (128, 128, 64, 256),
           "128x256x32t256": (128, 256, 32, 256), "256x128x32t256": (256, 128, 32, 256),
           "128x128x32t128": (128, 128, 32, 128), "64x128x32t128": (64, 128, 32, 128),
           "256x256x32t256": (256, 256, 32, 256)}
EXTRAS = {"a_fp32": ["A_FP32"], "b_t": ["B_TRANSPOSED"]}
SHAPES = ((2048, 8192, 2048), (2048, 2048, 8192), (4096, 4096, 4096))
CHECK_ROWS = 16


def variants() -> dict[str, list[str]]:
    out = {}
    for name, (bm, bn, bk, threads) in TILINGS.items():
        base = [f"BM={bm}", f"BN={bn}", f"BK={bk}", f"THREADS={threads}"]
        out[name] = base
        if name in ("128x128x32t256", "128x256x32t256"):
            for extra, defines in EXTRAS.items():
                out[f"{name}+{extra}"] = base + defines
    return out


def build(out_dir: Path) -> None:
    from vktrain.runtime_shaders.slang import find_slangc  # the build's own slangc (slangtorch's)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, defines in variants().items():
        target = out_dir / f"{name}.spv"
        subprocess.run([str(find_slangc()), str(SOURCE), "-entry", "main", "-stage", "compute", "-target", "spirv",
                        "-profile", "spirv_1_6", "-emit-spirv-directly", "-O0", *[f"-D{d}" for d in defines],
                        "-o", str(target), "-warnings-disable", "41012"], check=True)
        print(f"{target}: {target.stat().st_size} bytes")


class _Module:
    def __init__(self, code: bytes):
        self.code = code


def run(spv_dir: Path, out: Path, replays: int) -> None:
    import torch
    from vktrain.runtime import Buffer, Device, Program
    from vktrain.serialization.dispatch import Dispatch

    rng = np.random.default_rng(0)
    results = []
    with Device(validation=False, nv_cooperative_matrix2=True) as device:
        meta = {"vk_device": device.name, "nv_cooperative_matrix2": sorted(device.nv_cooperative_matrix2),
                "torch_device": torch.cuda.get_device_name(0), "replays": replays,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(meta, flush=True)
        for M, N, K in SHAPES:
            a = rng.standard_normal((M, K)).astype(np.float16)
            b = rng.standard_normal((K, N)).astype(np.float16)
            rows = np.linspace(0, M - 1, CHECK_ROWS).astype(np.int64)
            a_t, b_t = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            torch.backends.cuda.matmul.allow_tf32 = False
            reference = (a_t[torch.from_numpy(rows).cuda()].float() @ b_t.float()).cpu().numpy().astype(np.float64)
            record = {"M": M, "N": N, "K": K, "torch": {}, "vk": {}}
            for dtype in ("float16", "bfloat16"):
                x, y = a_t.to(getattr(torch, dtype)), b_t.to(getattr(torch, dtype))
                for _ in range(3):
                    x @ y
                torch.cuda.synchronize()
                samples = []
                for _ in range(replays):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    x @ y
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) * 1e-3)
                record["torch"][dtype] = 2 * M * N * K / statistics.median(samples) / 1e12
            buffers = {"a16": Buffer.from_array(device, a), "a32": Buffer.from_array(device, a.astype(np.float32)),
                       "b": Buffer.from_array(device, b), "bt": Buffer.from_array(device, np.ascontiguousarray(b.T)),
                       "c": Buffer(device, 4 * M * N)}
            for name, defines in variants().items():
                bm, bn = (int(d.split("=")[1]) for d in defines[:2])
                a_key = "a32" if "A_FP32" in defines else "a16"
                b_key = "bt" if "B_TRANSPOSED" in defines else "b"
                code = (spv_dir / f"{name}.spv").read_bytes()
                dispatch = Dispatch(shader=f"probe_coopmat2@{name}", groups=(N // bn, M // bm, 1),
                                    bindings=["c", a_key, b_key], push_constants=struct.pack("<4I", M, N, K, 0))
                try:
                    with Program(device, [dispatch], buffers, timing=True,
                                 modules={dispatch.shader: _Module(code)}) as program:
                        for _ in range(3):
                            program.replay()
                        samples = []
                        for _ in range(replays):
                            program.replay()
                            samples.append(sum(program.timings()))
                    got = np.stack([buffers["c"].read(np.float32, (N,), offset=4 * int(r) * N) for r in rows])
                    err = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
                    seconds = statistics.median(samples)
                    record["vk"][name] = {"ms": seconds * 1e3, "tflops": 2 * M * N * K / seconds / 1e12,
                                          "rel_err": err}
                except Exception as exc:  # a variant the driver refuses: keep the others
                    record["vk"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                print(f"{M}x{N}x{K} {name}: {record['vk'][name]}", flush=True)
            print(f"{M}x{N}x{K} torch: {record['torch']}", flush=True)
            results.append(record)
            for buffer in buffers.values():
                buffer.destroy()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build")
    build_parser.add_argument("--out-dir", type=Path, required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("spv_dir", type=Path)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if args.command == "build":
        build(args.out_dir)
    else:
        run(args.spv_dir, args.out, args.replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Causal attention forward and backward: vktrain's fp32 SIMT kernels (kernels/attention.py) against its
tensor-core kernels (kernels/coopmat_attention.py, the fp16-tc route) and PyTorch SDPA in bf16 (and
fp32) on the same GPU in one run, at Llama-3.2-1B attention shapes (Hq = 32, Hkv = 8, D = 64).

    python scripts/bench_coopmat_attention.py --out bench/results/coopmat_attention_h200.json
    python scripts/bench_coopmat_attention.py --quick --emulate     # lavapipe smoke run (emulated kernels)

Vulkan times: median over replays of one recorded Program of the sum of its dispatches' timestamps (per
dispatch too: the backward's delta, absmax, DQ and DKV). PyTorch: CUDA events around SDPA (forward) and
autograd.grad through it (backward, from a retained graph), bf16 and fp32 inputs. FLOPs count the causal
half of the algorithm's products (bench_kernels.py's convention): 2 x B Hq S^2 D for the forward (q k^T,
P v), 5 x that for the backward; the deterministic kernels' recomputation (P and dS twice) is not
counted. Errors: relative Frobenius norm of each vktrain result against PyTorch's fp32 one (or, without
torch's GPU, against vktrain's fp32 kernels).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_results import out_error  # noqa: E402
from bench_timing import median_cuda_ms  # noqa: E402

from vktrain.runtime import Buffer, Device, Program, run_dispatches  # noqa: E402
from vktrain.backend.kernel_planning.kernels import attention, coopmat_attention  # noqa: E402
from vktrain.backend.kernel_planning.kernels.coopmat import coopmat_supported  # noqa: E402


def _rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def _time_program(device, dispatches, buffers, replays: int, warmup: int) -> dict:
    with Program(device, dispatches, buffers, timing=True) as program:
        for _ in range(warmup + 1):
            program.replay()
        totals, per_dispatch = [], []
        for _ in range(replays):
            program.replay()
            timings = program.timings()
            totals.append(sum(timings))
            per_dispatch.append(timings)
    medians = [statistics.median(t[i] for t in per_dispatch) for i in range(len(dispatches))]
    return {"ms": 1e3 * statistics.median(totals),
            "dispatches": [{"shader": d.shader, "ms": 1e3 * m} for d, m in zip(dispatches, medians)]}


def _vulkan_case(device, impl: str, arrays: dict, dims: dict, scale: float, replays: int, warmup: int,
                 emulate: bool, row_blocks: int | None = None) -> dict:
    """Forward and backward of one implementation ("fp32" or "coopmat", the latter with its default
    tiling or `row_blocks`): times and results."""
    B, S, Hq, Hkv, D = (dims[n] for n in ("B", "S", "Hq", "Hkv", "D"))
    shared = device.limits.max_compute_shared_memory_size
    names = dict(q="q", k="k", v="v", out="out", lse="lse")
    grads = dict(d_out="d_out", d_q="d_q", d_k="d_k", d_v="d_v", delta="delta")
    buffers = {name: Buffer.from_array(device, a) for name, a in arrays.items()}
    for name, like in (("out", "q"), ("d_q", "q"), ("d_k", "k"), ("d_v", "v")):
        buffers[name] = Buffer(device, arrays[like].nbytes)
    buffers["lse"] = Buffer(device, 4 * B * Hq * S)
    buffers["delta"] = Buffer(device, attention.causal_attention_backward_scratch_nbytes(B, S, Hq))
    if impl == "fp32":
        forward = attention.plan_causal_attention(**dims, **names, scale=scale, shared_memory_bytes=shared,
                                                  max_workgroup_size=device.limits.max_compute_work_group_invocations)
        backward = attention.plan_causal_attention_backward(
            **dims, **names, **grads, scale=scale, shared_memory_bytes=shared,
            max_workgroup_size=device.limits.max_compute_work_group_invocations)
    else:
        options = dict(shared_memory_bytes=shared, emulate=emulate, subgroup_size=device.subgroup_size,
                       row_blocks=row_blocks)
        buffers["absmax"] = Buffer(device, coopmat_attention.backward_absmax_scratch_nbytes(B, S, Hq, Hkv, D))
        forward = coopmat_attention.plan_coopmat_causal_attention(**dims, **names, scale=scale, **options)
        backward = coopmat_attention.plan_coopmat_causal_attention_backward(
            **dims, **names, **grads, absmax="absmax", scale=scale, **options)
    try:
        result = {"forward": _time_program(device, forward, buffers, replays, warmup)}
        run_dispatches(device, forward, buffers)  # out and lse for the backward, outside its timing
        result["backward"] = _time_program(device, backward, buffers, replays, warmup)
        outputs = {name: buffers[name].read(np.float32, arrays[like].shape)
                   for name, like in (("out", "q"), ("d_q", "q"), ("d_k", "k"), ("d_v", "v"))}
        return result, outputs
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _torch_case(torch, arrays: dict, scale: float, dtype, replays: int, warmup: int):
    """SDPA forward and backward on CUDA in `dtype`: times and fp32 results in vktrain's layouts."""
    dev = torch.device("cuda")
    # SDPA wants [B, H, S, D]; enable_gqa maps query head h to kv head h // (Hq / Hkv) as vktrain does.
    leaves = [torch.from_numpy(arrays[n]).to(dev).transpose(1, 2).contiguous().to(dtype).requires_grad_(True)
              for n in ("q", "k", "v")]
    grad = torch.from_numpy(arrays["d_out"]).to(dev).transpose(1, 2).to(dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(*leaves, is_causal=True, scale=scale, enable_gqa=True)

    with torch.no_grad():
        forward_ms = median_cuda_ms(torch, lambda: sdpa(*leaves, is_causal=True, scale=scale, enable_gqa=True),
                                    replays, warmup)
    backward_ms = median_cuda_ms(torch, lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                                 replays, warmup)
    d_q, d_k, d_v = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    as_numpy = lambda t: t.transpose(1, 2).float().cpu().numpy()  # noqa: E731
    outputs = {"out": as_numpy(out.detach()), "d_q": as_numpy(d_q), "d_k": as_numpy(d_k), "d_v": as_numpy(d_v)}
    return {"forward": {"ms": forward_ms}, "backward": {"ms": backward_ms}}, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--quick", action="store_true", help="small shapes (B=1, S=64, Hq=4, Hkv=2)")
    parser.add_argument("--emulate", action="store_true",
                        help="run the COOPMAT_EMULATE kernels on a device without tensor cores (a smoke test)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))

    device = Device()
    if not coopmat_supported(device.cooperative_matrix_properties) and not args.emulate:
        print(f"{device.name} has no 16x16x16 fp16 cooperative matrices; pass --emulate for a smoke run",
              file=sys.stderr)
        return 2
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        torch, has_cuda = None, False
    B, Hq, Hkv, D = (1, 4, 2, 64) if args.quick else (1, 32, 8, 64)
    report = {"device": device.name, "platform": platform.platform(), "emulated": bool(args.emulate),
              "torch": getattr(torch, "__version__", None), "cuda": has_cuda, "replays": args.replays,
              "flops": "forward 2 B Hq S^2 D, backward 5 B Hq S^2 D (causal half, no recomputation)", "cases": []}
    rng = np.random.default_rng(0)
    # B = 1 at two lengths (the kernel comparison), and B = 4 x 512 (the training step's shape).
    for B, S in (((B, 64),) if args.quick else ((1, 512), (1, 2048), (4, 512))):
        dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
        scale = 1.0 / math.sqrt(D)
        arrays = {"q": rng.standard_normal((B, S, Hq, D)), "k": rng.standard_normal((B, S, Hkv, D)),
                  "v": rng.standard_normal((B, S, Hkv, D)), "d_out": rng.standard_normal((B, S, Hq, D)) * 1e-6}
        arrays = {n: a.astype(np.float32) for n, a in arrays.items()}
        causal_flops = B * Hq * S * S * D
        flops = {"forward": 2 * causal_flops, "backward": 5 * causal_flops}
        case = {"shape": dims, "d_out_magnitude": 1e-6, "implementations": {}}
        results = {}
        for impl in ("fp32", "coopmat"):
            case["implementations"][f"vk_{impl}"], results[f"vk_{impl}"] = _vulkan_case(
                device, impl, arrays, dims, scale, args.replays, args.warmup, args.emulate)
        # Every tiling the device holds, to check default_row_blocks' choice by measurement.
        shared = device.limits.max_compute_shared_memory_size
        for row_blocks in coopmat_attention.ROW_BLOCK_CHOICES:
            if all(coopmat_attention.shared_memory_nbytes(k, D, row_blocks) <= shared for k in coopmat_attention.KERNELS):
                name = f"vk_coopmat_row_blocks_{row_blocks}"
                case["implementations"][name], results[name] = _vulkan_case(
                    device, "coopmat", arrays, dims, scale, args.replays, args.warmup, args.emulate, row_blocks)
        if has_cuda:
            for name, dtype in (("torch_sdpa_bf16", torch.bfloat16), ("torch_sdpa_fp32", torch.float32)):
                case["implementations"][name], results[name] = _torch_case(torch, arrays, scale, dtype,
                                                                           args.replays, args.warmup)
        reference = "torch_sdpa_fp32" if has_cuda else "vk_fp32"
        for name, entry in case["implementations"].items():
            for direction in ("forward", "backward"):
                entry[direction]["tflops"] = flops[direction] / (entry[direction]["ms"] * 1e-3) / 1e12
            if name != reference:
                entry["rel_err_vs_" + reference] = {n: _rel_err(results[name][n], results[reference][n])
                                                    for n in ("out", "d_q", "d_k", "d_v")}
        impls = case["implementations"]
        case["speedup"] = {f"{direction}_{a}_over_{b}": impls[b][direction]["ms"] / impls[a][direction]["ms"]
                           for direction in ("forward", "backward")
                           for a, b in (("vk_coopmat", "vk_fp32"), ("vk_coopmat", "torch_sdpa_bf16"))
                           if b in impls}
        report["cases"].append(case)
        print(json.dumps({"B": B, "S": S, **{k: round(v, 3) for k, v in case["speedup"].items()},
                          **{f"{n}_{d}_ms": round(e[d]["ms"], 3) for n, e in impls.items()
                             for d in ("forward", "backward")}}), flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

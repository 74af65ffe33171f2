"""The step's GEMMs by shape, for bench_step.py: which op of an executor computes which M x N x K product
(`gemm_shapes`), and each top shape's achieved TFLOP/s beside torch's fp16 / bf16 matmul at the same
M x N x K on the same GPU (`add_rates`, `add_torch_rates`): the issue-30 comparison "every large GEMM of
the step at >= 50% of torch's fp16 matmul", in the same run as the step."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

from bench_timing import median_cuda_ms

# The GEMM ops whose time `top_gemms` splits by shape (M x N x K of the product each computes).
GEMM_OPS = ("aten.mm.default", "aten.addmm.default", "vktrain.linear_q4gsw.default",
            "vktrain.linear_q4gsw_backward.default", "vktrain.linear_dW.default")
TORCH_REPLAYS, TORCH_WARMUP = 20, 3


def gemm_shapes(executor) -> dict[int, str]:
    """Op index -> "op MxNxK (operand layout)" for the GEMM ops of an executor's graph: the key under which
    `top_gemms` adds up their dispatches (split-K reductions and absmax passes included)."""
    from vktrain.serialization import graph as vk

    graph = executor.graph
    shapes = {}
    for index, op in enumerate(executor.ops):
        if op.name not in GEMM_OPS:
            continue
        args = op.args[1:3] if op.name == "aten.addmm.default" else op.args[:3]  # addmm: (addend, a, b)
        tensors = [graph.tensor(v) for v in args if isinstance(graph.values[v], vk.TensorValue)]
        out = list(graph.tensor(op.outputs[0]).shape)
        rows = math.prod(out[:-1])
        if op.name in ("aten.mm.default", "aten.addmm.default"):
            a, b = tensors[0], tensors[1]
            layout = "".join("T" if t.view_strides else "N" for t in (a, b))  # T: a strided (transposed) view
            kind = "mm" if op.name == "aten.mm.default" else "addmm"
            shapes[index] = f"{kind} {a.shape[0]}x{b.shape[1]}x{a.shape[1]} {layout}"
        elif op.name == "vktrain.linear_dW.default":
            d_out, x = tensors[0], tensors[1]
            shapes[index] = f"linear_dW {d_out.shape[-1]}x{x.shape[-1]}x{math.prod(d_out.shape[:-1])}"
        else:
            shapes[index] = f"{op.name.split('.')[1]} {rows}x{out[-1]}x{tensors[0].shape[-1]}"
    return shapes


def dims(name: str) -> tuple[int, int, int]:
    """(M, N, K) of a `gemm_shapes` name."""
    M, N, K = (int(v) for v in name.split()[1].split("x"))
    return M, N, K


def add_rates(rows: list[dict[str, Any]], shapes: dict[int, str]) -> list[dict[str, Any]]:
    """Each top_gemms row with `count` (the step's GEMMs of that shape) and `tflops` (2 M N K count over
    the row's GPU time per step: its absmax and split-K passes included)."""
    counts = Counter(shapes.values())
    for row in rows:
        M, N, K = dims(row["name"])
        row["count"] = counts[row["name"]]
        row["tflops"] = 2 * M * N * K * row["count"] / (row["ms"] * 1e-3) / 1e12 if row["ms"] else None
    return rows


def add_torch_rates(torch, rows: list[dict[str, Any]]) -> None:
    """Torch's fp16 and bf16 matmul TFLOP/s at each row's M x N x K on the current CUDA device (CUDA events,
    median of TORCH_REPLAYS), and the row's share of torch fp16's rate (`of_torch_fp16`)."""
    for row in rows:
        M, N, K = dims(row["name"])
        for dtype in ("float16", "bfloat16"):
            row[f"torch_{dtype}_tflops"] = 2 * M * N * K / (_torch_matmul_ms(torch, M, N, K, dtype) * 1e-3) / 1e12
        if row.get("tflops"):
            row["of_torch_fp16"] = row["tflops"] / row["torch_float16_tflops"]
    torch.cuda.empty_cache()


def _torch_matmul_ms(torch, M: int, N: int, K: int, dtype: str) -> float:
    a = torch.randn(M, K, device="cuda", dtype=getattr(torch, dtype))
    b = torch.randn(K, N, device="cuda", dtype=getattr(torch, dtype))
    return median_cuda_ms(torch, lambda: torch.matmul(a, b), TORCH_REPLAYS, TORCH_WARMUP)

"""Dense fp32 GEMM for mm / bmm / addmm / baddbmm (matmul.comp), transposes expressed as strides.

`plan_gemm` computes C[b] = alpha * A[b] @ B[b] (+ beta * bias[b]) for views A [batch, M, K] and
B [batch, K, N] with any element strides (a transposed operand is a view whose last two strides are
swapped: t_copy / permute_copy feeding a mm need not be materialised) and a bias view broadcast to
[batch, M, N] (addmm's bias [N] or [M, N] reads in place with stride 0). C is contiguous.

Tiling: 64 x 64 output tiles, K steps of 16, 256 threads with 4 x 4 outputs each; partial tiles at
the edges are masked. A grid over the device limit (batch > 65535, huge M) is split by the runtime.
Accuracy: fp32 products accumulated in fp32 in k order within a tile; relative error ~ K * eps in the
worst case, ~ sqrt(K) * eps typically (tests: norm-relative 1e-4 against float64).
"""
from __future__ import annotations

import numbers
from typing import Any, Sequence

from ..schedule import Dispatch, ceil_div, pack_push
from .layout import (
    MAX_ELEMENTS,
    KernelArgumentError,
    StridedView,
    binding,
    check_dtype,
    check_shape,
    check_view_fits,
)
from .registry import register_kernel

TILE_M = 64
TILE_N = 64
A_M_FASTEST_SPEC_ID = 3
B_K_FASTEST_SPEC_ID = 4


def _as_batched(view: StridedView, what: str) -> StridedView:
    if view.rank == 2:
        return view.unsqueeze(0)
    if view.rank == 3:
        return view
    raise KernelArgumentError(f"{what} must have rank 2 or 3 (got sizes {view.sizes})")


def plan_gemm(out: Any, a: Any, a_view: StridedView, b: Any, b_view: StridedView, *,
              bias: Any = None, bias_view: StridedView | None = None, alpha: float = 1.0, beta: float = 1.0,
              label: str = "gemm") -> list[Dispatch]:
    """out [batch, M, N] (or [M, N] when both operands are 2-D) = alpha * A @ B (+ beta * bias).

    Operand views have rank 2 ([M, K] / [K, N]) or 3 ([batch, M, K] / [batch, K, N]); a 2-D operand
    or a batch of 1 broadcasts over the other's batch. The bias view must broadcast to the output.
    """
    A = _as_batched(a_view, f"{label}: A")
    B = _as_batched(b_view, f"{label}: B")
    batch_a, M, K = A.sizes
    batch_b, K_b, N = B.sizes
    if K != K_b:
        raise KernelArgumentError(
            f"{label}: inner dims differ: A {a_view.sizes} has K={K} but B {b_view.sizes} has K={K_b}")
    if batch_a != batch_b and 1 not in (batch_a, batch_b):
        raise KernelArgumentError(f"{label}: batch sizes {batch_a} and {batch_b} differ")
    batch = max(batch_a, batch_b)
    A = A.expand((batch, M, K))
    B = B.expand((batch, K, N))
    check_view_fits(A, None, f"{label}: A")
    check_view_fits(B, None, f"{label}: B")
    if batch * M * N > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{label}: the output [{batch}, {M}, {N}] has more than {MAX_ELEMENTS} elements (32-bit indices)")
    if batch * M * N == 0:
        return []
    has_bias = bias is not None
    if has_bias != (bias_view is not None):
        raise KernelArgumentError(f"{label}: give both bias and bias_view, or neither")
    if has_bias:
        if bias_view.rank > 3:
            raise KernelArgumentError(f"{label}: bias must have rank <= 3, got sizes {bias_view.sizes}")
        try:
            bias_full = bias_view.expand((batch, M, N))
        except KernelArgumentError:
            raise KernelArgumentError(
                f"{label}: bias of sizes {bias_view.sizes} does not broadcast to the output "
                f"[{batch}, {M}, {N}]") from None
        check_view_fits(bias_full, None, f"{label}: bias")
        bias_strides, bias_offset = bias_full.strides, bias_full.offset
    else:
        bias_strides, bias_offset = (0, 0, 0), 0

    push = pack_push(
        M, N, K,
        A.offset, A.strides[0], A.strides[1], A.strides[2],
        B.offset, B.strides[0], B.strides[1], B.strides[2],
        bias_offset, *bias_strides,
        float(alpha), float(beta))
    spec = {
        # Walk the tile along whichever dim is contiguous in memory so loads coalesce.
        A_M_FASTEST_SPEC_ID: bool(A.strides[1] == 1 and A.strides[2] != 1),
        B_K_FASTEST_SPEC_ID: bool(B.strides[1] == 1 and B.strides[2] != 1),
    }
    bindings = [binding(out, "w"), binding(a, "r"), binding(b, "r")]
    if has_bias:
        bindings.append(binding(bias, "r"))
    shader = "matmul@HAS_BIAS=1" if has_bias else "matmul@HAS_BIAS=0"
    groups = (ceil_div(N, TILE_N), ceil_div(M, TILE_M), batch)
    return [Dispatch(shader, groups, bindings=tuple(bindings), push_constants=push, spec_constants=spec,
                     label=label)]


# aten ops (calling convention: see layout.py). Inputs fp32 contiguous; out fp32 contiguous.

def _matrix(shape: Sequence[int], dtype: Any, rank: int, what: str) -> StridedView:
    check_dtype(dtype, what)
    shape = check_shape(shape, what)
    if len(shape) != rank:
        raise KernelArgumentError(f"{what} must have rank {rank}, got shape {shape}")
    return StridedView.contiguous(shape)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelArgumentError(f"{what} must be a real number, got {value!r}")
    return float(value)


@register_kernel("aten.mm.default")
def plan_mm(*, out: Any, self: Any, self_shape: Sequence[int], mat2: Any, mat2_shape: Sequence[int],
            self_dtype: Any = "float32", mat2_dtype: Any = "float32",
            label: str = "aten.mm.default") -> list[Dispatch]:
    """aten.mm: out [M, N] = self [M, K] @ mat2 [K, N]."""
    a = _matrix(self_shape, self_dtype, 2, "aten.mm self")
    b = _matrix(mat2_shape, mat2_dtype, 2, "aten.mm mat2")
    return plan_gemm(out, self, a, mat2, b, label=label)


@register_kernel("aten.bmm.default")
def plan_bmm(*, out: Any, self: Any, self_shape: Sequence[int], mat2: Any, mat2_shape: Sequence[int],
             self_dtype: Any = "float32", mat2_dtype: Any = "float32",
             label: str = "aten.bmm.default") -> list[Dispatch]:
    """aten.bmm: out [B, M, N] = self [B, M, K] @ mat2 [B, K, N] (equal batch sizes, like torch)."""
    a = _matrix(self_shape, self_dtype, 3, "aten.bmm self")
    b = _matrix(mat2_shape, mat2_dtype, 3, "aten.bmm mat2")
    if a.sizes[0] != b.sizes[0]:
        raise KernelArgumentError(f"aten.bmm: batch sizes differ: self {a.sizes} vs mat2 {b.sizes}")
    return plan_gemm(out, self, a, mat2, b, label=label)


@register_kernel("aten.addmm.default")
def plan_addmm(*, out: Any, self: Any, self_shape: Sequence[int], mat1: Any, mat1_shape: Sequence[int],
               mat2: Any, mat2_shape: Sequence[int], beta: float = 1, alpha: float = 1,
               self_dtype: Any = "float32", mat1_dtype: Any = "float32", mat2_dtype: Any = "float32",
               label: str = "aten.addmm.default") -> list[Dispatch]:
    """aten.addmm: out [M, N] = beta * self + alpha * mat1 [M, K] @ mat2 [K, N]; self broadcasts to
    [M, N] ([N], [1, N], [M, 1], scalar...). beta == 0 ignores self entirely (NaN included)."""
    check_dtype(self_dtype, "aten.addmm self")
    bias = StridedView.contiguous(check_shape(self_shape, "aten.addmm self"))
    if bias.rank > 2:
        raise KernelArgumentError(f"aten.addmm: self must have rank <= 2, got shape {bias.sizes}")
    a = _matrix(mat1_shape, mat1_dtype, 2, "aten.addmm mat1")
    b = _matrix(mat2_shape, mat2_dtype, 2, "aten.addmm mat2")
    return plan_gemm(out, mat1, a, mat2, b, bias=self, bias_view=bias, alpha=_number(alpha, "aten.addmm alpha"),
                     beta=_number(beta, "aten.addmm beta"), label=label)


@register_kernel("aten.baddbmm.default")
def plan_baddbmm(*, out: Any, self: Any, self_shape: Sequence[int], batch1: Any, batch1_shape: Sequence[int],
                 batch2: Any, batch2_shape: Sequence[int], beta: float = 1, alpha: float = 1,
                 self_dtype: Any = "float32", batch1_dtype: Any = "float32", batch2_dtype: Any = "float32",
                 label: str = "aten.baddbmm.default") -> list[Dispatch]:
    """aten.baddbmm: out [B, M, N] = beta * self + alpha * batch1 @ batch2; self broadcasts."""
    check_dtype(self_dtype, "aten.baddbmm self")
    bias = StridedView.contiguous(check_shape(self_shape, "aten.baddbmm self"))
    a = _matrix(batch1_shape, batch1_dtype, 3, "aten.baddbmm batch1")
    b = _matrix(batch2_shape, batch2_dtype, 3, "aten.baddbmm batch2")
    if a.sizes[0] != b.sizes[0]:
        raise KernelArgumentError(f"aten.baddbmm: batch sizes differ: batch1 {a.sizes} vs batch2 {b.sizes}")
    return plan_gemm(out, batch1, a, batch2, b, bias=self, bias_view=bias,
                     alpha=_number(alpha, "aten.baddbmm alpha"), beta=_number(beta, "aten.baddbmm beta"),
                     label=label)


@register_kernel("aten.linear.default")
def plan_linear(*, out: Any, input: Any, input_shape: Sequence[int], weight: Any, weight_shape: Sequence[int],
                bias: Any = None, bias_shape: Sequence[int] | None = None, input_dtype: Any = "float32",
                weight_dtype: Any = "float32", bias_dtype: Any = "float32",
                label: str = "aten.linear.default") -> list[Dispatch]:
    """aten.linear: out [..., N] = input [..., K] @ weight[N, K].T (+ bias [N]). The transpose is a
    stride swap read in place, never materialised."""
    check_dtype(input_dtype, "aten.linear input")
    input_shape = check_shape(input_shape, "aten.linear input")
    if not input_shape:
        raise KernelArgumentError("aten.linear: input must have at least one dim")
    w = _matrix(weight_shape, weight_dtype, 2, "aten.linear weight")
    n, k = w.sizes
    if input_shape[-1] != k:
        raise KernelArgumentError(
            f"aten.linear: input {input_shape} has last dim {input_shape[-1]} but weight {w.sizes} has K={k}")
    rows = StridedView.contiguous(input_shape).numel // k if k else 0
    a = StridedView.contiguous((rows, k))
    if bias is None:
        return plan_gemm(out, input, a, weight, w.transpose(0, 1), label=label)
    check_dtype(bias_dtype, "aten.linear bias")
    bias_view = StridedView.contiguous(check_shape(bias_shape if bias_shape is not None else (), "aten.linear bias"))
    if bias_view.sizes != (n,):
        raise KernelArgumentError(f"aten.linear: bias must have shape ({n},), got {bias_view.sizes}")
    return plan_gemm(out, input, a, weight, w.transpose(0, 1), bias=bias, bias_view=bias_view, label=label)

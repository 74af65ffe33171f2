"""Sum / mean / amax over any set of dims (reduce.slang): a general strided reduction, no permute needed.

The input view's dims split into kept dims (the output's index space) and reduced dims; each side is
merged into at most MAX_REDUCE_RANK (4) dims (adjacent dims contiguous with each other merge), so any
reduction over a rank <= 8 input fits. The output is contiguous, in the kept dims' order (keepdim only
changes the output's shape, not its bytes).

Strategy, a pure function of the shapes (so runs are bitwise reproducible):
* one thread per output, serial sum, when the reduction is short or when there are many outputs whose
  elements are adjacent in memory (column sums of a row-major [rows, cols]: neighbouring threads read
  neighbouring addresses);
* otherwise one workgroup of 64 per output: strided per-thread partial sums, then a fixed tree.
Accuracy: each thread's running sum is compensated (Kahan), so a serial sum errs by ~2 eps * sum|x|
whatever its length, and the tree path by ~(2 + 6) eps * sum|x| (6 levels of plain adds); mean
multiplies by 1 / count (one more rounding).
Limits: one output may reduce up to 2^32 - 1 elements in principle; on lavapipe, whose driver ends
an invocation after 65535 loop trips, up to 33.5M (64 threads x 8 elements x 65535 trips).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import KernelArgumentError, StridedView, check_shape, normalize_dim
from vktrain.backend.kernel_planning.kernels.layout import (
    binding, check_dtype, check_view_fits, coalesce_dims, padded_innermost_first
)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

MAX_REDUCE_RANK = 4
WORKGROUP_SIZE = 64
STRATEGY_SPEC_ID = 3
STRATEGY_GROUP_PER_OUTPUT = 0
STRATEGY_THREAD_PER_OUTPUT = 1
REDUCE_OP_SPEC_ID = 4
REDUCE_OPS = {"sum": 0, "mean": 0, "amax": 1}  # mean is a sum scaled by 1 / count
# Serial sums are used up to this length whatever the layout (a 64-wide group would idle anyway).
SERIAL_ALWAYS_LENGTH = 64
# Column-sum pattern: enough outputs to fill a GPU with one thread each.
SERIAL_MIN_OUTPUTS = 1024
# Longest serial sum. lavapipe ends an invocation after 65535 loop trips (8 elements each here), so
# a serial sum must stay below 524288 elements there; the tree path allows 64x more per output.
SERIAL_MAX_LENGTH = 262144


def reduced_dims(rank: int, dims: Sequence[int] | None, what: str) -> tuple[int, ...]:
    """torch's dim argument normalised: None or [] reduces every dim; duplicates are an error."""
    if dims is None or len(dims) == 0:
        return tuple(range(rank))
    normalized = [normalize_dim(int(d), rank, what) for d in dims]
    if len(set(normalized)) != len(normalized):
        raise KernelArgumentError(f"{what}: dim {list(dims)} names a dim more than once")
    return tuple(sorted(normalized)) if rank else ()


def reduced_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if axis in dims else size for axis, size in enumerate(shape))
    return tuple(size for axis, size in enumerate(shape) if axis not in dims)


def choose_strategy(out_numel: int, red_numel: int, innermost_kept_stride: int | None) -> int:
    if red_numel <= SERIAL_ALWAYS_LENGTH:
        return STRATEGY_THREAD_PER_OUTPUT
    if out_numel >= SERIAL_MIN_OUTPUTS and innermost_kept_stride == 1 and red_numel <= SERIAL_MAX_LENGTH:
        return STRATEGY_THREAD_PER_OUTPUT
    return STRATEGY_GROUP_PER_OUTPUT


def plan_sum(out: Any, source: Any, view: StridedView, dims: Sequence[int] | None, *,
             mean: bool = False, label: str | None = None) -> list[Dispatch]:
    """out = sum (or mean) of `view` of buffer `source` over `dims` (None / empty = all dims).

    The output is contiguous with the kept dims in order (shape `reduced_shape(view.sizes, dims, kd)`
    for either keepdim). A reduction over zero elements gives 0 for sum and NaN for mean, like torch.
    """
    return plan_reduce("mean" if mean else "sum", out, source, view, dims, label=label)


def plan_reduce(op: str, out: Any, source: Any, view: StridedView, dims: Sequence[int] | None, *,
                label: str | None = None) -> list[Dispatch]:
    """out = op ("sum", "mean" or "amax") of `view` over `dims`; see plan_sum. amax of zero elements
    is refused, as torch does; NaN propagates through amax."""
    if op not in REDUCE_OPS:
        raise KernelArgumentError(f"unknown reduction {op!r}; known: {sorted(REDUCE_OPS)}")
    mean = op == "mean"
    label = label or op
    dims = reduced_dims(view.rank, dims, label)
    check_view_fits(view, None, f"{label} input")
    kept = [axis for axis in range(view.rank) if axis not in dims]
    out_sizes = [view.sizes[a] for a in kept]
    out_numel = math.prod(out_sizes)
    red_numel = math.prod(view.sizes[a] for a in dims)
    if out_numel == 0:
        return []
    # Merge within each side; dims of the other side sit between them in the input but not in the
    # merged lists, and coalesce_dims only merges neighbours whose strides chain, so that is safe.
    out_merged, (out_strides,) = coalesce_dims(out_sizes, [view.strides[a] for a in kept])
    red_merged, (red_strides,) = coalesce_dims([view.sizes[a] for a in dims], [view.strides[a] for a in dims])
    for side, merged in (("kept", out_merged), ("reduced", red_merged)):
        if len(merged) > MAX_REDUCE_RANK:
            raise KernelArgumentError(
                f"{label}: the {side} dims of input {view.sizes} over dims {list(dims)} need {len(merged)} "
                f"dims after merging; reduce.slang supports at most {MAX_REDUCE_RANK} per side")
    if red_numel == 0 and op == "amax":
        raise KernelArgumentError(
            f"{label}: amax over dims {list(dims)} of {view.sizes} reduces zero elements (torch raises too)")
    if red_numel == 0:
        scale = math.nan if mean else 0.0  # the kernel's empty loop sums to 0; 0 * NaN = NaN
    else:
        scale = 1.0 / red_numel if mean else 1.0
    innermost_kept_stride = out_strides[-1] if out_strides else None
    strategy = choose_strategy(out_numel, red_numel, innermost_kept_stride)
    push = pack_push(
        out_numel, red_numel, len(out_merged), len(red_merged), view.offset, float(scale),
        *padded_innermost_first(out_merged, MAX_REDUCE_RANK, 1),
        *padded_innermost_first(out_strides, MAX_REDUCE_RANK, 0),
        *padded_innermost_first(red_merged, MAX_REDUCE_RANK, 1),
        *padded_innermost_first(red_strides, MAX_REDUCE_RANK, 0))
    groups = out_numel if strategy == STRATEGY_GROUP_PER_OUTPUT else ceil_div(out_numel, WORKGROUP_SIZE)
    spec = {STRATEGY_SPEC_ID: strategy, REDUCE_OP_SPEC_ID: REDUCE_OPS[op]}
    return [Dispatch("reduce", groups, bindings=(binding(out, "w"), binding(source, "r")),
                     push_constants=push, spec_constants=spec, label=label)]


# aten ops (calling convention: see layout.py). The output is fp32, contiguous, of shape
# reduced_shape(self_shape, dims, keepdim).

def _check_reduce_dtypes(key: str, self_dtype: Any, dtype: Any) -> None:
    check_dtype(self_dtype, f"{key} self")
    if dtype is not None:
        check_dtype(dtype, f"{key} dtype")


@register_kernel("aten.sum.dim_IntList")
def plan_sum_dim(*, out: Any, self: Any, self_shape: Sequence[int], dim: Sequence[int] | None,
                 keepdim: bool = False, dtype: Any = None, self_dtype: Any = "float32",
                 label: str = "aten.sum.dim_IntList") -> list[Dispatch]:
    """aten.sum.dim_IntList: sum over `dim` (None or [] = all dims), keepdim or not."""
    _check_reduce_dtypes("aten.sum.dim_IntList", self_dtype, dtype)
    view = StridedView.contiguous(check_shape(self_shape, "aten.sum self"))
    return plan_sum(out, self, view, dim, label=label)


@register_kernel("aten.sum.default")
def plan_sum_all(*, out: Any, self: Any, self_shape: Sequence[int], dtype: Any = None,
                 self_dtype: Any = "float32", label: str = "aten.sum.default") -> list[Dispatch]:
    """aten.sum.default: sum of every element, a 0-d output."""
    _check_reduce_dtypes("aten.sum.default", self_dtype, dtype)
    view = StridedView.contiguous(check_shape(self_shape, "aten.sum self"))
    return plan_sum(out, self, view, None, label=label)


@register_kernel("aten.mean.dim")
def plan_mean_dim(*, out: Any, self: Any, self_shape: Sequence[int], dim: Sequence[int] | None,
                  keepdim: bool = False, dtype: Any = None, self_dtype: Any = "float32",
                  label: str = "aten.mean.dim") -> list[Dispatch]:
    """aten.mean.dim: mean over `dim` (None or [] = all dims), keepdim or not."""
    _check_reduce_dtypes("aten.mean.dim", self_dtype, dtype)
    view = StridedView.contiguous(check_shape(self_shape, "aten.mean self"))
    return plan_sum(out, self, view, dim, mean=True, label=label)


@register_kernel("aten.amax.default")
def plan_amax(*, out: Any, self: Any, self_shape: Sequence[int], dim: Sequence[int] | None = (),
              keepdim: bool = False, self_dtype: Any = "float32", label: str = "aten.amax.default") -> list[Dispatch]:
    """aten.amax: maximum over `dim` ([] = all dims), keepdim or not; NaN propagates."""
    check_dtype(self_dtype, "aten.amax self")
    view = StridedView.contiguous(check_shape(self_shape, "aten.amax self"))
    return plan_reduce("amax", out, self, view, dim, label=label)

"""The Q8_0 weight family: a frozen matrix W [N, K] held on the device as int8 codes [N, K] and float32
scales [N * K / 32] (vktrain.quant.q8_0, docs/spec/q8_0.md), read without ever being widened to float32.

    embedding_q8_0(codes, scales, indices)    out = W[indices]       embedding_q8_0.slang
    linear_q8_0(x, codes, scales)             out = x @ W^T          matmul.slang, B_Q8_0 variants
    linear_q8_0_backward(d_out, codes, scales) out = d_out @ W       matmul.slang, B_Q8_0 variants

A tied embedding (SmolLM2) is read by all three: the lookup, the head's logits and, backward, the head's
d_h (W is frozen: no dW). The GEMMs are plan_gemm (kernels/matmul.py) with B = W^T or W as a strided view
of the codes, dequantized as each element is loaded: the same tiles, tuning (CPU register tiles on
lavapipe) and products in the same order as the float32 GEMM over the dequantized matrix, whose every
element code * scale is exactly the float32 value, so the results are those of the float32 route bit for
bit on a device that runs both bodies alike (lavapipe: tests/test_q8_0_weights.py).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES, q8_0_num_scales
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.backend.kernel_planning.kernels.gemm_tuning import GPU_TUNING
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, StridedView, check_shape
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, binding, check_dtype, row_windows, table_window
from vktrain.backend.kernel_planning.kernels.matmul import plan_gemm
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

WORKGROUP_SIZE = 64  # embedding_q8_0.slang
COLUMNS_PER_INVOCATION = 4  # embedding_q8_0.slang writes one vec4 of one row (one word of codes)
INDEX_DTYPES = ("int32", "int64")  # int64 indices are int32 on the GPU (the runner converts them)


def _weight(codes_shape: Sequence[int], scales_shape: Sequence[int], label: str) -> tuple[int, int]:
    codes_shape = check_shape(codes_shape, f"{label} codes")
    if len(codes_shape) != 2:
        raise KernelArgumentError(f"{label}: codes must be 2-D [N, K], got shape {codes_shape}")
    n, k = codes_shape
    try:
        scales = q8_0_num_scales(n, k)
    except ValueError as exc:
        raise KernelArgumentError(f"{label}: {exc}") from None
    if tuple(check_shape(scales_shape, f"{label} scales")) != (scales,):
        raise KernelArgumentError(f"{label}: codes [{n}, {k}] need scales of shape [{scales}], "
                                  f"got {list(scales_shape)}")
    return n, k


def _check_dtypes(label: str, codes_dtype: Any, scales_dtype: Any) -> None:
    check_dtype(codes_dtype, f"{label} codes", ("int8",))
    check_dtype(scales_dtype, f"{label} scales")


@register_kernel("vktrain.embedding_q8_0.default")
def plan_embedding_q8_0(*, out: Any, codes: Any, codes_shape: Sequence[int], scales: Any, scales_shape: Sequence[int],
                        indices: Any, indices_shape: Sequence[int], codes_dtype: Any = "int8",
                        scales_dtype: Any = "float32", indices_dtype: Any = "int64",
                        binding_limit: BindingLimit | None = None, label: str = "embedding_q8_0") -> list[Dispatch]:
    """out (contiguous, indices_shape + [K]) = W[indices]; K must be a multiple of 4 (one word of codes
    per invocation). An index outside [0, N) gives a NaN row. Codes over `binding_limit` are bound in
    windows of rows, each starting at a whole block whose scales' binding offset is aligned too, and each
    gathering the indices in it (as kernels/embedding.py): the unsplit output bit for bit."""
    _check_dtypes(label, codes_dtype, scales_dtype)
    check_dtype(indices_dtype, f"{label} indices", INDEX_DTYPES)
    n, k = _weight(codes_shape, scales_shape, label)
    if k % COLUMNS_PER_INVOCATION:
        raise KernelArgumentError(f"{label}: rows of {k} codes; the kernel reads whole words of "
                                  f"{COLUMNS_PER_INVOCATION} (K % {COLUMNS_PER_INVOCATION} == 0)")
    num_indices = math.prod(check_shape(indices_shape, f"{label} indices"))
    if num_indices * k > MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: the output has {num_indices * k} elements; at most {MAX_ELEMENTS}")
    words = num_indices * k // COLUMNS_PER_INVOCATION
    if words == 0:
        return []
    if binding_limit is None or binding_limit.fits(n * k):
        windows = [((0, n), binding(codes, "r"), binding(scales, "r"))]
    else:
        windows = [((begin, end), table_window(codes, begin * k, end * k, "r", binding_limit, label),
                    table_window(scales, 4 * begin * k // Q8_0_BLOCK_VALUES, 4 * end * k // Q8_0_BLOCK_VALUES, "r",
                                 binding_limit, label))
                   for begin, end in row_windows(n, k, binding_limit, "the codes", label,
                                                 binding_limit.q8_0_window_start)]
    return [Dispatch("embedding_q8_0", ceil_div(words, WORKGROUP_SIZE),
                     bindings=(binding(out, "w"), binding(indices, "r"), codes_window, scales_window),
                     push_constants=pack_push(num_indices, k // COLUMNS_PER_INVOCATION, n, begin, end),
                     label=label if len(windows) == 1 else f"{label}.rows{begin}")
            for (begin, end), codes_window, scales_window in windows]


def _plan_head_gemm(out: Any, rows_input: Any, input_shape: Sequence[int], codes: Any, codes_shape: Sequence[int],
                    scales: Any, scales_shape: Sequence[int], transposed: bool, scratch: Any, tuning: str,
                    binding_limit: BindingLimit | None, max_workgroup_size: int | None, label: str) -> list[Dispatch]:
    n, k = _weight(codes_shape, scales_shape, label)
    input_shape = check_shape(input_shape, f"{label} input")
    inner = k if transposed else n
    if not input_shape or input_shape[-1] != inner:
        raise KernelArgumentError(f"{label}: the input {list(input_shape)} must have last dim {inner} "
                                  f"(codes [{n}, {k}])")
    rows = math.prod(input_shape[:-1])
    w = StridedView.contiguous((n, k))
    return plan_gemm(out, rows_input, StridedView.contiguous((rows, inner)), codes,
                     w.transpose(0, 1) if transposed else w, b_scales=scales, scratch=scratch, tuning=tuning,
                     binding_limit=binding_limit, max_workgroup_size=max_workgroup_size, label=label)


@register_kernel("vktrain.linear_q8_0.default")
def plan_linear_q8_0(*, out: Any, x: Any, x_shape: Sequence[int], codes: Any, codes_shape: Sequence[int], scales: Any,
                     scales_shape: Sequence[int], x_dtype: Any = "float32", codes_dtype: Any = "int8",
                     scales_dtype: Any = "float32", scratch: Any = None, tuning: str = GPU_TUNING,
                     binding_limit: BindingLimit | None = None, max_workgroup_size: int | None = None,
                     label: str = "linear_q8_0") -> list[Dispatch]:
    """out [..., N] = x [..., K] @ W^T. `scratch`, `tuning`, `binding_limit` and `max_workgroup_size` as
    in plan_gemm."""
    _check_dtypes(label, codes_dtype, scales_dtype)
    check_dtype(x_dtype, f"{label} x")
    return _plan_head_gemm(out, x, x_shape, codes, codes_shape, scales, scales_shape, True, scratch, tuning,
                           binding_limit, max_workgroup_size, label)


@register_kernel("vktrain.linear_q8_0_backward.default")
def plan_linear_q8_0_backward(*, out: Any, d_out: Any, d_out_shape: Sequence[int], codes: Any,
                              codes_shape: Sequence[int], scales: Any, scales_shape: Sequence[int],
                              d_out_dtype: Any = "float32", codes_dtype: Any = "int8", scales_dtype: Any = "float32",
                              scratch: Any = None, tuning: str = GPU_TUNING, binding_limit: BindingLimit | None = None,
                              max_workgroup_size: int | None = None,
                              label: str = "linear_q8_0_backward") -> list[Dispatch]:
    """out [..., K] = d_out [..., N] @ W. `scratch`, `tuning`, `binding_limit` and `max_workgroup_size` as
    in plan_gemm."""
    _check_dtypes(label, codes_dtype, scales_dtype)
    check_dtype(d_out_dtype, f"{label} d_out")
    return _plan_head_gemm(out, d_out, d_out_shape, codes, codes_shape, scales, scales_shape, False, scratch, tuning,
                           binding_limit, max_workgroup_size, label)


__all__ = ["plan_embedding_q8_0", "plan_linear_q8_0", "plan_linear_q8_0_backward"]

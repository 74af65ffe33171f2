"""Embedding lookup and its deterministic dense backward (embedding.slang).

Indices are int32 on the GPU: the runner converts int64 index tensors before upload (values must fit
in int32, which every vocabulary does). Weight and gradients are fp32, contiguous.

Forward: out[..., :] = weight[indices[...], :]. An index outside [0, num_weights) yields a NaN row (a
kernel cannot raise; NaN surfaces in the loss rather than silently reading another row).

A table over the device's max storage binding size (`binding_limit`: a large vocabulary's embedding) is
bound in windows of whole rows, one dispatch each; each gathers the indices that fall in its window (the
window of row 0 also writes the NaN rows), so the output is the unsplit one bit for bit.

Backward (embedding_dense_backward): grad_weight[v] = sum of grad_output rows whose index is v, added in
increasing position order; the padding_idx row is zero; scale_grad_by_freq divides by the count;
indices outside [0, num_weights) contribute to no row.
One workgroup per (vocabulary row, block of 256 columns) scans all indices with a uniform branch and
accumulates its columns in registers: no float atomics, so two runs are bitwise identical, and every
output element is written exactly once. Cost: num_weights * ceil(dim / 256) * num_indices index
compares (uniform, from shared memory) plus one read of each gradient row per occurrence; fine for
the rare graphs that train an embedding (LoRA freezes it), quadratic-ish for huge vocabularies.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, check_shape
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, binding, check_dtype, row_windows, table_window
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

WORKGROUP_SIZE = 64
# embedding.slang BACKWARD: columns of a vocabulary row one work group accumulates (64 threads x 4).
BACKWARD_COLUMNS_PER_GROUP = 256
INT32_MAX = 2**31 - 1


def _check_weight_shape(weight_shape: Sequence[int], label: str) -> tuple[int, int]:
    weight_shape = check_shape(weight_shape, f"{label} weight")
    if len(weight_shape) != 2:
        raise KernelArgumentError(f"{label}: weight must be 2-D [num_weights, dim], got shape {weight_shape}")
    if weight_shape[0] > INT32_MAX:
        raise KernelArgumentError(f"{label}: {weight_shape[0]} rows do not fit int32 indices")
    return weight_shape


def plan_embedding(out: Any, weight: Any, weight_shape: Sequence[int], indices: Any,
                   indices_shape: Sequence[int], *, binding_limit: BindingLimit | None = None,
                   label: str = "embedding") -> list[Dispatch]:
    """out (contiguous, indices_shape + [dim]) = weight[indices]. A table over `binding_limit` is bound
    in windows of rows (module docstring)."""
    num_weights, dim = _check_weight_shape(weight_shape, label)
    num_indices = math.prod(check_shape(indices_shape, f"{label} indices"))
    total = num_indices * dim
    if total > MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: the output has {total} elements; at most {MAX_ELEMENTS} are supported")
    if total == 0:
        return []
    if binding_limit is None or binding_limit.fits(4 * num_weights * dim):
        windows = [((0, num_weights), binding(weight, "r"))]
    else:
        windows = [((begin, end), table_window(weight, 4 * begin * dim, 4 * end * dim, "r", binding_limit, label))
                   for begin, end in row_windows(num_weights, 4 * dim, binding_limit, "the table", label)]
    return [Dispatch("embedding@BACKWARD=0", ceil_div(total, WORKGROUP_SIZE),
                     bindings=(binding(out, "w"), binding(indices, "r"), table),
                     push_constants=pack_push(num_indices, dim, num_weights, -1, 0, begin, end),
                     label=label if len(windows) == 1 else f"{label}.rows{begin}")
            for (begin, end), table in windows]


def plan_embedding_dense_backward(out: Any, grad_output: Any, grad_output_shape: Sequence[int], indices: Any,
                                  indices_shape: Sequence[int], num_weights: int, padding_idx: int = -1,
                                  scale_grad_by_freq: bool = False, *,
                                  label: str = "embedding_dense_backward") -> list[Dispatch]:
    """out [num_weights, dim] = per-row sums of grad_output [*indices_shape, dim] (see module doc)."""
    indices_shape = check_shape(indices_shape, f"{label} indices")
    grad_output_shape = check_shape(grad_output_shape, f"{label} grad_output")
    if tuple(grad_output_shape[:-1]) != tuple(indices_shape) or len(grad_output_shape) != len(indices_shape) + 1:
        raise KernelArgumentError(
            f"{label}: grad_output shape {grad_output_shape} must be indices shape {indices_shape} + [dim]")
    dim = grad_output_shape[-1]
    _check_weight_shape((num_weights, dim), label)
    if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
        raise KernelArgumentError(f"{label}: padding_idx must be an int, got {padding_idx!r}")
    # torch passes padding_idx already normalised (>= 0) or -1 for none; any negative means none.
    padding = padding_idx if 0 <= padding_idx < num_weights else -1
    if num_weights * dim > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{label}: the output has {num_weights * dim} elements; at most {MAX_ELEMENTS} are supported")
    if num_weights * dim == 0:
        return []
    num_indices = math.prod(indices_shape)
    push = pack_push(num_indices, dim, num_weights, padding, int(bool(scale_grad_by_freq)), 0, num_weights)
    groups = (num_weights, ceil_div(dim, BACKWARD_COLUMNS_PER_GROUP), 1)
    return [Dispatch("embedding@BACKWARD=1", groups,
                     bindings=(binding(out, "w"), binding(indices, "r"), binding(grad_output, "r")),
                     push_constants=push, label=label)]


# aten ops (calling convention: see layout.py). `indices_dtype` may be int32 or int64: int64 index
# tensors of the graph are int32 on the GPU (the runner converts them on upload).
INDEX_DTYPES = ("int32", "int64")


@register_kernel("aten.embedding.default")
def plan_aten_embedding(*, out: Any, weight: Any, weight_shape: Sequence[int], indices: Any,
                        indices_shape: Sequence[int], padding_idx: int = -1, scale_grad_by_freq: bool = False,
                        sparse: bool = False, weight_dtype: Any = "float32", indices_dtype: Any = "int64",
                        binding_limit: BindingLimit | None = None, label: str = "aten.embedding.default"
                        ) -> list[Dispatch]:
    """aten.embedding: out = weight[indices] (padding_idx and scale_grad_by_freq only matter backward)."""
    check_dtype(weight_dtype, "aten.embedding weight")
    check_dtype(indices_dtype, "aten.embedding indices", INDEX_DTYPES)
    if sparse:
        raise KernelArgumentError("aten.embedding: sparse=True (sparse gradients) is not supported")
    return plan_embedding(out, weight, weight_shape, indices, indices_shape, binding_limit=binding_limit, label=label)


@register_kernel("aten.embedding_dense_backward.default")
def plan_aten_embedding_dense_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int],
                                       indices: Any, indices_shape: Sequence[int], num_weights: int,
                                       padding_idx: int, scale_grad_by_freq: bool,
                                       grad_output_dtype: Any = "float32", indices_dtype: Any = "int64",
                                       label: str = "aten.embedding_dense_backward.default") -> list[Dispatch]:
    """aten.embedding_dense_backward: out [num_weights, dim], deterministic (see the module doc)."""
    check_dtype(grad_output_dtype, "aten.embedding_dense_backward grad_output")
    check_dtype(indices_dtype, "aten.embedding_dense_backward indices", INDEX_DTYPES)
    if isinstance(num_weights, bool) or not isinstance(num_weights, int) or num_weights < 0:
        raise KernelArgumentError(
            f"aten.embedding_dense_backward: num_weights must be an int >= 0, got {num_weights!r}")
    return plan_embedding_dense_backward(out, grad_output, grad_output_shape, indices, indices_shape, num_weights,
                                         padding_idx, scale_grad_by_freq, label=label)

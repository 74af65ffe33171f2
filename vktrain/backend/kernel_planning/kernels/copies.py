"""The aten view, copy and fill ops (view_copy, clone, _to_copy, permute / transpose / t, expand,
(un)squeeze, slice, select, cat, full / scalar_tensor / *_like): plans over the strided-copy and fill
kernels of kernels/layout.py, in its calling convention (see its docstring).

Copies accept fp32 and int32 / int64 (int64 graph tensors are int32 on the GPU). `view_copy` (and
`reshape`) of a contiguous tensor is an alias: `is_alias_view` says so, and its plan is a plain 1-D copy
for runners that keep every value in its own buffer. Over `binding_limit` copies and fills run in windows of
their flat index space (`plan_copy`, kernels/elementwise_windows.py).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from vktrain.serialization.dispatch import Dispatch
from vktrain.backend.kernel_planning.kernels.elementwise_windows import (element_windows, needs_windows, operand_span,
                                                                  split_windows, window_binding, window_offset)
from vktrain.backend.kernel_planning.kernels.layout import (
    CONVERT_FP32_TO_INT32, CONVERT_INT32_TO_FP32, CONVERT_NONE, BindingLimit, check_dtype, coalesce_dims, copy_push,
    elementwise_groups, fill_word, plan_fill, plan_strided_copy
)
from vktrain.serialization.strided_view import (
    KernelArgumentError, StridedView, check_shape, infer_reshape, normalize_dim
)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel


def plan_copy(out: Any, source: Any, source_view: StridedView, *, out_view: StridedView | None = None,
              convert: int = CONVERT_NONE, label: str = "strided_copy",
              binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """layout.plan_strided_copy, split over `binding_limit` into windows of the copy's flat index space
    (kernels/elementwise_windows.py): each binds the elements of the input and of the output it moves."""
    whole = plan_strided_copy(out, source, source_view, out_view=out_view, convert=convert, label=label)
    out_view = StridedView.contiguous(source_view.sizes) if out_view is None else out_view
    if not whole or not needs_windows(binding_limit, [(out, out_view.extent()), (source, source_view.extent())]):
        return whole
    sizes, strides = coalesce_dims(source_view.sizes, source_view.strides, out_view.strides)

    def plan_window(begin: int, end: int) -> Dispatch:
        bindings, offsets = [], []
        for buffer, view, operand_strides, access, what in ((out, out_view, strides[1], "w", "the output"),
                                                            (source, source_view, strides[0], "r", "the input")):
            lo, hi = operand_span(sizes, operand_strides, view.offset, begin, end)
            bound, skipped = window_binding(buffer, lo, hi, access, binding_limit, label, what)
            bindings.append(bound)
            offsets.append(window_offset(view.offset, lo, skipped))
        push = copy_push(end - begin, sizes, (offsets[1], offsets[0]), strides, begin)
        return Dispatch("copy", elementwise_groups(end - begin), bindings=tuple(bindings), push_constants=push,
                        spec_constants=whole[0].spec_constants, label=f"{label}.window{begin}")

    return split_windows(source_view.numel, binding_limit, plan_window)


def _plan_fill(out: Any, numel: int, word: int, *, label: str, binding_limit: BindingLimit | None) -> list[Dispatch]:
    """layout.plan_fill, over `binding_limit` one fill per window of elements, each bound at its window."""
    if not needs_windows(binding_limit, [(out, numel)]):
        return plan_fill(out, numel, word, label=label)
    dispatches = []
    for begin, end in element_windows(numel, binding_limit):
        bound, skipped = window_binding(out, begin, end, "w", binding_limit, label, "the output")
        if skipped:  # copy@FILL writes from its binding's first word
            raise KernelArgumentError(f"{label}: a fill split over bindings needs its output at an offset aligned "
                                      f"to {binding_limit.alignment} bytes; it is {skipped} elements past one")
        dispatches += plan_fill(bound, end - begin, word, label=f"{label}.window{begin}")
    return dispatches


def _copy_source(shape: Sequence[int], dtype: Any, what: str) -> tuple[StridedView, str]:
    name = check_dtype(dtype, what, ("float32", "int32", "int64"))
    return StridedView.contiguous(check_shape(shape, what)), name


def _check_memory_format(memory_format: Any, what: str) -> None:
    # Compared by name: this module must not import torch (str(torch.preserve_format) is
    # "torch.preserve_format").
    if memory_format is not None and str(memory_format).replace("torch.", "") not in (
            "contiguous_format", "preserve_format"):
        raise KernelArgumentError(f"{what}: memory_format={memory_format!r} is not supported "
                                  f"(only contiguous tensors live on the GPU)")


def is_alias_view(self_shape: Sequence[int], size: Sequence[int]) -> bool:
    """Whether view_copy(self, size) may alias its input instead of copying: always True, since every
    GPU tensor is contiguous (same bytes, new shape). Raises KernelArgumentError if `size` is invalid."""
    infer_reshape(check_shape(self_shape, "view_copy self"), size)
    return True


@register_kernel("aten.view_copy.default")
def plan_view_copy(*, out: Any, self: Any, self_shape: Sequence[int], size: Sequence[int],
                   self_dtype: Any = "float32", label: str = "aten.view_copy.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.view_copy: same elements, new shape (one -1 allowed). The bytes do not change, so this plan
    is a flat copy; a runner that aliases buffers skips it (see `is_alias_view`)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.view_copy self")
    infer_reshape(view.sizes, size)
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


@register_kernel("aten.clone.default")
def plan_clone(*, out: Any, self: Any, self_shape: Sequence[int], memory_format: Any = None,
               self_dtype: Any = "float32", label: str = "aten.clone.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.clone: a contiguous copy (memory_format must be None / contiguous / preserve)."""
    _check_memory_format(memory_format, "aten.clone")
    view, _ = _copy_source(self_shape, self_dtype, "aten.clone self")
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


# _to_copy conversions between the GPU dtypes (int64 graph tensors are int32 on the GPU).
_TO_COPY_CONVERSIONS = {
    ("float32", "float32"): CONVERT_NONE,
    ("int32", "int32"): CONVERT_NONE,
    ("int64", "int64"): CONVERT_NONE,
    ("int32", "int64"): CONVERT_NONE,
    ("int64", "int32"): CONVERT_NONE,
    ("int32", "float32"): CONVERT_INT32_TO_FP32,
    ("int64", "float32"): CONVERT_INT32_TO_FP32,
    ("float32", "int32"): CONVERT_FP32_TO_INT32,
    ("float32", "int64"): CONVERT_FP32_TO_INT32,
}


@register_kernel("aten._to_copy.default")
def plan_to_copy(*, out: Any, self: Any, self_shape: Sequence[int], dtype: Any = None,
                 self_dtype: Any = "float32", memory_format: Any = None, label: str = "aten._to_copy.default",
                 binding_limit: BindingLimit | None = None, **ignored_options: Any) -> list[Dispatch]:
    """aten._to_copy: a copy, converting between float32 and int32/int64 (int -> float rounds to
    nearest, float -> int truncates toward zero). layout / device / pin_memory / non_blocking are
    accepted and ignored (everything is a dense GPU buffer)."""
    view, source = _copy_source(self_shape, self_dtype, "aten._to_copy self")
    target = source if dtype is None else check_dtype(dtype, "aten._to_copy dtype", ("float32", "int32", "int64"))
    _check_memory_format(memory_format, "aten._to_copy")
    return plan_copy(out, self, StridedView.contiguous((view.numel,)),
                     convert=_TO_COPY_CONVERSIONS[(source, target)], label=label, binding_limit=binding_limit)


@register_kernel("aten.alias_copy.default")
def plan_alias_copy(*, out: Any, self: Any, self_shape: Sequence[int], self_dtype: Any = "float32",
                    label: str = "aten.alias_copy.default",
                    binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.alias_copy: the same tensor (a flat copy; a runner may alias it instead)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.alias_copy self")
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


@register_kernel("dim_order_ops._to_dim_order_copy.default")
def plan_to_dim_order_copy(*, out: Any, self: Any, self_shape: Sequence[int], dtype: Any = None,
                           dim_order: Sequence[int] | None = None, self_dtype: Any = "float32",
                           label: str = "dim_order_ops._to_dim_order_copy.default",
                           binding_limit: BindingLimit | None = None, **ignored_options: Any) -> list[Dispatch]:
    """ExecuTorch's _to_dim_order_copy: _to_copy whose memory format is a dim order; only the
    contiguous order (None or 0..rank-1) exists on the GPU."""
    rank = len(check_shape(self_shape, "_to_dim_order_copy self"))
    if dim_order is not None and tuple(dim_order) != tuple(range(rank)):
        raise KernelArgumentError(
            f"_to_dim_order_copy: dim_order {list(dim_order)} is not contiguous (0..{rank - 1}); only "
            f"contiguous tensors live on the GPU")
    return plan_to_copy(out=out, self=self, self_shape=self_shape, dtype=dtype, self_dtype=self_dtype, label=label,
                        binding_limit=binding_limit)


@register_kernel("aten.permute_copy.default")
def plan_permute_copy(*, out: Any, self: Any, self_shape: Sequence[int], dims: Sequence[int],
                      self_dtype: Any = "float32", label: str = "aten.permute_copy.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.permute_copy: out = self.permute(dims), materialised contiguously."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.permute_copy self")
    return plan_copy(out, self, view.permute(dims), label=label, binding_limit=binding_limit)


@register_kernel("aten.t_copy.default")
def plan_t_copy(*, out: Any, self: Any, self_shape: Sequence[int], self_dtype: Any = "float32",
                label: str = "aten.t_copy.default", binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.t_copy: transpose of a tensor of rank <= 2 (rank 0 and 1 are copies)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.t_copy self")
    if view.rank > 2:
        raise KernelArgumentError(f"aten.t_copy expects a tensor of rank <= 2, got shape {view.sizes}")
    return plan_copy(out, self, view.transpose(0, 1) if view.rank == 2 else view, label=label,
                     binding_limit=binding_limit)


@register_kernel("aten.transpose_copy.int")
def plan_transpose_copy(*, out: Any, self: Any, self_shape: Sequence[int], dim0: int, dim1: int,
                        self_dtype: Any = "float32", label: str = "aten.transpose_copy.int",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.transpose_copy: out = self.transpose(dim0, dim1), materialised contiguously."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.transpose_copy self")
    return plan_copy(out, self, view.transpose(dim0, dim1), label=label, binding_limit=binding_limit)


@register_kernel("aten.expand_copy.default")
def plan_expand_copy(*, out: Any, self: Any, self_shape: Sequence[int], size: Sequence[int], implicit: bool = False,
                     self_dtype: Any = "float32", label: str = "aten.expand_copy.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.expand_copy: broadcast to `size` (-1 keeps a dim), materialised contiguously."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.expand_copy self")
    return plan_copy(out, self, view.expand(size), label=label, binding_limit=binding_limit)


@register_kernel("aten.unsqueeze_copy.default")
def plan_unsqueeze_copy(*, out: Any, self: Any, self_shape: Sequence[int], dim: int, self_dtype: Any = "float32",
                        label: str = "aten.unsqueeze_copy.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.unsqueeze_copy: same bytes with a size-1 dim inserted (a flat copy)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.unsqueeze_copy self")
    view.unsqueeze(dim)  # validates dim
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


@register_kernel("aten.squeeze_copy.dims")
def plan_squeeze_copy_dims(*, out: Any, self: Any, self_shape: Sequence[int], dim: Sequence[int],
                           self_dtype: Any = "float32", label: str = "aten.squeeze_copy.dims",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.squeeze_copy.dims: same bytes without the listed size-1 dims (a flat copy)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.squeeze_copy self")
    view.squeeze(dim)  # validates dims
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


@register_kernel("aten.squeeze_copy.dim")
def plan_squeeze_copy_dim(*, out: Any, self: Any, self_shape: Sequence[int], dim: int,
                          self_dtype: Any = "float32", label: str = "aten.squeeze_copy.dim",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.squeeze_copy.dim: same bytes without `dim` if it has size 1 (a flat copy)."""
    return plan_squeeze_copy_dims(out=out, self=self, self_shape=self_shape, dim=[dim], self_dtype=self_dtype,
                                  label=label, binding_limit=binding_limit)


@register_kernel("aten.squeeze_copy.default")
def plan_squeeze_copy(*, out: Any, self: Any, self_shape: Sequence[int], self_dtype: Any = "float32",
                      label: str = "aten.squeeze_copy.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.squeeze_copy: same bytes without any size-1 dim (a flat copy)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.squeeze_copy self")
    return plan_copy(out, self, StridedView.contiguous((view.numel,)), label=label, binding_limit=binding_limit)


@register_kernel("aten.slice_copy.Tensor")
def plan_slice_copy(*, out: Any, self: Any, self_shape: Sequence[int], dim: int = 0, start: int | None = None,
                    end: int | None = None, step: int = 1, self_dtype: Any = "float32",
                    label: str = "aten.slice_copy.Tensor", binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.slice_copy: self[..., start:end:step, ...] along `dim` (bounds clamped like Python)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.slice_copy self")
    return plan_copy(out, self, view.slice(dim, start, end, step), label=label, binding_limit=binding_limit)


@register_kernel("aten.select_copy.int")
def plan_select_copy(*, out: Any, self: Any, self_shape: Sequence[int], dim: int, index: int,
                     self_dtype: Any = "float32", label: str = "aten.select_copy.int",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.select_copy: self.select(dim, index) (negative index counts from the end)."""
    view, _ = _copy_source(self_shape, self_dtype, "aten.select_copy self")
    return plan_copy(out, self, view.select(dim, index), label=label, binding_limit=binding_limit)


@register_kernel("aten.cat.default")
def plan_cat(*, out: Any, tensors: Sequence[Any], tensors_shapes: Sequence[Sequence[int]], dim: int = 0,
             tensors_dtype: Any = "float32", label: str = "aten.cat.default",
                 binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """aten.cat: one strided copy per input into its slab of the output along `dim`.

    `tensors` are the input buffers and `tensors_shapes` their shapes (same rank, equal sizes off
    `dim`); like torch, 1-D empty inputs are skipped whatever the rank of the others.
    """
    if len(tensors) != len(tensors_shapes) or not tensors:
        raise KernelArgumentError(
            f"aten.cat: {len(tensors)} tensors but {len(tensors_shapes)} shapes (need the same number, >= 1)")
    check_dtype(tensors_dtype, "aten.cat tensors", ("float32", "int32", "int64"))
    shapes = [check_shape(s, f"aten.cat tensors[{i}]") for i, s in enumerate(tensors_shapes)]
    used = [(t, s) for t, s in zip(tensors, shapes) if s != (0,)]
    if not used:
        return []
    rank = len(used[0][1])
    d = normalize_dim(dim, rank, "aten.cat")
    for _, shape in used:
        if len(shape) != rank or any(a != b for axis, (a, b) in enumerate(zip(shape, used[0][1])) if axis != d):
            raise KernelArgumentError(
                f"aten.cat along dim {d}: shapes {[s for _, s in used]} differ off the concatenated dim")
    out_shape = list(used[0][1])
    out_shape[d] = sum(shape[d] for _, shape in used)
    out_full = StridedView.contiguous(out_shape)
    dispatches: list[Dispatch] = []
    start = 0
    for index, (tensor, shape) in enumerate(used):
        region = out_full.slice(d, start, start + shape[d])
        dispatches += plan_copy(out, tensor, StridedView.contiguous(shape), out_view=region,
                                        label=f"{label}[{index}]",
                                binding_limit=binding_limit)
        start += shape[d]
    return dispatches


# Fills. The result dtype is `dtype` when given, else the tensor's (the *_like ops) or, for full /
# scalar_tensor, float32 for a float fill and int64 for an integral one (torch's inference).
FILL_DTYPES = ("float32", "int32", "int64")


def _fill_dtype(dtype: Any, default: str, what: str) -> str:
    return check_dtype(default if dtype is None else dtype, what, FILL_DTYPES)


def _inferred_dtype(value: Any) -> str:
    return "int64" if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "float32"


@register_kernel("aten.full.default")
def plan_full(*, out: Any, size: Sequence[int], fill_value: Any, dtype: Any = None, label: str = "aten.full.default",
              binding_limit: BindingLimit | None = None, **ignored_options: Any) -> list[Dispatch]:
    """aten.full: a new tensor of `size` filled with `fill_value` (layout / device / pin_memory ignored)."""
    name = _fill_dtype(dtype, _inferred_dtype(fill_value), "aten.full dtype")
    numel = math.prod(check_shape(size, "aten.full size"))
    return _plan_fill(out, numel, fill_word(fill_value, name, "aten.full"), label=label, binding_limit=binding_limit)


@register_kernel("aten.scalar_tensor.default")
def plan_scalar_tensor(*, out: Any, s: Any, dtype: Any = None, label: str = "aten.scalar_tensor.default",
                       binding_limit: BindingLimit | None = None, **ignored_options: Any) -> list[Dispatch]:
    """aten.scalar_tensor: a 0-d tensor holding `s` (float32 unless dtype says otherwise, like torch)."""
    name = _fill_dtype(dtype, "float32", "aten.scalar_tensor dtype")
    return _plan_fill(out, 1, fill_word(s, name, "aten.scalar_tensor"), label=label, binding_limit=binding_limit)


def _like_plan(key: str, fill: Any, doc: str):
    def plan(*, out: Any, self: Any, self_shape: Sequence[int], dtype: Any = None, self_dtype: Any = "float32",
             memory_format: Any = None, label: str = key, binding_limit: BindingLimit | None = None,
             **ignored_options: Any) -> list[Dispatch]:
        _check_memory_format(memory_format, key)
        name = _fill_dtype(dtype, check_dtype(self_dtype, f"{key} self", FILL_DTYPES), f"{key} dtype")
        numel = math.prod(check_shape(self_shape, f"{key} self"))
        return _plan_fill(out, numel, fill_word(fill, name, key), label=label, binding_limit=binding_limit)

    plan.__name__ = plan.__qualname__ = "plan_" + key.split(".")[1]
    plan.__doc__ = f"{key}: {doc} (self is only read for its shape; layout / device / pin_memory ignored)"
    return register_kernel(key)(plan)


plan_zeros_like = _like_plan("aten.zeros_like.default", 0, "a tensor of self's shape filled with 0")
plan_ones_like = _like_plan("aten.ones_like.default", 1, "a tensor of self's shape filled with 1")


@register_kernel("aten.full_like.default")
def plan_full_like(*, out: Any, self: Any, self_shape: Sequence[int], fill_value: Any, dtype: Any = None,
                   self_dtype: Any = "float32", memory_format: Any = None, label: str = "aten.full_like.default",
                   binding_limit: BindingLimit | None = None, **ignored_options: Any) -> list[Dispatch]:
    """aten.full_like: a tensor of self's shape (and dtype, unless given) filled with fill_value."""
    _check_memory_format(memory_format, "aten.full_like")
    name = _fill_dtype(dtype, check_dtype(self_dtype, "aten.full_like self", FILL_DTYPES), "aten.full_like dtype")
    numel = math.prod(check_shape(self_shape, "aten.full_like self"))
    return _plan_fill(out, numel, fill_word(fill_value, name, "aten.full_like"), label=label,
                      binding_limit=binding_limit)

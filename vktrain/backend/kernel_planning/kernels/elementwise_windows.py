"""Windows of a flat index space: how elementwise kernels split tensors over the max storage binding size.

An elementwise op (and a strided copy) runs one invocation per element of its contiguous output. Over the
limit, the plan cuts that index space into windows of consecutive elements [begin, end), each a multiple of
the binding alignment long (in elements), so every window of the output starts at an aligned binding
offset (exactly, when the output itself is aligned) and vec4 runs stay 16-byte aligned. Each input is bound
by the elements its window reads: `operand_span` derives them from the operand's (broadcast) strides, so a
same-shape input is bound at the same element window, a [N] bias against [M, N] by the columns the window
covers (all N once it spans a row), a scalar by its one element. An input whose window still spans more
than one binding may (a transposed read, a long stride) is refused naming it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from vktrain.serialization.dispatch import BufferBinding
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, sub_binding
from vktrain.serialization.strided_view import KernelArgumentError

FLOAT_BYTES = 4
T = TypeVar("T")


class WindowTooWide(KernelArgumentError):
    """An operand of one window spans more than one binding may (a narrower window may still fit)."""


def element_windows(numel: int, limit: BindingLimit, per_window: int | None = None) -> list[tuple[int, int]]:
    """[begin, end) windows covering elements [0, numel) once, `per_window` elements each (a multiple of the
    alignment in elements; default as many as one binding holds, less the alignment slack of sub_binding)."""
    per_window = per_window or widest_window(limit)
    return [(begin, min(begin + per_window, numel)) for begin in range(0, numel, per_window)]


def widest_window(limit: BindingLimit) -> int:
    per_alignment = limit.alignment // FLOAT_BYTES
    return limit.window_bytes // FLOAT_BYTES // per_alignment * per_alignment


def split_windows(numel: int, limit: BindingLimit, plan_window: Callable[[int, int], T]) -> list[T]:
    """plan_window(begin, end) for every window of the widest size at which each window's operands bind within
    `limit`: from a whole binding's elements, halved while a window is too wide (a strided read: a slice of
    wide rows, a column of a bias), down to one alignment's elements; its refusal below that."""
    per_alignment = limit.alignment // FLOAT_BYTES
    per_window = widest_window(limit)
    while True:
        try:
            return [plan_window(begin, end) for begin, end in element_windows(numel, limit, per_window)]
        except WindowTooWide:
            if per_window <= per_alignment:
                raise
            per_window = max(per_alignment, per_window // 2 // per_alignment * per_alignment)


def operand_span(sizes: Sequence[int], strides: Sequence[int], offset: int, begin: int, end: int) -> tuple[int, int]:
    """Elements [lo, hi) of its buffer that an operand read at `offset + sum(coord[d] * strides[d])` touches
    for the flat (row-major over `sizes`, outermost first) indices [begin, end), end > begin. Exact: strides
    are non-negative, so each dim's extreme coordinates bound it."""
    low, high = _index_range(tuple(sizes), tuple(strides), begin, end - 1)
    return offset + low, offset + high + 1


def _index_range(sizes: tuple[int, ...], strides: tuple[int, ...], first: int, last: int) -> tuple[int, int]:
    """(min, max) of sum(coord * stride) over the flat indices [first, last] of `sizes` (row-major)."""
    if not sizes:
        return 0, 0
    inner = 1
    for size in sizes[1:]:
        inner *= size
    inner_max = sum((size - 1) * stride for size, stride in zip(sizes[1:], strides[1:]))
    head_first, rest_first = divmod(first, inner)
    head_last, rest_last = divmod(last, inner)
    stride = strides[0]
    if head_first == head_last:
        low, high = _index_range(sizes[1:], strides[1:], rest_first, rest_last)
        return head_first * stride + low, head_first * stride + high
    # The partial first row, the partial last row (from coordinate 0) and any whole rows between.
    first_low, first_high = _index_range(sizes[1:], strides[1:], rest_first, inner - 1)
    _, last_high = _index_range(sizes[1:], strides[1:], 0, rest_last)
    low = min(head_first * stride + first_low, (head_first + 1) * stride)
    high = max(head_last * stride + last_high, (head_last - 1) * stride + inner_max if head_last - head_first > 1
               else head_first * stride + first_high)
    return low, high


def window_binding(buffer: Any, lo: int, hi: int, access: str, limit: BindingLimit, label: str,
                   what: str) -> tuple[BufferBinding, int]:
    """Elements [lo, hi) of `buffer` as a binding within `limit`, and the element offset of `lo` in it;
    refused naming `what` when they span more than one binding may."""
    bound, skipped = sub_binding(buffer, FLOAT_BYTES * lo, FLOAT_BYTES * hi, access, limit.alignment)
    if not limit.fits(bound.size):
        raise WindowTooWide(str(limit.refusal(label, f"{what} (elements {lo}..{hi - 1} of one window of the output)",
                                              bound.size)))
    if skipped % FLOAT_BYTES:
        raise KernelArgumentError(f"{label}: {what} starts {skipped} bytes into an aligned binding offset, "
                                  f"not a whole number of float32 elements")
    return bound, skipped // FLOAT_BYTES


def window_offset(view_offset: int, lo: int, skipped: int) -> int:
    """The element offset a window's push block gives an operand whose view starts at `view_offset`, bound from
    element `lo` (`skipped` elements into its binding): the kernel adds the window's global coordinates, so it
    may be below zero, wrapping mod 2^32 as the kernels' uint arithmetic does."""
    return (view_offset - lo + skipped) % 2**32


def needs_windows(limit: BindingLimit | None, tensors: Sequence[tuple[Any, int]]) -> bool:
    """Whether any of `tensors` ((buffer, elements its view reaches)) binds over `limit`: a BufferBinding's
    own size where it has one, else the elements reached."""
    if limit is None:
        return False
    for buffer, elements in tensors:
        size = buffer.size if isinstance(buffer, BufferBinding) and buffer.size is not None \
            else FLOAT_BYTES * elements
        if not limit.fits(size):
            return True
    return False

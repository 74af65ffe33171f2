"""Strided tensor views: how a tensor lives in a buffer (sizes, element strides, element offset).

permute / transpose / expand / slice / select / unsqueeze / squeeze are pure metadata on a view (no data
moves). The backend decides which ops become views (vktrain/backend/passes/views.py) and records them in
the delegate blob; the kernel planners read them (vktrain/backend/kernel_planning/kernels/layout.py). Both
stand on this one definition, so it lives on the ground floor with the blob format. Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from vktrain.errors import VktrainError

# Element indices and offsets travel as uint32 push constants.
MAX_ELEMENTS = 2**32 - 1


class KernelArgumentError(VktrainError, ValueError):
    """A kernel was asked for something it does not support (dtype, rank, shape, argument value)."""


def _as_int_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        result = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise KernelArgumentError(f"{what} must be a sequence of ints, got {values!r}") from None
    for v, original in zip(result, values):
        if v != original:
            raise KernelArgumentError(f"{what} must be a sequence of ints, got {values!r}")
    return result


def check_shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    """`shape` as a tuple of non-negative ints, or a KernelArgumentError naming `what`."""
    result = _as_int_tuple(shape, f"{what} shape")
    if any(d < 0 for d in result):
        raise KernelArgumentError(f"{what} shape {result} has a negative size")
    if math.prod(result) > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{what} shape {result} has {math.prod(result)} elements; at most {MAX_ELEMENTS} are supported")
    return result


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape` (the last dim has stride 1)."""
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def normalize_dim(dim: int, rank: int, what: str) -> int:
    """`dim` in [-rank, rank) as a non-negative index (rank 0 accepts -1 and 0 like torch)."""
    bound = max(rank, 1)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -bound <= dim < bound:
        raise KernelArgumentError(f"{what}: dim {dim!r} is out of range for a tensor of rank {rank}")
    return dim % bound


@dataclass(frozen=True)
class StridedView:
    """A tensor as a kernel reads it from a buffer: `sizes`, element `strides`, element `offset`.

    Strides may be 0 (expanded dims). View ops return new views and never move data.
    """

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", check_shape(self.sizes, "view"))
        object.__setattr__(self, "strides", _as_int_tuple(self.strides, "view strides"))
        if len(self.sizes) != len(self.strides):
            raise KernelArgumentError(f"view sizes {self.sizes} and strides {self.strides} differ in rank")
        if any(s < 0 for s in self.strides) or self.offset < 0:
            raise KernelArgumentError(
                f"view strides {self.strides} and offset {self.offset} must be non-negative")

    @classmethod
    def contiguous(cls, shape: Sequence[int], offset: int = 0) -> "StridedView":
        shape = check_shape(shape, "tensor")
        return cls(shape, contiguous_strides(shape), offset)

    @property
    def rank(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def is_contiguous(self) -> bool:
        """Row-major dense (size-1 dims may have any stride)."""
        expected = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def extent(self) -> int:
        """Elements of the buffer the view can touch, counted from element 0 (0 for an empty view)."""
        if self.numel == 0:
            return 0
        return self.offset + sum((size - 1) * stride for size, stride in zip(self.sizes, self.strides)) + 1

    def permute(self, dims: Sequence[int]) -> "StridedView":
        dims = [normalize_dim(d, self.rank, "permute") for d in _as_int_tuple(dims, "permute dims")]
        if sorted(dims) != list(range(self.rank)):
            raise KernelArgumentError(f"permute dims {dims} are not a permutation of range({self.rank})")
        return StridedView(tuple(self.sizes[d] for d in dims), tuple(self.strides[d] for d in dims), self.offset)

    def transpose(self, dim0: int, dim1: int) -> "StridedView":
        order = list(range(self.rank))
        a = normalize_dim(dim0, self.rank, "transpose")
        b = normalize_dim(dim1, self.rank, "transpose")
        if self.rank == 0:
            return self
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    def expand(self, sizes: Sequence[int]) -> "StridedView":
        """torch.expand: -1 keeps a size; new leading dims and size-1 dims broadcast with stride 0."""
        sizes = _as_int_tuple(sizes, "expand sizes")
        if len(sizes) < self.rank:
            raise KernelArgumentError(
                f"expand to {sizes}: the target has fewer dims than the tensor's {self.sizes}")
        lead = len(sizes) - self.rank
        new_sizes, new_strides = [], []
        for axis, target in enumerate(sizes):
            if axis < lead:
                if target < 0:
                    raise KernelArgumentError(f"expand to {sizes}: -1 is not allowed for a new leading dim")
                new_sizes.append(target)
                new_strides.append(0)
                continue
            size, stride = self.sizes[axis - lead], self.strides[axis - lead]
            if target == -1 or target == size:
                new_sizes.append(size)
                new_strides.append(stride)
            elif size == 1 and target >= 0:
                new_sizes.append(target)
                new_strides.append(0)
            else:
                raise KernelArgumentError(
                    f"expand of {self.sizes} to {sizes}: size {size} at dim {axis - lead} is not 1 "
                    f"and differs from {target}")
        return StridedView(tuple(new_sizes), tuple(new_strides), self.offset)

    def broadcast_to(self, shape: Sequence[int]) -> "StridedView":
        return self.expand(shape)

    def slice(self, dim: int, start: int | None, end: int | None, step: int = 1) -> "StridedView":
        """torch slicing along `dim` (start/end clamped like Python slices; step >= 1)."""
        d = normalize_dim(dim, self.rank, "slice")
        if step < 1:
            raise KernelArgumentError(f"slice step must be >= 1, got {step}")
        begin, stop, _ = slice(start, end, step).indices(self.sizes[d])
        length = max(0, -(-(stop - begin) // step))  # ceil
        sizes = list(self.sizes)
        strides = list(self.strides)
        sizes[d] = length
        offset = self.offset + (begin * strides[d] if length else 0)
        strides[d] *= step
        return StridedView(tuple(sizes), tuple(strides), offset)

    def select(self, dim: int, index: int) -> "StridedView":
        d = normalize_dim(dim, self.rank, "select")
        size = self.sizes[d]
        if not -size <= index < size:
            raise KernelArgumentError(f"select index {index} is out of range for dim {d} of size {size}")
        index %= size
        return StridedView(self.sizes[:d] + self.sizes[d + 1:], self.strides[:d] + self.strides[d + 1:],
                           self.offset + index * self.strides[d])

    def unsqueeze(self, dim: int) -> "StridedView":
        d = normalize_dim(dim, self.rank + 1, "unsqueeze")
        return StridedView(self.sizes[:d] + (1,) + self.sizes[d:], self.strides[:d] + (0,) + self.strides[d:],
                           self.offset)

    def squeeze(self, dims: Sequence[int] | None = None) -> "StridedView":
        """Drop the size-1 dims among `dims` (all size-1 dims when None), like torch.squeeze."""
        if dims is None:
            drop = {d for d, size in enumerate(self.sizes) if size == 1}
        else:
            drop = {normalize_dim(d, self.rank, "squeeze") for d in _as_int_tuple(dims, "squeeze dims")}
            drop = {d for d in drop if self.sizes[d] == 1}
        keep = [d for d in range(self.rank) if d not in drop]
        return StridedView(tuple(self.sizes[d] for d in keep), tuple(self.strides[d] for d in keep), self.offset)

    def reshape_contiguous(self, shape: Sequence[int]) -> "StridedView":
        """A view of the same elements with `shape` (one -1 allowed); the view must be contiguous."""
        shape = infer_reshape(self.sizes, shape)
        if not self.is_contiguous:
            raise KernelArgumentError(
                f"reshape of a non-contiguous view (sizes {self.sizes}, strides {self.strides}) needs a copy first")
        return StridedView.contiguous(shape, self.offset)


# Transposes as strided views: the ATen transpose ops, and the view of its input's bytes each one's output is
# (the backend's view decisions and the runtime's materialised transposes read this one definition).
TRANSPOSE_OPS = ("aten.permute_copy.default", "aten.t_copy.default", "aten.transpose_copy.int")


def transposed_view(name: str, params: Sequence[Any], source_view: StridedView) -> StridedView:
    """The view a transpose op's output is of its input's bytes. `params` are the op's decoded arguments
    after `self` (permute: dims; transpose: dim0, dim1; t: none); `source_view` is how the input is read."""
    if name == "aten.permute_copy.default":
        return source_view.permute(params[0])
    if name == "aten.t_copy.default":
        if source_view.rank > 2:
            raise KernelArgumentError(f"aten.t_copy expects a tensor of rank <= 2, got shape {list(source_view.sizes)}")
        return source_view.transpose(0, 1) if source_view.rank == 2 else source_view
    if name == "aten.transpose_copy.int":
        return source_view.transpose(params[0], params[1])
    raise KernelArgumentError(f"{name} is not a transpose op")


def infer_reshape(sizes: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """`shape` with its single -1 resolved so that it has as many elements as `sizes`."""
    shape = _as_int_tuple(shape, "view shape")
    numel = math.prod(sizes)
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in shape):
        raise KernelArgumentError(f"view shape {shape}: at most one -1 and no other negative size")
    if unknown:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or numel % known:
            raise KernelArgumentError(f"view shape {shape} is invalid for a tensor of {numel} elements")
        shape = tuple(numel // known if d == -1 else d for d in shape)
    if math.prod(shape) != numel:
        raise KernelArgumentError(
            f"view shape {shape} has {math.prod(shape)} elements but the tensor {tuple(sizes)} has {numel}")
    return shape

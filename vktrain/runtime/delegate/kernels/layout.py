"""Views, permutes and copies: strided tensor views and the one generic strided-copy kernel.

A `StridedView` says how a kernel reads a tensor that lives in a buffer: sizes, element strides and an
element offset. permute / transpose / expand / slice / select / unsqueeze / squeeze are pure metadata
on a view (no GPU work); a kernel either reads the view in place (elementwise, reduction and GEMM
kernels take input strides) or `plan_strided_copy` materialises it into a contiguous tensor with
`copy.comp`. The elementwise, reduction and matmul families import their stride helpers from here.

Dtypes on the GPU: fp32 and int32 (32-bit words; the runner converts int64 index tensors to int32
before upload). A copy moves raw words, so one kernel serves both; `_to_copy` also converts between
the two (int32 -> fp32, fp32 -> int32 truncating toward zero).

The aten view, copy and fill ops built on these (view_copy, permute_copy, _to_copy, cat, full, ...)
are in kernels/copies.py.

Calling convention of every aten plan function (copies / elementwise / reduction / matmul / embedding,
and the vktrain ops without a lowering adapter, e.g. swiglu): keyword arguments only; each tensor argument of the aten schema is passed under its schema
name as a buffer key (or Buffer / BufferBinding) together with `<name>_shape` and optionally
`<name>_dtype` (default "float32"; a tensor-list argument `tensors` has `tensors_shapes`); scalar and
list arguments keep their schema names; the output buffer is `out`, always contiguous; `label` names
the dispatches. A plan is pure (no device access), so a partitioner can call it with placeholder
buffer keys: a KernelArgumentError is the reason the op cannot be lowered.
"""
from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from vktrain.runtime.vk.schedule import BufferBinding, Dispatch, ceil_div, pack_push
from vktrain.errors import VktrainError

# copy.comp / elementwise.comp: MAX_RANK and WORKGROUP_SIZE.
MAX_STRIDED_RANK = 6
WORKGROUP_SIZE = 64
# Element indices and offsets travel as uint32 push constants.
MAX_ELEMENTS = 2**32 - 1
# The device limits the plans size workgroups by (OpContext.limits), as errors name them.
SHARED_MEMORY_LIMIT = "shared memory per workgroup (Vulkan maxComputeSharedMemorySize, WebGPU " \
                      "max-compute-workgroup-storage-size)"
WORKGROUP_SIZE_LIMIT = "workgroup limit (Vulkan maxComputeWorkGroupInvocations / maxComputeWorkGroupSize[0], " \
                       "WebGPU max-compute-invocations-per-workgroup / max-compute-workgroup-size-x)"

# copy.comp CONVERT specialization constant (id 3).
COPY_CONVERT_SPEC_ID = 3
CONVERT_NONE = 0
CONVERT_INT32_TO_FP32 = 1
CONVERT_FP32_TO_INT32 = 2


class KernelArgumentError(VktrainError, ValueError):
    """A kernel was asked for something it does not support (dtype, rank, shape, argument value)."""


def check_positive_ints(op: str, **values: Any) -> None:
    """Each of `values` (a plan's sizes and launch parameters) must be a Python int >= 1; bool is refused."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KernelArgumentError(f"{op}: {name} must be an int >= 1, got {value!r}")


def check_power_of_two_workgroup(op: str, workgroup_size: Any) -> None:
    """Kernels that reduce in shared memory halve their workgroup at each tree level."""
    if (not isinstance(workgroup_size, int) or isinstance(workgroup_size, bool) or workgroup_size < 1
            or workgroup_size & (workgroup_size - 1)):
        raise KernelArgumentError(
            f"{op}: workgroup_size must be a power of two (the shared-memory reduction halves it), "
            f"got {workgroup_size!r}")


def use_vec4(op: str, vec4: bool | None, length: int, length_name: str, why: str = "") -> bool:
    """Whether a plan takes its kernel's @VEC4 variant: by default whenever `length` (the extent the
    kernel moves in vec4s) is a multiple of 4, the only case that variant serves. `why` explains the
    requirement in the error."""
    if vec4 is None:
        return length % 4 == 0
    if vec4 and length % 4:
        reason = f" ({why})" if why else ""
        raise KernelArgumentError(
            f"{op}: the vec4 kernel needs {length_name} % 4 == 0{reason}, got {length_name}={length}")
    return bool(vec4)


def shader_variant(shader: str, **defines: bool) -> str:
    """The name of `shader` built with the defines that are set, in the given order: "rms_norm@VEC4+BACKWARD"."""
    used = [name for name, is_set in defines.items() if is_set]
    return shader + ("@" + "+".join(used) if used else "")


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


def check_dtype(dtype: Any, what: str, allowed: Sequence[str] = ("float32",)) -> str:
    """Normalise a dtype name ("float32", numpy dtype, torch-style "torch.float32") and check it."""
    name = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    if name not in allowed:
        raise KernelArgumentError(f"{what} has dtype {name}; this kernel supports {', '.join(allowed)}")
    return name


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


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy/torch broadcasting of `shapes`; KernelArgumentError naming the clashing sizes."""
    rank = max((len(s) for s in shapes), default=0)
    result = []
    for axis in range(rank):
        size = 1
        for shape in shapes:
            index = len(shape) - rank + axis
            if index < 0:
                continue
            dim = shape[index]
            if dim != 1:
                if size not in (1, dim):
                    raise KernelArgumentError(
                        f"shapes {[tuple(s) for s in shapes]} do not broadcast: size {size} vs {dim} "
                        f"at dim {axis - rank}")
                size = dim
        result.append(size)
    return tuple(result)


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
        length = max(0, ceil_div(stop - begin, step))
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


def coalesce_dims(sizes: Sequence[int], *stride_lists: Sequence[int]
                  ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Merge dims so that an index space walks every operand the same way with fewer dims.

    Size-1 dims are dropped; neighbouring dims (outer d, inner d+1) merge when every operand has
    stride[d] == stride[d+1] * size[d+1]. Returns (sizes, strides per operand), outermost first.
    Kernels decompose flat indices dim by dim, so fewer dims is fewer integer divisions per element.
    """
    merged_sizes: list[int] = []
    merged_strides: list[list[int]] = [[] for _ in stride_lists]
    for axis, size in enumerate(sizes):
        if size == 1:
            continue
        if merged_sizes and all(strides_out[-1] == strides[axis] * size
                                for strides_out, strides in zip(merged_strides, stride_lists)):
            merged_sizes[-1] *= size
            for strides_out, strides in zip(merged_strides, stride_lists):
                strides_out[-1] = strides[axis]
            continue
        merged_sizes.append(size)
        for strides_out, strides in zip(merged_strides, stride_lists):
            strides_out.append(strides[axis])
    return tuple(merged_sizes), tuple(tuple(s) for s in merged_strides)


def padded_innermost_first(values: Sequence[int], length: int, fill: int) -> list[int]:
    """Kernels store dims innermost first in fixed-length push-constant arrays."""
    reversed_values = list(reversed(values))
    return reversed_values + [fill] * (length - len(reversed_values))


def check_view_fits(view: StridedView, buffer_elements: int | None, what: str) -> None:
    if view.extent() > MAX_ELEMENTS:
        raise KernelArgumentError(f"{what} reaches element {view.extent()}; offsets are 32-bit")
    if buffer_elements is not None and view.extent() > buffer_elements:
        raise KernelArgumentError(
            f"{what} (sizes {view.sizes}, strides {view.strides}, offset {view.offset}) reaches element "
            f"{view.extent() - 1} but its buffer holds {buffer_elements} elements")


def elementwise_groups(numel: int) -> int:
    """Work groups for one thread per element; the runtime splits grids over the device limit."""
    return ceil_div(numel, WORKGROUP_SIZE)


def plan_strided_copy(out: Any, source: Any, source_view: StridedView, *,
                      out_view: StridedView | None = None, convert: int = CONVERT_NONE,
                      label: str = "strided_copy") -> list[Dispatch]:
    """Dispatches copying `source_view` of buffer `source` into `out_view` of buffer `out`.

    `out_view` defaults to a contiguous tensor of the source's sizes at offset 0; any strided region
    of a larger output works too (cat, slice_scatter), as long as it does not overlap itself.
    `out`/`source` are buffer keys or BufferBindings. An empty view plans no dispatch.
    """
    if convert not in (CONVERT_NONE, CONVERT_INT32_TO_FP32, CONVERT_FP32_TO_INT32):
        raise KernelArgumentError(f"{label}: unknown conversion {convert!r}")
    out_view = StridedView.contiguous(source_view.sizes) if out_view is None else out_view
    if out_view.sizes != source_view.sizes:
        raise KernelArgumentError(
            f"{label}: output region sizes {out_view.sizes} differ from the source's {source_view.sizes}")
    if any(stride == 0 and size > 1 for size, stride in zip(out_view.sizes, out_view.strides)):
        raise KernelArgumentError(f"{label}: the output region {out_view} writes an element more than once")
    for view, what in ((source_view, f"{label} source"), (out_view, f"{label} output")):
        check_view_fits(view, None, what)
    if source_view.numel == 0:
        return []
    sizes, (in_strides, out_strides) = coalesce_dims(source_view.sizes, source_view.strides, out_view.strides)
    if len(sizes) > MAX_STRIDED_RANK:
        raise KernelArgumentError(
            f"{label}: the copy of sizes {source_view.sizes} needs {len(sizes)} dims after merging "
            f"contiguous ones; copy.comp supports at most {MAX_STRIDED_RANK}")
    push = copy_push(source_view.numel, sizes, (source_view.offset, out_view.offset), (in_strides, out_strides))
    return [Dispatch(
        "copy", elementwise_groups(source_view.numel),
        bindings=(binding(out, "w"), binding(source, "r")),
        push_constants=push, spec_constants={COPY_CONVERT_SPEC_ID: convert}, label=label)]


def copy_push(numel: int, sizes: Sequence[int], offsets: tuple[int, int], strides: tuple[Sequence[int], Sequence[int]],
              window_start: int = 0) -> bytes:
    """copy.comp's push block: `numel` elements of merged `sizes` from flat index `window_start` on (a window
    of a copy split over bindings, kernels/copies.py), (input, output) element offsets and strides."""
    return pack_push(numel, len(sizes), *offsets,
                     *padded_innermost_first(sizes, MAX_STRIDED_RANK, 1),
                     *padded_innermost_first(strides[0], MAX_STRIDED_RANK, 0),
                     *padded_innermost_first(strides[1], MAX_STRIDED_RANK, 0), window_start)


def fill_word(value: Any, dtype: str, what: str) -> int:
    """The 32-bit word a GPU tensor of `dtype` ("float32", "int32", "int64") holds for `value`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelArgumentError(f"{what}: fill value must be a real number, got {value!r}")
    if dtype == "float32":
        try:
            return struct.unpack("<I", struct.pack("<f", float(value)))[0]
        except OverflowError:
            raise KernelArgumentError(f"{what}: fill value {value!r} overflows float32") from None
    if float(value) != int(value) or not -(2**31) <= int(value) < 2**31:
        raise KernelArgumentError(
            f"{what}: fill value {value!r} is not an integer that fits int32 ({dtype} is int32 on the GPU)")
    return int(value) & 0xFFFFFFFF


def plan_fill(out: Any, numel: int, word: int, *, label: str = "fill") -> list[Dispatch]:
    """Dispatches writing the 32-bit `word` (see fill_word) into elements [0, numel) of `out`."""
    if not isinstance(numel, int) or not 0 <= numel <= MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: numel must be an int in [0, {MAX_ELEMENTS}], got {numel!r}")
    if numel == 0:
        return []
    return [Dispatch("copy@FILL", elementwise_groups(numel), bindings=(binding(out, "w"),),
                     push_constants=pack_push(numel, word), label=label)]


def binding(buffer: Any, access: str) -> BufferBinding:
    """A buffer key (or an existing BufferBinding) with the access this kernel performs."""
    if isinstance(buffer, BufferBinding):
        return BufferBinding(buffer.buffer, buffer.offset, buffer.size, access)
    return BufferBinding(buffer, access=access)


# ---- bindings over the device's max storage binding size: plans that can split a tensor cut it by this

VEC4_BYTES = 16  # windows start 16-byte aligned whatever the device allows, so vec4 arrays stay aligned


@dataclass(frozen=True)
class BindingLimit:
    """The most bytes one storage binding may span (the device's max storage binding size, or less when a
    user asks: --max-binding-mib) and the alignment of binding offsets (its min storage buffer offset
    alignment, at least VEC4_BYTES). A window of a tensor starts up to `alignment - 4` bytes before its
    first element (its binding offset rounded down), so its elements may span `window_bytes`."""

    max_bytes: int
    alignment: int = 256

    def __post_init__(self) -> None:
        check_positive_ints("BindingLimit", max_bytes=self.max_bytes, alignment=self.alignment)
        object.__setattr__(self, "alignment", max(self.alignment, VEC4_BYTES))
        if self.alignment & (self.alignment - 1) or self.max_bytes < 2 * self.alignment:
            raise KernelArgumentError(f"BindingLimit: alignment {self.alignment} must be a power of two and at most "
                                      f"half of max_bytes {self.max_bytes}")

    @property
    def window_bytes(self) -> int:
        return self.max_bytes - self.alignment

    @property
    def q8_0_window_start(self) -> int:
        """Codes a window of a Q8_0 matrix starts at a multiple of: whole 32-code blocks, whose float32
        scales (4 bytes per 32 codes) then start at an aligned binding offset too."""
        return 8 * self.alignment

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.max_bytes

    def refusal(self, label: str, what: str, needed: int) -> KernelArgumentError:
        return KernelArgumentError(f"{label}: {what} needs a binding of {needed} bytes, over the device's max storage "
                                   f"binding size of {self.max_bytes} bytes, and the kernel cannot split it that far")


def exceeds(limit: BindingLimit | None, sizes: Sequence[int | None]) -> bool:
    """Whether any of the bindings of these byte sizes is over `limit` (None: no limit)."""
    return limit is not None and any(size is not None and not limit.fits(size) for size in sizes)


def binding_limit_of(limits: Any) -> BindingLimit | None:
    """The BindingLimit of a device's limits (Vulkan or WebGPU DeviceLimits), None without limits."""
    if limits is None:
        return None
    return BindingLimit(int(limits.max_storage_buffer_range), int(limits.min_storage_buffer_offset_alignment))


def sub_binding(buffer: Any, start: int, end: int, access: str, alignment: int) -> tuple[BufferBinding, int]:
    """Bytes [start, end) of the tensor `buffer` binds (a key: from the buffer's start; a BufferBinding: from
    its offset) as a binding whose offset is rounded down to `alignment`, and the bytes it starts before
    `start` (the element offset a kernel adds, times the element size)."""
    key, base = (buffer.buffer, buffer.offset) if isinstance(buffer, BufferBinding) else (buffer, 0)
    absolute = base + start
    offset = absolute - absolute % alignment
    return BufferBinding(key, offset, base + end - offset, access), absolute - offset


def row_windows(rows: int, row_bytes: int, limit: BindingLimit, what: str, label: str,
                start_alignment: int | None = None) -> list[tuple[int, int]]:
    """[begin, end) windows of whole rows of a table, each at most `limit.max_bytes` and starting at a
    multiple of `start_alignment` bytes (default the binding alignment), so each binds with no element
    offset: a kernel addresses its rows from `begin`."""
    alignment = start_alignment or limit.alignment
    step = alignment // math.gcd(row_bytes, alignment)  # rows from one aligned start to the next
    per_window = limit.max_bytes // row_bytes // step * step
    if per_window == 0:
        raise limit.refusal(label, f"{step} rows of {what} ({row_bytes} bytes each)", step * row_bytes)
    return [(begin, min(begin + per_window, rows)) for begin in range(0, rows, per_window)]


def table_window(buffer: Any, begin: int, end: int, access: str, limit: BindingLimit, label: str) -> BufferBinding:
    """Bytes [begin, end) of a tensor as a binding starting exactly there (row_windows' starts)."""
    bound, skipped = sub_binding(buffer, begin, end, access, limit.alignment)
    if skipped:
        raise KernelArgumentError(f"{label}: a window of a table split over bindings must start at an offset aligned "
                                  f"to {limit.alignment} bytes; the tensor's own offset is not")
    return bound

"""Views, permutes and copies: the one generic strided-copy kernel and the kernels' shape helpers.

A `StridedView` (vktrain/serialization/strided_view.py) says how a kernel reads a tensor that lives in a
buffer: sizes, element strides and an element offset. permute / transpose / expand / slice / select /
unsqueeze / squeeze are pure metadata on a view (no GPU work); a kernel either reads the view in place (elementwise, reduction and GEMM
kernels take input strides) or `plan_strided_copy` materialises it into a contiguous tensor with
`copy.slang`. The elementwise, reduction and matmul families import their stride helpers from here.

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

from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, StridedView

# copy.slang / elementwise.slang: MAX_RANK and WORKGROUP_SIZE.
MAX_STRIDED_RANK = 6
WORKGROUP_SIZE = 64
# The device limits the plans size workgroups by (OpContext.limits), as errors name them.
SHARED_MEMORY_LIMIT = "shared memory per workgroup (Vulkan maxComputeSharedMemorySize, WebGPU " \
                      "max-compute-workgroup-storage-size)"
WORKGROUP_SIZE_LIMIT = "workgroup limit (Vulkan maxComputeWorkGroupInvocations / maxComputeWorkGroupSize[0], " \
                       "WebGPU max-compute-invocations-per-workgroup / max-compute-workgroup-size-x)"

# copy.slang CONVERT specialization constant (id 3).
COPY_CONVERT_SPEC_ID = 3
CONVERT_NONE = 0
CONVERT_INT32_TO_FP32 = 1
CONVERT_FP32_TO_INT32 = 2


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


def fitted_workgroup(preferred: int, max_workgroup_size: int | None) -> int:
    """`preferred` invocations (a power of two), halved until a device allowing `max_workgroup_size` per
    workgroup (None: no limit given) runs it: the workgroup a plan picks within a device profile's limits."""
    size = preferred
    while max_workgroup_size is not None and size > max_workgroup_size and size > 1:
        size //= 2
    return size


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


def check_dtype(dtype: Any, what: str, allowed: Sequence[str] = ("float32",)) -> str:
    """Normalise a dtype name ("float32", numpy dtype, torch-style "torch.float32") and check it."""
    name = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    if name not in allowed:
        raise KernelArgumentError(f"{what} has dtype {name}; this kernel supports {', '.join(allowed)}")
    return name


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
            f"contiguous ones; copy.slang supports at most {MAX_STRIDED_RANK}")
    push = copy_push(source_view.numel, sizes, (source_view.offset, out_view.offset), (in_strides, out_strides))
    return [Dispatch(
        "copy", elementwise_groups(source_view.numel),
        bindings=(binding(out, "w"), binding(source, "r")),
        push_constants=push, spec_constants={COPY_CONVERT_SPEC_ID: convert}, label=label)]


def copy_push(numel: int, sizes: Sequence[int], offsets: tuple[int, int], strides: tuple[Sequence[int], Sequence[int]],
              window_start: int = 0) -> bytes:
    """copy.slang's push block: `numel` elements of merged `sizes` from flat index `window_start` on (a window
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

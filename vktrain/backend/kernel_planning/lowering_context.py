"""What an op lowering sees: the decoded op (OpContext), its tensors as the kernels bind them
(TensorArg), and the record of how one graph op becomes dispatches (OpLowering). The table of lowerings
itself is op_lowering.py; the executor (executor.py) builds the contexts from the blob's storage."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from vktrain.errors import GraphLoweringError
from vktrain.opdefs import OpDef, op_def
from vktrain.backend.kernel_planning.kernels import attention, coopmat, layout
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.strided_view import StridedView
from vktrain.serialization import graph as vk


# What the GPU kernels read and write (int64 tensors live on the GPU as int32; float64 exists only in the
# CPU references). The partitioner delegates no op whose tensors have another dtype.
KERNEL_DTYPES = frozenset({"float32", "int32", "int64", "uint8", "int8"})


# ------------------------------------------------------------------------------------------------
# What a lowering sees
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorArg:
    """A tensor value as a kernel binds it: `binding` covers exactly the value's bytes on the GPU.

    `dtype` is the graph dtype name ("float32", "int64", ...); int64 tensors are stored as int32 (the
    blob records it; the executor converts them on upload) and the aten families accept "int64" meaning
    exactly that. `layout` is the graph layout (q4gsw weights are W_4X8 words on the GPU). `view` is the
    strided view the blob records for a lazily transposed tensor (a permutation of another tensor's
    bytes, never materialised); the backend only leaves those for ops that read strided operands.
    """

    value_id: int
    binding: BufferBinding
    shape: tuple[int, ...]
    dtype: str
    layout: vk.Layout = vk.Layout.PLAIN
    view: Optional[StridedView] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strided(self) -> StridedView:
        """How a kernel reads this tensor from its binding (contiguous unless lazily transposed)."""
        return self.view if self.view is not None else StridedView.contiguous(self.shape)

    @property
    def storage(self) -> Any:
        """The buffer key this tensor lives in (two TensorArgs with equal storage share bytes)."""
        return self.binding.buffer


@dataclass(frozen=True)
class RankProduct:
    """An addmm's rank-r product that a 4-bit base GEMM adds in its epilogue (rank_epilogue.py): the base
    kernel then writes `out`, the addmm's output, instead of its own."""
    out: BufferBinding
    epilogue: coopmat.RankEpilogue


@dataclass
class OpContext:
    """One op, decoded: `args` in schema order (TensorArg, None, int, float, bool, str, tuple of
    numbers, or list of TensorArg for a tensor list), `outputs` as TensorArg."""

    index: int
    op: vk.OpCall
    args: list
    outputs: list
    label: str
    # Allocates a scratch buffer owned by this op: (nbytes, purpose) -> binding.
    scratch: Callable[[int, str], BufferBinding]
    # The device's DeviceLimits (vktrain.runtime.vk.device), for kernels that size workgroups or shared
    # memory tiles by them; None: the Vulkan-guaranteed minimums the kernels default to.
    limits: Optional[Any] = None
    gemm: coopmat.GemmRoute = coopmat.FP32_ROUTE  # the GEMM kernels chosen at load for this device (kernels/coopmat.py)
    binding_limit: Optional[layout.BindingLimit] = None  # what the plans that can split a tensor cut it by
    # The device's DeviceProfile (vktrain/runtime/device_profiles.py): what planning reads of the device;
    # None: `limits` (or the Vulkan-guaranteed minimums) instead.
    profile: Optional[DeviceProfile] = None
    # A 4-bit base GEMM's offer to add an addmm's product in its epilogue, taken only by its tensor-core plan.
    rank_product: Optional[RankProduct] = None

    def fail(self, message: str) -> GraphLoweringError:
        return GraphLoweringError(f"op {self.index} ({self.op.name}): {message}")

    def tensor(self, position: int, name: str) -> TensorArg:
        value = self.args[position]
        if not isinstance(value, TensorArg):
            raise self.fail(f"argument {position} ({name}) must be a tensor, got {value!r}")
        return value

    def integer(self, position: int, name: str) -> int:
        value = self.args[position]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"argument {position} ({name}) must be an int, got {value!r}")
        return value

    def real(self, position: int, name: str) -> float:
        value = self.args[position]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"argument {position} ({name}) must be a number, got {value!r}")
        return float(value)

    @property
    def shared_memory_bytes(self) -> int:
        """Shared memory a workgroup may use on this device."""
        if self.profile is not None:
            return self.profile.max_shared_memory_bytes
        if self.limits is None:
            return attention.DEFAULT_SHARED_MEMORY_BYTES
        return int(self.limits.max_compute_shared_memory_size)

    @property
    def max_workgroup_size(self) -> int:
        """Invocations a workgroup may have on this device (1-D workgroups)."""
        if self.profile is not None:
            return min(self.profile.max_workgroup_invocations, self.profile.max_workgroup_size[0])
        if self.limits is None:
            return attention.DEFAULT_MAX_WORKGROUP_SIZE
        return min(int(self.limits.max_compute_work_group_invocations),
                   int(self.limits.max_compute_work_group_size[0]))


@dataclass(frozen=True)
class OpLowering:
    """How the graph op `key` becomes dispatches. Its argument names (blob order) and outputs are its
    definition's; it needs the kernel registered under `key` unless `needs_kernel` is False."""

    key: str
    lower: Callable[[OpContext], list[Dispatch]]
    needs_kernel: bool = True

    @property
    def definition(self) -> OpDef:
        return op_def(self.key)

    @property
    def arg_names(self) -> tuple[str, ...]:
        return self.definition.schema.arg_names

    @property
    def num_outputs(self) -> int:
        return len(self.definition.schema.returns)

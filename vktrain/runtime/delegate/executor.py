"""GraphExecutor: a VkGraph (the delegate blob) on a Device, recorded once, replayed per call.

Load time (everything that can fail fails here, never at step time):
  1. pattern rewrites (op_lowering.fuse_patterns) and the op-lowering lookup: an op without a kernel
     is a GraphLoweringError "unsupported op <name>";
  2. storage: one Buffer per planned memory object that still holds a tensor once the decisions below
     are made, sized by the largest of those tensors, not by the plan (its tensors bind it at offset 0
     with their own size; a big planned tensor that became a view must not keep its object big), one
     per constant (uploaded once; W_4X8 weights stay packed; a synthetic constant, benchmark blobs only,
     is generated here from its seed, then uploaded the same way), one per input, per mutable state
     tensor and per unplanned intermediate. Storage decisions that save copies:
       * aliasing: a view op that moves no bytes (view_copy / squeeze / unsqueeze of a contiguous
         tensor, int64 <-> int32 _to_copy) binds its output to its input's storage, when the longer
         lifetime collides with no other tensor planned into that memory object (or else the input can
         move into the view's own object);
       * lazy transposes: permute / t / transpose whose every reader takes strided operands (mm, other
         transposes) are views of their input's bytes; transposes that cancel out are plain aliases;
       * in-place state: adamw runs in place (the GPU kernel does), so when its output is the update of
         the very state it reads and nothing reads that state afterwards, the output IS the state buffer.
     Any other state update is a recorded copy dispatch at the end of the step;
  3. every op becomes Dispatches through the op-lowering table; ONE Program records them all.

Per call: write the inputs (int64 -> int32 with a range check; index inputs checked against the
embedding / logits they index), replay, read the outputs only. int64 tensors live on the GPU as int32
(every index a model uses fits); they are converted back on read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vktrain.serialization import graph as vk

from vktrain.runtime.vk.commands import Program
from vktrain.runtime.vk.memory import Buffer
from vktrain.runtime.delegate.op_lowering import (
    VIEW_ACCEPTING_OPS,
    GraphLoweringError,
    OpContext,
    TensorArg,
    alias_source,
    copy_words,
    decode_scalar,
    fuse_patterns,
    lowering_for,
    transpose_source,
    transposed_view,
)
from vktrain.runtime.delegate.kernels.layout import StridedView
from vktrain.runtime.delegate.kernels.requant import requant_output_nbytes
from vktrain.runtime.vk.schedule import BufferBinding, Dispatch
from vktrain.errors import VktrainError

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_REQUANT = "vktrain.q4gsw_requant.default"


class ExecutorInputError(VktrainError, ValueError):
    """An input or state array does not match what the graph expects (shape, dtype, range)."""


def _align(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def _round4(nbytes: int) -> int:
    return max(4, -(-nbytes // 4) * 4)


def _to_gpu_array(array: np.ndarray, dtype: vk.DType, what: str) -> np.ndarray:
    """`array` in the representation the GPU holds for graph dtype `dtype` (int64 -> checked int32)."""
    if dtype == vk.DType.INT64:
        if array.dtype.kind not in "iu":
            raise ExecutorInputError(f"{what} must hold integers (graph dtype int64), got {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < _INT32_MIN or high > _INT32_MAX:
                raise ExecutorInputError(
                    f"{what} holds values in [{low}, {high}]; int64 tensors are int32 on the GPU, so values "
                    f"must lie in [{_INT32_MIN}, {_INT32_MAX}]")
        return np.ascontiguousarray(array, dtype=np.int32)
    expected = dtype.numpy_dtype
    if dtype in (vk.DType.FLOAT32, vk.DType.FLOAT16):
        if array.dtype.kind != "f":
            raise ExecutorInputError(f"{what} must be floating point (graph dtype {expected}), got {array.dtype}")
        return np.ascontiguousarray(array, dtype=expected)
    if array.dtype != expected:
        raise ExecutorInputError(f"{what} has dtype {array.dtype}, the graph expects {expected}")
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor value lives: storage key, bytes it occupies on the GPU, its physical layout."""

    key: str
    nbytes: int
    layout: vk.Layout


class GraphExecutor:
    """Runs one VkGraph on `device`. See the module docstring for what happens at load and per call.

    `run(*inputs)` takes arrays in `input_names` order and returns the outputs (numpy, graph dtypes).
    `read_state(name)` / `write_state(name, array)` / `reset_state()` access the mutable state by the
    names the exporter recorded (parameter / buffer FQNs); `timings()` gives (label, seconds) per
    dispatch of the last call. `staging=True` forces staging copies for every host access (the path a
    discrete GPU takes; tests use it on unified devices).
    """

    def __init__(self, device, graph: vk.VkGraph, *, timing: bool = True, staging: bool | None = None):
        graph.validate()
        self.device = device
        self._staging = staging  # Buffer's access path: None = direct on unified memory, else staging
        self.graph = graph
        self.ops: list[vk.OpCall] = fuse_patterns(graph)
        self._lowerings = [lowering_for(op, index) for index, op in enumerate(self.ops)]
        self._buffers: dict[str, Buffer] = {}
        self.program: Program | None = None
        self._state_by_name = self._index_state()
        self._index_limits = self._find_index_limits()
        try:
            self._assign_storage()
            self._allocate_buffers()
            self._upload_constants()
            self.reset_state()
            self.dispatches: list[Dispatch] = self._plan_dispatches()
            self.program = Program(device, self.dispatches, self._buffers, timing=timing)
        except BaseException:
            self.close()
            raise
        self._ran = False

    # ------------------------------------------------------------------------------ naming
    @property
    def input_names(self) -> list[str]:
        return [self.graph.tensor(v).name or f"input{i}" for i, v in enumerate(self.graph.inputs)]

    @property
    def output_names(self) -> list[str]:
        return [self.graph.tensor(v).name or f"output{i}" for i, v in enumerate(self.graph.outputs)]

    @property
    def state_names(self) -> list[str]:
        return list(self._state_by_name)

    def _index_state(self) -> dict[str, vk.MutableState]:
        by_name: dict[str, vk.MutableState] = {}
        for state in self.graph.mutable_state:
            name = self.graph.tensor(state.state_id).name or f"state{state.state_id}"
            if name in by_name:
                raise GraphLoweringError(f"two mutable state tensors are named {name!r}; state names must be unique")
            by_name[name] = state
        return by_name

    def _find_index_limits(self) -> dict[int, list[tuple[int | None, int, str]]]:
        """Graph input -> [(lowest allowed value or None, exclusive upper bound, what it indexes)] for
        inputs used as indices.

        A kernel cannot raise: an embedding index out of range reads a NaN row and a fused_ce label >= V
        is silently ignored, where the CPU reference raises. So the executor checks such inputs on the
        host. Inputs are followed through byte-preserving view ops (the labels are flattened first).
        """
        derived_from = {}
        for op in self.ops:
            source = alias_source(self.graph, op)
            if source is not None:
                derived_from[op.outputs[0]] = source
        uses = []  # (index tensor, low, bound, description)
        for index, op in enumerate(self.ops):
            if op.name == "aten.embedding.default":
                rows = self.graph.tensor(op.args[0]).shape[0]
                uses.append((op.args[1], 0, rows, f"row of the {rows}-row embedding of op {index}"))
            elif op.name == "vktrain.fused_ce.default":  # labels < 0 are ignored rows
                vocab = self.graph.tensor(op.args[0]).shape[-1]
                uses.append((op.args[1], None, vocab, f"class of the {vocab}-wide logits of op {index} (fused_ce)"))
        limits: dict[int, list[tuple[int | None, int, str]]] = {}
        inputs = set(self.graph.inputs)
        for value_id, low, bound, what in uses:
            while value_id in derived_from:
                value_id = derived_from[value_id]
            if value_id in inputs:
                limits.setdefault(value_id, []).append((low, bound, what))
        return limits

    @property
    def index_limits(self) -> dict[str, int]:
        """Input name -> exclusive upper bound of its values, for inputs used as indices (token ids: the
        embedding's rows; labels: the logits' classes). Checked on every run()."""
        names = dict(zip(self.graph.inputs, self.input_names))
        return {names[value_id]: min(bound for _, bound, _ in uses) for value_id, uses in self._index_limits.items()}

    def _check_index_input(self, name: str, value_id: int, array: np.ndarray) -> None:
        if not array.size:
            return
        for low, bound, what in self._index_limits.get(value_id, ()):
            for bad, position in ((int(array.max()), int(array.argmax())), (int(array.min()), int(array.argmin()))):
                if bad >= bound or (low is not None and bad < low):
                    where = [int(i) for i in np.unravel_index(position, array.shape)]
                    allowed = f"[{low}, {bound})" if low is not None else f"< {bound}"
                    raise ExecutorInputError(f"input {name!r} holds {bad} at {where}, but it must be a {what} "
                                             f"({allowed})")

    # ------------------------------------------------------------------------------ storage
    @staticmethod
    def _gpu_nbytes(tensor: vk.TensorValue) -> int:
        if tensor.dtype == vk.DType.INT64:
            return tensor.numel * 4  # int32 on the GPU
        return tensor.nbytes

    def _assign_storage(self) -> None:
        """Decide the storage key of every tensor value (see the module docstring, step 2)."""
        self._index_uses()
        self._place_tensors()
        self._repair_memory_plan()
        self._root = {v: v for v in self._tensors}  # alias group of each value, by its root value
        self._span = {v: self._lifetime(v) for v in self._tensors}  # per group root: the group's lifetime
        self._alias_views()
        self._update_state_in_place()
        self._plan_state_copies()

    def _index_uses(self) -> None:
        """Producer and readers of every value; q4gsw_requant results (W_4X8 words on the GPU)."""
        graph = self.graph
        n_ops = len(self.ops)
        inputs = set(graph.inputs)
        self._states = {s.state_id for s in graph.mutable_state}
        self._late_reads = set(graph.outputs) | {s.update_id for s in graph.mutable_state}  # read after the step
        for state in graph.mutable_state:
            if state.state_id in inputs:
                raise GraphLoweringError(f"mutable state value {state.state_id} is also a graph input")
        self._producer: dict[int, int] = {}
        self._reads: dict[int, list[int]] = {}
        self._requant_outputs: dict[int, tuple[int, int]] = {}  # value id -> (N, K)
        for index, op in enumerate(self.ops):
            for arg in op.args:
                self._reads.setdefault(arg, []).append(index)
            for out in op.outputs:
                if out in self._producer or out in inputs or out in self._states:
                    raise GraphLoweringError(f"op {index} ({op.name}) writes value {out}, which is an input, "
                                             f"mutable state or another op's output")
                self._producer[out] = index
            if op.name == _REQUANT:
                scales = graph.tensor(op.args[1])
                group_size = graph.values[op.args[2]]
                if len(scales.shape) == 2 and isinstance(group_size, vk.IntValue):
                    self._requant_outputs[op.outputs[0]] = (scales.shape[1], scales.shape[0] * group_size.value)
        for value_id in self._late_reads:
            self._reads.setdefault(value_id, []).append(n_ops)
            if value_id in self._requant_outputs:
                raise GraphLoweringError(f"value {value_id} (a q4gsw_requant result, W_4X8 words on the GPU) is a "
                                         f"graph output or state update; only linear_q4gsw ops can read it")

    def _lifetime(self, value_id: int) -> tuple[int, int]:
        """Inclusive op-index interval [written, last read], the memory planner's convention (-1: before
        the first op, len(ops): after the last)."""
        first = self._producer.get(value_id, -1)
        return first, max(self._reads.get(value_id, [first]) + [first])

    def _place_tensors(self) -> None:
        """Initial storage keys: the planned memory object, else a buffer of the value's own."""
        graph = self.graph
        inputs = set(graph.inputs)
        used = set(self._producer) | set(self._reads) | inputs | self._states
        self._tensors: dict[int, _Tensor] = {}
        constant_keys: dict[tuple[int, vk.DType, vk.Layout], str] = {}
        for value_id in sorted(used):
            tensor = graph.values[value_id]
            if not isinstance(tensor, vk.TensorValue):
                continue
            nbytes, layout = self._gpu_nbytes(tensor), tensor.layout
            if value_id in self._requant_outputs:
                nbytes, layout = requant_output_nbytes(*self._requant_outputs[value_id]), vk.Layout.Q4GSW_W4X8
            if tensor.constant_id >= 0:
                # Values reading the same constant bytes share one upload (unless they read it as
                # another dtype or layout, which the backend does not do today).
                identity = (tensor.constant_id, tensor.dtype, tensor.layout)
                if identity not in constant_keys:
                    taken = any(other[0] == tensor.constant_id for other in constant_keys)
                    constant_keys[identity] = f"constant{tensor.constant_id}" + (f".{value_id}" if taken else "")
                key = constant_keys[identity]
            elif value_id in self._states:
                key = f"state{value_id}"  # persists across steps: never shared
            elif tensor.mem_obj_id >= 0 and value_id not in self._requant_outputs:
                key = f"mem{tensor.mem_obj_id}"
            else:
                key = f"value{value_id}"
            self._tensors[value_id] = _Tensor(key, nbytes, layout)
            if tensor.constant_id < 0 and value_id not in inputs | self._states and value_id not in self._producer:
                raise GraphLoweringError(f"value {value_id} ({tensor.name or 'unnamed'}) is read but nothing writes "
                                         f"it: not an input, constant, mutable state or op output")

    def _repair_memory_plan(self) -> None:
        """The memory plan was made for the blob's op list; the rewrites (fuse_patterns) can lengthen a
        lifetime (threshold_backward reads x where `le` did, a few ops earlier). A tensor whose planned
        object is still in use when it is written gets a buffer of its own instead."""
        by_object: dict[str, list[int]] = {}
        for value_id, placement in self._tensors.items():
            if placement.key.startswith("mem"):
                by_object.setdefault(placement.key, []).append(value_id)
        for members in by_object.values():
            busy_until = -2
            for value_id in sorted(members, key=self._lifetime):
                first, last = self._lifetime(value_id)
                if first <= busy_until:
                    self._tensors[value_id] = replace(self._tensors[value_id], key=f"value{value_id}")
                else:
                    busy_until = last

    def _collides(self, key: str, lifetime: tuple[int, int], group: int) -> bool:
        """Whether a group other than `group` in memory object `key` is alive during `lifetime`."""
        return key.startswith("mem") and any(
            placement.key == key and self._root[other] == other and other != group
            and not (self._span[other][1] < lifetime[0] or lifetime[1] < self._span[other][0])
            for other, placement in self._tensors.items())

    def _view_of(self, op: vk.OpCall) -> tuple[int, StridedView | None] | None:
        """(source, view) when `op`'s output may share its input's bytes: a byte-preserving view op
        (view None), or a transpose read only by ops that take strided views (its StridedView; None when
        the transposes cancel out). None when the output needs bytes of its own."""
        graph, n_ops = self.graph, len(self.ops)
        source = alias_source(graph, op)
        if source is not None:
            return None if source in self._views else (source, None)  # reshaping a transpose moves data
        source = transpose_source(op, graph)
        if source is None or source not in self._tensors:
            return None
        input_view = self._views.get(source, StridedView.contiguous(graph.tensor(source).shape))
        view = transposed_view(op.name, [decode_scalar(graph.values[arg]) for arg in op.args[1:]], input_view)
        if view.is_contiguous:
            return source, None
        readers = self._reads.get(op.outputs[0], ())
        if any(reader == n_ops or self.ops[reader].name not in VIEW_ACCEPTING_OPS for reader in readers):
            return None
        return source, view

    def _alias_views(self) -> None:
        """Bind view outputs to their input's storage where no other tensor of that memory object is
        alive meanwhile; else move the whole group into the view's own object when that one is free."""
        self.aliased_ops: set[int] = set()
        self._views: dict[int, StridedView] = {}  # lazily transposed values: how to read their bytes
        for index, op in enumerate(self.ops):
            found = self._view_of(op)
            if found is None or found[0] not in self._tensors:
                continue
            (source, view), out = found, op.outputs[0]
            group = self._root[source]
            home = self._tensors[group].key
            if home.startswith("state") and out in self._late_reads:
                continue  # the state buffer changes at the end of the step; such a view needs its own copy
            first, last = self._lifetime(out)
            merged = (min(self._span[group][0], first), max(self._span[group][1], last))
            if self._collides(home, merged, group):
                # The source's producer can write into the view's object instead, if the source is an
                # intermediate and nothing else lives there meanwhile.
                own = self._tensors[out].key
                if not home.startswith("mem") or self._collides(own, merged, out):
                    continue
                home = own
            for member in [v for v in self._tensors if self._root[v] == group] + [out]:
                self._tensors[member] = replace(self._tensors[member], key=home)
            self._root[out] = group
            self._span[group] = merged
            if view is not None:
                self._views[out] = view
            self.aliased_ops.add(index)

    def _update_state_in_place(self) -> None:
        """adamw writes its (param, exp_avg, exp_avg_sq) outputs into the state buffers it reads, when
        each output is that state's update and nothing reads the old value (or a view of it) later."""
        update_of = {s.state_id: s.update_id for s in self.graph.mutable_state}
        for index, op in enumerate(self.ops):
            if op.name != "vktrain.adamw.default":
                continue
            others = {self._tensors[a].key for a in op.args[3:] if a in self._tensors}
            for source, target in zip(op.args[:3], op.outputs):
                if source not in self._states or update_of[source] != target or self._tensors[source].key in others:
                    continue
                group = self._root[source]
                members = [v for v in self._tensors if self._root[v] == group]
                if any(reader > index for v in members for reader in self._reads.get(v, ())):
                    continue
                self._root[target] = group
                self._tensors[target] = replace(self._tensors[target], key=self._tensors[source].key)

    def _plan_state_copies(self) -> None:
        """State updates that did not happen in place become copies at the end of the step."""
        graph = self.graph
        self._state_copies = [s for s in graph.mutable_state
                              if self._tensors[s.update_id].key != self._tensors[s.state_id].key]
        overwritten = {self._tensors[s.state_id].key for s in self._state_copies}
        for state in self._state_copies:
            if self._tensors[state.update_id].key in overwritten:
                raise GraphLoweringError(
                    f"the update of state value {state.state_id} reads the storage of another state that is "
                    f"itself updated at the end of the step; the copy order would matter (unsupported)")
        for value_id in graph.outputs:
            if self._tensors[value_id].key in overwritten:
                raise GraphLoweringError(f"graph output value {value_id} is a mutable state tensor updated at the end "
                                         f"of the step; return its update instead")

    def _allocate_buffers(self) -> None:
        """One buffer per storage key, sized by the tensors actually placed there. A memory object's
        planned size is not used: it counts occupants that became views of other storage (a transposed
        weight) or moved out, and its int64 tensors at 8 bytes; an object left with no occupant gets none."""
        sizes: dict[str, int] = {}
        for tensor in self._tensors.values():
            sizes[tensor.key] = max(sizes.get(tensor.key, 0), tensor.nbytes)
        for key, nbytes in sorted(sizes.items()):
            self._buffers[key] = Buffer(self.device, _round4(nbytes), name=key, staging=self._staging)

    def _binding(self, value_id: int) -> BufferBinding:
        tensor = self._tensors[value_id]
        return BufferBinding(tensor.key, 0, _round4(tensor.nbytes))

    def _upload_constants(self) -> None:
        uploaded = set()
        self.synthetic_constant_bytes = 0  # bytes generated at load (vk.SyntheticConstant), for reports
        for value_id, placement in self._tensors.items():
            tensor = self.graph.values[value_id]
            if tensor.constant_id < 0 or placement.key in uploaded:
                continue
            # A synthetic constant is generated here (numpy, deterministic by its seed); the array is
            # dropped right after its upload, so at most one big constant is in host memory at a time.
            array = self.graph.constant_array(value_id)
            if self.graph.is_synthetic(tensor.constant_id):
                self.synthetic_constant_bytes += array.nbytes
            what = f"constant {tensor.name or value_id}"
            try:
                data = _to_gpu_array(array, tensor.dtype, what)
            except ExecutorInputError as exc:
                raise GraphLoweringError(str(exc)) from None
            self._buffers[placement.key].write(data)
            uploaded.add(placement.key)

    # ------------------------------------------------------------------------------ dispatches
    def _tensor_arg(self, value_id: int) -> TensorArg:
        tensor = self.graph.tensor(value_id)
        placement = self._tensors[value_id]
        return TensorArg(value_id, self._binding(value_id), tensor.shape, tensor.dtype.numpy_dtype.name,
                         placement.layout, self._views.get(value_id))

    def _decode(self, value_id: int, index: int, op: vk.OpCall) -> Any:
        value = self.graph.values[value_id]
        if isinstance(value, vk.TensorValue):
            return self._tensor_arg(value_id)
        if isinstance(value, vk.ValueListValue):
            items = [self.graph.values[item] for item in value.items]
            if not all(isinstance(item, vk.TensorValue) for item in items):
                raise GraphLoweringError(f"op {index} ({op.name}): value list {value_id} mixes tensors and scalars")
            return [self._tensor_arg(item) for item in value.items]
        return decode_scalar(value)

    SCRATCH_KEY = "scratch"
    SCRATCH_ALIGN = 256  # >= minStorageBufferOffsetAlignment of every Vulkan device (the spec caps it at 256)

    def _scratch(self, index: int):
        """Op-owned scratch lives in ONE buffer shared by all ops: an op's scratch is dead once its own
        dispatches are done, and the dependency barriers order the next op's reuse of the same bytes.
        Within one op, each purpose gets its own aligned range."""
        purposes: dict[str, BufferBinding] = {}

        def allocate(nbytes: int, purpose: str) -> BufferBinding:
            if purpose in purposes:
                raise GraphLoweringError(f"op {index} asked twice for scratch buffer {purpose!r}")
            offset = sum(_align(b.size, self.SCRATCH_ALIGN) for b in purposes.values())
            purposes[purpose] = BufferBinding(self.SCRATCH_KEY, offset, _round4(nbytes))
            self._scratch_bytes = max(self._scratch_bytes, offset + _round4(nbytes))
            return purposes[purpose]
        return allocate

    def _plan_dispatches(self) -> list[Dispatch]:
        dispatches: list[Dispatch] = []
        self._scratch_bytes = 0
        for index, (op, lowering) in enumerate(zip(self.ops, self._lowerings)):
            if index in self.aliased_ops:
                continue  # the output is its input's bytes: nothing to move
            label = f"{index}:{op.name}"
            args = [self._decode(arg, index, op) for arg in op.args]
            if op.name not in VIEW_ACCEPTING_OPS and any(isinstance(a, TensorArg) and a.view is not None for a in args):
                raise GraphLoweringError(f"op {index} ({op.name}) would read a transposed view it cannot handle "
                                         f"(executor bug: transposes are only left lazy for view-accepting readers)")
            outputs = [self._tensor_arg(out) for out in op.outputs]
            context = OpContext(index, op, args, outputs, label, self._scratch(index), self.device.limits)
            dispatches += lowering.lower(context)
        if self._scratch_bytes:
            self._buffers[self.SCRATCH_KEY] = Buffer(self.device, self._scratch_bytes, name=self.SCRATCH_KEY,
                                                     staging=self._staging)
        for state in self._state_copies:
            name = self.graph.tensor(state.state_id).name or f"state{state.state_id}"
            dispatches += copy_words(self._binding(state.state_id), self._binding(state.update_id),
                                     _round4(self._tensors[state.state_id].nbytes), label=f"state_update:{name}")
        if not dispatches:
            raise GraphLoweringError("the graph has no work for the GPU (no ops and no state updates)")
        return dispatches

    # ------------------------------------------------------------------------------ running
    def run(self, *inputs: Any) -> list[np.ndarray]:
        """Write `inputs` (in `input_names` order), replay the recorded step, return the outputs."""
        self._check_open()
        if len(inputs) != len(self.graph.inputs):
            raise ExecutorInputError(f"the graph takes {len(self.graph.inputs)} inputs ({', '.join(self.input_names)}), "
                                     f"got {len(inputs)}")
        staged = []
        for name, value_id, array in zip(self.input_names, self.graph.inputs, inputs):
            tensor = self.graph.tensor(value_id)
            array = np.asarray(array)
            if array.shape != tensor.shape:
                raise ExecutorInputError(f"input {name!r} has shape {list(array.shape)}, expected {list(tensor.shape)}")
            data = _to_gpu_array(array, tensor.dtype, f"input {name!r}")
            self._check_index_input(name, value_id, data)
            staged.append((value_id, data))
        for value_id, data in staged:
            self._buffers[self._tensors[value_id].key].write(data)
        self.program.replay()
        self._ran = True
        return [self._read(value_id) for value_id in self.graph.outputs]

    __call__ = run

    def _read(self, value_id: int) -> np.ndarray:
        tensor = self.graph.tensor(value_id)
        buffer = self._buffers[self._tensors[value_id].key]
        if tensor.dtype == vk.DType.INT64:
            return buffer.read(np.int32, tensor.shape).astype(np.int64)
        return buffer.read(tensor.dtype.numpy_dtype, tensor.shape)

    def timings(self) -> list[tuple[str, float]] | None:
        """(dispatch label, seconds) for each dispatch of the last run; None without GPU timestamps."""
        self._check_open()
        if not self._ran:
            raise RuntimeError("timings() before the first run()")
        seconds = self.program.timings()
        if seconds is None:
            return None
        return [(dispatch.name, value) for dispatch, value in zip(self.dispatches, seconds)]

    # ------------------------------------------------------------------------------ state
    def _state(self, name: str) -> vk.MutableState:
        try:
            return self._state_by_name[name]
        except KeyError:
            raise KeyError(f"no mutable state named {name!r}; the graph has {self.state_names}") from None

    def read_state(self, name: str) -> np.ndarray:
        """A copy of mutable state `name` (e.g. "model.layers.0.lora_A") as it is after the last run."""
        self._check_open()
        return self._read(self._state(name).state_id)

    def write_state(self, name: str, array: Any) -> None:
        """Overwrite mutable state `name` (restoring a checkpoint); shape must match, dtype must be compatible."""
        self._check_open()
        self._write_state(name, array)

    def _write_state(self, name: str, array: Any) -> None:
        state = self._state(name)
        tensor = self.graph.tensor(state.state_id)
        array = np.asarray(array)
        if array.shape != tensor.shape:
            raise ExecutorInputError(f"state {name!r} has shape {list(tensor.shape)}, got an array of shape "
                                     f"{list(array.shape)}")
        data = _to_gpu_array(array, tensor.dtype, f"state {name!r}")
        self._buffers[self._tensors[state.state_id].key].write(data)

    def initial_state(self, name: str) -> np.ndarray:
        """The value state `name` had when the graph was exported (zeros unless it has an initial constant)."""
        state = self._state(name)
        tensor = self.graph.tensor(state.state_id)
        if state.initial_constant_id < 0:
            return np.zeros(tensor.shape, tensor.dtype.numpy_dtype)
        data = vk.constant_bytes(self.graph.constants[state.initial_constant_id])  # generates a synthetic one
        return np.frombuffer(data, tensor.dtype.numpy_dtype, tensor.numel).reshape(tensor.shape).copy()

    def reset_state(self) -> None:
        """Every mutable state tensor back to its initial value."""
        for name in self._state_by_name:
            self._write_state(name, self.initial_state(name))

    # ------------------------------------------------------------------------------ introspection
    def storage_of(self, value_id: int) -> str:
        """The buffer key value `value_id` lives in ("mem3", "state0", "constant2", "value17", ...)."""
        return self._tensors[value_id].key

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of every buffer this executor allocated, by key."""
        return {key: buffer.size for key, buffer in self._buffers.items()}

    # ------------------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.program is None:
            raise RuntimeError("this GraphExecutor was closed")

    def close(self) -> None:
        """Free the Program and every buffer (idempotent)."""
        if self.program is not None:
            self.program.destroy()
            self.program = None
        for buffer in self._buffers.values():
            buffer.destroy()
        self._buffers.clear()

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["ExecutorInputError", "GraphExecutor", "GraphLoweringError"]

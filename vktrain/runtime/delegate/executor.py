"""GraphExecutor: a VkGraph (the delegate blob) on a Device, recorded once, replayed per call.

The AOT backend (vktrain/backend/passes) made every storage decision and recorded it per tensor
(CONTRACTS.md "Delegate graph conventions"); this executor carries the record out and decides nothing.

Load time (everything that can fail fails here, never at step time):
  1. the op-lowering lookup: an op without a kernel is a GraphLoweringError "unsupported op <name>";
  2. storage: one Buffer per memory object (its planned size), per constant (uploaded once, converted to
     its stored dtype; W_4X8 weights stay packed; a synthetic constant, benchmark blobs only, is
     generated here from its seed, then uploaded the same way), per input, per mutable state tensor and
     per tensor with storage of its own but no memory object. A tensor with `storage_of` binds that
     tensor's buffer (a view reads it through its recorded strides; an in-place adamw output writes it);
  3. every op becomes Dispatches through the op-lowering table, except ops whose outputs are all views
     (they move no data); state updates not stored in their state are copied at the end of the step;
     ONE Program records them all.

Per call: write the inputs (converted to their stored dtype: int64 -> int32 with a range check; index
inputs checked against the embedding / logits they index), replay, read the outputs only (converted
back to their graph dtype).

GEMM precision (docs/PRECISION.md): the one device decision. The blob lists the precision policies the
program allows; `precision` picks one, and the executor selects the GemmRoute (kernels/coopmat.py) its
op lowerings follow on this device; `gemm_report()` says what was chosen.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vktrain.serialization import graph as vk

from vktrain.runtime.vk.commands import Program
from vktrain.runtime.vk.memory import Buffer
from vktrain.runtime.delegate.lowering_context import GraphLoweringError, OpContext, TensorArg
from vktrain.runtime.delegate.op_lowering import copy_words, lowering_for
from vktrain.runtime.delegate.kernels.coopmat import allowed_precisions, select_gemm_route
from vktrain.runtime.delegate.kernels.gemm_tuning import select_gemm_tuning
from vktrain.runtime.device_profiles import profile_of
from vktrain.serialization.strided_view import StridedView
from vktrain.runtime.delegate.kernels.layout import binding_limit_of
from vktrain.contract import PRECISION_AUTO
from vktrain.runtime.vk.schedule import BufferBinding, Dispatch
from vktrain.errors import VktrainError

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
TENSOR_CORE_SHADER_PREFIX = "coopmat_"
# The ops whose products a GEMM kernel computes (those a GemmRoute may move to the tensor cores).
GEMM_OPS = frozenset({"vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default",
                      "vktrain.linear_dW.default", "aten.mm.default", "aten.bmm.default", "aten.addmm.default",
                      "vktrain.causal_attention.default", "vktrain.causal_attention_backward.default"})


# The embedding lookups and the argument holding their indices: aten.embedding(weight, indices), and the
# Q8_0 table the backend's q8_0_weights pass writes, vktrain.embedding_q8_0(codes, scales, indices).
EMBEDDING_INDEX_ARG = {"aten.embedding.default": 1, "vktrain.embedding_q8_0.default": 2}


class ExecutorInputError(VktrainError, ValueError):
    """An input or state array does not match what the graph expects (shape, dtype, range)."""


MIN_MAX_BINDING_BYTES = 1 << 20  # the least max_binding_bytes: every split kernel's windows fit it


def binding_limited(limits: Any, max_binding_bytes: int | None) -> Any:
    """A device's limits with its max storage binding size lowered to `max_binding_bytes` (None: as they are;
    above the device's own: refused)."""
    if max_binding_bytes is None:
        return limits
    if isinstance(max_binding_bytes, bool) or not isinstance(max_binding_bytes, int) \
            or max_binding_bytes < MIN_MAX_BINDING_BYTES:
        raise GraphLoweringError(f"max_binding_bytes (the max storage binding size, --max-binding-mib) must be an "
                                 f"int >= {MIN_MAX_BINDING_BYTES} (1 MiB, the least vktrain's split kernels need), "
                                 f"got {max_binding_bytes!r}")
    if max_binding_bytes > limits.max_storage_buffer_range:  # it lowers the device's limit, never raises it
        raise GraphLoweringError(f"max_binding_bytes (--max-binding-mib) {max_binding_bytes} is above the device's "
                                 f"max storage binding size of {limits.max_storage_buffer_range} bytes "
                                 f"({limits.max_storage_buffer_range / (1 << 20):.1f} MiB); it can only lower it: "
                                 f"give at most {limits.max_storage_buffer_range >> 20}, or leave it out")
    return replace(limits, max_storage_buffer_range=max_binding_bytes)


def _align(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def _round4(nbytes: int) -> int:
    return max(4, -(-nbytes // 4) * 4)


def _to_stored_array(array: np.ndarray, tensor: vk.TensorValue, what: str) -> np.ndarray:
    """`array` (of graph dtype `tensor.dtype`) as the bytes stored for it (int64 -> range-checked int32)."""
    stored = tensor.storage_dtype
    if stored != tensor.dtype:
        if (tensor.dtype, stored) != (vk.DType.INT64, vk.DType.INT32):
            raise GraphLoweringError(f"{what}: storing {tensor.dtype.name} as {stored.name} is not supported "
                                     f"(only int64 as int32)")
        if array.dtype.kind not in "iu":
            raise ExecutorInputError(f"{what} must hold integers (graph dtype int64), got {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < _INT32_MIN or high > _INT32_MAX:
                raise ExecutorInputError(
                    f"{what} holds values in [{low}, {high}]; int64 tensors are int32 on the GPU, so values "
                    f"must lie in [{_INT32_MIN}, {_INT32_MAX}]")
        return np.ascontiguousarray(array, dtype=np.int32)
    expected = stored.numpy_dtype
    if stored in (vk.DType.FLOAT32, vk.DType.FLOAT16):
        if array.dtype.kind != "f":
            raise ExecutorInputError(f"{what} must be floating point (graph dtype {expected}), got {array.dtype}")
        return np.ascontiguousarray(array, dtype=expected)
    if array.dtype != expected:
        raise ExecutorInputError(f"{what} has dtype {array.dtype}, the graph expects {expected}")
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class SharedTensor:
    """A tensor another executor of the same program owns (its buffer and byte offset, and its record), for
    this executor to bind instead of storage of its own: how a .pte's eval method reads the training
    step's LoRA state without a copy."""

    buffer: Buffer
    offset: int
    tensor: vk.TensorValue


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor value lives: the buffer key, the binding's offset and bytes, how it is read."""

    key: str
    offset: int
    nbytes: int
    view: StridedView | None  # a strided view of the buffer's tensor; None = contiguous


class GraphExecutor:
    """Runs one VkGraph on `device`. See the module docstring for what happens at load and per call.

    `run(*inputs)` takes arrays in `input_names` order and returns the outputs (numpy, graph dtypes).
    `read_state(name)` / `write_state(name, array)` / `reset_state()` access the mutable state by the
    names the exporter recorded (parameter / buffer FQNs); `timings()` gives (label, seconds) per
    dispatch of the last call. `staging=True` forces staging copies for every host access (the path a
    discrete GPU takes; tests use it on unified devices). `precision` is the GEMM precision policy
    (vktrain.contract.PRECISION_CHOICES; auto: fp16-tc where the device has tensor cores); `emulate_tensor_cores` (tests) runs fp16-tc's coopmat kernels
    emulated on a device without tensor cores.

    `shared` (name -> SharedTensor, e.g. another executor's `shared_state()`): a constant or state tensor
    of this graph with one of these names binds that buffer (same shape and stored dtype, checked) instead
    of storage of its own; this executor never uploads, resets or frees it. That is how the methods of
    one program share their weights and state on the device (eval reads the training step's adapters;
    generation's decode reads prefill's KV caches).

    `max_binding_bytes` lowers the max storage binding size the kernels plan for below the device's (a user
    checking that a program fits a browser's 128 MiB: --max-binding-mib); `limits` are the ones planned by.
    Tensors over it are split across dispatches where the kernel can (kernels/matmul.py, embedding.py,
    q8_0.py, cross_entropy.py); any other binding over it is refused at load, naming the tensor.
    """

    def __init__(self, device, graph: vk.VkGraph, *, timing: bool = True, staging: bool | None = None,
                 shared: dict[str, SharedTensor] | None = None, precision: str = PRECISION_AUTO,
                 emulate_tensor_cores: bool = False, max_binding_bytes: int | None = None):
        graph.validate()
        self.device = device
        self.max_binding_bytes = max_binding_bytes
        self.limits = binding_limited(device.limits, max_binding_bytes)
        self.profile = profile_of(device)  # what planning reads of the device
        self.gemm_route = replace(select_gemm_route(precision, allowed_precisions(graph.metadata), device,
                                                    emulate=emulate_tensor_cores, profile=self.profile),
                                  fp32_tuning=select_gemm_tuning(device))
        self._staging = staging  # Buffer's access path: None = direct on unified memory, else staging
        self._shared = dict(shared or {})
        self._borrowed: set[str] = set()  # buffer keys of shared tensors: another executor owns them
        self.graph = graph
        self.ops: list[vk.OpCall] = graph.ops
        self._lowerings = [lowering_for(op, index) for index, op in enumerate(self.ops)]
        self._buffers: dict[str, Buffer] = {}
        self.program: Program | None = None
        self._state_by_name = self._index_state()
        self._index_limits = self._find_index_limits()
        try:
            self._place_tensors()
            self._allocate_buffers()
            self._upload_constants()
            self.reset_state()  # of the state it owns: shared state keeps its contents
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
        inputs = set(self.graph.inputs)
        for state in self.graph.mutable_state:
            if state.state_id in inputs:
                raise GraphLoweringError(f"mutable state value {state.state_id} is also a graph input")
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
        host. Inputs are followed through the views recorded in the blob (the labels are flattened first).
        """
        uses = []  # (index tensor, low, bound, description)
        for index, op in enumerate(self.ops):
            if op.name in EMBEDDING_INDEX_ARG:  # (table or its codes, ..., indices)
                rows = self.graph.tensor(op.args[0]).shape[0]
                indices = op.args[EMBEDDING_INDEX_ARG[op.name]]
                uses.append((indices, 0, rows, f"row of the {rows}-row embedding of op {index}"))
            elif op.name == "vktrain.fused_ce.default":  # labels < 0 are ignored rows
                vocab = self.graph.tensor(op.args[0]).shape[-1]
                uses.append((op.args[1], None, vocab, f"class of the {vocab}-wide logits of op {index} (fused_ce)"))
        limits: dict[int, list[tuple[int | None, int, str]]] = {}
        inputs = set(self.graph.inputs)
        for value_id, low, bound, what in uses:
            tensor = self.graph.tensor(value_id)
            if tensor.is_view:
                value_id = tensor.storage_of
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
    def _shared_key(self, value_id: int) -> str | None:
        """The buffer key of a constant or state tensor bound to a SharedTensor, checked; else None."""
        tensor = self.graph.values[value_id]
        if tensor.name not in self._shared or (tensor.constant_id < 0 and value_id not in self._states):
            return None
        owner = self._shared[tensor.name].tensor
        if (owner.shape, owner.storage_dtype, owner.layout) != (tensor.shape, tensor.storage_dtype, tensor.layout):
            raise GraphLoweringError(
                f"tensor {tensor.name!r} is {tensor.storage_dtype.name}{list(tensor.shape)} ({tensor.layout.name}) "
                f"here but {owner.storage_dtype.name}{list(owner.shape)} ({owner.layout.name}) in the executor "
                f"sharing it; both must be the same tensor of one program")
        return f"shared:{tensor.name}"

    def _own_key(self, value_id: int, constant_keys: dict[tuple[int, vk.DType, vk.Layout], str]) -> str:
        """The buffer key of a tensor with storage of its own."""
        tensor = self.graph.values[value_id]
        shared = self._shared_key(value_id)
        if shared is not None:
            return shared
        if tensor.constant_id >= 0:
            # Values reading the same constant bytes share one upload (unless they read it as another
            # dtype or layout, which the backend does not do today).
            identity = (tensor.constant_id, tensor.dtype, tensor.layout)
            if identity not in constant_keys:
                taken = any(other[0] == tensor.constant_id for other in constant_keys)
                constant_keys[identity] = f"constant{tensor.constant_id}" + (f".{value_id}" if taken else "")
            return constant_keys[identity]
        if value_id in self._states:
            return f"state{value_id}"  # persists across steps: never shared within a graph
        if tensor.mem_obj_id >= 0:
            return f"mem{tensor.mem_obj_id}"
        return f"value{value_id}"

    def _place_tensors(self) -> None:
        """The recorded storage of every tensor the graph uses, as buffer keys and bindings."""
        self._states = {s.state_id for s in self.graph.mutable_state}
        constant_keys: dict[tuple[int, vk.DType, vk.Layout], str] = {}
        self._tensors: dict[int, _Tensor] = {}
        for value_id in self.graph.used_tensor_ids():
            tensor = self.graph.values[value_id]
            if tensor.storage_dtype == vk.DType.INT64:
                raise GraphLoweringError(f"value {value_id} ({tensor.name or 'unnamed'}) is stored as int64; the GPU "
                                         f"kernels hold int64 tensors as int32 (the backend's storage-dtype pass "
                                         f"records that: compile the graph with vktrain.backend.passes)")
            root = tensor.storage_of if tensor.storage_of >= 0 else value_id
            view = None
            if tensor.view_strides:
                view = StridedView(tensor.shape, tensor.view_strides, tensor.view_offset)
            key = self._own_key(root, constant_keys)
            offset = self._shared[self.graph.values[root].name].offset if key.startswith("shared:") else tensor.mem_offset
            self._tensors[value_id] = _Tensor(key, offset, _round4(tensor.stored_nbytes), view)

    def _allocate_buffers(self) -> None:
        """One buffer per storage key: a memory object's planned size, else the largest tensor bound to it."""
        sizes = {f"mem{m.id}": _round4(m.size_bytes) for m in self.graph.memory_objects}
        for tensor in self._tensors.values():
            if not tensor.key.startswith("mem"):
                sizes[tensor.key] = max(sizes.get(tensor.key, 0), tensor.offset + tensor.nbytes)
        used = {tensor.key for tensor in self._tensors.values()}
        for key in sorted(k for k in used if k.startswith("shared:")):
            self._buffers[key] = self._shared[key.removeprefix("shared:")].buffer
            self._borrowed.add(key)
        for key, nbytes in sorted(sizes.items()):
            if key in used and key not in self._borrowed:
                self._buffers[key] = Buffer(self.device, nbytes, name=key, staging=self._staging)

    def _binding(self, value_id: int) -> BufferBinding:
        tensor = self._tensors[value_id]
        return BufferBinding(tensor.key, tensor.offset, tensor.nbytes)

    def _upload_constants(self) -> None:
        uploaded = set()
        self.synthetic_constant_bytes = 0  # bytes generated at load (vk.SyntheticConstant), for reports
        for value_id, placement in self._tensors.items():
            tensor = self.graph.values[value_id]
            if tensor.constant_id < 0 or placement.key in uploaded or placement.key in self._borrowed:
                continue
            # A synthetic constant is generated here (numpy, deterministic by its seed); the array is
            # dropped right after its upload, so at most one big constant is in host memory at a time.
            array = self.graph.constant_array(value_id)
            if self.graph.is_synthetic(tensor.constant_id):
                self.synthetic_constant_bytes += array.nbytes
            what = f"constant {tensor.name or value_id}"
            try:
                data = _to_stored_array(array, tensor, what)
            except ExecutorInputError as exc:
                raise GraphLoweringError(str(exc)) from None
            self._write(value_id, data)
            uploaded.add(placement.key)

    # ------------------------------------------------------------------------------ dispatches
    def _tensor_arg(self, value_id: int) -> TensorArg:
        tensor = self.graph.tensor(value_id)
        return TensorArg(value_id, self._binding(value_id), tensor.shape, tensor.dtype.numpy_dtype.name,
                         tensor.layout, self._tensors[value_id].view)

    def _decode(self, value_id: int, index: int, op: vk.OpCall) -> Any:
        value = self.graph.values[value_id]
        if isinstance(value, vk.TensorValue):
            return self._tensor_arg(value_id)
        if isinstance(value, vk.ValueListValue):
            items = [self.graph.values[item] for item in value.items]
            if not all(isinstance(item, vk.TensorValue) for item in items):
                raise GraphLoweringError(f"op {index} ({op.name}): value list {value_id} mixes tensors and scalars")
            return [self._tensor_arg(item) for item in value.items]
        return vk.decode_scalar(value)

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

    def _check_binding_sizes(self, context: OpContext, planned: list[Dispatch]) -> None:
        """Refuse a dispatch binding more than the max storage binding size, naming the graph tensor."""
        limit = self.limits.max_storage_buffer_range
        for dispatch in planned:
            for bound in dispatch.bindings:
                if bound.size is None or bound.size <= limit:
                    continue
                tensors = [t for t in [*context.args, *context.outputs] if isinstance(t, TensorArg)
                           and t.storage == bound.buffer and t.binding.offset < bound.offset + bound.size
                           and bound.offset < t.binding.offset + t.binding.size]
                names = ", ".join(f"{self.graph.tensor(t.value_id).name or f'value {t.value_id}'} "
                                  f"{t.dtype}{list(t.shape)}" for t in tensors) or f"buffer {bound.buffer!r}"
                raise context.fail(
                    f"dispatch {dispatch.name!r} binds tensor {names} over {bound.size} "
                    f"bytes, more than the max storage binding size of {limit} bytes, and its kernel cannot split "
                    f"it (the head's mm, the linear q4gsw ops, the embeddings, fused_ce, elementwise ops and copies "
                    f"split; see README "
                    f"'Picking a runtime')")

    def _plan_dispatches(self) -> list[Dispatch]:
        dispatches: list[Dispatch] = []
        self.tensor_core_ops: list[str] = []  # labels of the ops lowered to the coopmat kernels
        self._scratch_bytes = 0
        for index, (op, lowering) in enumerate(zip(self.ops, self._lowerings)):
            if op.outputs and all(self.graph.tensor(out).is_view for out in op.outputs):
                continue  # the output is its source's bytes: nothing to move
            label = f"{index}:{op.name}"
            args = [self._decode(arg, index, op) for arg in op.args]
            outputs = [self._tensor_arg(out) for out in op.outputs]
            context = OpContext(index, op, args, outputs, label, self._scratch(index), self.limits,
                                self.gemm_route, binding_limit_of(self.limits), self.profile)
            planned = lowering.lower(context)
            self._check_binding_sizes(context, planned)
            if any(d.shader.startswith(TENSOR_CORE_SHADER_PREFIX) for d in planned):
                self.tensor_core_ops.append(label)
            dispatches += planned
        if self._scratch_bytes:
            self._buffers[self.SCRATCH_KEY] = Buffer(self.device, self._scratch_bytes, name=self.SCRATCH_KEY,
                                                     staging=self._staging)
        for state in self.graph.mutable_state:
            if self._tensors[state.update_id].key == self._tensors[state.state_id].key:
                continue  # updated in place
            name = self.graph.tensor(state.state_id).name or f"state{state.state_id}"
            dispatches += copy_words(self._binding(state.state_id), self._binding(state.update_id),
                                     self._tensors[state.state_id].nbytes, label=f"state_update:{name}")
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
            data = _to_stored_array(array, tensor, f"input {name!r}")
            self._check_index_input(name, value_id, data)
            staged.append((value_id, data))
        for value_id, data in staged:
            self._write(value_id, data)
        self.program.replay()
        self._ran = True
        return [self._read(value_id) for value_id in self.graph.outputs]

    __call__ = run

    def _write(self, value_id: int, stored: np.ndarray) -> None:
        placement = self._tensors[value_id]
        self._buffers[placement.key].write(stored, placement.offset)

    def _read(self, value_id: int) -> np.ndarray:
        tensor, placement = self.graph.tensor(value_id), self._tensors[value_id]
        stored = self._buffers[placement.key].read(tensor.storage_dtype.numpy_dtype, tensor.shape, placement.offset)
        return stored.astype(tensor.dtype.numpy_dtype, copy=False)

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
        self._write(state.state_id, _to_stored_array(array, tensor, f"state {name!r}"))

    def initial_state(self, name: str) -> np.ndarray:
        """The value state `name` had when the graph was exported (zeros unless it has an initial constant)."""
        state = self._state(name)
        tensor = self.graph.tensor(state.state_id)
        if state.initial_constant_id < 0:
            return np.zeros(tensor.shape, tensor.dtype.numpy_dtype)
        data = vk.constant_bytes(self.graph.constants[state.initial_constant_id])  # generates a synthetic one
        return np.frombuffer(data, tensor.dtype.numpy_dtype, tensor.numel).reshape(tensor.shape).copy()

    def reset_state(self) -> None:
        """Every mutable state tensor this executor owns back to its initial value."""
        for name, state in self._state_by_name.items():
            if self._tensors[state.state_id].key not in self._borrowed:
                self._write_state(name, self.initial_state(name))

    def shared_constants(self) -> dict[str, SharedTensor]:
        """Named constant tensors this executor uploaded, by name, for another executor of the same program
        to bind (`shared`) where its constant holds the same bytes (a name read in two layouts is left out)."""
        self._check_open()
        found: dict[str, list[int]] = {}
        for value_id, placement in self._tensors.items():
            tensor = self.graph.values[value_id]
            if tensor.constant_id >= 0 and tensor.name and tensor.storage_of < 0 and placement.key not in self._borrowed:
                found.setdefault(tensor.name, []).append(value_id)
        return {name: SharedTensor(self._buffers[self._tensors[ids[0]].key], self._tensors[ids[0]].offset,
                                   self.graph.tensor(ids[0]))
                for name, ids in found.items() if len(ids) == 1}

    def constants_matching(self, graph: vk.VkGraph) -> dict[str, SharedTensor]:
        """This executor's named constants that `graph` (another method of the same program) holds byte for
        byte under the same name, shape, dtype and layout: for that graph's executor to bind (`shared`)
        rather than upload a second copy (the frozen base of eval, prefill and decode)."""
        theirs = self.shared_constants()
        same = {}
        for value in graph.values:
            if not (isinstance(value, vk.TensorValue) and value.constant_id >= 0 and value.name in theirs):
                continue
            owner = theirs[value.name]
            if (owner.tensor.shape, owner.tensor.dtype, owner.tensor.layout) != (value.shape, value.dtype, value.layout):
                continue
            if owner.tensor.storage_dtype != value.storage_dtype:
                continue
            mine = np.frombuffer(vk.stored_bytes(graph.constants[value.constant_id]), np.uint8)
            other = np.frombuffer(vk.stored_bytes(self.graph.constants[owner.tensor.constant_id]), np.uint8)
            if np.array_equal(mine, other):
                same[value.name] = owner
        return same

    def shared_state(self) -> dict[str, SharedTensor]:
        """Every mutable state tensor by name, for another executor of the same program to bind (`shared`)."""
        self._check_open()
        return {name: SharedTensor(self._buffers[self._tensors[state.state_id].key],
                                   self._tensors[state.state_id].offset, self.graph.tensor(state.state_id))
                for name, state in self._state_by_name.items()}

    # ------------------------------------------------------------------------------ introspection
    def storage_of(self, value_id: int) -> str:
        """The buffer key value `value_id` lives in ("mem3", "state0", "constant2", "value17", ...)."""
        return self._tensors[value_id].key

    def gemm_report(self) -> str:
        """The GEMM precision chosen at load and how many ops took the tensor cores (train's startup line)."""
        gemms = sum(op.name in GEMM_OPS for op in self.ops)
        report = f"{self.gemm_route.describe()}; {len(self.tensor_core_ops)} of {gemms} GEMM ops on {self.gemm_route.fp16_kernels}"
        kernel_report = getattr(self.device, "kernel_report", None)  # WebGPU: the WGSL feature bodies taken
        return report if kernel_report is None else f"{report}; {kernel_report()}"

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of every buffer this executor allocated, by key (not those it binds from another: `shared`)."""
        return {key: buffer.size for key, buffer in self._buffers.items() if key not in self._borrowed}

    # ------------------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.program is None:
            raise RuntimeError("this GraphExecutor was closed")

    def close(self) -> None:
        """Free the Program and every buffer (idempotent)."""
        if self.program is not None:
            self.program.destroy()
            self.program = None
        for key, buffer in self._buffers.items():
            if key not in self._borrowed:
                buffer.destroy()
        self._buffers.clear()

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["ExecutorInputError", "GraphExecutor", "GraphLoweringError", "SharedTensor"]

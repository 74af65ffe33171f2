"""Run an exported training-step .pte: the vktrain delegate on Vulkan, the rest of the program in numpy.

    runner = TrainingRunner.from_pte("step.pte")           # device=None opens Device() (VKTRAIN_DEVICE)
    loss = runner.step(token_ids, labels, hparams)         # int64 [B, S], int64 [B, S], float32 [5]
    lora = runner.lora_state()                              # {"model.layers.0.lora_A": array, ...}
    runner.read_state(name) / runner.write_state(name, array)   # checkpoints (FQNs the exporter recorded)

The .pte's execution plan is interpreted the way ExecuTorch's runtime does: its non-constant tensors
live in planned memory arenas (a tensor is a (memory id, offset) view, so ExecuTorch's memory-planned
views are free), a DelegateCall passes the delegate its inputs then its outputs, and KernelCalls outside
the delegate run in numpy. Only the instructions the built-in models can leave outside the delegate
are implemented (`CPU_KERNELS`: dtype / dim-order copies, clones, views); a program with any other
instruction is refused at load with "unsupported instruction <op>".

`n_valid` (the loss divisor, float32 []) is an input of the exported step; `step()` computes it as the
number of labels >= 0 unless given, so a caller accumulating gradients can pass its own.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from vktrain.serialization import deserialize_blob

from vktrain.contract import BACKEND_ID, HPARAMS, LABELS, MODEL_PREFIX, N_VALID, STEP_INPUTS, TOKEN_IDS
from vktrain.runtime.vk.errors import RuntimeErrorBase
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.runtime.program.pte import (
    Bool,
    DelegateCall,
    Double,
    ExecutionPlan,
    FreeCall,
    Int,
    IntList,
    KernelCall,
    MoveCall,
    Null,
    PteFile,
    Tensor,
)
from vktrain.runtime.program.pte_schema.executorch_flatbuffer.ScalarType import ScalarType

LORA_SUFFIXES = (".lora_A", ".lora_B")

_NUMPY_SCALAR_TYPES = {
    ScalarType.BYTE: np.uint8, ScalarType.CHAR: np.int8, ScalarType.SHORT: np.int16, ScalarType.INT: np.int32,
    ScalarType.LONG: np.int64, ScalarType.HALF: np.float16, ScalarType.FLOAT: np.float32,
    ScalarType.DOUBLE: np.float64, ScalarType.BOOL: np.bool_,
}


class UnsupportedProgramError(RuntimeErrorBase, ValueError):
    """The .pte holds something this runner cannot execute (instruction, delegate count, input names)."""


# ------------------------------------------------------------------------------------------------
# CPU kernels for instructions outside the delegate (ExecuTorch out-variant convention: the schema's
# arguments, then the out tensor, then the returned value, which is the out tensor again)
# ------------------------------------------------------------------------------------------------

def _copy_into(out: np.ndarray, source: np.ndarray) -> None:
    if out.size != source.size:
        raise UnsupportedProgramError(f"copy of {source.size} elements into a tensor of {out.size}")
    # Same-shape copy; dtype conversion follows numpy's (float -> int truncates toward zero, like torch).
    out[...] = source.reshape(out.shape).astype(out.dtype, copy=False)


def _dim_order_copy(values: list, args: tuple[int, ...]) -> None:
    # dim_order_ops::_to_dim_order_copy.out(self, non_blocking, dim_order, out) and
    # _clone_dim_order.out(self, non_blocking, dim_order, out): contiguous dim orders only.
    source, dim_order, out = values[args[0]], values[args[2]], values[args[3]]
    if dim_order is not None and tuple(dim_order) != tuple(range(out.ndim)):
        raise UnsupportedProgramError(f"dim order {tuple(dim_order)} (only contiguous tensors are supported)")
    _copy_into(out, source)


def _copy_first_into_out(values: list, args: tuple[int, ...]) -> None:
    # aten::clone.out(self, memory_format, out), aten::_to_copy.out(self, non_blocking, memory_format, out),
    # aten::view_copy.out(self, size, out): a copy of `self` into `out` (shape and dtype from `out`).
    _copy_into(values[args[-2]], values[args[0]])


CPU_KERNELS: dict[str, Callable[[list, tuple[int, ...]], None]] = {
    "dim_order_ops::_to_dim_order_copy.out": _dim_order_copy,
    "dim_order_ops::_clone_dim_order.out": _dim_order_copy,
    "aten::_to_copy.out": _copy_first_into_out,
    "aten::clone.out": _copy_first_into_out,
    "aten::view_copy.out": _copy_first_into_out,
}
# executorch_prim::et_view(self, size, out): `out` becomes a view of `self` (no data of its own).
_ET_VIEW = "executorch_prim::et_view.default"


def _kind(dtype: np.dtype) -> str:
    """'int' for signed / unsigned integers, else numpy's kind ('f' float, 'b' bool, ...)."""
    return "int" if dtype.kind in "iu" else dtype.kind


class ProgramInterpreter:
    """Executes one execution plan: arenas for planned tensors, numpy for KernelCalls, `delegate` for the
    DelegateCall(s). `delegate(index, args) -> outputs` runs delegate `index`; `args` are the call's
    values (inputs, then the output tensors it fills) and its results land in the last len(outputs)."""

    def __init__(self, pte: PteFile, plan: ExecutionPlan,
                 delegate: Optional[Callable[[int, list[Any]], list[np.ndarray]]] = None):
        self.pte = pte
        self.plan = plan
        self._delegate = delegate
        for index, instruction in enumerate(plan.instructions):
            if isinstance(instruction, KernelCall):
                name = plan.operators[instruction.op_index].qualified_name
                if name not in CPU_KERNELS and name != _ET_VIEW:
                    raise UnsupportedProgramError(
                        f"unsupported instruction {name} (instruction {index} of plan {plan.name!r}): vktrain runs "
                        f"only the vktrain delegate and these CPU ops: {', '.join(sorted(CPU_KERNELS) + [_ET_VIEW])}")
            elif isinstance(instruction, DelegateCall):
                if delegate is None:
                    raise UnsupportedProgramError(f"instruction {index} calls delegate {instruction.delegate_index}, "
                                                  f"but no delegate runner was given")
            elif not isinstance(instruction, (MoveCall, FreeCall)):
                raise UnsupportedProgramError(f"unsupported instruction {type(instruction).__name__} (instruction "
                                              f"{index} of plan {plan.name!r}): control flow is not supported")
        self._arenas = [bytearray(int(size)) for size in plan.non_const_buffer_sizes]
        self._initial_values = [self._materialize(index, value) for index, value in enumerate(plan.values)]

    def _materialize(self, index: int, value: Any) -> Any:
        if isinstance(value, Tensor):
            dtype = _NUMPY_SCALAR_TYPES.get(value.scalar_type)
            if dtype is None:
                raise UnsupportedProgramError(f"value {index} has scalar type {value.scalar_type_name}, not supported on the CPU")
            if tuple(value.dim_order) != tuple(range(len(value.sizes))):
                raise UnsupportedProgramError(f"value {index} has dim order {value.dim_order}; only contiguous tensors")
            count = math.prod(value.sizes)
            if value.allocation_info is not None:
                memory = value.allocation_info
                if not 0 <= memory.memory_id < len(self._arenas):
                    raise UnsupportedProgramError(f"value {index} is planned into memory {memory.memory_id}, the plan "
                                                  f"has {len(self._arenas)} arenas")
                return np.frombuffer(self._arenas[memory.memory_id], dtype, count,
                                     memory.memory_offset).reshape(value.sizes)
            data = self.pte.tensor_data(value)
            if data is None:
                return None  # a tensor without storage (et_view output): bound when its view runs
            return np.frombuffer(data, dtype, count).reshape(value.sizes)
        if isinstance(value, Null):
            return None
        if isinstance(value, Int):
            return value.int_val
        if isinstance(value, Bool):
            return value.bool_val
        if isinstance(value, Double):
            return value.double_val
        if isinstance(value, IntList):
            # ExecuTorch boxes list items: each item is the index of an Int value.
            items = []
            for item in value.items:
                boxed = self.plan.values[item] if 0 <= item < len(self.plan.values) else None
                if not isinstance(boxed, Int):
                    raise UnsupportedProgramError(f"value {index}: int list item {item} is not an Int value")
                items.append(boxed.int_val)
            return tuple(items)
        return value

    def run(self, inputs: list[np.ndarray]) -> list[Any]:
        plan = self.plan
        if len(inputs) != len(plan.inputs):
            raise ExecutorInputError(f"plan {plan.name!r} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        values = list(self._initial_values)
        for value_index, array in zip(plan.inputs, inputs):
            target = values[value_index]
            array = np.asarray(array)
            if isinstance(target, np.ndarray):
                if array.shape != target.shape:
                    raise ExecutorInputError(f"plan input value {value_index} has shape {list(target.shape)}, got "
                                             f"{list(array.shape)}")
                if _kind(array.dtype) != _kind(target.dtype):
                    raise ExecutorInputError(f"plan input value {value_index} holds {target.dtype}, got an array of "
                                             f"{array.dtype} (no silent float <-> int conversion)")
                target[...] = array
            else:
                values[value_index] = array
        for instruction in plan.instructions:
            if isinstance(instruction, KernelCall):
                name = plan.operators[instruction.op_index].qualified_name
                if name == _ET_VIEW:
                    source, size, out = instruction.args[:3]
                    values[out] = values[source].reshape(values[size])
                else:
                    CPU_KERNELS[name](values, instruction.args)
            elif isinstance(instruction, DelegateCall):
                results = self._delegate(instruction.delegate_index, [values[a] for a in instruction.args])
                outputs = instruction.args[len(instruction.args) - len(results):]
                for value_index, result in zip(outputs, results):
                    target = values[value_index]
                    if isinstance(target, np.ndarray):
                        target[...] = result
                    else:
                        values[value_index] = result
            elif isinstance(instruction, MoveCall):
                values[instruction.move_to] = values[instruction.move_from]
            # FreeCall: arenas are reused by the memory plan; nothing to free.
        # Outputs may live in an arena the next run overwrites: hand out copies.
        return [np.array(values[index]) if isinstance(values[index], np.ndarray) else values[index]
                for index in plan.outputs]


class TrainingRunner:
    """One exported LoRA training step (see the module docstring). Build with `from_pte`."""

    def __init__(self, pte: PteFile, device=None, *, method: str = "forward", timing: bool = True):
        self.pte = pte
        self.plan = pte.execution_plan(method)
        # Every instruction is checked (unsupported ones refused) before anything else, GPU work included.
        self._interpreter = ProgramInterpreter(pte, self.plan, self._run_delegate)
        delegates = self.plan.delegates
        if len(delegates) != 1 or delegates[0].id != BACKEND_ID:
            raise UnsupportedProgramError(
                f"{pte.source}: expected exactly one {BACKEND_ID} delegate in plan {method!r}, found "
                f"{[d.id for d in delegates] or 'none'} (was the program lowered with VktrainPartitioner?)")
        calls = [i for i in self.plan.instructions if isinstance(i, DelegateCall)]
        if len(calls) != 1:
            raise UnsupportedProgramError(f"{pte.source}: the delegate is called {len(calls)} times; expected once")
        if len(self.plan.outputs) != 1:
            raise UnsupportedProgramError(f"{pte.source}: a training step returns the loss only; plan {method!r} "
                                          f"has {len(self.plan.outputs)} outputs")
        self.graph = deserialize_blob(bytes(delegates[0].data))
        n_in, n_out = len(self.graph.inputs), len(self.graph.outputs)
        if len(calls[0].args) != n_in + n_out:
            raise UnsupportedProgramError(
                f"{pte.source}: the delegate call passes {len(calls[0].args)} values, its graph has {n_in} inputs "
                f"and {n_out} outputs")
        self._input_names = self._plan_input_names(calls[0])

        self._owns_device = device is None
        if device is None:
            from vktrain.runtime.vk.device import Device
            device = Device()
        self.device = device
        try:
            self.executor = GraphExecutor(device, self.graph, timing=timing)
        except BaseException:
            if self._owns_device:
                device.close()
            raise

    @classmethod
    def from_pte(cls, path: Union[str, os.PathLike], device=None, **options: Any) -> "TrainingRunner":
        """PteFile -> the single vktrain delegate -> its blob -> VkGraph -> GraphExecutor."""
        return cls(PteFile.load(path), device, **options)

    def _plan_input_names(self, call: DelegateCall) -> list[str]:
        """Name of each plan input: the delegate graph input it feeds (through the DelegateCall args)."""
        graph_inputs = {value: self.graph.tensor(self.graph.inputs[i]).name
                        for i, value in enumerate(call.args[:len(self.graph.inputs)])}
        names = []
        for position, value in enumerate(self.plan.inputs):
            name = graph_inputs.get(value)
            if name not in STEP_INPUTS:
                raise UnsupportedProgramError(
                    f"{self.pte.source}: plan input {position} (value {value}) "
                    + (f"feeds delegate input {name!r}" if name else "does not feed the delegate directly")
                    + f"; a training step takes {', '.join(STEP_INPUTS)}")
            names.append(name)
        missing = [n for n in (TOKEN_IDS, LABELS, HPARAMS) if n not in names]
        if missing:
            raise UnsupportedProgramError(f"{self.pte.source}: the program has no input(s) {missing}; is it a training step?")
        return names

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """(batch, seq) of the token_ids the program was exported for."""
        position = self._input_names.index(TOKEN_IDS)
        return tuple(self.plan.values[self.plan.inputs[position]].sizes)

    @property
    def vocab_size(self) -> int:
        """Largest token id / label + 1 the program accepts (embedding rows and logits classes)."""
        limits = self.executor.index_limits
        bounds = [limits[name] for name in (TOKEN_IDS, LABELS) if name in limits]
        if not bounds:
            raise AttributeError("the program's token_ids / labels index no embedding or fused_ce")
        return min(bounds)

    def _run_delegate(self, index: int, args: list) -> list[np.ndarray]:
        return self.executor.run(*args[:len(self.graph.inputs)])

    # ------------------------------------------------------------------------------ training
    @property
    def input_names(self) -> list[str]:
        return list(self._input_names)

    def step(self, token_ids: Any, labels: Any, hparams: Any, n_valid: Optional[float] = None) -> float:
        """One training step on the GPU: forward, backward, AdamW on every LoRA tensor. Returns the loss.

        token_ids / labels int [B, S] (labels < 0 are ignored), hparams float32 [5] = [lr, beta1, beta2,
        eps, weight_decay]; n_valid defaults to the number of labels >= 0.
        """
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            raise ExecutorInputError(f"labels must be integers, got {labels.dtype}")
        if n_valid is None:
            n_valid = float(np.count_nonzero(labels >= 0))
        by_name = {TOKEN_IDS: np.asarray(token_ids), LABELS: labels,
                   HPARAMS: np.asarray(hparams, dtype=np.float32), N_VALID: np.float32(n_valid)}
        (loss,) = self._interpreter.run([by_name[name] for name in self._input_names])
        return float(np.asarray(loss).reshape(()))

    # ------------------------------------------------------------------------------ state
    @property
    def state_names(self) -> list[str]:
        return self.executor.state_names

    def read_state(self, name: str) -> np.ndarray:
        return self.executor.read_state(name)

    def write_state(self, name: str, array: Any) -> None:
        self.executor.write_state(name, array)

    def lora_state(self) -> dict[str, np.ndarray]:
        """The LoRA tensors by exporter FQN ("model.<layer>.lora_A" / ".lora_B"; not their AdamW moments)."""
        return {name: self.read_state(name) for name in self.state_names
                if name.startswith(MODEL_PREFIX) and name.endswith(LORA_SUFFIXES)}

    def state_dict(self) -> dict[str, np.ndarray]:
        """All mutable state (adapters, AdamW moments, step) by FQN: a checkpoint."""
        return {name: self.read_state(name) for name in self.state_names}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` checkpoint; every state tensor must be present."""
        missing = sorted(set(self.state_names) - set(state))
        unknown = sorted(set(state) - set(self.state_names))
        if missing or unknown:
            raise KeyError(f"checkpoint does not match the program's state: missing {missing}, unknown {unknown}")
        for name in self.state_names:
            self.write_state(name, state[name])

    def timings(self) -> list[tuple[str, float]] | None:
        return self.executor.timings()

    # ------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        self.executor.close()
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> "TrainingRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["BACKEND_ID", "CPU_KERNELS", "ProgramInterpreter", "TrainingRunner", "UnsupportedProgramError"]

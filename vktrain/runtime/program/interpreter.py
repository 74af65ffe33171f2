"""The .pte interpreter without the training state: ExecuTorch's execution plan run with the vktrain
delegate on the device and the instructions outside it in numpy, and the load-time checks of a training
step's plan (`verify_training_program`). TrainingRunner (runner.py) and EvalMethod (evaluation.py) build
on it; GenerationRunner (vktrain/generate/runner.py) runs its decode methods with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from vktrain.contract import HPARAM_NAMES, HPARAMS, LABELS, STEP_INPUTS, TOKEN_IDS
from vktrain.runtime.delegate.executor import ExecutorInputError
from vktrain.serialization.pte import (
    NUMPY_SCALAR_TYPES,
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
from vktrain.serialization.verify import (
    UnsupportedProgramError, VerificationError, load_delegate_graph, verify_plan
)
from vktrain.runtime.program.step_inputs import step_input_specs
from vktrain.serialization import graph as g


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


def check_instructions_supported(pte: PteFile, plan: ExecutionPlan, has_delegate: bool) -> None:
    """Every instruction is one this interpreter runs (CPU_KERNELS, et_view, a DelegateCall when a delegate
    runner is given, moves and frees)."""
    for index, instruction in enumerate(plan.instructions):
        if isinstance(instruction, KernelCall):
            name = plan.operators[instruction.op_index].qualified_name
            if name not in CPU_KERNELS and name != _ET_VIEW:
                raise UnsupportedProgramError(
                    f"{pte.source}: unsupported instruction {name} (instruction {index} of plan {plan.name!r}): vktrain "
                    f"runs only the vktrain delegate and these CPU ops: {', '.join(sorted(CPU_KERNELS) + [_ET_VIEW])}")
        elif isinstance(instruction, DelegateCall):
            if not has_delegate:
                raise UnsupportedProgramError(f"{pte.source}: instruction {index} calls delegate "
                                              f"{instruction.delegate_index}, but no delegate runner was given")
        elif not isinstance(instruction, (MoveCall, FreeCall)):
            raise UnsupportedProgramError(f"{pte.source}: unsupported instruction {type(instruction).__name__} "
                                          f"(instruction {index} of plan {plan.name!r}): control flow is not supported")


def check_storageless_tensors(pte: PteFile, plan: ExecutionPlan) -> None:
    """A tensor with neither planned memory nor data is bound when it is computed; only an et_view output
    is (a view of its input). Any other would be a plan input or result the memory plan forgot."""
    views = {instruction.args[2] for instruction in plan.instructions if isinstance(instruction, KernelCall)
             and plan.operators[instruction.op_index].qualified_name == _ET_VIEW and len(instruction.args) >= 3}
    for index, value in enumerate(plan.values):
        if (isinstance(value, Tensor) and value.allocation_info is None and value.data_buffer_idx == 0
                and index not in views):
            raise VerificationError(f"{pte.source}: plan {plan.name!r} value {index} ({value.scalar_type_name}"
                                    f"{list(value.sizes)}) has neither allocation_info nor data (data_buffer_idx 0); "
                                    f"only the output of {_ET_VIEW} may", check_storageless_tensors.__name__)


class ProgramInterpreter:
    """Executes one execution plan: arenas for planned tensors, numpy for KernelCalls, `delegate` for the
    DelegateCall(s). `delegate(index, args) -> outputs` runs delegate `index`; `args` are the call's
    values (inputs, then the output tensors it fills) and its results land in the last len(outputs).
    The plan is verified first; each arena is allocated with what its tensors need, capped by
    `host_memory_limit` (default: this machine's RAM)."""

    def __init__(self, pte: PteFile, plan: ExecutionPlan,
                 delegate: Optional[Callable[[int, list[Any]], list[np.ndarray]]] = None, *,
                 host_memory_limit: Optional[int] = None):
        self.pte = pte
        self.plan = plan
        self._delegate = delegate
        check_instructions_supported(pte, plan, delegate is not None)
        check_storageless_tensors(pte, plan)
        arena_needs = verify_plan(pte, plan, host_memory_limit)
        self._arenas = [bytearray(size) for size in arena_needs]
        self._initial_values = [self._materialize(index, value) for index, value in enumerate(plan.values)]

    def _materialize(self, index: int, value: Any) -> Any:
        if isinstance(value, Tensor):
            dtype = NUMPY_SCALAR_TYPES[value.scalar_type]  # verify_plan refused other dtypes, dim orders
            count = math.prod(value.sizes)
            if value.allocation_info is not None:
                memory = value.allocation_info
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
                    raise UnsupportedProgramError(f"{self.pte.source}: value {index}: int list item {item} is not an Int value")
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


@dataclass(frozen=True)
class VerifiedTrainingProgram:
    """A training step whose .pte passed every host-side check (nothing allocated yet)."""
    plan: ExecutionPlan
    graph: g.VkGraph  # the vktrain delegate's graph
    input_names: list[str]  # name of each plan input: the delegate graph input it feeds


def verify_method(pte: PteFile, method: str, *, what: str, verify_constants: bool = True,
                  host_memory_limit: Optional[int] = None) -> VerifiedTrainingProgram:
    """Every host-side check of one of the .pte's methods that computes a loss (the training step, its eval and
    accumulate methods) before anything is allocated (see verify.py); its inputs may take any names (a user
    module's method takes its loss's inputs). `what` names the method in errors ("an eval method")."""
    plan = pte.execution_plan(method)
    check_instructions_supported(pte, plan, has_delegate=True)
    check_storageless_tensors(pte, plan)
    verify_plan(pte, plan, host_memory_limit)
    call, graph = load_delegate_graph(pte, plan, verify_constants=verify_constants)
    check_loss_output(pte, plan, call, graph)
    names = plan_input_names(pte, plan, call, graph, accepted=None, required=(), what=what)
    return VerifiedTrainingProgram(plan, graph, names)


def verify_training_program(pte: PteFile, method: str = "forward", *, verify_constants: bool = True,
                            host_memory_limit: Optional[int] = None) -> VerifiedTrainingProgram:
    """Every check a training step's .pte must pass before the runner allocates anything (verify_method);
    the device's memory is checked once the device is open (check_device_memory). hparams is optional: without
    it the program's hyper-parameters are baked (TrainingRunner.takes_hparams)."""
    program = verify_method(pte, method, what="a training step", verify_constants=verify_constants,
                            host_memory_limit=host_memory_limit)
    check_hparams_input(pte, program.plan, program.input_names)
    return program


def check_hparams_input(pte: PteFile, plan: ExecutionPlan, names: list[str]) -> None:
    """An `hparams` input is the float32 [len(HPARAM_NAMES)] tensor adamw reads."""
    if HPARAMS not in names:
        return
    spec = step_input_specs(plan, names)[HPARAMS]
    if spec.shape != (len(HPARAM_NAMES),) or spec.dtype != np.float32:
        raise UnsupportedProgramError(f"{pte.source}: plan {plan.name!r} input {HPARAMS!r} is {spec.describe()}; "
                                      f"expected float32[{len(HPARAM_NAMES)}] ({', '.join(HPARAM_NAMES)})")


def check_loss_output(pte: PteFile, plan: ExecutionPlan, call: DelegateCall, graph: g.VkGraph) -> None:
    """A training step returns one value, the loss: a float32 [] the delegate computes."""
    if len(plan.outputs) != 1:
        raise UnsupportedProgramError(f"{pte.source}: a training step returns the loss only; plan {plan.name!r} "
                                      f"has {len(plan.outputs)} outputs")
    (output,) = plan.outputs
    delegate_outputs = call.args[len(graph.inputs):]
    value = plan.values[output]
    is_float_scalar = (isinstance(value, Tensor) and value.sizes == ()
                       and NUMPY_SCALAR_TYPES.get(value.scalar_type) is np.float32)
    if output not in delegate_outputs or not is_float_scalar:
        found = f"{value.scalar_type_name}{list(value.sizes)}" if isinstance(value, Tensor) else type(value).__name__
        if output in delegate_outputs and isinstance(value, Tensor) and len(value.sizes) >= 2:  # logits [B, S, V]
            raise UnsupportedProgramError(f"{pte.source} is not a training step: plan {plan.name!r} returns {found} "
                                          f"(a forward program's logits, e.g. vktrain export --program forward or "
                                          f"forward-base), not a loss; export the model with --program train-step "
                                          f"(the default)")
        raise VerificationError(f"{pte.source}: plan {plan.name!r} output is value {output} ({found}); expected the "
                                f"loss, a FLOAT[] the delegate returns (one of values {list(delegate_outputs)})",
                                check_loss_output.__name__)


def plan_input_names(pte: PteFile, plan: ExecutionPlan, call: DelegateCall, graph: g.VkGraph, *,
                     accepted: Optional[tuple[str, ...]] = STEP_INPUTS,
                     required: tuple[str, ...] = (TOKEN_IDS, LABELS, HPARAMS), what: str = "a training step") -> list[str]:
    """Name of each plan input: the delegate graph input it feeds (through the DelegateCall args); every
    one in `accepted` (None: any name, but each must feed the delegate), all of `required` present."""
    graph_inputs = {value: graph.tensor(graph.inputs[i]).name for i, value in enumerate(call.args[:len(graph.inputs)])}
    names = []
    for position, value in enumerate(plan.inputs):
        name = graph_inputs.get(value)
        if name is None or (accepted is not None and name not in accepted):
            raise UnsupportedProgramError(
                f"{pte.source}: plan {plan.name!r} input {position} (value {value}) "
                + (f"feeds delegate input {name!r}" if name else "does not feed the delegate directly")
                + (f"; {what} takes {', '.join(accepted)}" if accepted is not None
                   else f"; every input of {what} must be a delegate input"))
        if name in names:
            raise UnsupportedProgramError(f"{pte.source}: plan inputs {names.index(name)} and {position} both feed "
                                          f"delegate input {name!r}")
        names.append(name)
    missing = [n for n in required if n not in names]
    if missing:
        raise UnsupportedProgramError(f"{pte.source}: plan {plan.name!r} has no input(s) {missing}; is it {what}?")
    return names

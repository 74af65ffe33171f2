"""Run an exported training-step .pte: the vktrain delegate on Vulkan, the rest of the program in numpy.

    runner = TrainingRunner.from_pte("step.pte")           # device=None opens Device() (VKTRAIN_DEVICE)
    runner = TrainingRunner.from_pte("step.pte", runtime="webgpu")   # the WebGPU device layer instead
    loss = runner.step(token_ids, labels, hparams)         # int64 [B, S], int64 [B, S], float32 [5]
    loss = runner.step_inputs({"x": x, "target": y}, hparams)   # any module's step, inputs by name
    lora = runner.lora_state()                              # {"model.layers.0.lora_A": array, ...}
    runner.read_state(name) / runner.write_state(name, array)   # checkpoints (FQNs the exporter recorded)
    guard = runner.state_guard()                            # device backups + NaN/inf check (train_loop.py)

The .pte's execution plan is interpreted the way ExecuTorch's runtime does: its non-constant tensors
live in planned memory arenas (a tensor is a (memory id, offset) view, so ExecuTorch's memory-planned
views are free), a DelegateCall passes the delegate its inputs then its outputs, and KernelCalls outside
the delegate run in numpy. Only the instructions the built-in models can leave outside the delegate
are implemented (`CPU_KERNELS`: dtype / dim-order copies, clones, views); a program with any other
instruction is refused at load with "unsupported instruction <op>".

Loading verifies everything first (vktrain/runtime/program/verify.py, `verify_training_program`): the
plan's tensors and arenas, the delegate blob's integrity and its I/O against the plan, and what the
graph will allocate against the device's memory, before the arenas or any device buffer exist.

Two entry points. `step_inputs(inputs, hparams)` runs any exported step (vktrain.export.export_training_step
of any nn.Module): `inputs` maps each of the program's input names but hparams (`input_names`: the loss
function's parameters) to an array, checked against the program's shape and dtype (`input_specs`;
vktrain/runtime/program/step_inputs.py). `step(token_ids, labels, hparams, n_valid)` is its case for the
token models (`is_token_step`): `n_valid` (the loss divisor, float32 []) is an input of their step; `step()`
computes it as the number of labels >= 0 unless given, so a caller accumulating gradients can pass its own.

A step without an `hparams` input (one written with upstream's et_vk ops, vktrain.export.etvk) has its
hyper-parameters baked (the blob's metadata METADATA_BAKED_SCALARS lists them): `takes_hparams` is False
and `step()` / `step_inputs()` must be called without hparams.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from vktrain.contract import (BACKEND_ID, HPARAM_NAMES, HPARAMS, LABELS, MODEL_PREFIX, N_VALID, PRECISION_AUTO,
                              STEP_INPUTS, TOKEN_IDS)
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.runtime.delegate.kernels.coopmat import PrecisionPolicyError
from vktrain.runtime.program.pte import (
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
from vktrain.runtime.runtimes import device_for
from vktrain.runtime.program.verify import (
    UnsupportedProgramError,
    VerificationError,
    check_device_memory,
    device_memory_bytes,
    load_delegate_graph,
    verify_plan,
)
from vktrain.runtime.program.step_inputs import StepInput, check_input_names, checked_input, step_input_specs
from vktrain.serialization import graph as g

LORA_SUFFIXES = (".lora_A", ".lora_B")


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


def verify_training_program(pte: PteFile, method: str = "forward", *, verify_constants: bool = True,
                            host_memory_limit: Optional[int] = None) -> VerifiedTrainingProgram:
    """Every check a training step's .pte must pass before the runner allocates anything (see verify.py);
    the device's memory is checked once the device is open (check_device_memory)."""
    plan = pte.execution_plan(method)
    check_instructions_supported(pte, plan, has_delegate=True)
    check_storageless_tensors(pte, plan)
    verify_plan(pte, plan, host_memory_limit)
    call, graph = load_delegate_graph(pte, plan, verify_constants=verify_constants)
    check_loss_output(pte, plan, call, graph)
    # Any names (a user module's step takes its loss's inputs); hparams is optional: without it the
    # program's hyper-parameters are baked (TrainingRunner.takes_hparams).
    names = plan_input_names(pte, plan, call, graph, accepted=None, required=())
    check_hparams_input(pte, plan, names)
    return VerifiedTrainingProgram(plan, graph, names)


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


class TrainingRunner:
    """One exported LoRA training step (see the module docstring). Build with `from_pte`.

    `verify_constants=False` skips hashing the delegate's constants at load (the graph checksum and every
    other check still run); the memory limits default to this machine's RAM and the device's largest
    memory heap. `precision` is the GEMM precision policy (docs/PRECISION.md; `emulate_tensor_cores`:
    GraphExecutor's test path). `runtime` ("vulkan" or "webgpu"; vktrain.runtime.runtimes) picks the device
    layer to open when `device` is None (default vulkan); a device given must be of it. `max_binding_bytes`:
    GraphExecutor's (a lower max storage binding size to plan for, e.g. a browser's 128 MiB)."""

    def __init__(self, pte: PteFile, device=None, *, method: str = "forward", timing: bool = True,
                 verify_constants: bool = True, host_memory_limit: Optional[int] = None,
                 device_memory_limit: Optional[int] = None, precision: str = PRECISION_AUTO,
                 emulate_tensor_cores: bool = False, runtime: Optional[str] = None,
                 max_binding_bytes: Optional[int] = None):
        self.pte = pte
        program = verify_training_program(pte, method, verify_constants=verify_constants,
                                          host_memory_limit=host_memory_limit)
        self.plan, self.graph, self._input_names = program.plan, program.graph, program.input_names
        self._input_specs = step_input_specs(self.plan, self._input_names)
        self._interpreter = ProgramInterpreter(pte, self.plan, self._run_delegate, host_memory_limit=host_memory_limit)
        self._eval = None  # the eval method, loaded by the first evaluate()
        self._eval_options = dict(verify_constants=verify_constants, host_memory_limit=host_memory_limit,
                                  device_memory_limit=device_memory_limit)

        device, self._owns_device = device_for(device, runtime)
        self.device = device
        try:
            check_device_memory(pte.source, self.graph, device_memory_bytes(device) if device_memory_limit is None
                                else device_memory_limit)
            try:
                self.executor = GraphExecutor(device, self.graph, timing=timing, precision=precision,
                                              emulate_tensor_cores=emulate_tensor_cores,
                                              max_binding_bytes=max_binding_bytes)
            except PrecisionPolicyError as exc:
                raise PrecisionPolicyError(f"{pte.source}: {exc}") from None
        except BaseException:
            if self._owns_device:
                device.close()
            raise

    @classmethod
    def from_pte(cls, path: Union[str, os.PathLike], device=None, **options: Any) -> "TrainingRunner":
        """PteFile -> the single vktrain delegate -> its blob -> VkGraph -> GraphExecutor."""
        return cls(PteFile.load(path), device, **options)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """(batch, seq) of the token_ids the program was exported for (a token step's only)."""
        if TOKEN_IDS not in self._input_specs:
            raise AttributeError(f"{self.pte.source} has no {TOKEN_IDS} input (its inputs: {self.input_names})")
        return self._input_specs[TOKEN_IDS].shape

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
        """The program's inputs in order, hparams included (each named after the delegate input it feeds)."""
        return list(self._input_names)

    @property
    def input_specs(self) -> dict[str, StepInput]:
        """name -> StepInput (shape, dtype) of every input step_inputs takes: all but hparams."""
        return {name: spec for name, spec in self._input_specs.items() if name != HPARAMS}

    @property
    def takes_hparams(self) -> bool:
        """False when the program has no hparams input: its hyper-parameters are baked into it."""
        return HPARAMS in self._input_names

    @property
    def is_token_step(self) -> bool:
        """True for the token models' step: inputs token_ids, labels (and hparams, n_valid), which
        `step()` takes; any other step runs through `step_inputs()`."""
        names = set(self._input_names)
        return {TOKEN_IDS, LABELS} <= names <= set(STEP_INPUTS)

    def step_inputs(self, inputs: Union[Mapping[str, Any], Sequence[Any]], hparams: Any = None) -> float:
        """One training step on the GPU of any exported step program. Returns the loss.

        `inputs`: an array for each input but hparams, by name (exactly `input_specs`' names) or as a
        sequence in the program's order; each must have the program's shape and a dtype that converts to
        the program's exactly (step_inputs.py). hparams float32 [5] = [lr, beta1, beta2, eps,
        weight_decay] (None, and only None, for a program whose hyper-parameters are baked)."""
        if (hparams is None) == self.takes_hparams:
            raise ExecutorInputError(f"{self.pte.source}: " + (
                "the program takes an hparams input [lr, beta1, beta2, eps, weight_decay]; none was given"
                if self.takes_hparams else "the program's hyper-parameters are baked (it has no hparams input); "
                "it cannot take hparams"))
        specs = self.input_specs
        if not isinstance(inputs, Mapping):
            inputs = list(inputs)
            if len(inputs) != len(specs):
                raise ExecutorInputError(f"{self.pte.source}: the step takes {len(specs)} inputs {list(specs)} (and "
                                         f"hparams, given apart), got a sequence of {len(inputs)}")
            inputs = dict(zip(specs, inputs))
        check_input_names(specs, inputs, str(self.pte.source))
        by_name = {name: checked_input(spec, inputs[name], str(self.pte.source)) for name, spec in specs.items()}
        if self.takes_hparams:
            by_name[HPARAMS] = checked_input(self._input_specs[HPARAMS], np.asarray(hparams, dtype=np.float32),
                                             str(self.pte.source))
        (loss,) = self._interpreter.run([by_name[name] for name in self._input_names])
        return float(np.asarray(loss).reshape(()))

    def step(self, token_ids: Any, labels: Any, hparams: Any = None, n_valid: Optional[float] = None) -> float:
        """One training step on the GPU: forward, backward, AdamW on every LoRA tensor. Returns the loss.

        token_ids / labels int [B, S] (labels < 0 are ignored), hparams float32 [5] = [lr, beta1, beta2,
        eps, weight_decay] (None, and only None, for a program whose hyper-parameters are baked);
        n_valid defaults to the number of labels >= 0. The token models' case of step_inputs().
        """
        if not self.is_token_step:
            raise ExecutorInputError(f"{self.pte.source}: step() takes a token model's token_ids and labels; this "
                                     f"program's inputs are {self.input_names}: call step_inputs()")
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            raise ExecutorInputError(f"labels must be integers, got {labels.dtype}")
        if n_valid is None:
            n_valid = float(np.count_nonzero(labels >= 0))
        by_name = {TOKEN_IDS: token_ids, LABELS: labels, N_VALID: np.float32(n_valid)}
        return self.step_inputs({name: by_name[name] for name in self.input_specs}, hparams)

    def evaluate(self, token_ids: Any, labels: Any) -> tuple[float, int]:
        """(loss summed over the labels >= 0, their count) of one batch, by the .pte's eval method on the
        current adapters; no state changes. The eval method is loaded on first use (EvalMethod)."""
        return self.eval_method().loss_sum(token_ids, labels)

    def evaluate_inputs(self, inputs: Mapping[str, Any]) -> float:
        """The .pte's eval method's loss on one batch of named inputs (`eval_method().input_specs`), on the
        current trained state; no state changes. The case of any module's step (step_inputs)."""
        return self.eval_method().loss(inputs)

    def eval_method(self):
        """The .pte's eval method bound to this step's state (an EvalMethod), loaded on first use."""
        if self._eval is None:
            from vktrain.runtime.program.evaluation import EvalMethod

            self._eval = EvalMethod(self.pte, self.executor, **self._eval_options)
        return self._eval

    # ------------------------------------------------------------------------------ state
    @property
    def state_names(self) -> list[str]:
        return self.executor.state_names

    def read_state(self, name: str) -> np.ndarray:
        return self.executor.read_state(name)

    def write_state(self, name: str, array: Any) -> None:
        self.executor.write_state(name, array)

    @property
    def state_nbytes(self) -> int:
        """Bytes of all mutable state as stored on the device (what a device backup of it takes)."""
        return sum(shared.tensor.stored_nbytes for shared in self.executor.shared_state().values())

    def state_guard(self, slots: int = 2):
        """Device backups of the state and its NaN/inf check (vktrain.runtime.delegate.state_guard), or
        None where a state tensor cannot be bound whole on this device. The caller closes it before the
        runner."""
        from vktrain.runtime.delegate.state_guard import StateGuard
        from vktrain.runtime.vk.errors import BindingRangeError

        try:
            return StateGuard(self.device, self.executor.shared_state(), slots=slots)
        except BindingRangeError:
            return None

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

    def gemm_report(self) -> str:
        """The GEMM precision chosen at load for this device (GraphExecutor.gemm_report)."""
        return self.executor.gemm_report()

    # ------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._eval is not None:
            self._eval.close()  # it borrows the training executor's state buffers: close it first
        self.executor.close()
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> "TrainingRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["BACKEND_ID", "CPU_KERNELS", "ProgramInterpreter", "TrainingRunner", "UnsupportedProgramError",
           "VerifiedTrainingProgram", "check_hparams_input", "check_instructions_supported", "check_loss_output", "check_storageless_tensors", "plan_input_names", "verify_training_program"]

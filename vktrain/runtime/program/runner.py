"""Run an exported training-step .pte: the vktrain delegate on Vulkan, the rest of the program in numpy.

    runner = TrainingRunner.from_pte("step.pte", planner=plan_schedule)   # device=None opens Device() (VKTRAIN_DEVICE)
    runner = TrainingRunner.from_pte("step.pte", planner=plan_schedule, runtime="webgpu")   # the WebGPU device layer
    loss = runner.step(token_ids, labels, hparams)         # int64 [B, S], int64 [B, S], float32 [5]
    runner.accumulate(token_ids, labels, n_valid)          # a --grad-accum .pte: gradient into grad_acc
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

Each method's delegate runs a Schedule the runner obtains (schedules.py `method_schedule`): one given
(`schedule=`), else one the caller's `planner` makes for the device (the app passes
vktrain.backend.kernel_planning.plan_schedule; the runtime plans nothing itself), else the load is refused.

Loading verifies everything first (vktrain/serialization/verify.py, `verify_training_program`): the
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

import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from vktrain.contract import (BACKEND_ID, HPARAMS, LABELS, MODEL_PREFIX, N_VALID, POSITIONS, PRECISION_AUTO, STEP_INPUTS,
                              TOKEN_IDS)
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.runtime.program.schedules import Planner, method_schedule
from vktrain.serialization.schedule import Schedule, ScheduleMismatchError
from vktrain.errors import PrecisionPolicyError
from vktrain.serialization.pte import PteFile
from vktrain.runtime.runtimes import device_for
from vktrain.serialization.verify import UnsupportedProgramError, check_device_memory, device_memory_bytes
from vktrain.runtime.program.embedded import module_options, step_selection, unused_tensor_cores_hint
from vktrain.runtime.program.step_inputs import (StepInput, check_input_names, checked_input, document_inputs,
                                                step_input_specs)
from vktrain.runtime.program.interpreter import (ProgramInterpreter, VerifiedTrainingProgram, check_hparams_input,
                                                 check_instructions_supported, check_loss_output,
                                                 check_storageless_tensors, plan_input_names,
                                                 verify_training_program)
from vktrain.serialization.peft_adapters import LORA_SUFFIXES

class TrainingRunner:
    """One exported LoRA training step (see the module docstring). Build with `from_pte`.

    `verify_constants=False` skips hashing the delegate's constants at load (the graph checksum and every
    other check still run); the memory limits default to this machine's RAM and the device's largest
    memory heap. `planner` (schedules.py `Planner`: plan(graph, profile, **options) -> Schedule, e.g.
    vktrain.backend.kernel_planning.plan_schedule) makes each method's schedule for the device, with these
    planning options: `precision`, the GEMM precision policy (docs/PRECISION.md; `emulate_tensor_cores`: the
    planner's test path), and `max_binding_bytes` (a lower max storage binding size to plan for, e.g. a
    browser's 128 MiB); the step's with state_guard=True too (the guard's dispatches: `state_guard()`); the
    eval and accumulate methods' with `shared` (the step's buffers they bind) and the step's options.
    `schedule`: a Schedule planned for this program's step, run as it is (the planning options then stay at
    their defaults). `runtime` ("vulkan" or "webgpu"; vktrain.runtime.runtimes) picks the
    device layer to open when `device` is None (default vulkan); a device given must be of it.

    A .pte exported with --target embeds a schedule per device profile: with none of `schedule`, `precision`,
    `emulate_tensor_cores`, `max_binding_bytes` given, the runner runs the one the device satisfies
    (vktrain/serialization/embedded.py's matching rule; `target` says which) with the blob's shader modules,
    and refuses the program (NoMatchingScheduleError) when none fits; without embedded schedules, or with one
    of those given, the planner plans at load."""

    def __init__(self, pte: PteFile, device=None, *, planner: Optional[Planner] = None, method: str = "forward",
                 timing: bool = True, verify_constants: bool = True, host_memory_limit: Optional[int] = None,
                 device_memory_limit: Optional[int] = None, precision: str = PRECISION_AUTO,
                 emulate_tensor_cores: bool = False, runtime: Optional[str] = None,
                 max_binding_bytes: Optional[int] = None, schedule: Optional[Schedule] = None):
        if schedule is not None and (precision, emulate_tensor_cores, max_binding_bytes) != (PRECISION_AUTO, False,
                                                                                              None):
            raise ScheduleMismatchError("a TrainingRunner given a schedule takes its precision, tensor-core "
                                        "emulation and binding limit from it; pass none of precision, "
                                        "emulate_tensor_cores, max_binding_bytes")
        self.pte = pte
        program = verify_training_program(pte, method, verify_constants=verify_constants,
                                          host_memory_limit=host_memory_limit)
        self.plan, self.graph, self._input_names = program.plan, program.graph, program.input_names
        self._input_specs = step_input_specs(self.plan, self._input_names)
        self._interpreter = ProgramInterpreter(pte, self.plan, self._run_delegate, host_memory_limit=host_memory_limit)
        self._eval = None  # the eval method, loaded by the first evaluate()
        self._accumulate = None  # the accumulate method, loaded by the first accumulate()
        self._eval_options = dict(verify_constants=verify_constants, host_memory_limit=host_memory_limit,
                                  device_memory_limit=device_memory_limit, planner=planner)

        device, self._owns_device = device_for(device, runtime)
        self.device = device
        try:
            check_device_memory(pte.source, self.graph, device_memory_bytes(device) if device_memory_limit is None
                                else device_memory_limit)
            # A schedule embedded at export (--target) for this device, unless the caller chose another plan.
            chosen = schedule is None and (precision, emulate_tensor_cores, max_binding_bytes) == (PRECISION_AUTO,
                                                                                                    False, None)
            selection = step_selection(self.graph, device, str(pte.source)) if chosen else None
            self.target = selection  # the embedded schedule it runs (None: planned at load, or `schedule`)
            try:
                obtained = method_schedule(self.graph, device, planner=planner, schedule=schedule,
                                           embedded=selection.schedule if selection else None, source=str(pte.source),
                                           precision=precision, emulate_tensor_cores=emulate_tensor_cores,
                                           max_binding_bytes=max_binding_bytes, state_guard=True)
            except PrecisionPolicyError as exc:
                raise PrecisionPolicyError(f"{pte.source}: {exc}") from None
            self.executor = GraphExecutor(device, self.graph, obtained.schedule, verify=obtained.verify, timing=timing,
                                          **module_options(selection))
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
        """True for the token models' step: inputs token_ids, labels (and hparams, n_valid; positions when
        exported with packed documents), which `step()` takes; any other step runs through `step_inputs()`."""
        names = set(self._input_names)
        return {TOKEN_IDS, LABELS} <= names <= set(STEP_INPUTS) | {POSITIONS}

    @property
    def takes_positions(self) -> bool:
        """Whether the step was exported with packed documents (`vktrain export --packing documents`): it takes
        each token's position in its document, and attention stays within documents."""
        return POSITIONS in self._input_names

    def token_inputs(self, token_ids: Any, labels: Any, n_valid: float, positions: Any = None) -> dict[str, Any]:
        """The named inputs of a token batch (hparams aside). `positions` [B, S] (packed documents) only for a
        step that takes them (checked: check_document_positions); such a step without them gets each row as
        one document."""
        return {TOKEN_IDS: token_ids, LABELS: labels, N_VALID: np.float32(n_valid),
                **document_inputs(self.takes_positions, positions, np.shape(token_ids), str(self.pte.source))}

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

    def step(self, token_ids: Any, labels: Any, hparams: Any = None, n_valid: Optional[float] = None,
             positions: Any = None) -> float:
        """One training step on the GPU: forward, backward, AdamW on every LoRA tensor. Returns the loss.

        token_ids / labels int [B, S] (labels < 0 are ignored), hparams float32 [5] = [lr, beta1, beta2,
        eps, weight_decay] (None, and only None, for a program whose hyper-parameters are baked);
        n_valid defaults to the number of labels >= 0; positions: packed documents (token_inputs). The
        token models' case of step_inputs().
        """
        if not self.is_token_step:
            raise ExecutorInputError(f"{self.pte.source}: step() takes a token model's token_ids and labels; this "
                                     f"program's inputs are {self.input_names}: call step_inputs()")
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            raise ExecutorInputError(f"labels must be integers, got {labels.dtype}")
        if n_valid is None:
            n_valid = float(np.count_nonzero(labels >= 0))
        by_name = self.token_inputs(token_ids, labels, n_valid, positions)
        return self.step_inputs({name: by_name[name] for name in self.input_specs}, hparams)

    def accumulate(self, token_ids: Any, labels: Any, n_valid: float, positions: Any = None) -> float:
        """Forward + backward of one micro-batch, its gradient added into the step's optimizer.grad_acc
        state (no update); returns its loss. `n_valid`: the number of labels >= 0 over ALL the micro-batches
        of the optimizer step, the step's own included (its loss and gradient divide by it), which the last
        micro-batch's step() gets too: then the update is that of one batch of all of them. Needs a .pte
        exported with gradient accumulation (AccumulateMethod, loaded on first use)."""
        return self.accumulate_inputs(self.token_inputs(token_ids, labels, n_valid, positions))

    def accumulate_inputs(self, inputs: Mapping[str, Any]) -> float:
        """The accumulate method (forward + backward into optimizer.grad_acc, no update) on named inputs,
        the step's own but hparams (any module's step, e.g. DPO's pairs); returns its loss."""
        return self.accumulate_method().accumulate(inputs)

    def accumulate_method(self):
        """The .pte's accumulate method bound to this step's state (an AccumulateMethod), loaded on first use:
        verified, planned and its pipelines built (seconds for a real model, so `vktrain train --grad-accum`
        asks for it at load rather than in its first step)."""
        if self._accumulate is None:
            from vktrain.runtime.program.accumulation import AccumulateMethod

            self._accumulate = AccumulateMethod(self.pte, self.executor, **self._eval_options)
        return self._accumulate

    def evaluate(self, token_ids: Any, labels: Any, positions: Any = None) -> tuple[float, int]:
        """(loss summed over the labels >= 0, their count) of one batch, by the .pte's eval method on the
        current adapters; no state changes. The eval method is loaded on first use (EvalMethod).
        `positions`: packed documents (token_inputs)."""
        return self.eval_method().loss_sum(token_ids, labels, positions)

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

    def read_states(self, names: list[str]) -> dict[str, np.ndarray]:
        """read_state of each of `names` in one device transfer."""
        return self.executor.read_states(names)

    def write_states(self, arrays: Mapping[str, Any], zeroed: Sequence[str] = ()) -> None:
        """write_state of each (name, array), and zeros into each state of `zeroed`, in one device transfer."""
        self.executor.write_states(arrays, zeroed)

    @property
    def state_nbytes(self) -> int:
        """Bytes of all mutable state as stored on the device (what a device backup of it takes)."""
        return sum(shared.tensor.stored_nbytes for shared in self.executor.shared_state().values())

    def state_guard(self, slots: int = 2):
        """Device backups of the state and its NaN/inf check (vktrain.runtime.delegate.state_guard), as the
        step's schedule plans them; None where it plans none or a state tensor cannot be bound whole on this
        device. The caller closes it before the runner."""
        from vktrain.runtime.delegate.state_guard import StateGuard
        from vktrain.runtime.vk.errors import BindingRangeError

        try:
            return StateGuard.for_executor(self.executor, slots=slots)
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
        """The GEMM precision chosen for this device (GraphExecutor.gemm_report) and where the schedule came from:
        embedded at export for a profile (`target`), or planned at load."""
        origin = (f"schedule embedded for device profile {self.target.profile.name!r}" if self.target is not None
                  else "schedule planned at load")
        hint = unused_tensor_cores_hint(self.graph, self.device) if self.target is not None else ""
        return f"{self.executor.gemm_report()}; {origin}" + (f"; {hint}" if hint else "")

    # ------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for method in (self._eval, self._accumulate):
            if method is not None:
                method.close()  # it borrows the training executor's state buffers: close it first
        self.executor.close()
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> "TrainingRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["BACKEND_ID", "ProgramInterpreter", "TrainingRunner", "UnsupportedProgramError",
           "VerifiedTrainingProgram", "check_hparams_input", "check_instructions_supported", "check_loss_output", "check_storageless_tensors", "plan_input_names", "verify_training_program"]

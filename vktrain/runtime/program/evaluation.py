"""The eval method of a training-step .pte (vktrain.export.eval): the step's loss without the update.

The eval method's delegate names its LoRA tensors as the training step names its state
(`model.<layer>.lora_A` / `.lora_B`); loading binds them to the training step executor's state buffers
(GraphExecutor `shared`), so eval reads the adapters as trained or as loaded into the training state,
and never touches the optimizer state. Its constants that the training step holds byte for byte under
the same name (the frozen base) bind the training executor's buffers too: one copy on the device.
Its intermediates reuse the step's intermediate and scratch buffers (GraphExecutor `arena`: eval runs
only between steps), so the program holds one set of activations.

    method = EvalMethod(pte, training_executor)     # what TrainingRunner.evaluate builds on first use
    loss_sum, count = method.loss_sum(token_ids, labels)   # a token model's eval method
    loss = method.loss(inputs)                             # any module's: its loss's inputs by name
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from vktrain.contract import EVAL_INPUTS, EVAL_METHOD, LABELS, MODEL_PREFIX, N_VALID, POSITIONS, TOKEN_IDS
from vktrain.runtime.program.schedules import Planner, bound_executor
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.interpreter import ProgramInterpreter, VerifiedTrainingProgram, verify_method
from vktrain.serialization.verify import UnsupportedProgramError
from vktrain.runtime.program.step_inputs import check_input_names, checked_input, document_inputs, step_input_specs
from vktrain.serialization.verify import check_device_memory, device_memory_bytes
from vktrain.serialization import graph as g


def verify_eval_method(pte: PteFile, *, verify_constants: bool = True,
                       host_memory_limit: Optional[int] = None) -> VerifiedTrainingProgram:
    """Every host-side check of the .pte's eval method (EvalMethod's, before it allocates; the fuzzer's)."""
    if EVAL_METHOD not in pte.method_names:
        raise UnsupportedProgramError(
            f"{pte.source} has no {EVAL_METHOD!r} method (it has {pte.method_names}): it was exported without "
            f"one; export the step and its eval method together (vktrain export does; for a module of your "
            f"own, export_training_and_eval_steps)")
    return verify_method(pte, EVAL_METHOD, what="an eval method", verify_constants=verify_constants,
                         host_memory_limit=host_memory_limit)


class EvalMethod:
    """The .pte's eval method on the device of `training` (the training step's GraphExecutor), bound to
    its state, run by the schedule `planner` makes (schedules.py). Verified like the training step before
    anything is allocated. `reuse_activations=False` gives
    it activation buffers of its own (tests compare the two)."""

    def __init__(self, pte: PteFile, training: GraphExecutor, *, timing: bool = False, verify_constants: bool = True,
                 host_memory_limit: Optional[int] = None, device_memory_limit: Optional[int] = None,
                 reuse_activations: bool = True, planner: Optional[Planner] = None):
        verified = verify_eval_method(pte, verify_constants=verify_constants, host_memory_limit=host_memory_limit)
        plan, self.graph, self._input_names = verified.plan, verified.graph, verified.input_names
        self.input_specs = step_input_specs(plan, self._input_names)
        self._source = str(pte.source)
        state = training.shared_state()
        lora = {name for name in state if name.startswith(MODEL_PREFIX)}
        reads = {value.name for value in self.graph.values if isinstance(value, g.TensorValue) and value.constant_id >= 0}
        if not lora <= reads:
            raise UnsupportedProgramError(
                f"{pte.source}: the {EVAL_METHOD!r} method does not read the training step's state "
                f"{sorted(lora - reads)}: it was not exported with this training step")
        check_device_memory(pte.source, self.graph, device_memory_bytes(training.device) if device_memory_limit is None
                            else device_memory_limit)
        shared = {name: state[name] for name in lora}
        shared.update(training.constants_matching(self.graph))  # the frozen base: on the device once
        self.executor = bound_executor(self.graph, training, shared, planner=planner, source=self._source,
                                       timing=timing, reuse_activations=reuse_activations)
        try:
            self._interpreter = ProgramInterpreter(pte, plan, self._run_delegate, host_memory_limit=host_memory_limit)
        except BaseException:
            self.executor.close()
            raise

    def _run_delegate(self, index: int, args: list) -> list[np.ndarray]:
        return self.executor.run(*args[:len(self.graph.inputs)])

    def loss_sum(self, token_ids: Any, labels: Any, positions: Any = None) -> tuple[float, int]:
        """(cross-entropy summed over the labels >= 0, how many there are) of one batch of the exported
        shape. The method divides by its n_valid input; it gets 1, so the sum comes back. `positions`:
        packed documents, for a method exported with them (step_inputs.document_inputs)."""
        takes_positions = POSITIONS in self._input_names
        if sorted(self._input_names) != sorted(EVAL_INPUTS + ((POSITIONS,) if takes_positions else ())):
            raise ExecutorInputError(f"{self._source}: the {EVAL_METHOD!r} method takes {self._input_names}, not a "
                                     f"token model's {list(EVAL_INPUTS)}: call loss()")
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            raise ExecutorInputError(f"labels must be integers, got {labels.dtype}")
        count = int(np.count_nonzero(labels >= 0))
        return self.loss({TOKEN_IDS: token_ids, LABELS: labels, N_VALID: np.float32(1.0),
                          **document_inputs(takes_positions, positions, np.shape(token_ids), self._source)}), count

    def loss(self, inputs: Mapping[str, Any]) -> float:
        """The method's loss on one batch of named inputs (exactly `input_specs`' names, each of the
        program's shape and a dtype that converts to its own exactly: vktrain/runtime/program/step_inputs.py)."""
        check_input_names(self.input_specs, inputs, self._source)
        by_name = {name: checked_input(spec, inputs[name], self._source) for name, spec in self.input_specs.items()}
        (loss,) = self._interpreter.run([by_name[name] for name in self._input_names])
        return float(np.asarray(loss).reshape(()))

    def close(self) -> None:
        self.executor.close()

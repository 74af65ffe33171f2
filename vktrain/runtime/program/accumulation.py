"""The accumulate method of a gradient-accumulating .pte (vktrain.export.export_accumulating_methods):
forward + backward of one micro-batch, its gradient added into the training step's optimizer.grad_acc.*
state on the device; the step's AdamW then uses gradient + grad_acc and zeroes grad_acc.

Like the eval method (evaluation.py), its executor binds the training executor's buffers (GraphExecutor
`shared`): the adapters and grad_acc state by name, the frozen base where byte-identical. Its own buffers
are its activations only, and those reuse the step's intermediate and scratch buffers (GraphExecutor `arena`:
the two never run at the same time), so a step of N micro-batches holds one micro-batch's on the device.

    method = AccumulateMethod(pte, training_executor)   # what TrainingRunner.accumulate builds on first use
    loss = method.accumulate(inputs)                     # inputs by name: a token model's EVAL_INPUTS
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from vktrain.contract import ACCUMULATE_METHOD, GRAD_ACC_PREFIX
from vktrain.runtime.program.schedules import Planner, bound_executor
from vktrain.runtime.delegate.executor import GraphExecutor
from vktrain.runtime.program.interpreter import ProgramInterpreter, verify_method
from vktrain.runtime.program.step_inputs import check_input_names, checked_input, step_input_specs
from vktrain.serialization.pte import PteFile
from vktrain.serialization.verify import UnsupportedProgramError, check_device_memory, device_memory_bytes
from vktrain.serialization import graph as g


class AccumulateMethod:
    """The .pte's accumulate method on the device of `training` (the step's GraphExecutor), bound to its
    state, run by the schedule `planner` makes (schedules.py). Verified like the training step before anything
    is allocated. `reuse_activations=False` gives it
    activation buffers of its own (tests compare the two)."""

    def __init__(self, pte: PteFile, training: GraphExecutor, *, verify_constants: bool = True,
                 host_memory_limit: Optional[int] = None, device_memory_limit: Optional[int] = None,
                 reuse_activations: bool = True, planner: Optional[Planner] = None):
        if ACCUMULATE_METHOD not in pte.method_names:
            raise UnsupportedProgramError(
                f"{pte.source} has no {ACCUMULATE_METHOD!r} method (it has {pte.method_names}): gradient "
                f"accumulation needs a .pte exported with it (vktrain export --grad-accum)")
        verified = verify_method(pte, ACCUMULATE_METHOD, what="an accumulate method",
                                 verify_constants=verify_constants, host_memory_limit=host_memory_limit)
        plan, self.graph, self._input_names = verified.plan, verified.graph, verified.input_names
        self.input_specs = step_input_specs(plan, self._input_names)
        self._source = str(pte.source)
        state = training.shared_state()
        accumulators = {name for name in state if name.startswith(GRAD_ACC_PREFIX)}
        names = {value.name for value in self.graph.values if isinstance(value, g.TensorValue) and value.name}
        if not accumulators or not accumulators <= names:
            raise UnsupportedProgramError(
                f"{pte.source}: the {ACCUMULATE_METHOD!r} method does not update the training step's gradient "
                f"accumulators {sorted(accumulators - names) or '(the step has none)'}: they were not exported together")
        check_device_memory(pte.source, self.graph, device_memory_bytes(training.device) if device_memory_limit is None
                            else device_memory_limit)
        shared = {name: tensor for name, tensor in state.items() if name in names}  # adapters and grad_acc
        shared.update(training.constants_matching(self.graph))  # the frozen base: on the device once
        self.executor = bound_executor(self.graph, training, shared, planner=planner, source=self._source,
                                       timing=False, reuse_activations=reuse_activations)
        try:
            self._interpreter = ProgramInterpreter(pte, plan, self._run_delegate, host_memory_limit=host_memory_limit)
        except BaseException:
            self.executor.close()
            raise

    def _run_delegate(self, index: int, args: list) -> list[np.ndarray]:
        return self.executor.run(*args[:len(self.graph.inputs)])

    def accumulate(self, inputs: Mapping[str, Any]) -> float:
        """Add one micro-batch's gradient into grad_acc; returns its loss (its sum over n_valid)."""
        check_input_names(self.input_specs, inputs, self._source)
        by_name = {name: checked_input(spec, inputs[name], self._source) for name, spec in self.input_specs.items()}
        (loss,) = self._interpreter.run([by_name[name] for name in self._input_names])
        return float(np.asarray(loss).reshape(()))

    def close(self) -> None:
        self.executor.close()

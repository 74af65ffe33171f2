"""The inputs a training step's .pte takes, by name, and the check every array given for one passes.

A step's inputs are named after the delegate graph inputs they feed (the names the export gave them: the
loss function's parameters, then `hparams`). TrainingRunner.step_inputs and `vktrain train --inputs`
check arrays against these specs before anything runs, so a wrong array is refused naming the input,
what the program expects and what was found.

Dtypes: an array must hold the program's dtype, or one of the same kind that converts to it exactly
(int32 for an int64 input, float16 for a float32 one); anything else (float64 for float32, an int for a
float) is refused rather than converted silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from vktrain.contract import POSITIONS
from vktrain.runtime.delegate.executor import ExecutorInputError
from vktrain.serialization.pte import NUMPY_SCALAR_TYPES, ExecutionPlan, Tensor


@dataclass(frozen=True)
class StepInput:
    """One input of a step program: its name, shape and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def step_input_specs(plan: ExecutionPlan, names: list[str]) -> dict[str, StepInput]:
    """name -> StepInput of each plan input (`names`: plan_input_names), in the plan's order."""
    specs = {}
    for name, value_index in zip(names, plan.inputs):
        value = plan.values[value_index]
        # verify_plan refused plan inputs that are not tensors of a known dtype
        assert isinstance(value, Tensor), f"plan input {name!r} is not a tensor"
        specs[name] = StepInput(name, tuple(int(d) for d in value.sizes), np.dtype(NUMPY_SCALAR_TYPES[value.scalar_type]))
    return specs


def _kind(dtype: np.dtype) -> str:
    return "int" if dtype.kind in "iu" else dtype.kind


def converts_exactly(found: np.dtype, expected: np.dtype) -> bool:
    """True when an array of `found` may feed an input of `expected`: the same kind ('int' covers signed
    and unsigned) and a cast that loses nothing."""
    return _kind(found) == _kind(expected) and np.can_cast(found, expected, casting="safe")


def checked_input(spec: StepInput, array: Any, where: str) -> np.ndarray:
    """`array` as the input `spec` takes it (C-contiguous, the program's dtype), or ExecutorInputError
    naming `where` (e.g. the .pte), the input, what it takes and what was found."""
    found = np.asarray(array)
    if found.shape != spec.shape:
        raise ExecutorInputError(f"{where}: input {spec.name!r} takes {spec.describe()}, got "
                                 f"{found.dtype}{list(found.shape)}")
    if not converts_exactly(found.dtype, spec.dtype):
        raise ExecutorInputError(f"{where}: input {spec.name!r} holds {spec.dtype}, got an array of {found.dtype} "
                                 f"({found.dtype} does not convert to {spec.dtype} exactly; cast it yourself if that "
                                 f"is what you mean)")
    return found.astype(spec.dtype, order="C", copy=False)  # (np.ascontiguousarray would make a [] input [1])


def check_input_names(specs: Mapping[str, StepInput], given: Mapping[str, Any], where: str) -> None:
    """`given` names exactly the inputs of `specs`: ExecutorInputError naming the missing and the unknown."""
    missing = [name for name in specs if name not in given]
    unknown = [name for name in given if name not in specs]
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"not inputs of the program {unknown}"] if unknown else [])
        raise ExecutorInputError(f"{where}: the step takes inputs {list(specs)}; {', '.join(parts)}")


def check_document_positions(positions: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    """contract.POSITIONS of a packed-documents step as int64 [B, S], or ExecutorInputError naming the first
    bad entry: each row starts a document (positions[b, 0] == 0) and every later entry starts the next
    one (0) or goes on with its document (positions[b, s - 1] + 1). The kernels' masks rely on it."""
    found = np.asarray(positions)
    if found.shape != tuple(shape) or found.dtype.kind not in "iu":
        raise ExecutorInputError(f"{where}: positions must be integers shaped like token_ids {list(shape)} (each "
                                 f"token's position in its document), got {found.dtype}{list(found.shape)}")
    found = found.astype(np.int64)
    previous = np.concatenate([np.full((found.shape[0], 1), -1), found[:, :-1]], axis=1)
    bad = np.argwhere((found != 0) & (found != previous + 1))
    if bad.size:
        b, s = (int(i) for i in bad[0])
        raise ExecutorInputError(f"{where}: positions[{b}, {s}] is {int(found[b, s])}; a position is 0 (a document "
                                 f"starts) or the previous one + 1"
                                 + (f" ({int(previous[b, s])} + 1)" if s else " (a row starts with a document)"))
    return found


def one_document_per_row(shape: tuple[int, ...]) -> np.ndarray:
    """Positions 0 .. S-1 of every row: each row one document (what a packed step computes unpacked)."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(shape[1], dtype=np.int64), tuple(shape)))


def document_inputs(takes_positions: bool, positions: Any, shape: tuple[int, ...], where: str) -> dict[str, Any]:
    """{POSITIONS: ...} of a token batch of `shape` for a method that takes them (the given positions,
    checked, or one document per row when None), {} for one that does not (which refuses positions)."""
    if takes_positions:
        return {POSITIONS: one_document_per_row(shape) if positions is None
                else check_document_positions(positions, shape, where)}
    if positions is not None:
        raise ExecutorInputError(f"{where}: the program takes no document positions (export it with --packing "
                                 f"documents to train on packed documents)")
    return {}


__all__ = ["StepInput", "check_document_positions", "document_inputs", "one_document_per_row", "check_input_names", "checked_input", "converts_exactly", "step_input_specs"]

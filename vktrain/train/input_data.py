"""`vktrain train STEP.pte --inputs DATA.npz`: the batches of a step that takes other inputs than tokens.

The .npz holds one array per input of the program but hparams, named as the program names it
(TrainingRunner.input_specs: the loss function's parameters). Each array is either
  * one batch, of the input's exact shape: every step gets it, or
  * a stack of batches, of shape [N, *the input's shape]: step t (1-based) gets batch (t - 1) mod N,
    so the batches are cycled in file order (no shuffling: an order of your own is an order of the file).
Arrays of both kinds may be mixed (e.g. a fixed mask next to stacked examples); the stacked ones must
agree on N. Dtypes follow TrainingRunner.step_inputs' rule (vktrain/runtime/program/step_inputs.py): the
program's, or one of the same kind that converts exactly. Everything is checked when the file is loaded,
before the first step; an error names the file, the array, what the program takes and what was found.
"""
from __future__ import annotations

import functools
import hashlib
import os
import zipfile
from pathlib import Path
from typing import Mapping, Union

import numpy as np

from vktrain.runtime.program.step_inputs import StepInput, converts_exactly
from vktrain.train.data import DataError


class ArrayBatches:
    """Named input arrays addressed by data position (module docstring); what `train()` reads in place of
    a TokenBatcher for a step that is not a token model's."""

    def __init__(self, arrays: Mapping[str, np.ndarray], specs: Mapping[str, StepInput], source: str = "inputs"):
        self.source = source
        self.seed = 0  # nothing is shuffled; kept for checkpoints, which record a data seed
        # Whether consecutive batches may be accumulated into one optimizer step (train's grad_accum): only
        # when the batches divide their loss by the step's total themselves (DPO's pairs: n_pairs).
        self.accumulates = False
        missing = [name for name in specs if name not in arrays]
        unknown = [name for name in arrays if name not in specs]
        if missing or unknown:
            parts = ([f"has no array for input(s) {missing}"] if missing else []) + (
                [f"holds array(s) {unknown} the program does not take"] if unknown else [])
            raise DataError(f"{source} {' and '.join(parts)}; the program's inputs are "
                            f"{', '.join(f'{n} {s.describe()}' for n, s in specs.items())} (hparams apart)")
        self._arrays: dict[str, np.ndarray] = {}
        self._stacked: set[str] = set()
        counts = {}
        for name, spec in specs.items():
            array = np.asarray(arrays[name])
            if array.shape == spec.shape:
                pass
            elif array.ndim == len(spec.shape) + 1 and array.shape[1:] == spec.shape and array.shape[0] > 0:
                self._stacked.add(name)
                counts[name] = array.shape[0]
            else:
                raise DataError(f"{source}: array {name!r} is {array.dtype}{list(array.shape)}; input {name!r} takes "
                                f"{spec.describe()}: give one batch of that shape or a stack [N, "
                                f"{', '.join(map(str, spec.shape))}]".replace("[N, ]", "[N]"))
            if not converts_exactly(array.dtype, spec.dtype):
                raise DataError(f"{source}: array {name!r} holds {array.dtype}; input {name!r} takes {spec.dtype} "
                                f"({array.dtype} does not convert to it exactly: save it as {spec.dtype})")
            self._arrays[name] = array.astype(spec.dtype, order="C", copy=False)
        if len(set(counts.values())) > 1:
            raise DataError(f"{source}: the stacked arrays hold different numbers of batches {counts}; they must agree")
        self.n_batches = next(iter(counts.values()), 1)

    @property
    def batches_per_epoch(self) -> float:
        return float(self.n_batches)

    def config(self) -> dict:
        """What decides the batches beyond the data itself (run_config records it in checkpoints)."""
        return {"inputs": {name: list(array.shape) for name, array in self._arrays.items()}}

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the names, dtypes, shapes and bytes of the arrays: what a checkpoint's data must match."""
        digest = hashlib.sha256(b"vktrain-inputs:")
        for name in sorted(self._arrays):
            array = self._arrays[name]
            digest.update(f"{name}:{array.dtype.str}:{list(array.shape)}:".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def batch(self, position: int) -> dict[str, np.ndarray]:
        """The inputs of batch number `position` (0-based): name -> array of the program's shape."""
        if position < 0:
            raise DataError(f"data position must be >= 0, got {position}")
        index = position % self.n_batches
        return {name: array[index] if name in self._stacked else array for name, array in self._arrays.items()}


def load_input_arrays(path: Union[str, os.PathLike], specs: Mapping[str, StepInput]) -> ArrayBatches:
    """The ArrayBatches of an .npz file (numpy.savez / savez_compressed) for a program's `specs`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--inputs {path} does not exist (or is not a file); expected an .npz of the step's inputs")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"--inputs {path}: not a readable .npz ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"--inputs {path} holds a single array; expected an .npz (numpy.savez) with one array "
                        f"per input, named as the program's inputs")
    try:
        with archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"--inputs {path}: not a readable .npz ({exc})") from None
    return ArrayBatches(arrays, specs, f"--inputs {path}")


__all__ = ["ArrayBatches", "load_input_arrays"]

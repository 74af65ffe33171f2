"""Training checkpoints: atomic file writes, and one safetensors file holding everything a resume needs.

A checkpoint is ONE safetensors file (numpy API, no torch):
  tensors   every mutable state tensor of the training program, by the exporter's FQN:
            model.<layer>.lora_A / lora_B, optimizer.exp_avg.<...>, optimizer.exp_avg_sq.<...>,
            optimizer.step
  metadata  (safetensors header, str -> str)
            format          "vktrain-checkpoint"     version   "1"
            step            completed training steps (the next step run is step + 1)
            data_position   batches consumed from the batcher (the next batch read is this index)
            program_sha256  sha256 of the .pte bytes: a checkpoint resumes only onto the same program
            data_sha256     fingerprint of the token stream (TokenBatcher.fingerprint)
            data_seed       the batcher's shuffle seed
            config          JSON: hyper-parameters and schedule of the run that wrote it (informative)
            records         JSON list of the per-step records so far ({"step", "loss", "lr"})

Files are written atomically (`atomic_write`): a temporary file in the destination directory, fsync,
os.replace, then fsync of the directory; a crash or error mid-write leaves the previous file intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Protocol, Union

import numpy as np
import safetensors
import safetensors.numpy
from vktrain.contract import STEP_STATE as OPTIMIZER_STEP_STATE  # the optimizer's step counter
from vktrain.errors import VktrainError

PathLike = Union[str, os.PathLike]

CHECKPOINT_FORMAT = "vktrain-checkpoint"
CHECKPOINT_VERSION = "1"


class CheckpointError(VktrainError, ValueError):
    """A checkpoint file is unreadable, malformed, or does not belong to this program / data."""


class StateAccess(Protocol):
    """What a checkpoint needs from a runner: its mutable state by name."""

    @property
    def state_names(self) -> list[str]: ...

    def read_state(self, name: str) -> np.ndarray: ...

    def write_state(self, name: str, array: Any) -> None: ...


# ------------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------------

def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable. Not every platform can open a directory (Windows): best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; restored at once
    os.umask(mask)
    return mask


def atomic_write(path: PathLike, writer: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `writer(file)` so that readers see either the old file or the complete new one.

    The data goes to a temporary file in the same directory (same file system, so the rename is atomic),
    is flushed and fsync'ed, then os.replace()s the destination. If `writer` raises, the temporary file
    is removed and the destination is untouched.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {directory} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            writer(file)
            file.flush()
            # mkstemp creates 0600; give the file the mode a plain open() would (0666 less the umask).
            os.fchmod(file.fileno(), 0o666 & ~_current_umask())
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    _fsync_directory(directory)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    atomic_write(path, lambda file: file.write(data))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """JSON (strict: NaN/inf are refused, they are not JSON) with a trailing newline, written atomically."""
    text = json.dumps(obj, indent=1, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: PathLike, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """Everything needed to continue a run exactly where it stopped (see the module docstring)."""

    step: int
    data_position: int
    program_sha256: str
    data_sha256: str
    data_seed: int
    tensors: dict[str, np.ndarray]
    records: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0 or self.data_position < 0:
            raise CheckpointError(f"checkpoint step and data position must be >= 0, got step={self.step}, "
                                  f"data_position={self.data_position}")


def capture_state(runner: StateAccess) -> dict[str, np.ndarray]:
    """A host copy of every mutable state tensor of `runner`."""
    return {name: np.array(runner.read_state(name), copy=True) for name in runner.state_names}


def save_checkpoint(path: PathLike, checkpoint: Checkpoint) -> None:
    """Serialize `checkpoint` to one safetensors file, atomically."""
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "step": str(checkpoint.step),
        "data_position": str(checkpoint.data_position),
        "program_sha256": checkpoint.program_sha256,
        "data_sha256": checkpoint.data_sha256,
        "data_seed": str(checkpoint.data_seed),
        "config": json.dumps(checkpoint.config, sort_keys=True, allow_nan=False),
        "records": json.dumps(checkpoint.records, allow_nan=False),
    }
    # np.array, not np.ascontiguousarray: the latter turns a 0-d tensor (optimizer.step) into shape [1].
    tensors = {name: np.array(array, order="C", copy=True) for name, array in checkpoint.tensors.items()}
    atomic_write_bytes(path, safetensors.numpy.save(tensors, metadata=metadata))


def _metadata_int(metadata: Mapping[str, str], key: str, path: PathLike) -> int:
    try:
        return int(metadata[key])
    except KeyError:
        raise CheckpointError(f"{path}: checkpoint metadata has no {key!r}") from None
    except ValueError:
        raise CheckpointError(f"{path}: checkpoint metadata {key!r} must be an integer, got {metadata[key]!r}") from None


def load_checkpoint(path: PathLike) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`; anything else is a CheckpointError saying why."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a truncated/corrupt header
        raise CheckpointError(f"{path} is not a readable safetensors checkpoint: {exc}") from None
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a vktrain checkpoint (metadata format={metadata.get('format')!r}, "
                              f"expected {CHECKPOINT_FORMAT!r})")
    if metadata.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {metadata.get('version')!r}; this vktrain reads "
                              f"version {CHECKPOINT_VERSION!r}")
    try:
        records = json.loads(metadata.get("records", "[]"))
        config = json.loads(metadata.get("config", "{}"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: checkpoint metadata is not valid JSON: {exc}") from None
    for key in ("program_sha256", "data_sha256"):
        if key not in metadata:
            raise CheckpointError(f"{path}: checkpoint metadata has no {key!r}")
    return Checkpoint(
        step=_metadata_int(metadata, "step", path),
        data_position=_metadata_int(metadata, "data_position", path),
        program_sha256=metadata["program_sha256"],
        data_sha256=metadata["data_sha256"],
        data_seed=_metadata_int(metadata, "data_seed", path),
        tensors=tensors,
        records=records,
        config=config,
    )


def restore_state(runner: StateAccess, checkpoint: Checkpoint, program_sha256: str, source: PathLike = "checkpoint") -> None:
    """Write the checkpoint's tensors into `runner`, after checking it belongs to this program.

    Refuses (CheckpointError) a checkpoint of another .pte, one whose tensors do not match the program's
    state names or shapes, and one whose optimizer step counter disagrees with its recorded step.
    Nothing is written unless every check passes.
    """
    if checkpoint.program_sha256 != program_sha256:
        raise CheckpointError(
            f"{source} was written for a different program (.pte sha256 {checkpoint.program_sha256[:16]}...), "
            f"this program's sha256 is {program_sha256[:16]}...; a checkpoint resumes only onto the .pte it came from")
    names = list(runner.state_names)
    missing = sorted(set(names) - set(checkpoint.tensors))
    unknown = sorted(set(checkpoint.tensors) - set(names))
    if missing or unknown:
        raise CheckpointError(f"{source} does not match the program's state: missing {missing}, unknown {unknown}")
    for name in names:
        current = np.asarray(runner.read_state(name))
        saved = checkpoint.tensors[name]
        if saved.shape != current.shape or saved.dtype != current.dtype:
            raise CheckpointError(f"{source}: state {name!r} is {saved.dtype}{list(saved.shape)} in the checkpoint, "
                                  f"the program holds {current.dtype}{list(current.shape)}")
    if OPTIMIZER_STEP_STATE in checkpoint.tensors:
        counter = float(checkpoint.tensors[OPTIMIZER_STEP_STATE].reshape(()))
        if counter != float(checkpoint.step):
            raise CheckpointError(f"{source}: the optimizer's step counter is {counter:g} but the checkpoint records "
                                  f"step {checkpoint.step}; the file is inconsistent")
    for name in names:
        runner.write_state(name, checkpoint.tensors[name])


__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "Checkpoint", "CheckpointError", "OPTIMIZER_STEP_STATE",
    "StateAccess", "atomic_write", "atomic_write_bytes", "atomic_write_json", "capture_state", "load_checkpoint",
    "restore_state", "save_checkpoint", "sha256_file",
]

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
            records         JSON list of the per-step records so far ({"step", "loss", "lr", "seconds"},
                            plus "skipped": [data positions] on a step that follows skipped batches)
            checksums       JSON {tensor name: sha256 of its dtype, shape and bytes}, verified on load
A checkpoint is consistent or refused, at save and at load: records are steps 1..step in order with
finite losses, data_position is step plus the batches skipped, every tensor is finite and matches its
checksum. `CheckpointSeries` keeps the last K checkpoints of a run.

Files are written atomically (`atomic_write`): a temporary file `.<name>.<random>.tmp` in the destination
directory, fsync, os.replace, then fsync of the directory; a crash or error mid-write leaves the previous
file intact (after kill -9 the temporary file stays: `remove_stale_temp_files` clears it).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from glob import escape as glob_escape
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
CHECKPOINT_VERSION = "2"  # 2: per-tensor checksums, consistency checked


class CheckpointError(VktrainError, ValueError):
    """A checkpoint file is unreadable, malformed, or does not belong to this program / data."""


class OutputWriteError(VktrainError, OSError):
    """An output file could not be written (disk full, no permission, ...); the message names the file."""


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


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


TEMP_SUFFIX = ".tmp"


def atomic_write(path: PathLike, writer: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `writer(file)` so that readers see either the old file or the complete new one.

    The data goes to a temporary file in the same directory (created with its missing parents; same file
    system, so the rename is atomic),
    is flushed and fsync'ed, then os.replace()s the destination. If `writer` raises, the temporary file
    is removed and the destination is untouched. An OSError (disk full, ...) becomes OutputWriteError
    naming `path`.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    tmp_name = None
    try:
        directory.mkdir(parents=True, exist_ok=True)  # created when written: a failed run leaves none empty
        fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=directory)
        with os.fdopen(fd, "wb") as file:
            writer(file)
            file.flush()
            # mkstemp creates 0600; give the file the mode a plain open() would (0666 less the umask).
            os.fchmod(file.fileno(), 0o666 & ~_current_umask())
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)
        if isinstance(exc, OSError) and not isinstance(exc, VktrainError):
            raise OutputWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise
    _fsync_directory(directory)


def remove_stale_temp_files(path: PathLike) -> list[Path]:
    """Remove the temporary files an interrupted `atomic_write(path, ...)` left (kill -9 mid-write);
    returns what was removed. Only names of atomic_write's own pattern for `path` are touched."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        return []
    removed = []
    for candidate in directory.glob(glob_escape(_temp_prefix(path)) + "*" + TEMP_SUFFIX):
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


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

def tensor_checksum(array: np.ndarray) -> str:
    """sha256 of a tensor's dtype, shape and bytes (what a checkpoint records and verifies per tensor)."""
    array = np.asarray(array)
    digest = hashlib.sha256(f"{array.dtype.str}:{list(array.shape)}:".encode())
    digest.update(array.tobytes())  # C order whatever the array's layout
    return digest.hexdigest()


def non_finite_tensors(tensors: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [name for name, array in tensors.items()
            if np.asarray(array).dtype.kind == "f" and not np.isfinite(array).all()]


def skipped_positions(records: list[dict]) -> int:
    """Batches skipped (--on-nonfinite skip) over the steps of `records`."""
    return sum(len(record.get("skipped", ())) for record in records)


def _check_records(records: Any, step: int, where: str) -> None:
    if not isinstance(records, list) or len(records) != step:
        found = f"{len(records)} record(s)" if isinstance(records, list) else f"a {type(records).__name__}"
        raise CheckpointError(f"{where}: records must be a list of one record per step 1..{step}, found {found}")
    for index, record in enumerate(records):
        expected_step = index + 1
        if not isinstance(record, dict) or record.get("step") != expected_step:
            raise CheckpointError(f"{where}: record {index} must be a dict with step {expected_step}, "
                                  f"got {record!r:.120}")
        for key in ("loss", "lr") + (("seconds",) if "seconds" in record else ()):
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CheckpointError(f"{where}: record of step {expected_step}: {key!r} must be a finite number, "
                                      f"got {value!r}")
        skipped = record.get("skipped", [])
        if not (isinstance(skipped, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in skipped)):
            raise CheckpointError(f"{where}: record of step {expected_step}: 'skipped' must be a list of data "
                                  f"positions, got {skipped!r:.120}")


@dataclass
class Checkpoint:
    """Everything needed to continue a run exactly where it stopped (see the module docstring).
    Construction checks it is consistent (CheckpointError naming `source` otherwise)."""

    step: int
    data_position: int
    program_sha256: str
    data_sha256: str
    data_seed: int
    tensors: dict[str, np.ndarray]
    records: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    source: str = field(default="checkpoint", compare=False)

    def __post_init__(self) -> None:
        where = self.source
        if self.step < 0:
            raise CheckpointError(f"{where}: step must be >= 0, got {self.step}")
        if not 0 <= self.data_seed < 2**32:
            raise CheckpointError(f"{where}: data_seed must lie in [0, 2**32), got {self.data_seed}")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{where}: config must be a JSON object, got {type(self.config).__name__}")
        _check_records(self.records, self.step, where)
        grad_accum = self.config.get("grad_accum", 1)  # micro-batches per step (train_loop.run_config)
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise CheckpointError(f"{where}: config grad_accum must be an integer >= 1, got {grad_accum!r}")
        expected_position = (self.step + skipped_positions(self.records)) * grad_accum
        if self.data_position != expected_position:
            raise CheckpointError(f"{where}: data_position {self.data_position} does not match step {self.step} "
                                  f"(+{skipped_positions(self.records)} skipped, {grad_accum} batch(es) a step): expected "
                                  f"{expected_position}")
        bad = non_finite_tensors(self.tensors)
        if bad:
            raise CheckpointError(f"{where}: tensor(s) {bad[:4]} hold NaN or infinity; a checkpoint holds finite "
                                  f"state only")


def capture_state(runner: StateAccess) -> dict[str, np.ndarray]:
    """A host copy of every mutable state tensor of `runner`."""
    return {name: np.array(runner.read_state(name), copy=True) for name in runner.state_names}


def save_checkpoint(path: PathLike, checkpoint: Checkpoint) -> None:
    """Serialize `checkpoint` to one safetensors file, atomically."""
    # np.array, not np.ascontiguousarray: the latter turns a 0-d tensor (optimizer.step) into shape [1].
    tensors = {name: np.array(array, order="C", copy=True) for name, array in checkpoint.tensors.items()}
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
        "checksums": json.dumps({name: tensor_checksum(array) for name, array in tensors.items()}, sort_keys=True),
    }
    atomic_write_bytes(path, safetensors.numpy.save(tensors, metadata=metadata))


def _metadata_int(metadata: Mapping[str, str], key: str, path: PathLike) -> int:
    try:
        return int(metadata[key])
    except KeyError:
        raise CheckpointError(f"{path}: checkpoint metadata has no {key!r}") from None
    except ValueError:
        raise CheckpointError(f"{path}: checkpoint metadata {key!r} must be an integer, got {metadata[key]!r}") from None


def _metadata_json(metadata: Mapping[str, str], key: str, path: PathLike) -> Any:
    if key not in metadata:
        raise CheckpointError(f"{path}: checkpoint metadata has no {key!r}")
    try:
        return json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: checkpoint metadata {key!r} is not valid JSON: {exc}") from None


def _verify_checksums(tensors: Mapping[str, np.ndarray], checksums: Any, path: PathLike) -> None:
    if not isinstance(checksums, dict) or sorted(checksums) != sorted(tensors):
        listed = sorted(checksums) if isinstance(checksums, dict) else checksums
        raise CheckpointError(f"{path}: checkpoint metadata 'checksums' must list every tensor {sorted(tensors)}, "
                              f"found {listed!r:.200}")
    for name, array in tensors.items():
        if tensor_checksum(array) != checksums[name]:
            raise CheckpointError(f"{path}: tensor {name!r} does not match its checksum (the file is corrupt)")


def _read_metadata(path: PathLike) -> dict[str, str]:
    try:
        with safetensors.safe_open(str(path), framework="numpy") as file:
            return file.metadata() or {}
    except Exception as exc:  # safetensors' own error types for a truncated/corrupt header
        raise CheckpointError(f"{path} is not a readable safetensors checkpoint: {exc}") from None


def _check_format(metadata: Mapping[str, str], path: PathLike, *, any_version: bool = False) -> None:
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a vktrain checkpoint (metadata format={metadata.get('format')!r}, "
                              f"expected {CHECKPOINT_FORMAT!r})")
    if not any_version and metadata.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {metadata.get('version')!r}; this vktrain reads "
                              f"version {CHECKPOINT_VERSION!r}")


def read_checkpoint_step(path: PathLike) -> int:
    """The step a vktrain checkpoint file of any version records, from its header alone (no tensor is read)."""
    metadata = _read_metadata(path)
    _check_format(metadata, path, any_version=True)
    return _metadata_int(metadata, "step", path)


def load_checkpoint(path: PathLike) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`; anything else (or anything inconsistent or corrupt)
    is a CheckpointError saying why."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    metadata = _read_metadata(path)
    _check_format(metadata, path)
    try:
        with safetensors.safe_open(str(path), framework="numpy") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated tensor data
        raise CheckpointError(f"{path} is not a readable safetensors checkpoint: {exc}") from None
    for key in ("program_sha256", "data_sha256"):
        if key not in metadata:
            raise CheckpointError(f"{path}: checkpoint metadata has no {key!r}")
    _verify_checksums(tensors, _metadata_json(metadata, "checksums", path), path)
    return Checkpoint(
        step=_metadata_int(metadata, "step", path),
        data_position=_metadata_int(metadata, "data_position", path),
        program_sha256=metadata["program_sha256"],
        data_sha256=metadata["data_sha256"],
        data_seed=_metadata_int(metadata, "data_seed", path),
        tensors=tensors,
        records=_metadata_json(metadata, "records", path),
        config=_metadata_json(metadata, "config", path),
        source=str(path),
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


class CheckpointSeries:
    """The checkpoints of one run: `path` always holds the newest; with keep > 1 the keep - 1 before it
    stay next to it as step-named files, <stem>.step<N><suffix> (run.safetensors -> run.step50.safetensors).

    Before `path` is replaced its previous file is hard-linked (copied where links are not possible) to
    its step-named name, so at every moment `path` is a complete checkpoint. Rotation removes only
    step-named files of steps before the one being written: a file of a later step (the continuation
    of a run resumed from an earlier step, e.g. one that diverged) stays until that step is written again.
    """

    def __init__(self, path: PathLike, keep: int = 1) -> None:
        if keep < 1:
            raise CheckpointError(f"the number of checkpoints to keep must be >= 1, got {keep}")
        self.path, self.keep = Path(path), keep

    def step_path(self, step: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.step{step}{self.path.suffix}")

    def _step_files(self) -> dict[int, Path]:
        prefix, suffix = f"{self.path.stem}.step", self.path.suffix
        files = {}
        for candidate in self.path.parent.glob(glob_escape(prefix) + "*" + glob_escape(suffix)):
            number = candidate.name[len(prefix):len(candidate.name) - len(suffix)]
            if number.isdigit():
                files[int(number)] = candidate
        return files

    def holds(self, path: PathLike) -> bool:
        """Whether `path` is one of the series' files (its newest or a step-named one)."""
        path = Path(path)
        return path.absolute() == self.path.absolute() or any(
            path.absolute() == p.absolute() for p in self._step_files().values())

    def kept(self) -> list[tuple[str, int]]:
        """(path, step) of every checkpoint of the series on disk, newest step first; `path` itself first."""
        kept = [(str(self.path), read_checkpoint_step(self.path))] if self.path.is_file() else []
        kept += [(str(p), step) for step, p in sorted(self._step_files().items(), reverse=True)]
        return kept

    def save(self, checkpoint: Checkpoint) -> None:
        """Write `checkpoint` as the newest (at `path`), then rotate."""
        if self.keep > 1 and self.path.is_file():
            previous_step = read_checkpoint_step(self.path)
            if previous_step != checkpoint.step:
                self._preserve(self.path, self.step_path(previous_step))
        save_checkpoint(self.path, checkpoint)
        older = sorted(step for step in self._step_files() if step < checkpoint.step)
        for step in older[:max(0, len(older) - (self.keep - 1))]:
            self.step_path(step).unlink(missing_ok=True)

    @staticmethod
    def _preserve(source: Path, target: Path) -> None:
        temporary = target.with_name(f"{_temp_prefix(target)}link{TEMP_SUFFIX}")
        temporary.unlink(missing_ok=True)
        try:
            os.link(source, temporary)
            os.replace(temporary, target)
        except OSError:  # no hard links on this file system: a copy (atomic too)
            temporary.unlink(missing_ok=True)
            atomic_write_bytes(target, source.read_bytes())

    def remove_stale_temp_files(self) -> list[Path]:
        """Temporary files of the series' own writes that a kill -9 left behind."""
        removed = remove_stale_temp_files(self.path)
        pattern = glob_escape(f".{self.path.stem}.step") + "*" + glob_escape(self.path.suffix) + ".*" + TEMP_SUFFIX
        for candidate in self.path.parent.glob(pattern):  # the step-named files' own
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
        return removed


__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "Checkpoint", "CheckpointError", "CheckpointSeries",
    "OPTIMIZER_STEP_STATE", "OutputWriteError", "StateAccess", "atomic_write", "atomic_write_bytes",
    "atomic_write_json", "capture_state", "load_checkpoint", "non_finite_tensors", "read_checkpoint_step",
    "remove_stale_temp_files", "restore_state", "save_checkpoint", "sha256_file", "skipped_positions",
    "tensor_checksum",
]

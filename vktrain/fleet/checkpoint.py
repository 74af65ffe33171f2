"""The server's checkpoint of a federation: the global adapters after a round, one safetensors file.

    DIR/global.safetensors   tensors: the global adapters by state name (what the clients train)
                             metadata: format "vktrain-federation", version, round (completed rounds),
                             program_sha256, run (JSON: the settings that decide the rounds' results,
                             compared on resume), records (JSON: the per-round records so far),
                             checksums (per tensor, verified on load)

Written atomically after every round (vktrain.train.checkpoint.atomic_write_bytes: the previous round's
file stays intact until the new one is complete). A resume reads it, checks that the program and the
run settings are the same, and continues with round `round + 1` from its adapters: the clients start
every round from the global adapters with fresh optimizer state (vktrain/fleet/client.py), and sampling
and data order derive from the seed and the round, so the resumed rounds equal an uninterrupted run's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from vktrain.train.checkpoint import CheckpointError, atomic_write_bytes, tensor_checksum

FORMAT = "vktrain-federation"
VERSION = "1"
FILE_NAME = "global.safetensors"
# Settings added to the run record later, with the value a checkpoint written before them ran with.
RUN_DEFAULTS = {"aggregation": "mean", "max_update_norm_ratio": None, "min_clients": 1}


@dataclass(frozen=True)
class FederationCheckpoint:
    round: int
    arrays: dict[str, np.ndarray]
    program_sha256: str
    run: dict
    records: list[dict]


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILE_NAME


def save_federation_checkpoint(directory: str | Path, checkpoint: FederationCheckpoint) -> Path:
    path = checkpoint_path(directory)
    tensors = {name: np.array(array, order="C", copy=True) for name, array in checkpoint.arrays.items()}
    metadata = {"format": FORMAT, "version": VERSION, "round": str(checkpoint.round),
                "program_sha256": checkpoint.program_sha256,
                "run": json.dumps(checkpoint.run, sort_keys=True, allow_nan=False),
                "records": json.dumps(checkpoint.records, allow_nan=False),
                "checksums": json.dumps({name: tensor_checksum(a) for name, a in tensors.items()}, sort_keys=True)}
    atomic_write_bytes(path, safetensors.numpy.save(tensors, metadata=metadata))
    return path


def _json(metadata: dict, key: str, path: Path) -> Any:
    try:
        return json.loads(metadata[key])
    except (KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: federation checkpoint metadata {key!r} is missing or not JSON ({exc})") from None


def load_federation_checkpoint(directory: str | Path) -> FederationCheckpoint:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(f"--resume: no federation checkpoint {path} (written by vktrain federate --checkpoint DIR)")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except Exception as exc:  # safetensors' own error types for a truncated or corrupt file
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r} version {metadata.get('version')!r}; "
                              f"expected {FORMAT!r} version {VERSION!r}")
    checksums = _json(metadata, "checksums", path)
    if not isinstance(checksums, dict) or sorted(checksums) != sorted(tensors):
        raise CheckpointError(f"{path}: metadata 'checksums' does not list exactly the file's tensors")
    for name, array in tensors.items():
        if tensor_checksum(array) != checksums[name]:
            raise CheckpointError(f"{path}: tensor {name!r} does not match its checksum (the file is corrupt)")
    try:
        completed = int(metadata["round"])
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: metadata 'round' is missing or not an integer") from None
    records = _json(metadata, "records", path)
    if not isinstance(records, list) or [r.get("round") for r in records] != list(range(0, completed + 1)):
        raise CheckpointError(f"{path}: metadata 'records' must hold rounds 0..{completed} in order")
    return FederationCheckpoint(completed, tensors, metadata.get("program_sha256", ""), _json(metadata, "run", path),
                                records)


def check_resumable(checkpoint: FederationCheckpoint, program_sha256: str, run: dict, source: str) -> None:
    """The checkpoint continues this federation: same program, same settings (a difference would make the
    resumed rounds differ from an uninterrupted run's)."""
    if checkpoint.program_sha256 != program_sha256:
        raise CheckpointError(f"{source}: written for another program (sha256 {checkpoint.program_sha256[:16]}..., "
                              f"this one is {program_sha256[:16]}...)")
    written = {**{key: RUN_DEFAULTS[key] for key in run if key in RUN_DEFAULTS}, **checkpoint.run}
    differences = [f"{key}: {written.get(key)!r} -> {run.get(key)!r}"
                   for key in sorted(set(run) | set(written)) if written.get(key) != run.get(key)]
    if differences:
        raise CheckpointError(f"{source}: the federation's settings differ from the checkpoint's "
                              f"({'; '.join(differences)}); resume with the same settings (only --rounds may grow)")


__all__ = ["FILE_NAME", "FederationCheckpoint", "check_resumable", "checkpoint_path", "load_federation_checkpoint",
           "save_federation_checkpoint"]

"""Every path a command writes, checked before anything runs, so that no output destroys a user's file
(torch-free; used by every command: export, train, eval, generate, merge, adapters convert, federate).

    check_outputs([Output("--json", args.json, TRAIN_RECORDS), ...], inputs=[("FILE.pte", args.program)],
                  overwrite=args.overwrite)

An output is refused (OutputError naming its flag and the path as typed, and the way out) when
  * it is one of the command's inputs (the same file or directory) or another of its outputs;
  * it exists and is not of the kind its flag writes: a file vktrain did not write there, recognised by
    its content (a PNG for --plot, a GGUF adapter for --out-gguf-adapter, a PEFT adapter directory for
    --out-adapters, ...), unless --overwrite is given;
  * it holds a run's checkpoint that this run does not continue (an existing --checkpoint without
    --resume: another run would replace it), unless --overwrite is given;
  * it cannot be written: an existing directory where a file goes (or the reverse), a parent that is a
    file, a directory that is not writable.
The check creates nothing (a run that fails leaves no empty directory behind); the writers create the
missing parent directories when they write (vktrain.train.checkpoint.atomic_write).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from vktrain.errors import VktrainError
from vktrain.train.checkpoint import remove_stale_temp_files

OVERWRITE_FLAG = "--overwrite"
_JSON_READ_LIMIT = 64 << 20  # a bigger file is no JSON vktrain wrote


class OutputError(VktrainError, ValueError):
    """An output path that would destroy a file, or that cannot be written."""


def add_overwrite_argument(parser) -> None:
    parser.add_argument(OVERWRITE_FLAG, action="store_true",
                        help="let the outputs replace existing files that vktrain did not write (or another "
                             "run's checkpoint); an output is never one of the command's inputs")


@dataclass(frozen=True)
class OutputKind:
    """What a flag writes: `description` names it in messages; `recognise(path)` says whether an existing
    file (or directory) is of this kind, i.e. one a run may replace. A directory kind writes the files
    `writes` into the directory; only those can be replaced. `holds_a_run`: the kind is a run's
    checkpoint, replaced only by the run that continues it."""

    description: str
    recognise: Callable[[Path], bool]
    directory: bool = False
    writes: tuple[str, ...] = ()
    holds_a_run: bool = False


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(size)
    except OSError:
        return b""


def _json_of(path: Path):
    try:
        if path.stat().st_size > _JSON_READ_LIMIT:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def json_records(key: str) -> Callable[[Path], bool]:
    """A JSON list of records, each an object with `key` (train's "step", federate's "round")."""
    def recognise(path: Path) -> bool:
        value = _json_of(path)
        return isinstance(value, list) and all(isinstance(item, dict) and key in item for item in value)
    return recognise


def json_object(*keys: str) -> Callable[[Path], bool]:
    """A JSON object with every one of `keys`."""
    def recognise(path: Path) -> bool:
        value = _json_of(path)
        return isinstance(value, dict) and all(key in value for key in keys)
    return recognise


def safetensors_metadata(path: Path) -> dict:
    """The metadata of a safetensors file, {} for anything else (or an unreadable file)."""
    try:
        import safetensors

        with safetensors.safe_open(str(path), framework="numpy") as file:
            return file.metadata() or {}
    except Exception:  # safetensors' own error types for a file that is not one
        return {}


def _is_png(path: Path) -> bool:
    return _head(path, 8) == b"\x89PNG\r\n\x1a\n"


def _is_pte(path: Path) -> bool:
    from vktrain.serialization.pte import PROGRAM_IDENTIFIER

    return _head(path, 8)[4:8] == PROGRAM_IDENTIFIER


def _is_gguf_adapter(path: Path) -> bool:
    if _head(path, 4) != b"GGUF":
        return False
    try:
        import gguf

        field_ = gguf.GGUFReader(str(path)).get_field(gguf.Keys.General.TYPE)
        return field_ is not None and field_.contents() == gguf.GGUFType.ADAPTER
    except Exception:  # not a readable GGUF: not one vktrain wrote
        return False


def _is_checkpoint(path: Path) -> bool:
    from vktrain.train.checkpoint import CHECKPOINT_FORMAT

    return safetensors_metadata(path).get("format") == CHECKPOINT_FORMAT


def _is_peft_directory(path: Path) -> bool:
    config = _json_of(path / "adapter_config.json")
    return isinstance(config, dict) and "peft_type" in config


# The kinds several commands write; a command's own (eval's JSON, merge's directory, ...) sits with it.
PNG = OutputKind("a PNG image", _is_png)
PTE = OutputKind("a .pte program", _is_pte)
GGUF_ADAPTER = OutputKind("a GGUF LoRA adapter", _is_gguf_adapter)
CHECKPOINT = OutputKind("a vktrain checkpoint", _is_checkpoint, holds_a_run=True)
PEFT_DIRECTORY = OutputKind("a PEFT adapter directory", _is_peft_directory, directory=True,
                            writes=("adapter_model.safetensors", "adapter_config.json"))


@dataclass(frozen=True)
class Output:
    """One output of a command: its flag, the path as the user typed it, what it writes there.
    `continues`: the input path this output may be (a resumed checkpoint, rewritten by the run that
    continues it)."""

    flag: str
    path: str
    kind: OutputKind
    continues: Optional[str] = None

    def named(self) -> str:
        return f"{self.flag} {self.path}"


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def _existing_ancestor(path: Path) -> Path:
    """The nearest of `path`'s parents (as typed, relative or not) that exists."""
    for parent in path.parents:
        if parent.exists() or str(parent) in (".", ""):
            return parent
    return Path(".")


def _check_writable(output: Output) -> None:
    """Where `output` goes can be created: no file where a directory is needed, permission to write."""
    target = Path(output.path)
    if target.exists():
        if output.kind.directory and not target.is_dir():
            raise OutputError(f"{output.named()} is a file; expected a directory (it will hold "
                              f"{', '.join(output.kind.writes)})")
        if not output.kind.directory and target.is_dir():
            raise OutputError(f"{output.named()} is a directory; expected a file name")
    where = target if output.kind.directory and target.is_dir() else _existing_ancestor(target)
    if not where.is_dir():
        raise OutputError(f"{output.named()}: cannot write there ({where} is a file, not a directory)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".vktrain-write-probe.", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{output.named()}: cannot write there ({where}: {exc.strerror or exc})") from None


def _replaced_files(output: Output) -> list[Path]:
    """The existing files the output would replace."""
    target = Path(output.path)
    if output.kind.directory:
        return [target / name for name in output.kind.writes if (target / name).exists()] if target.is_dir() else []
    return [target] if target.is_file() else []


def _check_replaced(output: Output, overwrite: bool) -> None:
    replaced = _replaced_files(output)
    if not replaced or overwrite:
        return
    if output.continues is not None and _same(output.path, output.continues):
        return
    recognised = output.kind.recognise(Path(output.path))
    if not recognised:
        what = (f"holds files vktrain did not write there ({', '.join(p.name for p in replaced)})"
                if output.kind.directory else f"exists and is not {output.kind.description}")
        raise OutputError(f"{output.named()} {what}; write to another path, or pass {OVERWRITE_FLAG} to replace "
                          f"{'them' if output.kind.directory else 'it'}")
    if output.kind.holds_a_run:
        raise OutputError(f"{output.named()} already holds {output.kind.description} of another run; continue that "
                          f"run with --resume{_resume_argument(output)}, or write this one to another path (or pass "
                          f"{OVERWRITE_FLAG} to replace it)")


def _resume_argument(output: Output) -> str:
    """How --resume names what `output` holds: train's takes the checkpoint file, federate's is a switch."""
    return "" if output.kind.directory else f" {output.path}"


def refuse_input(output: Output, label: str, path: Optional[str]) -> None:
    """OutputError when `output` is the input `path` (named `label`, e.g. "--data" or "the program")."""
    if path and os.path.exists(path) and _same(output.path, path) and not (
            output.continues is not None and _same(path, output.continues)):
        raise OutputError(f"{output.named()} is {label} {path}, an input of this command; an output never replaces "
                          f"an input: write it to another path")


def check_outputs(outputs: Sequence[Output], inputs: Sequence[tuple[str, Optional[str]]] = (),
                  overwrite: bool = False) -> None:
    """Check every output (the module docstring's rules), in the order given; then clear the temporary
    files an interrupted write of them left. Outputs whose path is None or empty are not given."""
    given = [output for output in outputs if output.path]
    for index, output in enumerate(given):
        for label, path in inputs:
            refuse_input(output, label, path)
        for other in given[:index]:
            if _same(output.path, other.path):
                raise OutputError(f"{output.named()} is also {other.named()}: two outputs cannot share a path")
        _check_writable(output)
        _check_replaced(output, overwrite)
    for output in given:
        files = [Path(output.path) / name for name in output.kind.writes] if output.kind.directory else [Path(output.path)]
        for file in files:
            remove_stale_temp_files(file)


__all__ = ["CHECKPOINT", "GGUF_ADAPTER", "OVERWRITE_FLAG", "Output", "OutputError", "OutputKind", "PEFT_DIRECTORY",
           "PNG", "PTE", "add_overwrite_argument", "check_outputs", "json_object", "json_records", "refuse_input",
           "safetensors_metadata"]

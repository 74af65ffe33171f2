"""Regenerate the flatbuffer Python code vktrain commits, with the flatc that executorch ships.

    python -m vktrain.serialization.generate          # rewrite the generated packages
    python -m vktrain.serialization.generate --check  # exit 1 if they are out of date

Two schemas are compiled:
- vktrain/serialization/schema.fbs (the delegate graph) -> vktrain/serialization/generated/vkt_blob/
- executorch's program.fbs + scalar_type.fbs (the .pte Program), taken from the installed executorch
  wheel -> vktrain/serialization/pte_schema/executorch_flatbuffer/ (read by vktrain/serialization/pte.py)

flatc names Python modules after the schema namespace, and generated modules import each other by
that name. So each schema is compiled from a temporary copy whose `namespace` line is rewritten to
the full package path: the generated imports are then correct as emitted and nothing is patched.
The namespace does not appear in the binary format, so this changes no byte of what is read.

Finds flatc through $FLATC, else executorch/data/bin/flatc. Does not import executorch.
"""
from __future__ import annotations

import argparse
import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_NAMESPACE_LINE = re.compile(r"^namespace\s+([A-Za-z_][A-Za-z0-9_.]*)\s*;", re.MULTILINE)


@dataclass(frozen=True)
class SchemaJob:
    """One flatc run: `main_schema` (plus its includes) -> Python package `package`."""

    schema_files: tuple[Path, ...]
    main_schema: Path
    original_namespace: str
    package: str  # dotted package the generated modules live in

    @property
    def output_dir(self) -> Path:
        return REPO_ROOT.joinpath(*self.package.split("."))


def executorch_dir() -> Path:
    spec = importlib.util.find_spec("executorch")  # locates the wheel without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("executorch is not installed in this Python environment; it provides flatc "
                         "and program.fbs (run scripts/setup.sh)")
    return Path(list(spec.submodule_search_locations)[0])


def find_flatc() -> Path:
    override = os.environ.get("FLATC")
    flatc = Path(override) if override else executorch_dir() / "data" / "bin" / "flatc"
    if not (flatc.is_file() and os.access(flatc, os.X_OK)):
        raise SystemExit(f"flatc not found or not executable at {flatc} (set $FLATC to override)")
    return flatc


def find_program_schema() -> tuple[Path, Path]:
    """program.fbs and scalar_type.fbs of the installed executorch (schema/, else exir/_serialize/)."""
    root = executorch_dir()
    for folder in (root / "schema", root / "exir" / "_serialize"):
        program, scalar_type = folder / "program.fbs", folder / "scalar_type.fbs"
        if program.is_file() and scalar_type.is_file():
            return program, scalar_type
    raise SystemExit(f"program.fbs + scalar_type.fbs not found under {root}/schema or {root}/exir/_serialize")


def schema_jobs() -> list[SchemaJob]:
    blob_schema = REPO_ROOT / "vktrain" / "serialization" / "schema.fbs"
    program, scalar_type = find_program_schema()
    return [
        SchemaJob((blob_schema,), blob_schema, "vkt_blob", "vktrain.serialization.generated.vkt_blob"),
        SchemaJob((program, scalar_type), program, "executorch_flatbuffer",
                  "vktrain.serialization.pte_schema.executorch_flatbuffer"),
    ]


def _copy_with_namespace(src: Path, dst: Path, original: str, replacement: str) -> None:
    text = src.read_text(encoding="utf-8")
    namespaces = _NAMESPACE_LINE.findall(text)
    if namespaces != [original]:
        raise SystemExit(f"{src}: expected exactly one `namespace {original};` line, found {namespaces}")
    dst.write_text(_NAMESPACE_LINE.sub(f"namespace {replacement};", text), encoding="utf-8")


def generate_into(job: SchemaJob, flatc: Path, scratch: Path) -> Path:
    """Run flatc for `job` inside `scratch`; return the folder holding the generated package."""
    schema_dir = scratch / "schema"
    out_dir = scratch / "out"
    schema_dir.mkdir()
    for schema in job.schema_files:
        _copy_with_namespace(schema, schema_dir / schema.name, job.original_namespace, job.package)
    cmd = [str(flatc), "--python", "--python-typing", "--gen-all", "-o", str(out_dir),
           str(schema_dir / job.main_schema.name)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"flatc failed ({' '.join(cmd)}):\n{result.stdout}{result.stderr}")
    generated = out_dir.joinpath(*job.package.split("."))
    if not (generated / "__init__.py").is_file():
        raise SystemExit(f"flatc produced no package at {generated}")
    return generated


def _differences(generated: Path, committed: Path) -> list[str]:
    if not committed.is_dir():
        return [f"{committed} is missing"]
    comparison = filecmp.dircmp(generated, committed, ignore=["__pycache__"])
    problems = [f"missing {committed / name}" for name in comparison.left_only]
    problems += [f"stale extra file {committed / name}" for name in comparison.right_only]
    _, mismatch, errors = filecmp.cmpfiles(generated, committed, comparison.common_files, shallow=False)
    problems += [f"out of date: {committed / name}" for name in mismatch + errors]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare the committed code with a fresh generation; exit 1 on difference")
    args = parser.parse_args(argv)
    flatc = find_flatc()
    problems: list[str] = []
    for job in schema_jobs():
        with tempfile.TemporaryDirectory(prefix="vktrain-flatc-") as scratch:
            generated = generate_into(job, flatc, Path(scratch))
            if args.check:
                problems += _differences(generated, job.output_dir)
            else:
                if job.output_dir.exists():
                    shutil.rmtree(job.output_dir)
                shutil.copytree(generated, job.output_dir, ignore=shutil.ignore_patterns("__pycache__"))
                print(f"generated {job.output_dir.relative_to(REPO_ROOT)} from {job.main_schema}")
    if problems:
        print("generated flatbuffer code is out of date; run `python -m vktrain.serialization.generate`:",
              *problems, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

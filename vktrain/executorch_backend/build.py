"""Build the trampoline (trampoline.cpp) into a shared library against the installed executorch wheel.

The library is cached, keyed by a hash of the source, the build command, the executorch version and the
Python version, under $VKTRAIN_CACHE_DIR or $XDG_CACHE_HOME/vktrain (default ~/.cache/vktrain), in
executorch_backend/. It is built on first use; a stale or missing one is rebuilt. The compiler is
$VKTRAIN_CXX (default g++).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from vktrain.contract import BACKEND_ID
from vktrain.errors import VktrainError
# vktrain's cache folder, one rule for every cache (the pipeline cache's too): $VKTRAIN_CACHE_DIR, else
# $XDG_CACHE_HOME/vktrain, else ~/.cache/vktrain.
from vktrain.runtime.vk.pipeline_store import CACHE_DIR_ENV as CACHE_ENV, cache_dir

SOURCE = Path(__file__).with_name("trampoline.cpp")
BRIDGE_MODULE = "vktrain.executorch_backend.bridge"
COMPILER_ENV = "VKTRAIN_CXX"
# The definitions the wheel's CMake config (share/cmake/executorch-config.cmake) asks consumers for.
EXECUTORCH_DEFINITIONS = ("C10_USING_CUSTOM_GENERATED_MACROS", "ET_EVENT_TRACER_ENABLED")


class TrampolineBuildError(VktrainError):
    """The trampoline cannot be built: no compiler, no headers, or the compiler failed."""


def executorch_paths() -> tuple[list[Path], Path, str]:
    """(include dirs, lib dir, version) of the installed executorch wheel."""
    try:
        from executorch import version
    except ImportError as exc:
        raise TrampolineBuildError(f"the executorch package is not importable ({exc}); install the executorch "
                                   "wheel to run vktrain .pte files through ExecuTorch's runtime") from None
    root = Path(version.__file__).parent  # executorch is a namespace package: no __init__ to locate
    include, lib = root / "include", root / "lib"
    interface = include / "executorch/runtime/backend/interface.h"
    if not interface.is_file():
        raise TrampolineBuildError(f"the executorch package at {root} has no C++ headers ({interface} is missing); "
                                   "expected a wheel that ships include/ (executorch >= 1.5)")
    if not (lib / "libexecutorch.so").is_file():
        raise TrampolineBuildError(f"the executorch package at {root} has no {lib / 'libexecutorch.so'}")
    # The vendored c10 headers, as the wheel's CMake config adds them (EXECUTORCH_INCLUDE_DIRS).
    c10 = include / "executorch/runtime/core/portable_type/c10"
    return [include, c10], lib, version.__version__


def python_include() -> Path:
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise TrampolineBuildError(f"Python's C headers are missing ({include / 'Python.h'}): install them "
                                   f"(Debian: apt-get install python3-dev)")
    return include


def compiler() -> str:
    name = os.environ.get(COMPILER_ENV) or "g++"
    path = shutil.which(name)
    if path is None:
        raise TrampolineBuildError(f"C++ compiler {name!r} (${COMPILER_ENV}) not found: install g++ "
                                   f"(apt-get install g++) or point ${COMPILER_ENV} at a C++17 compiler")
    return path


def build_command(output: Path) -> list[str]:
    includes, lib, _ = executorch_paths()
    return [compiler(), "-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
            *(f"-D{d}" for d in EXECUTORCH_DEFINITIONS),
            f'-DVKTRAIN_BACKEND_ID="{BACKEND_ID}"', f'-DVKTRAIN_BRIDGE_MODULE="{BRIDGE_MODULE}"',
            *(f"-I{include}" for include in includes), f"-I{python_include()}", str(SOURCE), "-o", str(output),
            f"-L{lib}", "-lexecutorch", f"-Wl,-rpath,{lib}"]


def library_target() -> Path:
    """Where the cache keeps the trampoline built from the current source with the current toolchain."""
    _, _, version = executorch_paths()
    command = build_command(Path("OUT"))
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *command, version, sys.version]).encode()).hexdigest()[:16]
    return cache_dir() / "executorch_backend" / f"vktrain_executorch_backend-{key}.so"


def library_path() -> Path:
    """The built trampoline, building it first when the cache has none for this source and toolchain."""
    target = library_target()
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built next to the target, then renamed: a concurrent or killed build never leaves a partial library.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            partial = Path(scratch) / target.name
            result = subprocess.run(build_command(partial), capture_output=True, text=True)
            if result.returncode != 0:
                raise TrampolineBuildError(f"building the ExecuTorch trampoline {SOURCE} failed (exit "
                                           f"{result.returncode}):\n{result.stderr.strip()[-4000:]}")
            os.replace(partial, target)
    except OSError as exc:
        raise TrampolineBuildError(f"cannot build the ExecuTorch trampoline into {target.parent} ({exc}); point "
                                   f"${CACHE_ENV} at a writable directory") from None
    return target


__all__ = ["BRIDGE_MODULE", "COMPILER_ENV", "TrampolineBuildError", "build_command", "cache_dir", "library_path", "library_target"]

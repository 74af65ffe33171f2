"""The native backend's loader: libvktrain_executorch_backend.so (native/executorch/backend.cc), built by
scripts/native_build.sh into build/native where the executorch wheel ships its C++ runtime, loaded with
RTLD_GLOBAL into this process after `executorch.runtime` (whose libexecutorch.so holds the backend registry
the library joins when it is loaded). Its init / execute / destroy run the native runtime: no vktrain Python
module and no Vulkan binding is imported, here or when ExecuTorch calls them.

$VKTRAIN_EXECUTORCH_BACKEND_LIBRARY names the library elsewhere (an installed copy).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

from vktrain.errors import VktrainError

LIBRARY_ENV = "VKTRAIN_EXECUTORCH_BACKEND_LIBRARY"
LIBRARY_NAME = "libvktrain_executorch_backend.so"
BUILT = Path(__file__).resolve().parents[2] / "build" / "native" / LIBRARY_NAME


class NativeBackendMissingError(VktrainError):
    """The native backend's library is not built (or $VKTRAIN_EXECUTORCH_BACKEND_LIBRARY names no file)."""


def library_path() -> Path:
    """The library to load: $VKTRAIN_EXECUTORCH_BACKEND_LIBRARY, else the one scripts/native_build.sh builds."""
    named = os.environ.get(LIBRARY_ENV)
    path = Path(named) if named else BUILT
    if not path.is_file():
        where = f"${LIBRARY_ENV} names {path}, which" if named else f"{path}"
        raise NativeBackendMissingError(
            f"the native ExecuTorch backend {where} is not there: build it with scripts/native_build.sh (it is built "
            f"where the executorch wheel ships include/ and lib/libexecutorch.so), or use the Python runtime's "
            f"backend: VKTRAIN_EXECUTORCH_BACKEND=python")
    return path


def load() -> ctypes.CDLL:
    """Loads the library (registering the backend) and checks its registration; the library."""
    library = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
    library.vktrain_executorch_last_error.restype = ctypes.c_char_p
    library.vktrain_executorch_live_delegates.restype = ctypes.c_int
    return library


def last_error(library: ctypes.CDLL) -> Optional[str]:
    message = library.vktrain_executorch_last_error().decode("utf-8", "replace")
    return message or None


__all__ = ["BUILT", "LIBRARY_ENV", "NativeBackendMissingError", "last_error", "library_path", "load"]

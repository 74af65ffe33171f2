"""vktrain's delegate for the stock ExecuTorch runtime (the executorch wheel's `executorch.runtime`).

    import vktrain.executorch_backend          # builds (once, cached) and loads the trampoline
    from executorch.runtime import Runtime
    method = Runtime.get().load_program("step.pte").load_method("forward")
    loss = method.execute([token_ids, labels, hparams, n_valid])[0]

Importing this package builds trampoline.cpp against the wheel's headers and libexecutorch.so if the
cache has no library for this source and toolchain (build.py), and loads it with RTLD_GLOBAL after
`executorch.runtime`, which registers the backend vktrain.contract.BACKEND_ID with ExecuTorch's
runtime. Its init / execute / destroy run vktrain's Python runtime (bridge.py): the delegate's state
stays resident on the Vulkan device between execute calls, as with TrainingRunner.

Delegates run on a Device opened by the first init (VKTRAIN_DEVICE), or on one given to `use_device`.
Failures reach ExecuTorch as a non-Ok Error; the reason is logged ("vktrain.executorch_backend") and
kept in `last_error()`.
"""
from __future__ import annotations

import ctypes

import executorch.runtime  # noqa: F401  (loads libexecutorch.so, whose backend registry the trampoline joins)

from vktrain.contract import BACKEND_ID
from vktrain.executorch_backend.bridge import executors, last_error, use_device
from vktrain.executorch_backend.build import TrampolineBuildError, library_path

LIBRARY = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
_registration = LIBRARY.vktrain_executorch_backend_registration()
if _registration != 0:
    raise TrampolineBuildError(f"registering backend {BACKEND_ID!r} with ExecuTorch failed with error "
                               f"{_registration:#x} (0x16: a backend of that name is already registered)")

__all__ = ["BACKEND_ID", "LIBRARY", "executors", "TrampolineBuildError", "last_error", "library_path", "use_device"]

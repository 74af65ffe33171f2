"""vktrain's delegate for the stock ExecuTorch runtime (the executorch wheel's `executorch.runtime`).

    import vktrain.executorch_backend          # registers vktrain's backend with ExecuTorch's runtime
    from executorch.runtime import Runtime
    program = Runtime.get().load_program("step.pte")
    method = program.load_method("forward")
    loss = method.execute([token_ids, labels, hparams, n_valid])[0]
    eval_loss = program.load_method("eval").execute([token_ids, labels, n_valid])[0]   # the trained adapters

Importing this package registers the backend vktrain.contract.BACKEND_ID, run by the implementation
$VKTRAIN_EXECUTORCH_BACKEND names:

  native (default): the native runtime (native/executorch/backend.cc, loaded by native.py): the delegate blob
    read and verified in C++, its embedded schedule (`vktrain export --target`) replayed on the Vulkan device;
    no vktrain Python module runs in the loop. An eval method binds the training step's state.
  python: the trampoline (trampoline.cpp, built by build.py on first use) into vktrain's Python runtime
    (bridge.py). Kept for what the native runtime does not run yet: a .pte without embedded schedules (it
    plans at load), cooperative-matrix schedules, synthetic constants, the accumulate method.

Only one can be registered in a process (ExecuTorch refuses a second backend of one name). Failures reach
ExecuTorch as a non-Ok Error; the reason is logged and kept in `last_error()`.
"""
from __future__ import annotations

import os
from typing import Optional

import executorch.runtime  # noqa: F401  (loads libexecutorch.so, whose backend registry the library joins)

from vktrain.contract import BACKEND_ID
from vktrain.errors import VktrainError

BACKEND_ENV = "VKTRAIN_EXECUTORCH_BACKEND"
IMPLEMENTATIONS = ("native", "python")
IMPLEMENTATION = os.environ.get(BACKEND_ENV) or "native"


class BackendRegistrationError(VktrainError):
    """The backend cannot be registered: an unknown implementation, or ExecuTorch refused the registration."""


if IMPLEMENTATION not in IMPLEMENTATIONS:
    raise BackendRegistrationError(f"${BACKEND_ENV} is {IMPLEMENTATION!r}; expected one of {', '.join(IMPLEMENTATIONS)}")

if IMPLEMENTATION == "native":
    from vktrain.executorch_backend import native as _native

    LIBRARY = _native.load()

    def last_error() -> Optional[str]:
        """The message of the last failure reported to ExecuTorch (None if none yet)."""
        return _native.last_error(LIBRARY)

    def live_delegates() -> int:
        """How many delegates ExecuTorch has initialized and not destroyed."""
        return LIBRARY.vktrain_executorch_live_delegates()
else:
    import ctypes

    from vktrain.executorch_backend.bridge import executors, last_error, use_device  # noqa: F401
    from vktrain.executorch_backend.build import library_path

    LIBRARY = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)

    def live_delegates() -> int:
        """How many delegates ExecuTorch has initialized and not destroyed."""
        return len(executors())

_registration = LIBRARY.vktrain_executorch_backend_registration()
if _registration != 0:
    raise BackendRegistrationError(f"registering backend {BACKEND_ID!r} with ExecuTorch failed with error "
                                   f"{_registration:#x} (0x16: a backend of that name is already registered)")

__all__ = ["BACKEND_ENV", "BACKEND_ID", "IMPLEMENTATION", "LIBRARY", "BackendRegistrationError", "last_error",
           "live_delegates"]

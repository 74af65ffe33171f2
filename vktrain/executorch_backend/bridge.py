"""The Python half of the trampoline: what trampoline.cpp's init / execute / destroy call (GIL held).

init(blob, named_data) builds a vktrain GraphExecutor from the delegate blob, exactly as TrainingRunner
does from a .pte's delegate (deserialize_blob with the .pte's named data, then the op-shape and device
memory checks, then GraphExecutor), and returns (executor, number of inputs, number of outputs).
execute(executor, values) runs it: `values` are the delegate call's tensors as (ExecuTorch scalar type,
sizes, memoryview), inputs then outputs; the outputs are written in place. The state (LoRA tensors,
AdamW moments, step) stays resident in the executor between calls.

These functions never raise into C++: a failure is logged (logger "vktrain.executorch_backend", and
`last_error()`) and returned as the name of the ExecuTorch error the trampoline reports.
"""
from __future__ import annotations

import atexit
import logging
import traceback
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from vktrain.errors import VktrainError
from vktrain.backend.kernel_planning import plan_schedule
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.runtime.program.schedules import method_schedule
from vktrain.serialization.pte import NUMPY_SCALAR_TYPES, PteFormatError
from vktrain.serialization.verify import (
    UnsupportedProgramError,
    check_device_memory,
    check_op_shapes,
    device_memory_bytes,
    infer_from_op_definitions,
)
from vktrain.runtime.vk.errors import DeviceMemoryError
from vktrain.serialization import BlobFormatError, deserialize_blob

LOGGER = logging.getLogger("vktrain.executorch_backend")
# The name the checks' messages give the blob (they name a .pte's `source`; ExecuTorch does not say which file).
BLOB_SOURCE = "ExecuTorch delegate blob"

_state: dict[str, Any] = {"device": None, "owns_device": False, "last_error": None}
_live: list[GraphExecutor] = []  # executors not yet destroyed: closed before the device at exit


class NamedData(Mapping):
    """The .pte's named data (key -> memoryview), read through the trampoline's callbacks on demand."""

    def __init__(self, get, keys):
        self._get, self._keys = get, keys

    def __getitem__(self, key: str) -> memoryview:
        data = self._get(key)
        if data is None:
            raise KeyError(key)
        return data

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def use_device(device) -> None:
    """Delegates initialized from now on run on `device` (a vktrain Device the caller owns and closes,
    after the ExecuTorch programs using it are gone). None, or never called: the first init opens Device()."""
    _state["device"], _state["owns_device"] = device, False


def _device():
    device = _state["device"]
    if device is None or device.closed:
        from vktrain.runtime.vk.device import Device

        device = Device()
        _state["device"], _state["owns_device"] = device, True
    return device


def last_error() -> Optional[str]:
    """The message of the last failure reported to ExecuTorch (None if none yet)."""
    return _state["last_error"]


def executors() -> list[GraphExecutor]:
    """The executors of the delegates ExecuTorch has initialized and not destroyed, oldest first: their
    resident state (read_state, state_names) is the training state of those ExecuTorch methods."""
    return list(_live)


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, (BlobFormatError, PteFormatError, UnsupportedProgramError)):
        return "InvalidProgram"
    if isinstance(exc, ExecutorInputError):
        return "InvalidArgument"
    if isinstance(exc, DeviceMemoryError):
        return "MemoryAllocationFailed"
    return "Internal"


def _report(what: str, exc: BaseException) -> str:
    message = f"{what}: {type(exc).__name__}: {exc}"
    _state["last_error"] = message
    # A VktrainError is bad input: its message says enough. Anything else is a bug: keep the traceback.
    LOGGER.error(message if isinstance(exc, VktrainError) else message + "\n" + traceback.format_exc())
    return _error_name(exc)


def init(blob: memoryview, named_data: Optional[tuple]):
    try:
        graph = deserialize_blob(blob, named_data=NamedData(*named_data) if named_data is not None else None)
        check_op_shapes(BLOB_SOURCE, graph, infer_from_op_definitions)
        device = _device()
        check_device_memory(BLOB_SOURCE, graph, device_memory_bytes(device))
        obtained = method_schedule(graph, device, planner=plan_schedule, embedded=None, source=BLOB_SOURCE)
        executor = GraphExecutor(device, graph, obtained.schedule, verify=obtained.verify, timing=False)
    except Exception as exc:
        return _report(f"{BLOB_SOURCE}: init", exc)
    _live.append(executor)
    return executor, len(graph.inputs), len(graph.outputs)


def _array(scalar_type: int, sizes: tuple, data: memoryview) -> np.ndarray:
    dtype = NUMPY_SCALAR_TYPES.get(scalar_type)
    if dtype is None:
        raise ExecutorInputError(f"ExecuTorch scalar type {scalar_type} is not one vktrain reads "
                                 f"(expected one of {sorted(int(t) for t in NUMPY_SCALAR_TYPES)})")
    return np.frombuffer(data, dtype).reshape(sizes)


def execute(executor: GraphExecutor, values: list) -> Optional[str]:
    try:
        count = len(executor.graph.inputs)
        inputs = [_array(*value) for value in values[:count]]
        results = executor.run(*inputs)
        for index, (value, result) in enumerate(zip(values[count:], results)):
            out = _array(*value)
            if out.shape != result.shape or out.dtype.kind != result.dtype.kind:
                raise ExecutorInputError(f"delegate output {index} is {result.dtype}{list(result.shape)}; ExecuTorch "
                                         f"allocated {out.dtype}{list(out.shape)} for it")
            out[...] = result
    except Exception as exc:
        return _report(f"{BLOB_SOURCE}: execute", exc)
    return None


def destroy(executor: GraphExecutor) -> None:
    try:
        if executor in _live:
            _live.remove(executor)
            executor.close()
    except Exception as exc:
        _report(f"{BLOB_SOURCE}: destroy", exc)


@atexit.register
def _close_at_exit() -> None:
    # ExecuTorch may destroy its methods after this (or never): free the device objects while it is open.
    device = _state["device"]
    for executor in list(_live):
        destroy(executor)
    if device is not None and _state["owns_device"] and not device.closed:
        device.close()


__all__ = ["NamedData", "destroy", "execute", "executors", "init", "last_error", "use_device"]

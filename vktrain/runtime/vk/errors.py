"""Exceptions of the Vulkan runtime, and the one place Vulkan results become them.

Every Vulkan entry point that returns a VkResult is called through `vk_call`, so a failure surfaces as
`VulkanError` naming the call and the result (never a bare binding exception or a crash). Loading the
`vulkan` binding is also done here (`load_vulkan`): the binding dlopens libvulkan at import time, and a
missing loader must become an error that says what to install, not an OSError from deep inside cffi.
"""
from __future__ import annotations

from typing import Any, Callable
from vktrain.errors import VktrainError
from vktrain.serialization.dispatch import ScheduleError  # noqa: F401  (the records' error, on the ground floor)

INSTALL_HINT = (
    "install a Vulkan loader and a driver (Debian/Ubuntu: `apt-get install libvulkan1 mesa-vulkan-drivers`; "
    "mesa-vulkan-drivers provides lavapipe, a CPU implementation), or your GPU vendor's Vulkan driver"
)


class RuntimeErrorBase(VktrainError, RuntimeError):
    """Base of every error raised by vktrain.runtime."""


class VulkanUnavailableError(RuntimeErrorBase):
    """No Vulkan loader, no instance, or no physical device could be found."""


class VulkanError(RuntimeErrorBase):
    """A Vulkan call returned a failing VkResult.

    `call` is the entry point's name (e.g. "vkAllocateMemory"), `result` the numeric VkResult and
    `result_name` its symbolic name (e.g. "VK_ERROR_OUT_OF_DEVICE_MEMORY").
    """

    def __init__(self, call: str, result: int, result_name: str, detail: str = ""):
        self.call = call
        self.result = result
        self.result_name = result_name
        message = f"{call} failed with {result_name} ({result})"
        if detail:
            message += f": {detail}"
        super().__init__(message)


class DeviceSelectionError(RuntimeErrorBase, ValueError):
    """VKTRAIN_DEVICE (or an explicit selector) matches no physical device."""


class ValidationLayerMissingError(VulkanUnavailableError):
    """Validation was requested but VK_LAYER_KHRONOS_validation is not installed."""


class BufferUsageError(RuntimeErrorBase, ValueError):
    """A buffer operation was asked for something the buffer cannot do (size, dtype, range)."""


class DeviceMemoryError(RuntimeErrorBase):
    """Device memory for a buffer cannot be had: the request is above a device limit
    (maxMemoryAllocationSize, the heap size, maxMemoryAllocationCount) or the driver ran out.

    `what` names the buffer, `requested_bytes` is what was asked for, `limit` says which limit it ran
    into and `limit_bytes` is that limit in bytes (None for a count); a driver failure chains its VulkanError.
    """

    def __init__(self, what: str, requested_bytes: int, limit: str, limit_bytes: int | None = None):
        self.what = what
        self.requested_bytes = requested_bytes
        self.limit = limit
        self.limit_bytes = limit_bytes
        super().__init__(f"cannot allocate {what}: {format_bytes(requested_bytes)} asked for, but {limit}")


def format_bytes(nbytes: int) -> str:
    """`nbytes` exactly, with a binary-unit approximation for reading (e.g. "2147483648 bytes (2.00 GiB)")."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes} bytes ({nbytes / (1 << shift):.2f} {unit})"
    return f"{nbytes} bytes"


class BindingRangeError(RuntimeErrorBase, ValueError):
    """A storage-buffer binding exceeds a device limit (maxStorageBufferRange, offset alignment)."""


def load_vulkan():
    """Import and return the `vulkan` binding, or raise VulkanUnavailableError saying what to install."""
    try:
        import vulkan
    except OSError as exc:  # the binding dlopens libvulkan.so.1 on import
        raise VulkanUnavailableError(f"cannot load the Vulkan loader library ({exc}); {INSTALL_HINT}") from exc
    except ImportError as exc:
        raise VulkanUnavailableError(
            f"the Python package `vulkan` is not importable ({exc}); install it with `pip install vulkan`"
        ) from exc
    return vulkan


_RESULT_NAMES: dict[int, str] | None = None


def result_name(code: int) -> str:
    """Symbolic name of a VkResult code (e.g. -2 -> "VK_ERROR_OUT_OF_DEVICE_MEMORY")."""
    global _RESULT_NAMES
    if _RESULT_NAMES is None:
        vk = load_vulkan()
        names: dict[int, str] = {}
        # VkResult values share integers with other enums; only these prefixes are VkResult names.
        positive = ("VK_SUCCESS", "VK_NOT_READY", "VK_TIMEOUT", "VK_EVENT_SET", "VK_EVENT_RESET",
                    "VK_INCOMPLETE", "VK_SUBOPTIMAL_KHR", "VK_THREAD_IDLE_KHR", "VK_THREAD_DONE_KHR",
                    "VK_OPERATION_DEFERRED_KHR", "VK_OPERATION_NOT_DEFERRED_KHR")
        for attr in dir(vk):
            if attr.startswith("VK_ERROR_") or attr in positive:
                value = getattr(vk, attr)
                if isinstance(value, int):
                    names.setdefault(value, attr)
        _RESULT_NAMES = names
    return _RESULT_NAMES.get(code, "VK_RESULT_UNKNOWN")


def _code_of_binding_exception(vk, exc: BaseException) -> int | None:
    for code, cls in vk.exception_codes.items():
        if code is not None and type(exc) is cls:
            return code
    return None


def vk_call(call: str, fn: Callable[..., Any], *args: Any, detail: str = "") -> Any:
    """Call a binding function; turn a failing VkResult into VulkanError naming `call` and the result.

    The binding raises its own exception class per VkResult (both errors and non-success codes such
    as VK_TIMEOUT); those all become VulkanError here.
    """
    vk = load_vulkan()
    try:
        return fn(*args)
    except (vk.VkError, vk.VkException) as exc:
        code = _code_of_binding_exception(vk, exc)
        if code is None:
            raise VulkanError(call, 0, type(exc).__name__, detail) from exc
        raise VulkanError(call, code, result_name(code), detail) from exc

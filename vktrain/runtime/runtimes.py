"""Which device layer runs a program: the Vulkan runtime (default) or the WebGPU one.

Both share everything above the device (the .pte reader, the executor, the Dispatch schedule, the
memory plan, the training loop); `open_device(runtime)` opens the device of one, and Buffer/Program
follow the device they are given. The WebGPU layer is imported only when asked for, so the Vulkan
path never needs wgpu.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

from vktrain.errors import VktrainError

VULKAN = "vulkan"
WEBGPU = "webgpu"
RUNTIMES = (VULKAN, WEBGPU)
DEFAULT_RUNTIME = VULKAN
RUNTIME_HELP = ("device layer: vulkan (default; the `vulkan` package and a Vulkan driver) or webgpu (wgpu-py, "
                "`pip install 'vktrain[webgpu]'`, over wgpu's Vulkan/Metal/D3D12 backends, WGSL kernels)")


class RuntimeChoiceError(VktrainError, ValueError):
    """A runtime name that is none of RUNTIMES, or a device that is not the runtime asked for."""


def check_runtime(runtime: Any, what: str = "runtime") -> str:
    if runtime not in RUNTIMES:
        raise RuntimeChoiceError(f"{what} must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    return runtime


def runtime_of(device: Any) -> str:
    """The runtime a vktrain device belongs to (a WebGPU Device names its own Buffer type)."""
    return WEBGPU if getattr(device, "buffer_type", None) is not None else VULKAN


def open_device(runtime: str = DEFAULT_RUNTIME, **options: Any):
    """A new Device of `runtime` (env VKTRAIN_DEVICE picks among its devices); the caller closes it."""
    if check_runtime(runtime) == WEBGPU:
        from vktrain.runtime.webgpu.device import Device
    else:
        from vktrain.runtime.vk.device import Device
    return Device(**options)


def device_for(device: Any, runtime: str | None) -> tuple[Any, bool]:
    """(`device`, False) when given (it must be of `runtime` if that is given too), else
    (open_device(runtime or the default), True): the second item says whether the caller owns it."""
    if device is None:
        return open_device(DEFAULT_RUNTIME if runtime is None else runtime), True
    if runtime is not None and runtime_of(device) != check_runtime(runtime):
        raise RuntimeChoiceError(f"runtime={runtime!r} but the device given is a {runtime_of(device)} device: {device!r}")
    return device, False


def add_runtime_argument(parser) -> None:
    """`--runtime vulkan|webgpu`, `--max-binding-mib N` and `--device-profile NAME|FILE.json` on a command that
    runs a program (train, eval, generate); `max_binding_bytes(args)` reads the second for the runners, and a
    command decorated with `with_device_profile` applies the third."""
    parser.add_argument("--runtime", choices=RUNTIMES, default=None, help=RUNTIME_HELP)
    parser.add_argument("--max-binding-mib", type=int, default=None, metavar="N",
                        help="plan for a max storage binding size of N MiB (below the device's; e.g. 128, a "
                             "browser's WebGPU default): tensors over it are split across dispatches where the kernel "
                             "can, others are refused at load naming them; on either runtime")
    parser.add_argument("--device-profile", metavar="NAME|FILE.json", default=None,
                        help="run as if the device's limits were this profile's (a built-in: `vktrain devices "
                             "--profiles`, or a profile file): planned with the profile's binding range, allocation "
                             "size, shared memory, workgroup limits and features; a profile the device cannot "
                             "emulate, or a program over its limits, is refused at load naming the limit "
                             "(env VKTRAIN_DEVICE_PROFILE)")


def max_binding_bytes(args) -> int | None:
    """--max-binding-mib in bytes (None when not given); the executor refuses values it cannot plan for."""
    mib = getattr(args, "max_binding_mib", None)
    return None if mib is None else mib << 20 if mib > 0 else mib


def with_device_profile(run: Callable[..., int]) -> Callable[..., int]:
    """`run(args, ...)` with --device-profile applied: the profile is checked (a built-in name or a valid
    profile file) before anything runs, and VKTRAIN_DEVICE_PROFILE names it while `run` runs (the executor
    plans with it: vktrain.runtime.device_profiles.planning_profile)."""
    from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV
    from vktrain.serialization.device_profile import resolve_profile

    @functools.wraps(run)
    def wrapped(args, *rest, **options) -> int:
        spec = getattr(args, "device_profile", None)
        if spec is None:
            return run(args, *rest, **options)
        resolve_profile(spec)  # refused by name (DeviceProfileError) before anything runs
        before = os.environ.get(DEVICE_PROFILE_ENV)
        os.environ[DEVICE_PROFILE_ENV] = spec
        try:
            return run(args, *rest, **options)
        finally:
            if before is None:
                os.environ.pop(DEVICE_PROFILE_ENV, None)
            else:
                os.environ[DEVICE_PROFILE_ENV] = before
    return wrapped

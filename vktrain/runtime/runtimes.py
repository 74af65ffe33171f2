"""Which device layer runs a program: the Vulkan runtime (default) or the WebGPU one.

Both share everything above the device (the .pte reader, the executor, the Dispatch schedule, the
memory plan, the training loop); `open_device(runtime)` opens the device of one, and Buffer/Program
follow the device they are given. The WebGPU layer is imported only when asked for, so the Vulkan
path never needs wgpu.
"""
from __future__ import annotations

from typing import Any

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
    """`--runtime vulkan|webgpu` and `--max-binding-mib N` on a command that runs a program (train, eval,
    generate); `max_binding_bytes(args)` reads the latter for the runners."""
    parser.add_argument("--runtime", choices=RUNTIMES, default=None, help=RUNTIME_HELP)
    parser.add_argument("--max-binding-mib", type=int, default=None, metavar="N",
                        help="plan for a max storage binding size of N MiB (below the device's; e.g. 128, a "
                             "browser's WebGPU default): tensors over it are split across dispatches where the kernel "
                             "can, others are refused at load naming them; on either runtime")


def max_binding_bytes(args) -> int | None:
    """--max-binding-mib in bytes (None when not given); the executor refuses values it cannot plan for."""
    mib = getattr(args, "max_binding_mib", None)
    return None if mib is None else mib << 20 if mib > 0 else mib

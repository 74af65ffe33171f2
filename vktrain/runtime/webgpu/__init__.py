"""vktrain's WebGPU device layer (wgpu-py; imported only when a WebGPU device is asked for).

The same Dispatch records, kernel families, executor and training loop as the Vulkan runtime run on it;
only the device layer and the kernels (WGSL, vktrain/runtime_shaders/wgsl/) differ:

    from vktrain.runtime import Buffer, Dispatch, Program
    from vktrain.runtime.webgpu import Device
    with Device() as dev:                    # env VKTRAIN_DEVICE=<index|name part> picks the adapter;
                                             # Device(limits=BROWSER_DEFAULT_LIMITS): what a browser grants
        x = Buffer.from_array(dev, array)    # vktrain.runtime's Buffer/Program build the WebGPU ones
        prog = Program(dev, dispatches, {"x": x, ...}, timing=True)
        prog.replay(); prog.timings(); x.read(np.float32)

`Buffer(device, ...)` and `Program(device, ...)` from vktrain.runtime (or vktrain.runtime.vk) build
this layer's objects when `device` is a WebGPU Device (its `buffer_type` / `program_type`), so code
written against the Vulkan layer runs here unchanged. device.py: adapter choice, limits, features,
host sync; memory.py: Buffer; pipelines.py: WGSL pipelines; program.py: Program; reflect.py: what a
WGSL kernel declares; errors.py: WebGPUUnavailableError, WebGPUError, MissingKernelsError (buffer
and schedule errors are the Vulkan layer's: BufferUsageError, BindingRangeError, ScheduleError,
DeviceMemoryError).
"""
import importlib

_EXPORTS = {
    "Device": ".device", "WebGPULimits": ".device", "BROWSER_DEFAULT_LIMITS": ".device", "load_wgpu": ".device",
    "Buffer": ".memory",
    "Program": ".program", "run_dispatches": ".program", "missing_kernels": ".program",
    "WGSLInterface": ".reflect", "reflect_wgsl": ".reflect",
    "MissingKernelsError": ".errors", "WebGPUError": ".errors", "WebGPUUnavailableError": ".errors",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vktrain.runtime.webgpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)

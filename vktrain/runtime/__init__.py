"""vktrain's Vulkan runtime core (numpy + the `vulkan` cffi binding + flatbuffers; never torch/executorch).

API summary
-----------
    from vktrain.runtime import Device, Buffer, Dispatch, BufferBinding, Program, pack_push, ceil_div

    with Device() as dev:                          # env VKTRAIN_DEVICE=<index|name part>, VKTRAIN_VALIDATION=1
        x = Buffer.from_array(dev, np.arange(n, dtype=np.float32), name="x")
        y = Buffer(dev, 4 * n, name="y")           # bytes; y.write(array, offset=0); y.read(np.float32, shape)
        d = Dispatch("test_axpy",                  # shader name; variants: "name@DEFINE+N=4"
                     groups=ceil_div(n, 64),       # int or (x, y, z)
                     bindings=[BufferBinding("x"), BufferBinding("y", offset=0, size=None)],
                     push_constants=pack_push(n, 2.0),      # kernel bytes (uint n; float alpha)
                     spec_constants={3: 1.0}, local_size=(64, 1, 1))
        prog = Program(dev, [d], {"x": x, "y": y}, timing=True)   # records once
        prog.replay()                              # submit + wait on a fence; write new inputs, replay again
        prog.timings()                             # [seconds per Dispatch] or None without timestamps
        result = y.read(np.float32)

Device: `name`, `device_type`, `limits` (DeviceLimits), `features` (enabled optional features, e.g.
"shaderInt8", "storageBuffer8BitAccess", "shaderFloat16", "shaderInt64", "shaderFloat64";
"robustBufferAccess" with validation),
`unified_memory`, `timestamps_supported`, `subgroup_size`, `subgroup_operations` (VkSubgroupFeatureFlags
usable in compute), `validation_messages` / `take_validation_messages()`, `pipelines` (PipelineCache),
`memory_stats()` (MemoryStats: allocations, bytes reserved / in use), `memory_budget()` (MemoryBudget: heaps,
largest buffer, `check_buffers(name -> bytes, what)` for load-time checks), `close()`. Everything created
from a Device is freed by its close().

Buffer(device, nbytes, name=, staging=None): sub-allocated from a few large device-memory blocks
(vk/allocator.py; `count_block_allocations` predicts the count without a device); direct mapped access
on unified memory, staging copies otherwise. `write(array|bytes, offset)`, `read(dtype, shape, offset)`, `zero()`,
`destroy()`, `.size` (nbytes padded to 4), `.nbytes`.

Dispatch / BufferBinding / pack_push live in vktrain/serialization/dispatch.py, split_groups / plan_barriers
in `vk/schedule.py` (pure data, no device needed); see its docstring for the conventions: bindings = shader's
set-0 bindings in order, push constants must match the shader's block, split dispatches for shaders whose push
block starts with the group-offset header (`uint4 vktrain_group_offset`, common.slangh), spec ids 0-2 = local size when `local_size` is given. Barriers are
inserted only between dependent dispatches (by buffer byte ranges and read/write access, taken from
the shader's readonly/writeonly qualifiers unless BufferBinding.access says otherwise).

Program(device, dispatches, buffers, timing=False, max_group_count=None, max_dispatches_per_submit=None):
`replay()` (= `submit()` + `wait()`), `timings()`, `barriers`, `recorded_dispatch_count`, `submits_per_replay`,
`submit_count`, `destroy()`. `run_dispatches(...)` runs a
list once.

Shaders: `vktrain/runtime_shaders/*.slang`, compiled by `python -m vktrain.runtime_shaders.build`
into the git-ignored `vktrain/runtime_shaders/spirv/` cache (and to WGSL in `wgsl/generated/`;
ship both to machines without a compiler; list the variants a source needs in its `// vktrain-variants:`
line so the build includes them).

Errors (errors.py): VulkanError (call, result, result_name) for any failing Vulkan call;
VulkanUnavailableError (no loader/device; says what to install); DeviceSelectionError;
ValidationLayerMissingError; BufferUsageError; DeviceMemoryError (a buffer above maxMemoryAllocationSize,
the heap or maxMemoryAllocationCount, or the driver out of memory: names buffer, bytes and limit);
BindingRangeError (maxStorageBufferRange, alignment);
ScheduleError (a Dispatch that does not fit its shader or the device); ShaderNotFoundError /
ShaderBuildError (from vktrain.runtime_shaders).
"""
import importlib

# Lazy exports (PEP 562): `import vktrain.train.adapters` (or .pte, .data, ...) must not load the Vulkan
# loader, so host-side code can use the torch-free file formats on a machine without Vulkan.
_EXPORTS = {
    "ShaderBuildError": "vktrain.runtime_shaders.build", "ShaderNotFoundError": "vktrain.runtime_shaders.build",
    "Program": ".vk.commands", "run_dispatches": ".vk.commands",
    "Device": ".vk.device", "DeviceLimits": ".vk.device", "PhysicalDeviceInfo": ".vk.device",
    "ValidationMessage": ".vk.device", "select_physical_device": ".vk.device",
    "BlockPolicy": ".vk.allocator", "MemoryBudget": ".vk.allocator", "MemoryHeap": ".vk.allocator",
    "MemoryStats": ".vk.allocator", "count_block_allocations": ".vk.allocator",
    "DeviceMemoryError": ".vk.errors",
    "BindingRangeError": ".vk.errors", "BufferUsageError": ".vk.errors", "DeviceSelectionError": ".vk.errors",
    "RuntimeErrorBase": ".vk.errors", "ScheduleError": "vktrain.serialization.dispatch", "ValidationLayerMissingError": ".vk.errors",
    "VulkanError": ".vk.errors", "VulkanUnavailableError": ".vk.errors",
    "Buffer": ".vk.memory", "find_memory_type": ".vk.memory",
    "PUSH_HEADER_BYTES": "vktrain.serialization.dispatch", "BufferBinding": "vktrain.serialization.dispatch",
    "Dispatch": "vktrain.serialization.dispatch",
    "ResolvedAccess": ".vk.schedule", "ceil_div": "vktrain.serialization.dispatch", "pack_push": "vktrain.serialization.dispatch",
    "plan_barriers": ".vk.schedule", "split_groups": ".vk.schedule",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vktrain.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BindingRangeError", "BlockPolicy", "Buffer", "BufferBinding", "BufferUsageError", "Device", "DeviceLimits",
    "DeviceMemoryError", "MemoryBudget", "MemoryHeap", "MemoryStats", "count_block_allocations",
    "DeviceSelectionError", "Dispatch", "PUSH_HEADER_BYTES", "PhysicalDeviceInfo", "Program",
    "ResolvedAccess", "RuntimeErrorBase", "ScheduleError", "ShaderBuildError", "ShaderNotFoundError",
    "ValidationLayerMissingError", "ValidationMessage", "VulkanError", "VulkanUnavailableError", "ceil_div",
    "find_memory_type", "pack_push", "plan_barriers", "run_dispatches", "select_physical_device",
    "split_groups",
]

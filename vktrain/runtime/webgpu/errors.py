"""Exceptions of the WebGPU device layer (the Vulkan layer's buffer and schedule errors are shared)."""
from __future__ import annotations

from vktrain.runtime.vk.errors import RuntimeErrorBase

INSTALL_HINT = ("install wgpu-py (`pip install 'vktrain[webgpu]'`, i.e. wgpu==0.32.0) and a GPU driver wgpu "
                "can use (Vulkan, Metal or D3D12; on Linux without a GPU, mesa-vulkan-drivers for lavapipe)")


class WebGPUUnavailableError(RuntimeErrorBase):
    """wgpu is not installed, finds no adapter, or the adapter lacks a limit/feature vktrain needs."""


class WebGPUError(RuntimeErrorBase):
    """A wgpu call failed (validation or device error); the message names the call and the object."""


class MissingKernelsError(RuntimeErrorBase, LookupError):
    """A dispatch list uses shaders that have no WGSL kernel; `shaders` lists every missing one."""

    def __init__(self, shaders: list[str], what: str = "this program"):
        self.shaders = sorted(set(shaders))
        super().__init__(f"the WebGPU runtime cannot run {what}: no WGSL kernel for {len(self.shaders)} shader(s): "
                         f"{', '.join(self.shaders)} (vktrain/runtime_shaders/wgsl/<shader>.wgsl)")

"""The vktrain Vulkan ExecuTorch backend: preprocess (edge program -> delegate blob), the graph passes
(passes/) and memory planning.

Importing `vktrain.backend.preprocess` registers `VktrainVulkanBackend` with ExecuTorch (as a
BackendDetails subclass). The names below are exported lazily, so that the torch-free parts (passes,
memory planning, lifetimes) import without torch or executorch."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "memory_planning": ("LiveInterval", "MemoryPlan", "plan_memory", "plan_graph_memory"),
    "passes": ("PASSES", "compile_graph"),
    "preprocess": ("METADATA_BACKEND", "METADATA_REFUSALS", "METADATA_STATE_BYTES", "METADATA_SYNTHETIC_CONSTANTS",
                   "METADATA_UNPLANNED_MEMORY_BYTES", "VktrainVulkanBackend", "build_vk_graph", "metadata_spec",
                   "synthetic_constants_spec"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

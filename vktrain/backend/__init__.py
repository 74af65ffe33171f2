"""The vktrain Vulkan ExecuTorch backend: preprocess (edge program -> delegate blob) and memory planning.

Importing this package registers `VktrainVulkanBackend` with ExecuTorch (as a BackendDetails subclass)."""
from .memory_planning import LiveInterval, MemoryPlan, plan_memory
from .preprocess import (
    METADATA_BACKEND,
    METADATA_REFUSALS,
    METADATA_STATE_BYTES,
    METADATA_SYNTHETIC_CONSTANTS,
    METADATA_UNPLANNED_MEMORY_BYTES,
    VktrainVulkanBackend,
    build_vk_graph,
    metadata_spec,
    synthetic_constants_spec,
)

__all__ = [
    "LiveInterval", "METADATA_BACKEND", "METADATA_REFUSALS", "METADATA_STATE_BYTES",
    "METADATA_SYNTHETIC_CONSTANTS", "METADATA_UNPLANNED_MEMORY_BYTES", "MemoryPlan", "VktrainVulkanBackend",
    "build_vk_graph", "metadata_spec", "plan_memory", "synthetic_constants_spec",
]

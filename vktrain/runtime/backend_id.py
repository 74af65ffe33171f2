"""The id the vktrain backend registers with ExecuTorch and records in every .pte's delegate.

Torch-free on purpose: the partitioner / backend (AOT, with torch) and the runner (numpy + Vulkan only)
must agree on it, and only this module can be imported by both.
"""
BACKEND_ID = "VktrainVulkanBackend"

__all__ = ["BACKEND_ID"]

"""The contract shared by the AOT side (export, partitioner, backend; with torch) and the runtime and
training application (numpy + Vulkan only): names and layouts both sides must agree on.

Torch-free on purpose: this is the one module both sides import for these facts.
"""
# The id the vktrain backend registers with ExecuTorch and records in every .pte's delegate.
BACKEND_ID = "VktrainVulkanBackend"

__all__ = ["BACKEND_ID"]

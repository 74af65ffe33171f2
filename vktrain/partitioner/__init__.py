"""Partitioning for the vktrain Vulkan backend: the op registry and the ExecuTorch Partitioner."""
from .op_registry import OpFeatures, TensorArg, check_node, get_op_features, op_key, register_op, supported_ops
from . import etvk_ops  # noqa: F401 (registers the et_vk ops' records)
from .partitioner import BACKEND_ID, REFUSALS_SPEC_KEY, Refusal, VktrainPartitioner, refusals_from_compile_specs

__all__ = [
    "BACKEND_ID", "REFUSALS_SPEC_KEY", "OpFeatures", "Refusal", "TensorArg", "VktrainPartitioner", "check_node",
    "get_op_features", "op_key", "refusals_from_compile_specs", "register_op", "supported_ops",
]

"""Which graph ops the runtime executes: op support as data, read by the partitioner (what it may
delegate), the load-time verifier and the runtime's lowering table alike.

Every op defined in vktrain/opdefs has a runtime kernel (tests/test_partitioner.py checks the kernel
registry against this), except the ops the backend's lora_linear pass expands into ops that have one
before the blob is written (vktrain/backend/passes/lora_linear.py).
"""
from __future__ import annotations

from vktrain.opdefs import OP_DEFS

LORA_LINEAR = "vktrain.lora_linear_q4gsw.default"
LORA_LINEAR_BACKWARD = "vktrain.lora_linear_q4gsw_backward.default"
# Defined ops no blob holds: the backend rewrites each into linear_q4gsw / mm / addmm ops.
EXPANDED_OPS = frozenset({LORA_LINEAR, LORA_LINEAR_BACKWARD})

RUNTIME_OPS = frozenset(OP_DEFS) - EXPANDED_OPS
# The 4-bit base GEMMs of a LoRA linear (its forward and its input gradient), whose outputs the backend's
# gemm_epilogue pass and the planner's rank epilogue pair with the addmm adding the adapter's product.
BASE_GEMMS = frozenset({"vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default"})


def runtime_ops() -> list[str]:
    """Graph op names the runtime can execute, sorted."""
    return sorted(RUNTIME_OPS)

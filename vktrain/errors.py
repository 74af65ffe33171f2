"""The root of vktrain's error family (torch-free; imported by every layer).

A `VktrainError` means bad input (a file, flag, shape or value: the message names the file or field, what
was found and what was expected) or an environmental failure (no Vulkan device, out of device memory, a
full disk). The CLI prints it as `vktrain <command>: error: <message>` and exits 2; anything that is not
a VktrainError is a bug in vktrain and is reported as one.
"""
from __future__ import annotations


class VktrainError(Exception):
    """Bad input or an environmental failure, with a message that says what and where."""


# Raised by kernel planning (vktrain/backend/kernel_planning) and by the runtime's load-time checks of a
# schedule (vktrain/serialization/schedule_memory.py), so both sides name them from here.
class GraphLoweringError(VktrainError, ValueError):
    """A graph op cannot be lowered: unknown op, wrong arity, or arguments no kernel accepts."""


class PrecisionPolicyError(VktrainError, ValueError):
    """A GEMM precision policy the runtime does not know, the program does not allow, or cannot run."""


__all__ = ["GraphLoweringError", "PrecisionPolicyError", "VktrainError"]

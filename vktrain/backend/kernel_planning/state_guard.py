"""The state guard's dispatches, planned with the training step's schedule (plan_schedule(state_guard=True)):
device backups of the mutable state and a NaN/inf check, which vktrain/runtime/delegate/state_guard.py replays.

`save` (into the backup slot GUARD_SLOT): a fill zeroing the per-tensor flags, then per state tensor one
state_guard.slang dispatch (copy its words into the slot, OR a flag when a word is NaN/inf), then
state_guard@ANY folding the flags into the one word of GUARD_RESULT the host reads. Every tensor has its own
256-byte-aligned range in the slot and in the flags buffer, so the copies run without barriers between them.
`restore`: the slot -> state copies (copy.slang). The bindings name the schedule's state buffers and the guard's
three keys (serialization/schedule.py GUARD_KEYS); the runtime binds GUARD_SLOT to each slot's buffer in turn.
"""
from __future__ import annotations

from typing import Sequence

from vktrain.backend.kernel_planning.kernels.layout import elementwise_groups, plan_fill, plan_strided_copy
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import BufferBinding, Dispatch, pack_push
from vktrain.serialization.schedule import GUARD_FLAGS, GUARD_RESULT, GUARD_SLOT, GuardedTensor, StateGuardPlan
from vktrain.serialization.strided_view import StridedView

ALIGN = 256  # >= every device's minStorageBufferOffsetAlignment (the Vulkan spec caps it at 256)
FLAG_STRIDE_WORDS = ALIGN // 4
# state_guard.slang's check modes, by the tensor's stored dtype.
CHECK_NONE, CHECK_FP32, CHECK_FP16 = 0, 1, 2
_CHECKS = {vk.DType.FLOAT32: CHECK_FP32, vk.DType.FLOAT16: CHECK_FP16}


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_state_guard(states: Sequence[tuple[str, BufferBinding, vk.DType]]) -> StateGuardPlan:
    """The guard of `states`: (name, the binding of the tensor's whole words, its stored dtype) per state tensor,
    in the order the runtime names them (the graph's mutable state)."""
    if not states:
        raise ValueError("a state guard needs at least one state tensor")
    tensors, offset = [], 0
    for name, binding, _ in states:
        tensors.append(GuardedTensor(name, offset, binding.size))
        offset += _align(binding.size)
    save = plan_fill(GUARD_FLAGS, FLAG_STRIDE_WORDS * len(states), 0, label="state_guard:clear")
    for index, ((name, binding, dtype), tensor) in enumerate(zip(states, tensors)):
        words = binding.size // 4
        save.append(Dispatch(
            "state_guard", elementwise_groups(words),
            bindings=(BufferBinding(GUARD_SLOT, tensor.slot_offset, binding.size, "w"),
                      BufferBinding(binding.buffer, binding.offset, binding.size, "r"),
                      BufferBinding(GUARD_FLAGS, ALIGN * index, 4, "rw")),
            push_constants=pack_push(words, _CHECKS.get(dtype, CHECK_NONE)),
            label=f"state_guard:{name}"))
    save.append(Dispatch("state_guard@ANY", 1, bindings=(BufferBinding(GUARD_RESULT, 0, 4, "w"),
                                                         BufferBinding(GUARD_FLAGS, access="r")),
                         push_constants=pack_push(len(states), FLAG_STRIDE_WORDS), label="state_guard:any"))
    restore = []
    for (name, binding, _), tensor in zip(states, tensors):
        restore += plan_strided_copy(binding, BufferBinding(GUARD_SLOT, tensor.slot_offset, binding.size),
                                     StridedView.contiguous((binding.size // 4,)), label=f"state_guard:restore:{name}")
    return StateGuardPlan(tuple(tensors), offset, ALIGN * len(states), tuple(save), tuple(restore))


__all__ = ["plan_state_guard"]

"""StateGuard: backups of a program's mutable state on the device, and a NaN/inf check, per step.

    guard = StateGuard(device, executor.shared_state(), slots=2)
    bad = guard.save(0)        # state -> backup slot 0, in one pass that also flags any NaN/inf: one word read
    guard.restore(0)           # backup slot 0 -> state (a device copy)
    arrays = guard.read(0)     # slot 0 on the host (only where a checkpoint must be written from it)

The training loop keeps the last states good to resume from (vktrain/train/train_loop.py); reading every
state tensor to the host each step costs more than the step on a GPU (58 MB for SmolLM2-135M at rank 16),
so the copies stay on the device. `save(slot)` replays one recorded Program: a fill zeroing the per-tensor
flags, then per state tensor one state_guard.slang dispatch (copy its words into the slot, OR a flag when
a word is NaN/inf), then state_guard@ANY folding the flags into one word the host reads. Every tensor has
its own 256-byte-aligned range in the slot and in the flags buffer, so the copies run without barriers
between them. `restore(slot)` replays the slot -> state copies (copy.slang). Nothing is read to the host
but that word, except by `read`.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from vktrain.runtime.delegate.executor import SharedTensor
from vktrain.runtime.delegate.kernels.layout import elementwise_groups, plan_fill, plan_strided_copy
from vktrain.serialization.strided_view import StridedView
from vktrain.runtime.vk.commands import Program
from vktrain.runtime.vk.memory import Buffer
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.runtime.vk.schedule import pack_push
from vktrain.serialization import graph as vk

ALIGN = 256  # >= every device's minStorageBufferOffsetAlignment (the Vulkan spec caps it at 256)
FLAG_STRIDE_WORDS = ALIGN // 4
CHECK_NONE, CHECK_FP32, CHECK_FP16 = 0, 1, 2
_CHECKS = {vk.DType.FLOAT32: CHECK_FP32, vk.DType.FLOAT16: CHECK_FP16}


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _words(tensor: vk.TensorValue) -> int:
    return max(1, -(-tensor.stored_nbytes // 4))


class StateGuard:
    """`slots` device backups of the state tensors `state` (name -> SharedTensor: GraphExecutor.shared_state())
    with the check described in the module docstring. The guard owns its buffers; the state's stay its
    executor's (close the guard first)."""

    def __init__(self, device, state: Mapping[str, SharedTensor], *, slots: int = 2, staging: bool | None = None):
        if not state:
            raise ValueError("a StateGuard needs at least one state tensor")
        self.device = device
        self.state = dict(state)
        self.slots = slots
        keys: dict[int, str] = {}
        self._buffers: dict[str, Buffer] = {}
        for shared in self.state.values():  # the executor's buffers, keyed here by identity
            if id(shared.buffer) not in keys:
                keys[id(shared.buffer)] = f"state.{len(keys)}"
                self._buffers[keys[id(shared.buffer)]] = shared.buffer
        self._layout: dict[str, tuple[BufferBinding, int]] = {}  # name -> (state binding, offset in a slot)
        offset = 0
        for name, shared in self.state.items():
            nbytes = 4 * _words(shared.tensor)
            self._layout[name] = (BufferBinding(keys[id(shared.buffer)], shared.offset, nbytes), offset)
            offset += _align(nbytes)
        self.slot_bytes = offset
        self._owned = {f"slot{i}": Buffer(device, offset, name=f"state_guard.slot{i}", staging=staging)
                       for i in range(slots)}
        self._owned["flags"] = Buffer(device, ALIGN * len(self.state), name="state_guard.flags",
                                     staging=staging)
        # Host-visible (no staging copy to read it): the one word read back per step.
        self._owned["result"] = Buffer(device, 4, name="state_guard.result", staging=False)
        self._buffers.update(self._owned)
        self._programs: list[Program] = []
        try:
            self._save = [self._program(self._save_dispatches(i)) for i in range(slots)]
        except BaseException:
            self.close()
            raise
        # Recorded on first use: a restore is rare (a non-finite step), and recording a dispatch per state
        # tensor costs load time (1,261 tensors for SmolLM2-135M).
        self._restore: list[Program | None] = [None] * slots

    def _program(self, dispatches: list[Dispatch]) -> Program:
        program = Program(self.device, dispatches, self._buffers, timing=False)
        self._programs.append(program)
        return program

    def _save_dispatches(self, slot: int) -> list[Dispatch]:
        dispatches = plan_fill("flags", FLAG_STRIDE_WORDS * len(self.state), 0, label="state_guard:clear")
        for index, (name, (binding, offset)) in enumerate(self._layout.items()):
            tensor = self.state[name].tensor
            words = binding.size // 4
            dispatches.append(Dispatch(
                "state_guard", elementwise_groups(words),
                bindings=(BufferBinding(f"slot{slot}", offset, binding.size, "w"),
                          BufferBinding(binding.buffer, binding.offset, binding.size, "r"),
                          BufferBinding("flags", ALIGN * index, 4, "rw")),
                push_constants=pack_push(words, _CHECKS.get(tensor.storage_dtype, CHECK_NONE)),
                label=f"state_guard:{name}"))
        dispatches.append(Dispatch("state_guard@ANY", 1, bindings=(BufferBinding("result", 0, 4, "w"),
                                                                   BufferBinding("flags", access="r")),
                                   push_constants=pack_push(len(self.state), FLAG_STRIDE_WORDS),
                                   label="state_guard:any"))
        return dispatches

    def _restore_dispatches(self, slot: int) -> list[Dispatch]:
        dispatches = []
        for name, (binding, offset) in self._layout.items():
            words = binding.size // 4
            dispatches += plan_strided_copy(binding, BufferBinding(f"slot{slot}", offset, binding.size),
                                            StridedView.contiguous((words,)), label=f"state_guard:restore:{name}")
        return dispatches

    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.slots):
            raise ValueError(f"slot must be an int in [0, {self.slots}), got {slot!r}")

    def save(self, slot: int) -> bool:
        """Copy the state into backup `slot`; True when any state tensor holds a NaN or an infinity."""
        self._check_slot(slot)
        self._save[slot].replay()
        return bool(self._owned["result"].read(np.uint32, (1,))[0])

    def restore(self, slot: int) -> None:
        """Put backup `slot` back into the state (on the device)."""
        self._check_slot(slot)
        if self._restore[slot] is None:
            self._restore[slot] = self._program(self._restore_dispatches(slot))
        self._restore[slot].replay()

    def read(self, slot: int) -> dict[str, np.ndarray]:
        """Backup `slot` on the host, by state name, in each tensor's graph dtype (a checkpoint's arrays)."""
        self._check_slot(slot)
        raw = self._owned[f"slot{slot}"].read(np.uint8, (self.slot_bytes,))  # one transfer, not one per tensor
        arrays = {}
        for name, (_, offset) in self._layout.items():
            tensor = self.state[name].tensor
            stored = np.frombuffer(raw, tensor.storage_dtype.numpy_dtype, tensor.numel, offset).reshape(tensor.shape)
            arrays[name] = stored.astype(tensor.dtype.numpy_dtype, copy=False)
        return arrays

    def close(self) -> None:
        """Free the Programs and the guard's own buffers (idempotent)."""
        for program in self._programs:
            program.destroy()
        self._programs.clear()
        for buffer in self._owned.values():
            buffer.destroy()
        self._owned.clear()

    def __enter__(self) -> "StateGuard":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["StateGuard"]

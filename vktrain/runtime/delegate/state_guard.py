"""StateGuard: backups of a program's mutable state on the device, and a NaN/inf check, per step.

    guard = StateGuard.for_executor(executor, slots=2)   # the training step's (None: its schedule has no guard)
    bad = guard.save(0)        # state -> backup slot 0, in one pass that also flags any NaN/inf: one word read
    guard.restore(0)           # backup slot 0 -> state (a device copy)
    arrays = guard.read(0)     # slot 0 on the host (only where a checkpoint must be written from it)

The training loop keeps the last states good to resume from (vktrain/train/train_loop.py); reading every
state tensor to the host each step costs more than the step on a GPU (58 MB for SmolLM2-135M at rank 16),
so the copies stay on the device. The dispatches are the schedule's (serialization/schedule.py
StateGuardPlan, planned by vktrain/backend/kernel_planning/state_guard.py): `save(slot)` replays the plan's save
list (a fill zeroing the per-tensor flags, per state tensor one state_guard.slang dispatch copying its words
into the slot and flagging NaN/inf, then state_guard@ANY folding the flags into one word) with the slot's
buffer bound to its backup-slot key, `restore(slot)` its restore list (copy.slang). The guard allocates the
slots, the flags and the result word; nothing is read to the host but that word, except by `read`.
"""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from vktrain.runtime.vk.commands import Program
from vktrain.runtime.vk.memory import Buffer
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.schedule import GUARD_FLAGS, GUARD_RESULT, GUARD_RESULT_BYTES, GUARD_SLOT, StateGuardPlan


class StateGuard:
    """`slots` device backups of the state `plan` guards, with the check described in the module docstring.
    `buffers`: the schedule's buffers by key (those the plan's bindings name: GraphExecutor.bound_buffers());
    `tensors`: each guarded state tensor's record by name (its dtype and shape, for `read`). The guard owns
    its slot, flags and result buffers; the state's stay its executor's (close the guard first)."""

    def __init__(self, device, plan: StateGuardPlan, buffers: Mapping[str, Buffer],
                 tensors: Mapping[str, vk.TensorValue], *, slots: int = 2, staging: bool | None = None,
                 modules: Mapping[str, object] | None = None):
        if not plan.tensors:
            raise ValueError("a StateGuard needs at least one state tensor")
        self.device = device
        self.plan = plan
        self._modules = modules  # shader name -> embedded ShaderModule (None: the local build), as the executor's
        self.tensors = {entry.name: tensors[entry.name] for entry in plan.tensors}
        self.slots = slots
        self.slot_bytes = plan.slot_bytes
        self._owned = {f"slot{i}": Buffer(device, plan.slot_bytes, name=f"state_guard.slot{i}", staging=staging)
                       for i in range(slots)}
        self._owned["flags"] = Buffer(device, plan.flags_bytes, name="state_guard.flags", staging=staging)
        # Host-visible (no staging copy to read it): the one word read back per step.
        self._owned["result"] = Buffer(device, GUARD_RESULT_BYTES, name="state_guard.result", staging=False)
        self._buffers = dict(buffers)
        self._programs: list[Program] = []
        try:
            self._save = [self._program(plan.save, i) for i in range(slots)]
        except BaseException:
            self.close()
            raise
        # Recorded on first use: a restore is rare (a non-finite step), and recording a dispatch per state
        # tensor costs load time (1,261 tensors for SmolLM2-135M).
        self._restore: list[Program | None] = [None] * slots

    @classmethod
    def for_executor(cls, executor, *, slots: int = 2) -> Optional["StateGuard"]:
        """The guard of a GraphExecutor's state as its schedule plans it; None where the schedule has no guard."""
        plan = executor.schedule.state_guard
        if plan is None:
            return None
        tensors = {name: shared.tensor for name, shared in executor.shared_state().items()}
        return cls(executor.device, plan, executor.bound_buffers(), tensors, slots=slots, modules=executor.modules)

    def _program(self, dispatches: tuple[Dispatch, ...], slot: int) -> Program:
        buffers = {**self._buffers, GUARD_SLOT: self._owned[f"slot{slot}"], GUARD_FLAGS: self._owned["flags"],
                   GUARD_RESULT: self._owned["result"]}
        program = Program(self.device, list(dispatches), buffers, timing=False, modules=self._modules)
        self._programs.append(program)
        return program

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
            self._restore[slot] = self._program(self.plan.restore, slot)
        self._restore[slot].replay()

    def read(self, slot: int) -> dict[str, np.ndarray]:
        """Backup `slot` on the host, by state name, in each tensor's graph dtype (a checkpoint's arrays)."""
        self._check_slot(slot)
        raw = self._owned[f"slot{slot}"].read(np.uint8, (self.slot_bytes,))  # one transfer, not one per tensor
        arrays = {}
        for entry in self.plan.tensors:
            name, tensor = entry.name, self.tensors[entry.name]
            stored = np.frombuffer(raw, tensor.storage_dtype.numpy_dtype, tensor.numel,
                                   entry.slot_offset).reshape(tensor.shape)
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

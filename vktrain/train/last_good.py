"""The last two states of a run, kept so that a NaN/inf step can be undone (train_loop.py's docstring).

    copies = last_good_states(runner, limit)      # DeviceCopies, HostCopies, or None (state over `limit`)
    bad = copies.keep(step)                       # the runner's state is S[step]; True if it holds NaN/inf
    copies.restore(step)                          # S[step] back into the runner
    tensors = copies.tensors(step)                # S[step] on the host, None unless held and finite

Two slots: `keep` overwrites the one not holding the newest good state, so after keep(t) the copies hold
S[t] and S[t-1]. A runner with `state_guard()` (TrainingRunner) keeps them on the device: one recorded
copy per step that also checks every word for NaN/inf, one word read back (StateGuard); any other runner
(a test's numpy fake) is copied to the host and scanned there.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from vktrain.train.checkpoint import capture_state, non_finite_tensors

# Up to this many bytes of state, host copies of the last two states are kept (a LoRA state is far smaller).
HOST_STATE_LIMIT = 64 << 20
# Up to this many bytes of state, device copies are (two backups beside the state; WebGPU's default
# largest buffer is 256 MiB, and one slot is one buffer).
DEVICE_STATE_LIMIT = 256 << 20


class _Slots:
    """Which step each of the two slots holds, and whether that state was finite."""

    def __init__(self) -> None:
        self.steps: list[Optional[int]] = [None, None]
        self.finite = [False, False]

    def target(self) -> int:
        """The slot to overwrite: an empty or non-finite one, else the older."""
        for slot in (0, 1):
            if self.steps[slot] is None or not self.finite[slot]:
                return slot
        return 0 if self.steps[0] < self.steps[1] else 1

    def holding(self, step: int) -> Optional[int]:
        for slot in (0, 1):
            if self.steps[slot] == step and self.finite[slot]:
                return slot
        return None

    def record(self, slot: int, step: int, finite: bool) -> None:
        self.steps[slot], self.finite[slot] = step, finite


class HostCopies:
    """Host copies (capture_state) of the runner's state, scanned with numpy."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.slots = _Slots()
        self._copies: list[Optional[dict[str, np.ndarray]]] = [None, None]

    def keep(self, step: int) -> bool:
        slot = self.slots.target()
        self._copies[slot] = capture_state(self.runner)
        bad = bool(non_finite_tensors(self._copies[slot]))
        self.slots.record(slot, step, not bad)
        return bad

    def restore(self, step: int) -> None:
        for name, array in self._copies[self._held(step)].items():
            self.runner.write_state(name, array)

    def tensors(self, step: int) -> Optional[dict[str, np.ndarray]]:
        slot = self.slots.holding(step)
        return None if slot is None else self._copies[slot]

    def _held(self, step: int) -> int:
        slot = self.slots.holding(step)
        if slot is None:
            raise RuntimeError(f"no good copy of step {step}'s state is held (steps held: {self.slots.steps})")
        return slot

    def close(self) -> None:
        self._copies = [None, None]


class DeviceCopies(HostCopies):
    """Backups on the device (StateGuard): no state is read to the host except by `tensors`."""

    def __init__(self, runner: Any, guard: Any) -> None:
        super().__init__(runner)
        self.guard = guard

    def keep(self, step: int) -> bool:
        slot = self.slots.target()
        bad = self.guard.save(slot)
        self.slots.record(slot, step, not bad)
        return bad

    def restore(self, step: int) -> None:
        self.guard.restore(self._held(step))

    def tensors(self, step: int) -> Optional[dict[str, np.ndarray]]:
        slot = self.slots.holding(step)
        return None if slot is None else self.guard.read(slot)

    def close(self) -> None:
        self.guard.close()


def state_nbytes(runner: Any) -> int:
    """Bytes of the runner's state: its own count where it has one, else by reading it once."""
    nbytes = getattr(runner, "state_nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return sum(np.asarray(runner.read_state(name)).nbytes for name in runner.state_names)


def last_good_states(runner: Any, limit: Optional[int] = None) -> Optional[HostCopies]:
    """Copies of the last good states for `runner`: on the device where it has `state_guard()`, else on the
    host; None when its state is larger than `limit` (default HOST_STATE_LIMIT on the host,
    DEVICE_STATE_LIMIT on the device)."""
    make_guard = getattr(runner, "state_guard", None)
    nbytes = state_nbytes(runner)
    if make_guard is not None and nbytes <= (DEVICE_STATE_LIMIT if limit is None else limit):
        guard = make_guard()
        if guard is not None:
            return DeviceCopies(runner, guard)
    return HostCopies(runner) if nbytes <= (HOST_STATE_LIMIT if limit is None else limit) else None


__all__ = ["DEVICE_STATE_LIMIT", "DeviceCopies", "HOST_STATE_LIMIT", "HostCopies", "last_good_states", "state_nbytes"]

"""Checkpoints written off the training loop's thread, at most one in flight.

    writer = CheckpointWriter(series, on_written=lambda step: ...)
    writer.submit(step, make_checkpoint)   # make_checkpoint() -> Checkpoint, called on the writer's thread
    writer.wait()                          # joins the write in flight; raises its error, if it failed

The caller hands over host arrays that nothing changes afterwards (a fresh read of the state at that step),
so the file is the state of that step whatever the loop does meanwhile. Serialisation, checksums, the
atomic write and its fsync happen on the writer's thread; `submit` first waits for the previous write, so
writes land in step order. A failed write leaves the previous file in place (atomic_write) and its error
is raised by the next `wait` or `submit` (or `check`, once it is known); `on_written(step)` runs on the
writer's thread after a write succeeded.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from vktrain.train.checkpoint import Checkpoint, CheckpointSeries


class CheckpointWriter:
    def __init__(self, series: CheckpointSeries, on_written: Callable[[int], None] = lambda step: None) -> None:
        self.series, self.on_written = series, on_written
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, step: int, make_checkpoint: Callable[[], Checkpoint]) -> None:
        """Start writing the checkpoint of `step` (after the previous write, whose error is raised here)."""
        self.wait()

        def write() -> None:
            try:
                self.series.save(make_checkpoint())
                self.on_written(step)
            except BaseException as exc:  # handed to the loop's thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=write, name=f"vktrain-checkpoint-{step}", daemon=False)
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a write that has already failed (no waiting)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error if it failed (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


__all__ = ["CheckpointWriter"]

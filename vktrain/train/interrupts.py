"""SIGINT (Ctrl-C) and SIGTERM (`timeout`, Slurm, Kubernetes, docker stop) during a long command.

    with StopOnSignal("train") as stop:
        ...                                  # a signal here raises Interrupted at once
        with stop.deferred():                # the loop: a signal asks it to stop at its next safe point
            train(..., stop_requested=stop.requested)
        if stop.signum is not None: ...      # say what was saved and how to resume; exit stop.exit_code

Inside `deferred()` the first signal only sets `signum` (the loop finishes the step in flight, saves and
returns); a second one raises Interrupted at once. Every file vktrain writes goes through an atomic
write (temporary file, fsync, rename), so stopping mid-write leaves the previous file intact and the
temporary one removed. Exit codes follow the shell's 128 + signal number: 130 for SIGINT, 143 for SIGTERM.
"""
from __future__ import annotations

import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal. `reported`: what was kept has already been printed."""

    def __init__(self, signum: int = signal.SIGINT, reported: bool = False) -> None:
        super().__init__(signal_name(signum))
        self.signum, self.reported = signum, reported

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)


class StopOnSignal:
    """SIGINT / SIGTERM handlers for one command (installed on entry, the previous ones restored on exit;
    a no-op outside the main thread, where Python delivers no signals)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.signum: Optional[int] = None  # the first signal received while deferring
        self._deferring = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextmanager
    def deferred(self) -> Iterator["StopOnSignal"]:
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)

    def _handle(self, signum: int, frame) -> None:
        if not self._deferring or self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        again = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
        print(f"\nvktrain {self.command}: {signal_name(signum)} received: stopping after the step in flight and "
              f"saving ({again} again to stop at once; files already written stay intact)",
              file=sys.stderr, flush=True)


def resume_command(argv: Sequence[str], checkpoint: str) -> str:
    """The command line `argv` (vktrain's arguments, as given) with `--resume checkpoint` in place of any
    --resume it had: the same run, continued from `checkpoint`."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--resume":
            skip = True
        elif not token.startswith("--resume="):
            kept.append(token)
    return shlex.join(["vktrain", *kept, "--resume", checkpoint])


__all__ = ["EXIT_CODES", "Interrupted", "StopOnSignal", "resume_command", "signal_name"]

"""One `flower-supernode` run by `vktrain fleet node`, with everything it starts (its `flower-superexec`, the
`flwr-clientapp` of every message) in a process group of its own, so that stopping it leaves nothing behind.

Flower 1.42's SuperNode has two ways of ending that need a hand:
  - after "Giving up reconnection" from its message loop (a SuperLink gone for --max-wait-time), its main
    thread ends but its Runtime API thread does not: the process never exits. It is killed HUNG_SECONDS
    after that line.
  - its SuperExec polls for the SuperNode's pid and, once it is gone, interrupts itself (SIGINT): while it is
    importing, or handling another signal, that prints a KeyboardInterrupt traceback. The rest of the group
    is sent SIGTERM, and has ended, before the exited SuperNode is reaped (its pid exists until then), so
    the SuperExec ends by that one signal.
Its output is passed on, line by line, to this process's stderr.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

GIVE_UP_LINE = "Giving up reconnection"  # Flower's retry invoker, when it stops retrying
HUNG_SECONDS = 15.0  # a SuperNode refused at start exits within a second or two of that line
STOP_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.2


class SuperNode:
    def __init__(self, command: list[str], env: dict) -> None:
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.gave_up_at: Optional[float] = None
        self._forwarder = threading.Thread(target=self._forward, daemon=True)
        self._forwarder.start()

    def _forward(self) -> None:
        out = getattr(sys.stderr, "buffer", None)  # bytes as they came: no encoding to fail
        for raw in self.process.stdout:
            if GIVE_UP_LINE.encode() in raw:
                self.gave_up_at = time.monotonic()
            try:
                if out is not None:
                    sys.stderr.flush()
                    out.write(raw)
                    out.flush()
                else:
                    sys.stderr.write(raw.decode("utf-8", errors="replace"))
                    sys.stderr.flush()
            except (OSError, ValueError, UnicodeError):
                pass  # stderr gone: keep reading, a SuperNode blocked on a full pipe would stall

    def exited(self) -> bool:
        """Whether the SuperNode process has ended (it is not reaped: its group can still be signalled)."""
        if self.process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def hung(self) -> bool:
        return self.gave_up_at is not None and time.monotonic() - self.gave_up_at > HUNG_SECONDS

    def stop(self) -> Optional[int]:
        """End the SuperNode and its group: SIGTERM to all (a hung SuperNode is killed first: its SIGTERM
        handler only prints a traceback), SIGKILL to what is left after STOP_GRACE_SECONDS; reap it. Its exit
        code (negative: the signal that ended it), None if it was stopped here."""
        with _signals_held():
            stopped_here = not self.exited()
            if stopped_here and self.hung():
                self.process.kill()
                self._wait_exited(STOP_GRACE_SECONDS)
            self._signal_group(signal.SIGTERM)  # one each: a second one, mid-exit, makes Flower print a traceback
            if not self._wait_exited(STOP_GRACE_SECONDS):
                self.process.kill()
            # the rest of the group ends before the SuperNode is reaped (see the module docstring)
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while self._signal_group(0) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
            if self._signal_group(0):
                self._signal_group(signal.SIGKILL)
                time.sleep(POLL_SECONDS)
            self.process.wait()
            self._forwarder.join(timeout=2.0)
            self.process.stdout.close()
        return None if stopped_here else self.process.returncode

    def _wait_exited(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.exited():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def _signal_group(self, signum: int) -> bool:
        """Send `signum` to the group (the SuperNode's pid is its id); False when no process is left in it
        (zombies of an exited SuperExec, not reaped by a container's init, count as none)."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            return False
        return signum != 0 or _live_members(self.process.pid)


def _live_members(group: int) -> bool:
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return not os.path.isdir("/proc")  # elsewhere: trust killpg


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM while the processes are being stopped are delivered once they are (a second Ctrl-C
    must not leave them running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda s, _: held.append(s)) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            signal.raise_signal(held[0])


__all__ = ["SuperNode"]

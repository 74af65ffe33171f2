"""Misbehaving clients on purpose (`vktrain federate --inject-failure CLIENT:ROUND[:KIND]`): to see the
server tolerate failed nodes and drop bad updates, in tests and demonstrations.

  raise   the ClientApp raises after its first local step (Flower returns an error reply)
  kill    the client's process kills itself (SIGKILL) after its first local step: a node that dies
          mid-round (with --engine sequential the client runs in the server's process: a server crash
          mid-round, after the previous round's checkpoint)
  nan     the reply's first tensor holds a NaN
  shape   the reply's first tensor lost its last row
  norm    the reply's update (client - global) is scaled to L2 norm 1e6
"""
from __future__ import annotations

import os
import signal

import numpy as np

from vktrain.errors import VktrainError

RAISE, KILL, NAN, SHAPE, NORM = "raise", "kill", "nan", "shape", "norm"
FAILURE_KINDS = (RAISE, KILL, NAN, SHAPE, NORM)
CORRUPTIONS = (NAN, SHAPE, NORM)  # the client answers, with a bad update
POISONED_NORM = 1e6


class ClientFailure(VktrainError, RuntimeError):
    """A failure injected on purpose: a client that fails mid-round."""


def parse_failures(items: list[str]) -> frozenset:
    """--inject-failure items -> {(client, round, kind)}."""
    failures = set()
    for item in items:
        client, _, rest = item.partition(":")
        server_round, _, kind = rest.partition(":")
        kind = kind or RAISE
        if not (client.isdigit() and server_round.isdigit()):
            raise VktrainError(f"--inject-failure expects CLIENT:ROUND[:KIND] (two integers), got {item!r}")
        if kind not in FAILURE_KINDS:
            raise VktrainError(f"--inject-failure {item}: KIND must be one of {', '.join(FAILURE_KINDS)}, got {kind!r}")
        failures.add((int(client), int(server_round), kind))
    return frozenset(failures)


def failure_of(failures: frozenset, partition: int, server_round: int) -> str | None:
    return next((kind for client, r, kind in failures if (client, r) == (partition, server_round)), None)


def fail_mid_round(kind: str, partition: int, server_round: int) -> None:
    """After the first local step: raise, or die as a killed process does."""
    if kind == KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    raise ClientFailure(f"client {partition}: failure injected in round {server_round} after 1 local step")


def corrupt(kind: str, arrays: dict[str, np.ndarray], global_arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reply's arrays made bad in the way `kind` says (a copy)."""
    arrays = {name: np.array(array, copy=True) for name, array in arrays.items()}
    first = next(iter(arrays))
    if kind == NAN:
        arrays[first].reshape(-1)[0] = np.nan
    elif kind == SHAPE:
        arrays[first] = arrays[first][:-1]
    elif kind == NORM:
        deltas = {name: arrays[name].astype(np.float64) - global_arrays[name] for name in arrays}
        norm = float(np.sqrt(sum(np.sum(d ** 2) for d in deltas.values())))
        if norm == 0.0:
            deltas[first].reshape(-1)[0], norm = 1.0, 1.0
        arrays = {name: (global_arrays[name] + deltas[name] * (POISONED_NORM / norm)).astype(arrays[name].dtype)
                  for name in arrays}
    return arrays


__all__ = ["CORRUPTIONS", "ClientFailure", "FAILURE_KINDS", "KILL", "NAN", "NORM", "POISONED_NORM", "RAISE", "SHAPE",
           "corrupt", "fail_mid_round", "failure_of", "parse_failures"]

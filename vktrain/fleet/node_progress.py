"""What a fleet node's ClientApp has done, in a node-local file `vktrain fleet node` watches: whether the node
took part in the federation and whether a train message is still due to it. A node whose last train message
has come ends when the server goes away (the federation is over); one that has not waits for the server to
come back (a restarted server, `--resume`).

The ClientApp runs in a `flwr-clientapp` process per message on the node's machine; `vktrain fleet node`
passes the folder as the node config's `progress` and reads DIR/progress.json (written atomically):
{"run": Flower's run id, "round": the round of the last message (0: the start-up query), "rounds": the
federation's, "last": no train message is due after this one}.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

PROGRESS_KEY = "progress"  # the node config's key: the folder
_FILE = "progress.json"


def train_due_after(partition: int, server_round: int, run_config: dict) -> bool:
    """Whether the server will sample `partition` for training in a round after `server_round` (the
    strategy's seeded sampling by the run config's nodes, fraction and seed; rounds are the federation's,
    a resumed run's included)."""
    from vktrain.fleet.strategy import _TRAIN, sample_partitions  # the strategy's own draw, not a copy of it

    n, fraction, seed = int(run_config["nodes"]), float(run_config["fraction"]), int(run_config["seed"])
    return any(partition in sample_partitions(n, fraction, seed, later, _TRAIN)
               for later in range(server_round + 1, int(run_config["rounds"]) + 1))


def write_progress(directory: str, run_id: int, server_round: int, rounds: int, last: bool) -> None:
    from vktrain.train.checkpoint import atomic_write_json

    atomic_write_json(Path(directory) / _FILE, {"run": int(run_id), "round": int(server_round),
                                                "rounds": int(rounds), "last": bool(last)})


def read_progress(directory: str | Path) -> Optional[dict]:
    """The last record, or None before the node's first message."""
    try:
        return json.loads((Path(directory) / _FILE).read_text())
    except FileNotFoundError:
        return None


__all__ = ["PROGRESS_KEY", "read_progress", "train_due_after", "write_progress"]

"""The same federation WITHOUT Ray: a Flower Grid that hands each message to the ClientApp in this
process, one after another (engine "sequential"). The ServerApp's strategy, the messages and the
ClientApp are Flower's and vktrain's as in the simulation; only the transport differs: no worker
processes, no concurrency, no Ray start-up. For machines without Ray (the H200 box has no network to
install it) and for measuring the rounds' compute alone; its timings are NOT those of a simulation.

A ClientApp that raises becomes an error reply, as in Flower's simulation (the round goes on).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from vktrain.fleet.client import PARTITION_ID

SEQUENTIAL = "sequential"


class SequentialGrid(Grid):
    """`n_clients` nodes, node id 1000 + partition id, each with its own Context (node_config
    partition-id / num-partitions, as Flower's simulation gives them)."""

    def __init__(self, client_app: ClientApp, n_clients: int) -> None:
        self.client_app = client_app
        self._run = Run.create_empty(run_id=1)
        # The identity messages are stamped with, set as Flower's run_simulation sets it for its ServerApp.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self.contexts = {1000 + p: Context(run_id=1, node_id=1000 + p,
                                           node_config={PARTITION_ID: p, "num-partitions": n_clients},
                                           state=RecordDict(), run_config={})
                         for p in range(n_clients)}
        self._replies: dict[str, Message] = {}
        self.client_seconds = 0.0  # time spent inside the ClientApp

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _deliver(self, message: Message) -> Message:
        started = time.perf_counter()
        try:
            reply = self.client_app(message, self.contexts[message.metadata.dst_node_id])
        except Exception as exc:  # what Flower's simulation does with a ClientApp that raises
            reason = f"{type(exc)}:<'{exc}'>"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        finally:
            self.client_seconds += time.perf_counter() - started
        return reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = str(uuid4())
            message.metadata.__dict__["_message_id"] = message_id
            self._replies[message_id] = self._deliver(message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(message_id) for message_id in message_ids if message_id in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


__all__ = ["SEQUENTIAL", "SequentialGrid"]

"""Flower strategies over vktrain's adapters: FedAvg over what the clients train (FedIT: lora_A and lora_B;
FFA-LoRA: lora_B only, lora_A frozen in the program and never sent), with reproducible sampling and
aggregation order, and a record of each round.

Both strategies are Flower's FedAvg (`flwr.serverapp.strategy.FedAvg`: the weighted mean of the clients'
arrays, weights `num-examples`, clients whose reply is an error left out); what differs is the program:
FFA-LoRA needs a step exported with `vktrain export --freeze-lora-a`, whose state has no lora_A (so the
clients send, and the server averages, B alone: exact, since B A averages linearly when A is shared, and
half the traffic). FedIT's mean of A and of B is not the mean of the products B_k A_k; that is the known
inexactness of FedAvg over LoRA that FFA-LoRA removes.

Deviations from FedAvg's defaults, for reproducibility (a resumed run equals an uninterrupted one):
  * clients are sampled by partition id from a generator seeded with (seed, round), not from Python's
    global random state over the simulation's random node ids (`node_of_partition`, learned from a query
    handshake at start, maps them);
  * replies are aggregated in partition order, so the float32 sums do not depend on arrival order.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from vktrain.fleet import FEDAVG, FFA, STRATEGIES
from vktrain.fleet.client import CLIENT, METRICS, PARTITION_ID

_TRAIN, _EVALUATE = 0, 1  # sampling streams


def payload_bytes(arrays: ArrayRecord) -> int:
    """Bytes of the arrays in a message as Flower serializes them (.npy: a ~128-byte header and the data; keys
    and message framing aside): what crosses the network per client."""
    return sum(len(array.data) for array in arrays.values())


def short_reason(reason: str, limit: int = 300) -> str:
    """The last line of an error reply's reason (Flower's carries the whole remote traceback)."""
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    return (lines[-1] if lines else str(reason))[:limit]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals that overlap at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in events:  # at a tie, an end (-1) sorts before a start: touching intervals do not overlap
        running += change
        peak = max(peak, running)
    return peak


def sample_partitions(n_clients: int, fraction: float, seed: int, server_round: int, stream: int) -> list[int]:
    """The partitions taking part in a round: max(1, int(n * fraction)) of them (FedAvg's count), drawn
    without replacement by (seed, round, stream), ascending."""
    count = min(n_clients, max(1, int(n_clients * fraction)))
    rng = np.random.default_rng([seed, server_round, stream])
    return sorted(int(p) for p in rng.choice(n_clients, size=count, replace=False))


class FleetFedAvg(FedAvg):
    """FedAvg with seeded sampling by partition, partition-ordered aggregation and per-round records
    (`rounds[r]`: sampled, failed, client losses, bytes each way). `round_offset` numbers the rounds of a
    resumed run as the whole federation does (Flower's Strategy.start counts from 1)."""

    def __init__(self, *, n_clients: int, fraction_train: float, fraction_evaluate: float, seed: int,
                 round_offset: int = 0) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate, min_train_nodes=1,
                         min_evaluate_nodes=1 if fraction_evaluate > 0 else 0, min_available_nodes=n_clients)
        self.n_clients = n_clients
        self.seed = seed
        self.round_offset = round_offset
        self.node_of_partition: dict[int, int] = {}
        self.rounds: dict[int, dict] = {}

    def _partition(self, message: Message) -> Optional[int]:
        node = message.metadata.src_node_id
        return next((p for p, n in self.node_of_partition.items() if n == node), None)

    def _messages(self, partitions: list[int], arrays: ArrayRecord, config: ConfigRecord, server_round: int,
                  message_type: str) -> list[Message]:
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [Message(record, self.node_of_partition[p], message_type) for p in partitions
                if p in self.node_of_partition]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        partitions = sample_partitions(self.n_clients, self.fraction_train, self.seed, server_round, _TRAIN)
        self.rounds[server_round] = {"round": server_round, "started": time.perf_counter(), "sampled": partitions,
                                     "bytes_down": payload_bytes(arrays) * len(partitions), "failed": {},
                                     "client_train_loss": {}}
        unreachable = [p for p in partitions if p not in self.node_of_partition]
        for partition in unreachable:
            self.rounds[server_round]["failed"][str(partition)] = "did not answer the start-up query"
        return self._messages(partitions, arrays, config, server_round, MessageType.TRAIN)

    def _sorted_replies(self, replies: Iterable[Message], is_train: bool) -> tuple[list[Message], list[Message]]:
        valid, errors = self._check_and_log_replies(list(replies), is_train=is_train)
        valid.sort(key=lambda message: int(message.content[CLIENT][PARTITION_ID]))
        return valid, errors

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        server_round += self.round_offset
        record = self.rounds[server_round]
        replies = list(replies)
        valid, errors = self._sorted_replies(replies, is_train=True)
        for message in errors:
            record["failed"][str(self._partition(message))] = short_reason(message.error.reason)
        answered = {self._partition(m) for m in replies}
        for partition in record["sampled"]:
            if partition not in answered and str(partition) not in record["failed"]:
                record["failed"][str(partition)] = "no reply before the timeout"
        intervals = []
        for message in valid:
            client = message.content[CLIENT]
            record["client_train_loss"][str(client[PARTITION_ID])] = float(message.content[METRICS]["train-loss"])
            intervals.append((float(client["started"]), float(client["finished"])))
        record["client_seconds"] = {str(m.content[CLIENT][PARTITION_ID]): end - start
                                    for m, (start, end) in zip(valid, intervals)}
        record["max_concurrent_clients"] = max_overlap(intervals)
        record["client_processes"] = len({int(m.content[CLIENT]["pid"]) for m in valid})
        record["client_devices"] = {str(m.content[CLIENT][PARTITION_ID]): str(m.content[CLIENT]["device"]) for m in valid}
        record["bytes_up"] = sum(payload_bytes(m.content[self.arrayrecord_key]) for m in valid)
        record["train_seconds"] = time.perf_counter() - record["started"]
        if not valid:
            return None, None  # Strategy.start keeps the previous global adapters
        contents = [message.content for message in valid]
        return (aggregate_arrayrecords(contents, self.weighted_by_key),
                self.train_metrics_aggr_fn(contents, self.weighted_by_key))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate == 0.0:
            return []
        server_round += self.round_offset
        partitions = sample_partitions(self.n_clients, self.fraction_evaluate, self.seed, server_round, _EVALUATE)
        self.rounds[server_round]["bytes_down"] += payload_bytes(arrays) * len(partitions)
        return self._messages(partitions, arrays, config, server_round, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        server_round += self.round_offset
        valid, errors = self._sorted_replies(replies, is_train=False)
        record = self.rounds[server_round]
        record["client_eval_loss"] = {str(m.content[CLIENT][PARTITION_ID]): float(m.content[METRICS]["eval-loss"])
                                      for m in valid}
        for message in errors:
            record["failed"].setdefault(str(self._partition(message)), "evaluate: " + short_reason(message.error.reason))
        if not valid:
            return None
        return self.evaluate_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)


__all__ = ["FEDAVG", "FFA", "FleetFedAvg", "STRATEGIES", "max_overlap", "payload_bytes", "sample_partitions", "short_reason"]

"""Flower strategies over vktrain's adapters: FedAvg over what the clients train (FedIT: lora_A and lora_B;
FFA-LoRA: lora_B only, lora_A frozen in the program and never sent), with reproducible sampling and
aggregation order, and a record of each round.

Both strategies are Flower's FedAvg (`flwr.serverapp.strategy.FedAvg`: sampling, messages, the round loop;
clients whose reply is an error left out) with vktrain's screening and aggregator (vktrain/fleet/robust.py:
by default the `num-examples`-weighted mean); what differs is the program:
FFA-LoRA needs a step exported with `vktrain export --freeze-lora-a`, whose state has no lora_A (so the
clients send, and the server averages, B alone: exact, since B A averages linearly when A is shared, and
half the traffic). FedIT's mean of A and of B is not the mean of the products B_k A_k; that is the known
inexactness of FedAvg over LoRA that FFA-LoRA removes.

Deviations from FedAvg's defaults, for reproducibility (a resumed run equals an uninterrupted one):
  * clients are sampled by partition id from a generator seeded with (seed, round), not from Python's
    global random state over the simulation's random node ids (`node_of_partition`, learned from a query
    handshake at start, maps them);
  * replies are aggregated in partition order, so the sums do not depend on arrival order;
  * every update is screened before aggregation and the aggregator is vktrain's (vktrain/fleet/robust.py:
    names, shapes, finiteness, norm against the round's median; mean in float64, median, trimmed mean);
    a reply whose partition id is not its node's is dropped too.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Optional, TextIO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from vktrain.fleet import FEDAVG, FFA, STRATEGIES
from vktrain.fleet.arrays import from_array_record, to_array_record
from vktrain.fleet.client import ARRAYS, CLIENT, METRICS, NUM_EXAMPLES, PARTITION_ID
from vktrain.fleet.robust import DEFAULT_MAX_NORM_RATIO, Aggregation, screen_updates

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
                 round_offset: int = 0, aggregation: Aggregation = Aggregation(),
                 max_norm_ratio: Optional[float] = DEFAULT_MAX_NORM_RATIO, min_clients: int = 1,
                 log: Optional[TextIO] = None) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate, min_train_nodes=1,
                         min_evaluate_nodes=1 if fraction_evaluate > 0 else 0, min_available_nodes=n_clients)
        self.n_clients = n_clients
        self.seed = seed
        self.round_offset = round_offset
        self.aggregation = aggregation
        self.max_norm_ratio = max_norm_ratio  # None: no norm bound
        self.min_clients = min_clients  # fewer accepted updates: the round keeps the global adapters
        self.log = log  # where dropped updates are reported (None: not printed)
        self._global: dict = {}  # the round's global adapters (what updates are screened against)
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
                                     "dropped": {}, "client_train_loss": {}, "aggregation": str(self.aggregation)}
        self._global = from_array_record(arrays)
        unreachable = [p for p in partitions if p not in self.node_of_partition]
        for partition in unreachable:
            self.rounds[server_round]["failed"][str(partition)] = "did not answer the start-up query"
        return self._messages(partitions, arrays, config, server_round, MessageType.TRAIN)

    def _sorted_replies(self, replies: Iterable[Message], is_train: bool) -> tuple[list[Message], list[Message]]:
        """Content replies in partition order, and error replies. Flower's consistency check across replies
        is off: one malformed reply must be dropped alone, not fail the round (screened here instead)."""
        valid, errors = self._check_and_log_replies(list(replies), is_train=is_train, validate=False)
        valid.sort(key=lambda message: (self._partition(message) is None, self._partition(message) or 0))
        return valid, errors

    def _unpack(self, message: Message) -> tuple[dict, float, float]:
        """(arrays, num-examples, train-loss) of a train reply; ValueError naming what is malformed."""
        content, partition = message.content, self._partition(message)
        try:
            claimed = int(content[CLIENT][PARTITION_ID])
            arrays = from_array_record(content[ARRAYS])
            metrics = content[METRICS]
            weight, loss = float(metrics[NUM_EXAMPLES]), float(metrics["train-loss"])
        except Exception as exc:  # a reply without the records or keys of vktrain's ClientApp
            raise ValueError(f"malformed reply ({type(exc).__name__}: {exc})") from None
        if claimed != partition:
            raise ValueError(f"reply claims partition {claimed}, its node serves partition {partition}")
        return arrays, weight, loss

    def _drop(self, record: dict, message: Message, partition, reason: str) -> None:
        record["dropped"][str(partition)] = reason
        if self.log is not None:
            print(f"round {record['round']}: dropped the update of client {partition} (node "
                  f"{message.metadata.src_node_id}): {reason}", file=self.log, flush=True)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        server_round += self.round_offset
        record = self.rounds[server_round]
        aggregating = time.perf_counter()
        replies = list(replies)
        valid, errors = self._sorted_replies(replies, is_train=True)
        for message in errors:
            record["failed"][str(self._partition(message))] = short_reason(message.error.reason)
        answered = {self._partition(m) for m in replies}
        for partition in record["sampled"]:
            if partition not in answered and str(partition) not in record["failed"]:
                record["failed"][str(partition)] = "no reply before the timeout"
        updates, by_partition = {}, {}
        for message in valid:
            partition = self._partition(message)
            if partition is None or partition not in record["sampled"] or partition in by_partition:
                self._drop(record, message, partition, "a reply from a node not sampled this round (or twice)")
                continue
            try:
                updates[partition] = self._unpack(message)
            except ValueError as exc:
                self._drop(record, message, partition, str(exc))
                continue
            by_partition[partition] = message
        screened = screen_updates(updates, self._global, self.max_norm_ratio)
        record["screen_seconds"] = time.perf_counter() - aggregating  # the replies read and screened
        for partition, reason in screened.dropped.items():
            self._drop(record, by_partition[partition], partition, reason)
        record["update_norms"] = {str(p): norm for p, norm in screened.norms.items()}
        record["median_update_norm"] = screened.median_norm
        accepted = [by_partition[p] for p in screened.accepted]
        intervals = []
        for message in accepted:
            client = message.content[CLIENT]
            record["client_train_loss"][str(client[PARTITION_ID])] = float(message.content[METRICS]["train-loss"])
            intervals.append((float(client["started"]), float(client["finished"])))
        record["client_seconds"] = {str(m.content[CLIENT][PARTITION_ID]): end - start
                                    for m, (start, end) in zip(accepted, intervals)}
        record["max_concurrent_clients"] = max_overlap(intervals)
        record["client_processes"] = len({int(m.content[CLIENT]["pid"]) for m in accepted})
        record["client_devices"] = {str(m.content[CLIENT][PARTITION_ID]): str(m.content[CLIENT]["device"])
                                    for m in accepted}
        record["bytes_up"] = sum(payload_bytes(m.content[self.arrayrecord_key]) for m in by_partition.values())
        record["train_seconds"] = time.perf_counter() - record["started"]
        record["trimmed_per_side"] = self.aggregation.trimmed(len(accepted))
        record["aggregated"] = len(accepted) >= self.min_clients and bool(accepted)
        if not record["aggregated"]:
            if accepted:
                record["not_aggregated"] = (f"{len(accepted)} accepted update(s), fewer than the {self.min_clients} "
                                            f"required (--min-clients); the global adapters stay")
            return None, None  # Strategy.start keeps the previous global adapters
        arrays = self.aggregation.combine([updates[p][0] for p in screened.accepted],
                                          [updates[p][1] for p in screened.accepted])
        contents = [message.content for message in accepted]
        aggregated = to_array_record(arrays), self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        record["aggregate_seconds"] = time.perf_counter() - aggregating  # screening + combining, the server's share
        record["combine_seconds"] = record["aggregate_seconds"] - record["screen_seconds"]
        return aggregated

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
        record["client_eval_loss"], usable = {}, []
        for message in valid:
            try:
                loss, weight = (float(message.content[METRICS][key]) for key in ("eval-loss", NUM_EXAMPLES))
            except Exception as exc:  # not vktrain's ClientApp's reply
                loss, weight = math.nan, f"malformed ({type(exc).__name__}: {exc})"
            if not (math.isfinite(loss) and isinstance(weight, float) and weight > 0):
                record["failed"].setdefault(str(self._partition(message)),
                                            f"evaluate: unusable reply (eval-loss {loss}, num-examples {weight})")
                continue
            record["client_eval_loss"][str(self._partition(message))] = loss
            usable.append(message)
        for message in errors:
            record["failed"].setdefault(str(self._partition(message)), "evaluate: " + short_reason(message.error.reason))
        if not usable:
            return None
        return self.evaluate_metrics_aggr_fn([m.content for m in usable], self.weighted_by_key)


__all__ = ["FEDAVG", "FFA", "FleetFedAvg", "STRATEGIES", "max_overlap", "payload_bytes", "sample_partitions", "short_reason"]

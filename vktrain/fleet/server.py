"""The Flower ServerApp of a federation: start-up handshake, Flower's strategy loop, the global held-out
loss, a checkpoint and a record per round.

Round r (Flower's Strategy.start drives it; vktrain/fleet/strategy.py samples and aggregates):
  1. the sampled clients get the global adapters and train `local_steps` steps (vktrain/fleet/client.py);
  2. FedAvg of the replies that came back (failed clients are left out and recorded);
  3. optionally, sampled clients evaluate the new global adapters on their held-out shards;
  4. here: the server's own runner evaluates them on the whole held-out file (`global_eval_loss`), the
     round's record is completed, the checkpoint written (atomic), the JSON rewritten, a line printed.
Round 0's record is the held-out loss of the initial adapters.

The server holds one TrainingRunner of the program (its eval method for the global loss, its state for
the initial adapters); clients never see it.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from vktrain.contract import PRECISION_AUTO
from vktrain.errors import VktrainError
from vktrain.fleet.checkpoint import (FederationCheckpoint, check_resumable, load_federation_checkpoint,
                                      save_federation_checkpoint)
from vktrain.fleet.arrays import from_array_record, to_array_record
from vktrain.fleet.client import CLIENT, PARTITION_ID, trained_names
from vktrain.fleet import FFA
from vktrain.fleet.robust import DEFAULT_MAX_NORM_RATIO, MEAN, Aggregation
from vktrain.fleet.strategy import FleetFedAvg
from vktrain.train.checkpoint import atomic_write_json, sha256_file
from vktrain.train.train_loop import AdamWConfig

# How long the start-up waits for every simulated node to be registered.
NODE_WAIT_SECONDS = 600


class FederationError(VktrainError, RuntimeError):
    """A federation that cannot run as asked (program and strategy disagree, nodes missing, ...)."""


@dataclass(frozen=True)
class FederationSettings:
    """A federation's settings. `run_config()` is what decides its results (compared on resume)."""
    program: str
    strategy: str
    n_clients: int
    rounds: int
    local_steps: int
    grad_accum: int = 1  # micro-batches per local optimizer step
    fraction: float = 1.0
    fraction_evaluate: float = 0.0
    lr: float = 1e-3
    optimizer: AdamWConfig = AdamWConfig()
    seed: int = 0
    partition: str = "iid"
    data_fingerprint: str = ""  # sha256 of the client shards
    eval_data: Optional[str] = None
    eval_batches: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    json_path: Optional[str] = None
    precision: str = PRECISION_AUTO
    timeout: float = 3600.0
    engine: str = "ray"
    aggregation: str = MEAN  # vktrain/fleet/robust.py
    max_norm_ratio: Optional[float] = DEFAULT_MAX_NORM_RATIO  # None: no norm bound
    min_clients: int = 1  # accepted updates a round needs to change the global adapters

    def run_config(self) -> dict:
        return {"strategy": self.strategy, "clients": self.n_clients, "fraction": self.fraction,
                "fraction_evaluate": self.fraction_evaluate, "local_steps": self.local_steps, "lr": self.lr,
                "optimizer": asdict(self.optimizer), "seed": self.seed, "partition": self.partition,
                "precision": self.precision, "data_sha256": self.data_fingerprint, "aggregation": self.aggregation,
                "max_update_norm_ratio": self.max_norm_ratio, "min_clients": self.min_clients,
                **({"grad_accum": self.grad_accum} if self.grad_accum != 1 else {})}  # older checkpoints: 1

    def train_config(self) -> ConfigRecord:
        o = self.optimizer
        return ConfigRecord({"local-steps": self.local_steps, "grad-accum": self.grad_accum, "lr": self.lr, "beta1": o.beta1, "beta2": o.beta2,
                             "eps": o.eps, "weight-decay": o.weight_decay})


@dataclass
class FederationResult:
    """What a federation produced: every round's record (round 0: before training) and the final adapters."""
    records: list[dict] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    resumed_from: Optional[int] = None


def node_partitions(grid: Grid, n_clients: int, timeout: float) -> dict[int, int]:
    """{partition id: node id} of the simulated nodes, from a query each answers with its partition id."""
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    while len(nodes := list(grid.get_node_ids())) < n_clients:
        if time.monotonic() > deadline:
            raise FederationError(f"only {len(nodes)} of {n_clients} client nodes registered in {NODE_WAIT_SECONDS} s")
        time.sleep(0.2)
    replies = grid.send_and_receive([Message(RecordDict(), node, MessageType.QUERY) for node in nodes],
                                    timeout=timeout)
    return {int(reply.content[CLIENT][PARTITION_ID]): reply.metadata.src_node_id
            for reply in replies if not reply.has_error()}


def failure_reason(recorded: str) -> str:
    """A failed client's error as its ClientApp raised it, without the wrapping Flower adds to the reply
    ("<class ...>:<'Exception ClientAppException occurred. Message: REASON'>")."""
    match = re.search(r"Message: (.*?)'?>?$", recorded, re.DOTALL) or re.search(r":<'(.*)'>$", recorded, re.DOTALL)
    return (match.group(1) if match else recorded).strip()


def _describe_round(record: dict, rounds: int) -> str:
    loss = record.get("global_eval_loss")
    clients = record["client_train_loss"]
    text = f"round {record['round']}/{rounds}:"
    if loss is not None:
        text += f" global held-out loss {loss:.4f},"
    if clients:
        text += f" client train loss {np.mean(list(clients.values())):.4f} ({len(clients)} client(s)),"
    failed = record["failed"]
    if failed:
        reasons = [(p, failure_reason(failed[p])) for p in sorted(failed)]
        named = [r if r.startswith(f"client {p}") else f"client {p}: {r}" for p, r in reasons]
        text += f" {len(failed)} failed ({'; '.join(named)}),"
    dropped = record.get("dropped") or {}
    if dropped:
        text += f" {len(dropped)} update(s) dropped ({', '.join(f'client {p}' for p in sorted(dropped, key=int))}),"
    if not record.get("aggregated", True):
        text += " global adapters unchanged,"
    return (text + f" {record['bytes_down'] / 2**20:.2f} MiB down / {record['bytes_up'] / 2**20:.2f} MiB up,"
            f" {record['seconds']:.1f} s")


class FederationServer:
    """Runs a federation on a Grid (Flower's simulation or the sequential one) with `runner`, the server's
    TrainingRunner of the program (the caller's: it stays open); `run` returns the result."""

    def __init__(self, settings: FederationSettings, runner, progress: bool = True) -> None:
        self.settings = settings
        self.runner = runner
        self.progress = progress
        self.result = FederationResult()
        self.stopped = False  # set when the command was interrupted: no round is recorded or saved after it

    def _held_out_batches(self, runner) -> Optional[list]:
        """The held-out batches of the global loss, made once for every round (None without --eval-data);
        with positions for a packed-documents step, as `vktrain train --eval-data` makes them."""
        from vktrain.serialization.tokenizer import program_tokenizer
        from vktrain.train.data import load_data
        from vktrain.train.held_out import prepare_eval_batches

        s = self.settings
        if s.eval_data is None:
            return None
        data = load_data(s.eval_data, runner.vocab_size, program_tokenizer(runner, s.program))
        return prepare_eval_batches(data, runner.batch_shape, s.eval_batches, runner.takes_positions)

    def _check_program(self, trained: list[str]) -> None:
        trains_a = any(name.endswith(".lora_A") for name in trained)
        if self.settings.strategy == FFA and trains_a:
            raise FederationError(f"{self.settings.program} trains lora_A; FFA-LoRA needs a step exported with lora_A "
                                  f"frozen (vktrain export ... --freeze-lora-a)")
        if not trained:
            raise FederationError(f"{self.settings.program} trains no LoRA tensor")

    def run(self, grid: Grid) -> FederationResult:
        from vktrain.train.held_out import evaluate_batches

        s, runner = self.settings, self.runner
        program_sha256 = sha256_file(s.program)
        trained = trained_names(runner.state_names)
        self._check_program(trained)
        held_out = self._held_out_batches(runner)
        arrays = runner.read_states(trained)
        done = 0
        if s.resume:
            checkpoint = load_federation_checkpoint(s.checkpoint_dir)
            check_resumable(checkpoint, program_sha256, s.run_config(), str(s.checkpoint_dir))
            arrays, done = checkpoint.arrays, checkpoint.round
            self.result.records = list(checkpoint.records)
            self.result.resumed_from = done
        self.result.arrays = arrays
        if done >= s.rounds:
            return self.result

        def global_loss(adapters: dict[str, np.ndarray]) -> Optional[float]:
            if held_out is None:
                return None
            runner.write_states(adapters)  # one transfer (vktrain/fleet/client.py)
            return evaluate_batches(runner, held_out)["loss"]

        strategy = FleetFedAvg(n_clients=s.n_clients, fraction_train=s.fraction,
                               fraction_evaluate=s.fraction_evaluate, seed=s.seed, round_offset=done,
                               aggregation=Aggregation.parse(s.aggregation), max_norm_ratio=s.max_norm_ratio,
                               min_clients=s.min_clients, log=sys.stderr if self.progress else None)
        strategy.node_of_partition = node_partitions(grid, s.n_clients, s.timeout)

        def after_round(local_round: int, record: ArrayRecord) -> Optional[MetricRecord]:
            if self.stopped:
                return None
            adapters = from_array_record(record)
            if local_round == 0:
                if done:  # resumed: round `done`'s record is in the checkpoint
                    return None
                entry = {"round": 0, "global_eval_loss": global_loss(adapters)}
            else:
                entry = strategy.rounds[done + local_round]
                entry["seconds_before_eval"] = time.perf_counter() - entry["started"]
                entry["global_eval_loss"] = global_loss(adapters)
                entry["seconds"] = time.perf_counter() - entry.pop("started")
            self.result.records.append(entry)
            self.result.arrays = adapters
            self._save(entry["round"], adapters, program_sha256)
            if self.progress and local_round:
                print(_describe_round(entry, s.rounds), file=sys.stderr, flush=True)
            loss = entry["global_eval_loss"]
            return None if loss is None else MetricRecord({"global-eval-loss": loss})

        strategy.start(grid, to_array_record(arrays), num_rounds=s.rounds - done, timeout=s.timeout,
                       train_config=s.train_config(), evaluate_config=ConfigRecord(), evaluate_fn=after_round)
        return self.result

    def _save(self, completed: int, arrays: dict[str, np.ndarray], program_sha256: str) -> None:
        s = self.settings
        if s.checkpoint_dir:
            save_federation_checkpoint(s.checkpoint_dir, FederationCheckpoint(
                completed, arrays, program_sha256, s.run_config(), self.result.records))
        if s.json_path:
            atomic_write_json(s.json_path, {"settings": {**s.run_config(), "program": s.program, "rounds": s.rounds,
                                                         "engine": s.engine, "eval_data": s.eval_data},
                                            "rounds": self.result.records})


def make_server_app(server: FederationServer) -> ServerApp:
    """A ServerApp whose main runs `server` (its result stays on `server.result`: the simulation runs
    the ServerApp in a thread of this process)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server.run(grid)

    return app


__all__ = ["FederationError", "FederationResult", "FederationServer", "FederationSettings", "make_server_app",
           "node_partitions"]

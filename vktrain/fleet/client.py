"""The Flower ClientApp around TrainingRunner (torch-free: numpy, the Vulkan runtime, flwr's records).

Messages (Flower's Message API; the server's side is vktrain/fleet/server.py):
  query     -> ConfigRecord "client" {"partition-id"}: which data shard this node holds (the server maps
               its random node ids to shards with it, so sampling and aggregation order are reproducible)
  train     ArrayRecord "arrays" (the global adapters, by state name) + ConfigRecord "config" (server-round,
            local-steps, grad-accum, lr, AdamW's betas, eps, weight-decay)
            -> ArrayRecord "arrays" (the adapters after `local-steps` AdamW steps on this shard),
               MetricRecord "metrics" {num-examples, train-loss, train-loss-first, train-loss-last},
               ConfigRecord "client" {partition-id, pid, device, started, finished} (the process, its
               Vulkan device and the wall-clock interval that ran it: how many clients ran at once)
  evaluate  ArrayRecord "arrays" -> MetricRecord "metrics" {num-examples, eval-loss}: the .pte's eval
            method on this client's shard of the held-out data (`vktrain eval`'s loss)

Local training. Every train message starts from the global adapters with FRESH AdamW state (moments and
step zero): a client is sampled in a fraction of the rounds, and moments kept from an earlier round were
accumulated along another global model's trajectory, so they would steer the update with stale curvature;
it also makes a client stateless, so any process can serve any client (Flower's simulation runs many
clients per process) and a round's result depends only on the global adapters, the round and the shard:
resuming a federation reproduces it exactly. Step j of round r reads batch (r - 1) * K + j of the shard
(K = local-steps; TokenBatcher's order, shuffled by the run's seed), so the rounds a client takes part
in walk through its data; with grad-accum N > 1 a step is N micro-batches accumulated on the device
(train_loop.run_accumulated_step), batches ((r - 1) * K + j) * N onward.
`num-examples` (FedAvg's weight) is the number of target tokens in the client's shard: McMahan et al.'s
n_k, the local dataset size.

One TrainingRunner per process and program serves every client that process runs (loading a program
and its pipelines costs seconds; clients differ only in the adapters written in and the data). Its
Vulkan device is the GPU Ray assigned the process where that can be identified (vktrain/fleet/gpus.py);
the process logs which device it opened and why.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from vktrain.contract import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MODEL_PREFIX, PRECISION_AUTO, STEP_STATE
from vktrain.errors import VktrainError
from vktrain.fleet.arrays import from_array_record, to_array_record
from vktrain.fleet.faults import CORRUPTIONS, ClientFailure, corrupt, fail_mid_round, failure_of
from vktrain.fleet.gpus import client_device_choice
from vktrain.train.data import TokenBatcher, TrainingData, load_data
from vktrain.train.held_out import evaluate_data
from vktrain.serialization.tokenizer import program_tokenizer
from vktrain.train.train_loop import AdamWConfig, describe_program, run_accumulated_step, run_step
from vktrain.backend.kernel_planning import plan_schedule

# Keys of the records in messages (FedAvg's defaults for the arrays and the config).
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
CLIENT = "client"
PARTITION_ID = "partition-id"  # Flower's node_config key in simulation, echoed in replies
NUM_EXAMPLES = "num-examples"
LORA_SUFFIXES = (".lora_A", ".lora_B")
# Where a train message's time goes in its process (LocalTrainer.seconds): the global adapters decoded from
# the message, written in (AdamW state zeroed), the local steps, the trained adapters read back, encoded.
PHASES = ("receive", "swap_in", "train", "swap_out", "send")


@dataclass(frozen=True)
class ClientSettings:
    """What every client process needs to know (pickled to Flower's simulation workers with the ClientApp)."""
    program: str  # the training-step .pte
    train_shards: tuple[str, ...]  # shard file of each partition id
    eval_shards: tuple[str, ...] = ()  # each partition's held-out shard (empty: no client-side evaluation)
    seed: int = 0
    precision: str = PRECISION_AUTO
    failures: frozenset = field(default_factory=frozenset)  # {(partition id, round, kind)}: vktrain/fleet/faults.py


def trained_names(state_names: list[str]) -> list[str]:
    """The LoRA tensors a program trains (`model.<layer>.lora_A|B`, not their AdamW moments), in state order;
    without lora_A when it was exported frozen."""
    return [name for name in state_names if name.startswith(MODEL_PREFIX) and name.endswith(LORA_SUFFIXES)]


def optimizer_state_names(state_names: list[str]) -> list[str]:
    return [name for name in state_names if name == STEP_STATE or name.startswith((EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX))]


class LocalTrainer:
    """One process's runner for a program, and the shards it has read."""

    def __init__(self, settings: ClientSettings) -> None:
        from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan: only in a client process
        from vktrain.runtime.vk.device import Device

        self.settings = settings
        choice = client_device_choice()
        self.device = Device(choice.selector)
        try:
            self.runner = TrainingRunner.from_pte(settings.program, self.device, planner=plan_schedule,
                                                  precision=settings.precision, timing=False)
        except BaseException:
            self.device.close()
            raise
        print(f"vktrain client process {os.getpid()}: {self.device.info.describe()}: {choice.reason}", file=sys.stderr)
        self.info = describe_program(self.runner)
        self.tokenizer = program_tokenizer(self.runner, settings.program)
        self.trained = trained_names(self.runner.state_names)
        self.optimizer_state = optimizer_state_names(self.runner.state_names)  # zeroed for each client
        self._data: dict[str, TrainingData] = {}
        self.seconds = dict.fromkeys(PHASES, 0.0)  # summed over the train messages served (PHASES)
        self.served = 0  # train messages served

    def timed(self, phase: str, started: float) -> float:
        """Adds the time since `started` to `phase`; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.seconds[phase] += now - started
        return now

    def close(self) -> None:
        self.runner.close()
        self.device.close()  # the runner was given it, so it leaves it open

    def data(self, path: str) -> TrainingData:
        if path not in self._data:
            self._data[path] = load_data(path, self.info.vocab_size, self.tokenizer)
        return self._data[path]

    def batcher(self, partition: int) -> TokenBatcher:
        path = self.settings.train_shards[partition]
        data = self.data(path)
        # A step exported with --packing documents gets the shard's document boundaries, as `vktrain train`
        # gives them (a token shard has none: each window is then one document).
        documents = data.starts if self.runner.takes_positions else None
        return TokenBatcher(data.tokens, self.info.batch_size, self.info.seq_len, labels=data.labels,
                            seed=self.settings.seed, source=path, documents=documents)

    def load_global(self, arrays: dict[str, np.ndarray]) -> None:
        """The global adapters in, AdamW state reset (module docstring)."""
        if sorted(arrays) != sorted(self.trained):
            raise VktrainError(f"{self.settings.program}: the server sent adapters {sorted(arrays)[:3]}... "
                               f"({len(arrays)}); this program trains {len(self.trained)} tensors "
                               f"({self.trained[:3]}...)")
        # One transfer for the adapters and the moments, zeroed on the device (tensor by tensor, a client's
        # ~1,260 state tensors cost ~1,260 staging buffers, submits and waits on a discrete GPU).
        self.runner.write_states(arrays, zeroed=self.optimizer_state)
        self.global_arrays = arrays

    def train(self, partition: int, server_round: int, config: ConfigRecord) -> tuple[dict[str, np.ndarray], dict]:
        steps = int(config["local-steps"])
        accumulate = int(config.get("grad-accum", 1))  # micro-batches per optimizer step
        optimizer = AdamWConfig(float(config["beta1"]), float(config["beta2"]), float(config["eps"]),
                                float(config["weight-decay"]))
        hparams = optimizer.hparams(float(config["lr"]))
        started = time.perf_counter()
        batches = self.batcher(partition)
        losses = []
        injected = failure_of(self.settings.failures, partition, server_round)
        for j in range(steps):
            if j == 1 and injected and injected not in CORRUPTIONS:
                fail_mid_round(injected, partition, server_round)
            first = ((server_round - 1) * steps + j) * accumulate
            if accumulate == 1:  # (tokens, labels[, positions]): train_loop's step, as `vktrain train` takes it
                losses.append(run_step(self.runner, batches.batch(first), hparams))
            else:
                micro = [batches.batch(first + k) for k in range(accumulate)]
                losses.append(run_accumulated_step(self.runner, micro, hparams))
        if not np.all(np.isfinite(losses)):
            raise VktrainError(f"client {partition}: non-finite local loss in round {server_round}: {losses}")
        started = self.timed("train", started)
        arrays = self.runner.read_states(self.trained)
        self.timed("swap_out", started)
        if injected in CORRUPTIONS:
            arrays = corrupt(injected, arrays, self.global_arrays)
        examples = self.data(self.settings.train_shards[partition]).trained_tokens
        metrics = {NUM_EXAMPLES: examples, "train-loss": float(np.mean(losses)),
                   "train-loss-first": losses[0], "train-loss-last": losses[-1]}
        return arrays, metrics

    def evaluate(self, partition: int) -> dict:
        result = evaluate_data(self.runner, self.data(self.settings.eval_shards[partition]))
        return {NUM_EXAMPLES: result["tokens"], "eval-loss": result["loss"]}


# One trainer per process and settings: Flower's workers run one client after another in one process.
_TRAINERS: dict[ClientSettings, LocalTrainer] = {}


def local_trainer(settings: ClientSettings) -> LocalTrainer:
    if settings not in _TRAINERS:
        _TRAINERS[settings] = LocalTrainer(settings)
    return _TRAINERS[settings]


def close_trainers() -> None:
    """Close this process's trainers (their runners and devices): after a sequential federation."""
    while _TRAINERS:
        _, trainer = _TRAINERS.popitem()
        trainer.close()


def partition_of(context: Context) -> int:
    return int(context.node_config[PARTITION_ID])


def make_client_app(settings: ClientSettings) -> ClientApp:
    """The ClientApp of a federation over `settings.program` (module docstring)."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return Message(RecordDict({CLIENT: ConfigRecord({PARTITION_ID: partition_of(context)})}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        started = time.time()  # wall clock: comparable across the processes of one machine
        partition = partition_of(context)
        config = message.content[CONFIG]
        trainer = local_trainer(settings)
        phase = time.perf_counter()
        arrays = from_array_record(message.content[ARRAYS])
        phase = trainer.timed("receive", phase)
        trainer.load_global(arrays)
        trainer.timed("swap_in", phase)
        arrays, metrics = trainer.train(partition, int(config["server-round"]), config)
        phase = time.perf_counter()
        record = to_array_record(arrays)
        trainer.timed("send", phase)
        trainer.served += 1
        content = RecordDict({ARRAYS: record, METRICS: MetricRecord(metrics),
                              CLIENT: ConfigRecord({PARTITION_ID: partition, "pid": os.getpid(),
                                                    "device": trainer.device.info.describe(), "started": started,
                                                    "finished": time.time()})})
        return Message(content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        partition = partition_of(context)
        if not settings.eval_shards:
            raise VktrainError("client-side evaluation needs held-out shards (vktrain federate --eval-data)")
        trainer = local_trainer(settings)
        trainer.load_global(from_array_record(message.content[ARRAYS]))
        content = RecordDict({METRICS: MetricRecord(trainer.evaluate(partition)),
                              CLIENT: ConfigRecord({PARTITION_ID: partition})})
        return Message(content, reply_to=message)

    return app


__all__ = ["ARRAYS", "CLIENT", "CONFIG", "ClientFailure", "ClientSettings", "LocalTrainer", "METRICS", "NUM_EXAMPLES",
           "PARTITION_ID", "PHASES", "close_trainers", "make_client_app", "trained_names"]

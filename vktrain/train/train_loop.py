"""The on-device training loop behind `vktrain train` (numpy + tqdm; no torch, no executorch).

    runner = TrainingRunner.from_pte("step.pte")             # any StepRunner
    info = describe_program(runner)                          # batch shape and vocabulary from the program
    batches = TokenBatcher(load_tokens(path), info.batch_size, info.seq_len, seed=0)
    state = train(runner, batches, steps=1000, schedule=LRSchedule("cosine", 1e-3, 1000, warmup_steps=50),
                  checkpoint_every=100, checkpoint_path="run.ckpt", keep_checkpoints=3,
                  json_path="losses.json", program_sha256=sha256_file("step.pte"))

Per step t (1-based): lr = schedule.lr(t); hparams = [lr, beta1, beta2, eps, weight_decay] (float32 [5],
a runtime input of the program: changing them never needs a re-export); batch = batches.batch(position);
loss = runner.step(tokens, labels, hparams) for a TokenBatcher's (tokens, labels), runner.step_inputs(batch,
hparams) for the named arrays of an ArrayBatches (vktrain/train/input_data.py: a step of any module);
record {"step": t, "loss": loss, "lr": lr, "seconds": s} (lr as the schedule computes it, in float64; the
program receives it rounded to float32; s the wall time of the loop's step: the batch, the program's run
and the state's NaN/inf check and backup, not the eval or checkpoint that may follow it).

`steps` is the step number to reach, not a count to add: resuming a checkpoint of step 10 with steps=20
runs steps 11..20, reading the same batches with the same learning rates as an uninterrupted run, so
the losses and the final state are identical.

Checkpoints (vktrain.train.checkpoint.CheckpointSeries: the newest at `checkpoint_path`, the
`keep_checkpoints` - 1 before it step-named) are written atomically every `checkpoint_every` steps and
after the last step. The loop reads the state of that step to the host (one transfer from the device
copy) and goes on; serialisation, checksums and the fsync'ed write run on another thread
(vktrain.train.checkpoint_writer), at most one at a time. The loop waits for it before the next
checkpoint, at the end and however it stops; a failed write stops the run with its error (the
previous checkpoint stays whole). The JSON log (a list of the records of every step since step 1, restored from the
checkpoint on resume) is rewritten atomically at every checkpoint and when the loop ends, however it ends.

Divergence. Forward, backward and AdamW are one program: step t's loss comes from the state BEFORE step
t (S[t-1]), and step t's update is applied in the same run. So
  * a non-finite loss at step t means S[t-1] is already bad (its values overflow on this batch) although
    finite: resuming S[t-1] with a smaller learning rate computes the same loss again. The learning rate
    that matters is step t-1's, so the state to resume from is S[t-2], the one before the update that
    produced S[t-1];
  * a finite loss whose update left NaN/inf in the state (S[t] non-finite) makes S[t-1] the state to
    resume from.
When the state is small enough (at most `last_good_state_limit` bytes; by default 256 MiB on a device,
64 MiB for a runner without one: vktrain/train/last_good.py), the loop keeps copies of S[t-1] and S[t-2]
and checks every update's result for NaN/inf. A TrainingRunner keeps them on the device (a recorded copy
per step that checks every word as it copies and reads back one word: no state crosses to the host per
step); other runners are copied to the host. On a non-finite step it puts S[t-1] back into the runner, then
  * on_nonfinite="stop" (default): writes the state to resume from as a step-named checkpoint (when
    checkpointing and no kept checkpoint holds that step; every kept checkpoint stays untouched) and
    raises NonFiniteLossError naming it;
  * on_nonfinite="skip": skips the batch (the data position moves on, the step is retried on the next
    batch; the next record lists the skipped positions under "skipped"); after MAX_CONSECUTIVE_SKIPS
    batches in a row the state itself is the problem and the loop stops as above.
A larger state is not copied: a non-finite loss stops the loop, nothing is written, and the error names
the newest kept checkpoint from before the step whose update made it bad. No checkpoint ever holds a
non-finite value (`Checkpoint` refuses one).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Union

import numpy as np
from tqdm import tqdm

from vktrain.contract import ADAMW_DEFAULTS, hparams_values
from vktrain.errors import VktrainError
from vktrain.train.checkpoint import (
    Checkpoint,
    CheckpointSeries,
    OutputWriteError,
    atomic_write_json,
    capture_state,
    non_finite_tensors,
    save_checkpoint,
    skipped_positions,
)
from vktrain.train.checkpoint_writer import CheckpointWriter
from vktrain.train.data import TokenBatcher
from vktrain.train.last_good import last_good_states

if TYPE_CHECKING:  # its input checks import the runtime's program reader; the loop needs only the type
    from vktrain.train.input_data import ArrayBatches
from vktrain.train.lr_schedule import LRSchedule

PathLike = Union[str, os.PathLike]

ON_NONFINITE = ("stop", "skip")
# Batches skipped in a row before the loop decides the state, not the data, gives the non-finite values.
MAX_CONSECUTIVE_SKIPS = 8
# AdamW's step counter is float32 state: integers above 2**24 are not all representable.
MAX_STEPS = 2**24

_FUSED_CE = "vktrain.fused_ce.default"
_EMBEDDING = "aten.embedding.default"


class TrainConfigError(VktrainError, ValueError):
    """A training setting (argument, hyper-parameter, program description) that cannot work."""


class StepRunner(Protocol):
    """What the loop needs from a training program (vktrain.runtime.program.runner.TrainingRunner is one):
    `step` for token batches, `step_inputs` for named input arrays (ArrayBatches)."""

    def step(self, token_ids: np.ndarray, labels: np.ndarray, hparams: np.ndarray) -> float: ...

    def step_inputs(self, inputs: Mapping[str, np.ndarray], hparams: np.ndarray) -> float: ...

    @property
    def state_names(self) -> list[str]: ...

    def read_state(self, name: str) -> np.ndarray: ...

    def write_state(self, name: str, array: Any) -> None: ...


class NonFiniteLossError(VktrainError, RuntimeError):
    """A step gave a NaN/inf loss (or left NaN/inf in the state); training stopped (module docstring).

    `resume_from` is the (path, step) of the checkpoint a resume with a smaller learning rate should start
    from, None when no kept checkpoint is early enough."""

    def __init__(self, step: int, loss: float, lr: float, resume_from: Optional[tuple[str, int]] = None, *,
                 state_non_finite: bool = False, skipped: int = 0) -> None:
        self.step, self.loss, self.lr, self.resume_from = step, loss, lr, resume_from
        if state_non_finite:
            what = f"the state held NaN/inf after step {step} (loss {loss}, lr {lr:.6g}); training stopped"
        else:
            what = f"the loss became {loss} at step {step} (lr {lr:.6g})"
            if skipped:
                what += f" on {skipped + 1} batches in a row ({skipped} skipped: the state, not the data, gives it)"
            what += "; training stopped " + (f"(the state that gives it was made by step {step - 1}'s update)"
                                             if step > 1 else "(the program's initial state gives it)")
        where = ("; no kept checkpoint is from before that (checkpoint with --checkpoint PATH --checkpoint-every K "
                 "--keep-checkpoints 2 or more)"
                 if resume_from is None else
                 f"; the last good checkpoint is {resume_from[0]} (step {resume_from[1]}): resume from it with a "
                 f"smaller --lr or more --warmup")
        super().__init__(what + where)


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's hyper-parameters, checked as the program receives them: rounded to float32."""

    beta1: float = ADAMW_DEFAULTS["beta1"]
    beta2: float = ADAMW_DEFAULTS["beta2"]
    eps: float = ADAMW_DEFAULTS["eps"]
    weight_decay: float = ADAMW_DEFAULTS["weight_decay"]

    def __post_init__(self) -> None:
        names = ("beta1", "beta2", "eps", "weight_decay")
        as_float32 = {name: float(np.float32(getattr(self, name))) for name in names}
        for name in ("beta1", "beta2"):
            if not 0.0 <= as_float32[name] < 1.0:
                raise TrainConfigError(f"AdamW {name} must lie in [0, 1) in float32, got {getattr(self, name)!r}"
                                       + (" (rounds to 1.0 in float32)" if as_float32[name] == 1.0 else ""))
        if not (math.isfinite(as_float32["eps"]) and as_float32["eps"] > 0):
            raise TrainConfigError(f"AdamW eps must be a positive finite float32, got {self.eps!r} "
                                   f"(float32: {as_float32['eps']!r})")
        if not (math.isfinite(as_float32["weight_decay"]) and as_float32["weight_decay"] >= 0):
            raise TrainConfigError(f"AdamW weight decay must be a finite float32 >= 0, got {self.weight_decay!r} "
                                   f"(float32: {as_float32['weight_decay']!r})")

    def check_lr(self, lr: float) -> None:
        """Refuse a learning rate whose product with the weight decay overflows float32 (the decoupled decay
        multiplies the parameters by 1 - lr * weight_decay)."""
        if not np.isfinite(np.float32(lr) * np.float32(self.weight_decay)):
            raise TrainConfigError(f"learning rate {lr!r} x weight decay {self.weight_decay!r} overflows float32")

    def hparams(self, lr: float) -> np.ndarray:
        """The program's hparams input: float32 [5] = [lr, beta1, beta2, eps, weight_decay]."""
        return np.array(hparams_values(lr, self.beta1, self.beta2, self.eps, self.weight_decay), dtype=np.float32)


@dataclass
class TrainState:
    """Where a run stands: completed steps, batches consumed, the per-step records so far, and the last
    checkpoint that holds this run as (path, step)."""

    step: int = 0
    data_position: int = 0
    records: list[dict] = field(default_factory=list)
    last_checkpoint: Optional[tuple[str, int]] = None

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, path: PathLike) -> "TrainState":
        return cls(checkpoint.step, checkpoint.data_position, list(checkpoint.records), (str(path), checkpoint.step))

    def data_position_after(self, step: int, grad_accum: int = 1) -> int:
        """The data position once `step` had completed (batches skipped before it included), each step (and
        each skip) taking `grad_accum` micro-batches."""
        return (step + skipped_positions(self.records[:step])) * grad_accum


@dataclass(frozen=True)
class ProgramInfo:
    """What the loop needs to know about a training program: its batch shape and vocabulary."""

    batch_size: int
    seq_len: int
    vocab_size: int
    metadata: dict = field(default_factory=dict)


def takes_hparams(runner: Any) -> bool:
    """False for a program whose hyper-parameters are baked (TrainingRunner.takes_hparams): its step takes
    no hparams. A runner without the attribute takes them."""
    return getattr(runner, "takes_hparams", True)


def is_token_step(runner: Any) -> bool:
    """False for a step that takes other inputs than a token model's (TrainingRunner.is_token_step): it
    trains on named input arrays (--inputs). A runner without the attribute is a token model's."""
    return getattr(runner, "is_token_step", True)


def describe_program(runner: Any) -> ProgramInfo:
    """Batch shape and vocabulary of a training program.

    A runner that has `batch_shape` ((B, S)) and `vocab_size` attributes is taken at its word; otherwise
    they are read from its delegate graph (`runner.graph`, a VkGraph): the shape of the `token_ids` input,
    and the class count of the fused cross-entropy's logits (the embedding's row count as a fallback).
    """
    graph = getattr(runner, "graph", None)
    metadata = dict(getattr(graph, "metadata", {}) or {})
    shape, vocab = getattr(runner, "batch_shape", None), getattr(runner, "vocab_size", None)
    if graph is not None:
        if shape is None:
            for value_id in graph.inputs:
                tensor = graph.tensor(value_id)
                if tensor.name == "token_ids":
                    shape = tensor.shape
        if vocab is None:
            vocab = _vocab_from_graph(graph)
    if shape is None or vocab is None:
        raise TrainConfigError("cannot tell the program's batch shape and vocabulary: the runner has no batch_shape / "
                         "vocab_size attributes and no delegate graph with a token_ids input and a fused_ce op")
    if len(shape) != 2:
        raise TrainConfigError(f"the program's token_ids input must be [batch, seq], got shape {list(shape)}")
    return ProgramInfo(int(shape[0]), int(shape[1]), int(vocab), metadata)


def _vocab_from_graph(graph) -> Optional[int]:
    for wanted, axis in ((_FUSED_CE, -1), (_EMBEDDING, 0)):
        for op in graph.ops:
            if op.name == wanted:
                return int(graph.tensor(op.args[0]).shape[axis])
    return None


def run_step(runner: StepRunner, batch: Union[tuple, Mapping[str, np.ndarray]], hparams) -> float:
    """One step on a batch of either source: a TokenBatcher's (tokens, labels[, positions]) or an
    ArrayBatches' inputs."""
    if isinstance(batch, Mapping):
        return float(runner.step_inputs(batch, hparams))
    return float(runner.step(*batch[:2], hparams, **_documents(batch)))


def _documents(batch: tuple) -> dict:
    """The positions keyword of a packed-documents batch (tokens, labels, positions); {} for (tokens, labels)."""
    return {"positions": batch[2]} if len(batch) > 2 else {}


def run_accumulated_step(runner: StepRunner, batches: list[tuple], hparams) -> float:
    """One optimizer step over several token micro-batches: each but the last adds its gradient into the
    program's accumulators (runner.accumulate), the last one's step applies AdamW to the sum. Every call
    divides by n_valid summed over all of them, so the update and the summed loss are those of one batch of
    all of them. Named batches (DPO's pairs) carry their divisor themselves: the accumulate method, then the
    step."""
    if isinstance(batches[0], Mapping):
        loss = sum(float(runner.accumulate_inputs(batch)) for batch in batches[:-1])
        return loss + float(runner.step_inputs(batches[-1], hparams))
    n_valid = float(sum(np.count_nonzero(np.asarray(batch[1]) >= 0) for batch in batches))
    loss = sum(float(runner.accumulate(*batch[:2], n_valid, **_documents(batch))) for batch in batches[:-1])
    return loss + float(runner.step(*batches[-1][:2], hparams, n_valid=n_valid, **_documents(batches[-1])))


def run_config(schedule: LRSchedule, optimizer: AdamWConfig, batches: Union[TokenBatcher, "ArrayBatches"],
               grad_accum: int = 1) -> dict:
    """The settings that decide the steps' results (recorded in checkpoints, compared on resume). A constant
    schedule's length and floor change nothing, so they are left out (extending such a run is no change);
    grad_accum only when above 1 (a checkpoint from before it existed is the same run)."""
    schedule_fields = schedule.to_dict()
    if schedule.kind == "constant":
        del schedule_fields["total_steps"], schedule_fields["min_lr_ratio"]
    config = {"schedule": schedule_fields, "optimizer": asdict(optimizer), **batches.config()}
    if grad_accum > 1:
        config["grad_accum"] = grad_accum
    return config


def train(runner: StepRunner, batches: Union[TokenBatcher, "ArrayBatches"], steps: int, schedule: LRSchedule,
          optimizer: AdamWConfig = AdamWConfig(), *, state: Optional[TrainState] = None,
          checkpoint_every: int = 0, checkpoint_path: Optional[PathLike] = None, keep_checkpoints: int = 1,
          program_sha256: str = "", json_path: Optional[PathLike] = None, progress: bool = True,
          log_every: int = 0, on_nonfinite: str = "stop",
          last_good_state_limit: Optional[int] = None,
          after_step: Optional[Callable[[int], dict]] = None,
          stop_requested: Optional[Callable[[], bool]] = None, first_record: Optional[dict] = None,
          grad_accum: int = 1) -> TrainState:
    """Run steps state.step + 1 .. `steps` (see the module docstring). Returns the final TrainState.

    `grad_accum` N > 1: each step takes N consecutive batches (run_accumulated_step; the runner needs an
    accumulate method) and advances the data position by N; checkpoints fall between steps, where the
    accumulators are zero, so a resume is exact.
    `state` continues a run (TrainState.from_checkpoint after `restore_state`) and is updated in place;
    None starts at step 0. `program_sha256` identifies the .pte in checkpoints (sha256_file of it).
    `keep_checkpoints`: how many checkpoints of the run stay on disk (CheckpointSeries); `on_nonfinite`:
    "stop" or "skip" (module docstring). `after_step(step)` runs after each completed step; what it
    returns (e.g. {"eval_loss": ...}) joins that step's record. `stop_requested()` (e.g. a signal
    arrived: vktrain.train.interrupts) is asked before each step: True ends the loop as if `steps` were
    reached at the current step (checkpointed, records written); the caller tells the two apart.
    Early stopping (vktrain.train.best) asks through it too. `first_record` (e.g. {"step": 0, "eval_loss": ...}, the held-out loss before training) leads the
    JSON log; it is no step's record, so checkpoints do not hold it.
    """
    state = TrainState() if state is None else state
    if steps < state.step:
        raise TrainConfigError(f"the run is already at step {state.step}; asked to train up to step {steps}, "
                               f"which is behind it")
    if steps > MAX_STEPS:
        raise TrainConfigError(f"at most {MAX_STEPS} steps (AdamW's step counter is float32), asked for {steps}")
    if checkpoint_every < 0:
        raise TrainConfigError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    if grad_accum < 1:
        raise TrainConfigError(f"grad_accum must be >= 1 (micro-batches per optimizer step), got {grad_accum}")
    if grad_accum > 1 and not (isinstance(batches, TokenBatcher) or getattr(batches, "accumulates", False)):
        raise TrainConfigError("gradient accumulation takes token batches (a token model's step) or preference "
                               "pairs; this run's batches are named input arrays")
    if checkpoint_every and checkpoint_path is None:
        raise TrainConfigError("checkpoint_every needs a checkpoint path")
    if on_nonfinite not in ON_NONFINITE:
        raise TrainConfigError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    optimizer.check_lr(schedule.base_lr)
    series = CheckpointSeries(checkpoint_path, keep_checkpoints) if checkpoint_path is not None else None
    if series is not None:
        series.kept()  # every file it would replace or rotate is a checkpoint: refused now, not at step N
    config = run_config(schedule, optimizer, batches, grad_accum)
    data_sha256 = batches.fingerprint if series is not None else ""
    copies = last_good_states(runner, last_good_state_limit)  # of S[t-1] and S[t-2]; None: too large
    if on_nonfinite == "skip" and copies is None:
        copies_limit = "the default limit" if last_good_state_limit is None else f"{last_good_state_limit} bytes"
        raise TrainConfigError(f"skipping non-finite batches needs a copy of the state before each step; the "
                               f"state is above {copies_limit}")
    skipped: list[int] = []  # data positions skipped since the last completed step
    writer = None if series is None else CheckpointWriter(
        series, on_written=lambda step: setattr(state, "last_checkpoint", (str(series.path), step)))

    def checkpoint_of(step: int, tensors: dict[str, np.ndarray]) -> Callable[[], Checkpoint]:
        """Makes step's Checkpoint, from what the run holds now (the loop goes on appending records)."""
        position, records = state.data_position_after(step, grad_accum), [dict(record) for record in state.records[:step]]
        return lambda: Checkpoint(step, position, program_sha256, data_sha256, batches.seed, tensors, records,
                                  config, source=str(series.path))

    def resume_point(step: int, tensors: Optional[dict[str, np.ndarray]]) -> Optional[tuple[str, int]]:
        """The kept checkpoint of `step`, else one written from `tensors` (step-named: every kept checkpoint
        stays untouched), else the newest kept before it."""
        if series is None or step < 0:
            return None
        try:
            wait_for_pending_checkpoint()
        except Exception as exc:  # a failed write must not hide the divergence: name what is on disk
            tqdm.write(f"vktrain train: warning: a checkpoint was not written: {exc}", file=sys.stderr)
        kept = series.kept()
        exact = [entry for entry in kept if entry[1] == step]
        if exact:
            return exact[0]
        if tensors is not None:
            target = series.step_path(step)
            try:
                save_checkpoint(target, checkpoint_of(step, tensors)())
                return str(target), step
            except OutputWriteError as exc:  # a full disk must not hide the divergence: name an older one
                tqdm.write(f"vktrain train: warning: the state of step {step} was not kept: {exc}", file=sys.stderr)
        earlier = [entry for entry in kept if entry[1] < step]
        return earlier[0] if earlier else None

    def checkpoint_now(loss: float, lr: float, tensors: Optional[dict[str, np.ndarray]]) -> None:
        """Start writing state.step's checkpoint on the writer's thread. `tensors`: the device or host copy
        of that step (finite: the copies hold finite states only), None to read the state here, where it is
        checked: a checkpoint never holds a non-finite value."""
        if tensors is None:
            tensors = capture_state(runner)
            if non_finite_tensors(tensors):
                raise NonFiniteLossError(state.step, loss, lr, resume_point(state.step - 1, None),
                                         state_non_finite=True)
        writer.submit(state.step, checkpoint_of(state.step, tensors))

    def wait_for_pending_checkpoint() -> None:
        """The one place the loop joins the checkpoint write in flight (raising its error, if it failed):
        before the next checkpoint, at the end, on divergence and however the loop stops."""
        if writer is not None:
            writer.wait()

    def write_json() -> None:
        if json_path is not None:
            atomic_write_json(json_path, ([first_record] if first_record else []) + state.records)

    bar = tqdm(total=steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True,
               desc="train", file=sys.stderr)
    try:
        if series is not None:
            series.remove_stale_temp_files()
        if copies is not None:
            copies.keep(state.step)  # S[state.step]
        while state.step < steps:
            if stop_requested is not None and stop_requested():
                break
            started = time.perf_counter()
            step = state.step + 1
            lr = schedule.lr(step)
            hparams = optimizer.hparams(lr) if takes_hparams(runner) else None
            if grad_accum == 1:
                loss = run_step(runner, batches.batch(state.data_position), hparams)
            else:
                loss = run_accumulated_step(
                    runner, [batches.batch(state.data_position + i) for i in range(grad_accum)], hparams)
            # A finite loss: S[step] is kept (overwriting S[step - 2]) and checked. A non-finite one leaves
            # S[step - 2] in place: the state to resume from.
            state_non_finite = math.isfinite(loss) and copies is not None and copies.keep(step)
            if not math.isfinite(loss) or state_non_finite:
                if copies is not None:  # the update used non-finite values: undo it
                    copies.restore(step - 1)
                if on_nonfinite == "skip" and len(skipped) < MAX_CONSECUTIVE_SKIPS:
                    skipped.append(state.data_position)
                    state.data_position += grad_accum
                    tqdm.write(f"step {step:6d}  loss {loss}: skipped batch {skipped[-1]}", file=sys.stderr)
                    continue
                resume_step = step - 1 if state_non_finite else step - 2
                tensors = copies.tensors(resume_step) if copies is not None else None
                raise NonFiniteLossError(step, loss, lr, resume_point(resume_step, tensors),
                                         state_non_finite=state_non_finite, skipped=len(skipped))
            record = {"step": step, "loss": loss, "lr": lr, "seconds": time.perf_counter() - started}
            if skipped:
                record["skipped"], skipped = skipped, []
            state.step, state.data_position = step, state.data_position + grad_accum
            state.records.append(record)
            if after_step is not None:
                record.update(after_step(step))
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", refresh=False)
            bar.update(1)
            if log_every and (step % log_every == 0 or step == steps):
                tqdm.write(f"step {step:6d}  loss {loss:.6f}  lr {lr:.4g}", file=sys.stdout)
                sys.stdout.flush()  # a log file or pipe sees each line when it is printed
            if writer is not None:
                writer.check()  # a write that failed stops the run now, not at the next checkpoint
            if checkpoint_every and step % checkpoint_every == 0:
                checkpoint_now(loss, lr, copies.tensors(step) if copies is not None else None)
                write_json()
        wait_for_pending_checkpoint()
        if series is not None and state.last_checkpoint != (str(series.path), state.step):
            last = state.records[-1] if state.records else {"loss": math.nan, "lr": math.nan}
            checkpoint_now(last["loss"], last["lr"], copies.tensors(state.step) if copies is not None else None)
            wait_for_pending_checkpoint()
    finally:
        bar.close()
        if copies is not None:
            copies.close()
        try:
            wait_for_pending_checkpoint()  # something is in flight only when an error or interrupt ended the loop
        except Exception as exc:  # that error goes on; this one is reported beside it
            tqdm.write(f"vktrain train: warning: a checkpoint was not written: {exc}", file=sys.stderr)
        write_json()  # however the loop ended: the records of every completed step
    return state


__all__ = ["AdamWConfig", "MAX_CONSECUTIVE_SKIPS", "MAX_STEPS", "NonFiniteLossError",
           "ON_NONFINITE", "ProgramInfo", "StepRunner", "TrainConfigError", "TrainState", "describe_program",
           "is_token_step", "run_accumulated_step", "run_config", "run_step", "takes_hparams", "train"]

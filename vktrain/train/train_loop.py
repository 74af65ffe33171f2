"""The on-device training loop behind `vktrain train` (numpy + tqdm; no torch, no executorch).

    runner = TrainingRunner.from_pte("step.pte")             # any StepRunner
    info = describe_program(runner)                          # batch shape and vocabulary from the program
    batches = TokenBatcher(load_tokens(path), info.batch_size, info.seq_len, seed=0)
    state = train(runner, batches, steps=1000, schedule=LRSchedule("cosine", 1e-3, 1000, warmup_steps=50),
                  checkpoint_every=100, checkpoint_path="run.ckpt", json_path="losses.json",
                  program_sha256=sha256_file("step.pte"))

Per step t (1-based): lr = schedule.lr(t); hparams = [lr, beta1, beta2, eps, weight_decay] (float32 [5],
a runtime input of the program: changing them never needs a re-export); batch = batches.batch(position);
loss = runner.step(tokens, labels, hparams); record {"step": t, "loss": loss, "lr": lr} (lr as the schedule
computes it, in float64; the program receives it rounded to float32).

`steps` is the step number to reach, not a count to add: resuming a checkpoint of step 10 with steps=20
runs steps 11..20, reading the same batches with the same learning rates as an uninterrupted run, so
the losses and the final state are identical.

Checkpoints (vktrain.train.checkpoint) are written atomically every `checkpoint_every` steps and after
the last step. The JSON log (a list of the records of every step since step 1, restored from the
checkpoint on resume) is rewritten atomically at every checkpoint and when the loop ends, however it ends.
A non-finite loss stops the loop with NonFiniteLossError naming the step. That step has already updated
the optimizer state on the device (forward, backward and AdamW are one program) with NaN/inf, so:
  * when checkpointing and the state is small (at most `last_good_state_limit` bytes, 64 MiB by default,
    i.e. LoRA-sized), the loop keeps a host copy of the state from before each step; on a bad step it
    writes the state back into the runner and saves it as the checkpoint of the last good step (t - 1);
  * otherwise the corrupted state is not saved and the checkpoint file keeps the last periodic one.
Either way the error names the checkpoint a resume (with a smaller learning rate) should start from.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import numpy as np
from tqdm import tqdm

from vktrain.contract import ADAMW_DEFAULTS, hparams_values

from vktrain.train.adapters import LORA_SUFFIXES, AdapterError, adapters_from_state, save_adapters
from vktrain.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    atomic_write_json,
    capture_state,
    load_checkpoint,
    restore_state,
    save_checkpoint,
    sha256_file,
)
from vktrain.train.data import DataError, TokenBatcher, check_vocab, default_dataset_path, load_tokens
from vktrain.train.lr_schedule import SCHEDULES, LRSchedule
from vktrain.errors import VktrainError

PathLike = Union[str, os.PathLike]

# Up to this many bytes of state, a host copy is kept before each step so that a NaN/inf step can be
# undone and the last good step checkpointed (a LoRA state is far smaller; a copy costs little).
LAST_GOOD_STATE_LIMIT = 64 << 20

# Delegate-graph metadata keys the loop reads when present (the exporter may record them; see run_train).
METADATA_LORA_ALPHA = "lora_alpha"
METADATA_SOURCE_MODEL = "source_model"
_FUSED_CE = "vktrain.fused_ce.default"
_EMBEDDING = "aten.embedding.default"


class StepRunner(Protocol):
    """What the loop needs from a training program (vktrain.runtime.program.runner.TrainingRunner is one)."""

    def step(self, token_ids: np.ndarray, labels: np.ndarray, hparams: np.ndarray) -> float: ...

    @property
    def state_names(self) -> list[str]: ...

    def read_state(self, name: str) -> np.ndarray: ...

    def write_state(self, name: str, array: Any) -> None: ...


class NonFiniteLossError(VktrainError, RuntimeError):
    """The loss of a step was NaN or infinite; training stopped."""

    def __init__(self, step: int, loss: float, lr: float, last_checkpoint: Optional[tuple[str, int]] = None,
                 rolled_back: bool = False) -> None:
        self.step, self.loss, self.lr = step, loss, lr
        self.last_checkpoint, self.rolled_back = last_checkpoint, rolled_back
        if rolled_back:
            state = f"the state was rolled back to step {step - 1}"
        else:
            state = "the state after that step is corrupted and was not saved"
        if last_checkpoint is not None:
            path, good_step = last_checkpoint
            where = (f"the last good checkpoint is {path} (step {good_step}); resume from it with a smaller --lr "
                     f"or more --warmup")
        else:
            where = "no checkpoint holds this run (use --checkpoint-every K --checkpoint PATH)"
        super().__init__(f"the loss became {loss} at step {step} (lr {lr:.6g}); training stopped; {state}; {where}")


@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = ADAMW_DEFAULTS["beta1"]
    beta2: float = ADAMW_DEFAULTS["beta2"]
    eps: float = ADAMW_DEFAULTS["eps"]
    weight_decay: float = ADAMW_DEFAULTS["weight_decay"]

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"AdamW {name} must lie in [0, 1), got {value}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"AdamW eps must be a positive finite number, got {self.eps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"AdamW weight decay must be a finite number >= 0, got {self.weight_decay}")

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


@dataclass(frozen=True)
class ProgramInfo:
    """What the loop needs to know about a training program: its batch shape and vocabulary."""

    batch_size: int
    seq_len: int
    vocab_size: int
    metadata: dict = field(default_factory=dict)


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
        raise ValueError("cannot tell the program's batch shape and vocabulary: the runner has no batch_shape / "
                         "vocab_size attributes and no delegate graph with a token_ids input and a fused_ce op")
    if len(shape) != 2:
        raise ValueError(f"the program's token_ids input must be [batch, seq], got shape {list(shape)}")
    return ProgramInfo(int(shape[0]), int(shape[1]), int(vocab), metadata)


def _vocab_from_graph(graph) -> Optional[int]:
    for wanted, axis in ((_FUSED_CE, -1), (_EMBEDDING, 0)):
        for op in graph.ops:
            if op.name == wanted:
                return int(graph.tensor(op.args[0]).shape[axis])
    return None


def _run_config(schedule: LRSchedule, optimizer: AdamWConfig, batches: TokenBatcher) -> dict:
    """The settings that decide the steps' results (recorded in checkpoints, compared on resume). A constant
    schedule's length and floor change nothing, so they are left out (extending such a run is no change)."""
    schedule_fields = schedule.to_dict()
    if schedule.kind == "constant":
        del schedule_fields["total_steps"], schedule_fields["min_lr_ratio"]
    return {"schedule": schedule_fields, "optimizer": asdict(optimizer),
            "batch_size": batches.batch_size, "seq_len": batches.seq_len, "shuffle": batches.shuffle}


def train(runner: StepRunner, batches: TokenBatcher, steps: int, schedule: LRSchedule,
          optimizer: AdamWConfig = AdamWConfig(), *, state: Optional[TrainState] = None,
          checkpoint_every: int = 0, checkpoint_path: Optional[PathLike] = None, program_sha256: str = "",
          json_path: Optional[PathLike] = None, progress: bool = True, log_every: int = 0,
          last_good_state_limit: int = LAST_GOOD_STATE_LIMIT) -> TrainState:
    """Run steps state.step + 1 .. `steps` (see the module docstring). Returns the final TrainState.

    `state` continues a run (TrainState.from_checkpoint after `restore_state`) and is updated in place;
    None starts at step 0. `program_sha256` identifies the .pte in checkpoints (sha256_file of it).
    """
    state = TrainState() if state is None else state
    if steps < state.step:
        raise ValueError(f"the run is already at step {state.step}; asked to train up to step {steps}, which is behind it")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    if checkpoint_every and checkpoint_path is None:
        raise ValueError("checkpoint_every needs a checkpoint path")
    config = _run_config(schedule, optimizer, batches)
    data_sha256 = batches.fingerprint if checkpoint_path is not None else ""
    written_at: Optional[int] = None  # step of the last checkpoint this call wrote
    keep_last_good = checkpoint_path is not None and \
        sum(np.asarray(runner.read_state(name)).nbytes for name in runner.state_names) <= last_good_state_limit

    def write_checkpoint() -> None:
        nonlocal written_at
        checkpoint = Checkpoint(state.step, state.data_position, program_sha256, data_sha256, batches.seed,
                                capture_state(runner), list(state.records), config)
        save_checkpoint(checkpoint_path, checkpoint)
        state.last_checkpoint, written_at = (str(checkpoint_path), state.step), state.step

    def write_json() -> None:
        if json_path is not None:
            atomic_write_json(json_path, state.records)

    bar = tqdm(total=steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True,
               desc="train", file=sys.stderr)
    try:
        for step in range(state.step + 1, steps + 1):
            lr = schedule.lr(step)
            tokens, labels = batches.batch(state.data_position)
            last_good = capture_state(runner) if keep_last_good else None
            loss = float(runner.step(tokens, labels, optimizer.hparams(lr)))
            if not math.isfinite(loss):
                if last_good is not None:
                    for name, array in last_good.items():
                        runner.write_state(name, array)
                    if written_at != state.step:
                        write_checkpoint()  # state.step is still the last good step
                raise NonFiniteLossError(step, loss, lr, state.last_checkpoint, rolled_back=last_good is not None)
            state.step, state.data_position = step, state.data_position + 1
            state.records.append({"step": step, "loss": loss, "lr": lr})
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", refresh=False)
            bar.update(1)
            if log_every and (step % log_every == 0 or step == steps):
                tqdm.write(f"step {step:6d}  loss {loss:.6f}  lr {lr:.4g}", file=sys.stdout)
            if checkpoint_every and step % checkpoint_every == 0:
                write_checkpoint()
                write_json()
        if checkpoint_path is not None and written_at != state.step:
            write_checkpoint()
    finally:
        bar.close()
        write_json()  # however the loop ended: the records of every completed step
    return state


# ------------------------------------------------------------------------------------------------
# Command line: `vktrain train`
# ------------------------------------------------------------------------------------------------

def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `vktrain train` arguments (the subcommand's parser; run it with `run_train`)."""
    parser.add_argument("program", metavar="FILE.pte", help="training-step program (vktrain export --program train-step)")
    parser.add_argument("--data", metavar="FILE",
                        help="token data: byte-level text (any file; each byte is a token 0..255), a .npy 1-D "
                             "integer array, or whitespace-separated ids in *.tokens.txt (default: the built-in corpus)")
    parser.add_argument("--steps", type=int, required=True, metavar="N",
                        help="train up to step N (a resumed run continues from its checkpoint's step)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="learning-rate schedule after warmup (default cosine)")
    parser.add_argument("--warmup", type=int, default=0, metavar="W", help="linear warmup steps (default 0)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0,
                        help="cosine floor as a fraction of --lr (default 0)")
    parser.add_argument("--beta1", type=float, default=ADAMW_DEFAULTS["beta1"])
    parser.add_argument("--beta2", type=float, default=ADAMW_DEFAULTS["beta2"])
    parser.add_argument("--eps", type=float, default=ADAMW_DEFAULTS["eps"])
    parser.add_argument("--weight-decay", type=float, default=ADAMW_DEFAULTS["weight_decay"],
                        help=f"AdamW decoupled weight decay (default {ADAMW_DEFAULTS['weight_decay']}, torch.optim.AdamW's)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="write a checkpoint every K steps (and after the last step)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="checkpoint file (safetensors), written atomically; default with --resume: that file")
    parser.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint of this same .pte")
    parser.add_argument("--json", metavar="FILE", help="write the per-step records [{step, loss, lr}, ...] as JSON")
    parser.add_argument("--out-adapters", metavar="DIR",
                        help="write the trained adapters in PEFT format (adapter_model.safetensors + adapter_config.json)")
    parser.add_argument("--lora-alpha", type=float,
                        help="LoRA alpha for adapter_config.json (needed with --out-adapters when the .pte does not record it)")
    parser.add_argument("--base-model", help="base_model_name_or_path for adapter_config.json")
    parser.add_argument("--seed", type=int, help="data shuffling seed (default 0; a resumed run keeps its checkpoint's)")
    parser.add_argument("--no-shuffle", action="store_true", help="read windows in file order")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--plot", metavar="FILE.png", help="write the loss curve of the whole run as a PNG")
    parser.add_argument("--log-every", type=int, default=1, metavar="N",
                        help="print step, loss and lr every N steps (default 1; 0: only the summary)")
    return parser


def _config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    differences = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            differences += _config_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            differences.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return differences


def _resolve_alpha(args: argparse.Namespace, metadata: dict) -> Optional[float]:
    if args.lora_alpha is not None:
        return args.lora_alpha
    if METADATA_LORA_ALPHA in metadata:
        return float(metadata[METADATA_LORA_ALPHA])
    return None


def run_train(args: argparse.Namespace, device=None) -> int:
    """`vktrain train`: 0 on success, 1 when the loss diverged, 2 for bad input, 130 when interrupted (Ctrl-C);
    errors are one line on stderr. `device`: a vktrain.runtime Device to run on (None: the default one)."""
    try:
        return _run_train(args, device)
    except NonFiniteLossError as exc:
        print(f"vktrain train: error: {exc}", file=sys.stderr)
        return 1
    except (DataError, CheckpointError, AdapterError, ValueError, OSError) as exc:
        print(f"vktrain train: error: {exc}", file=sys.stderr)
        return 2


def _run_train(args: argparse.Namespace, device) -> int:
    from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan: imported only when a run starts

    program_path = Path(args.program)
    if not program_path.is_file():
        raise ValueError(f"program {program_path} does not exist (or is not a file)")
    if args.checkpoint_every and not (args.checkpoint or args.resume):
        raise ValueError("--checkpoint-every needs --checkpoint PATH (where to write them)")
    checkpoint_path = args.checkpoint or args.resume
    for flag, target in (("--checkpoint", checkpoint_path), ("--json", args.json)):
        # Found now, not when the first checkpoint is due after minutes of training.
        if target and not Path(target).absolute().parent.is_dir():
            raise ValueError(f"{flag} {target}: directory {Path(target).absolute().parent} does not exist")
    schedule = LRSchedule(args.schedule, args.lr, args.steps, args.warmup, args.min_lr_ratio)
    optimizer = AdamWConfig(args.beta1, args.beta2, args.eps, args.weight_decay)
    resume = load_checkpoint(args.resume) if args.resume else None
    if resume is not None and args.seed is not None and args.seed != resume.data_seed:
        raise ValueError(f"--seed {args.seed} differs from the checkpoint's data seed {resume.data_seed}: the resumed "
                         f"run would read other batches; drop --seed to keep the checkpoint's")
    seed = resume.data_seed if resume is not None else (0 if args.seed is None else args.seed)
    data_path = Path(args.data) if args.data else default_dataset_path()
    tokens = load_tokens(data_path)
    program_sha256 = sha256_file(program_path)

    with TrainingRunner.from_pte(program_path, device) as runner:
        info = describe_program(runner)
        alpha = _resolve_alpha(args, info.metadata)
        if args.out_adapters and alpha is None:
            raise ValueError("--out-adapters: the .pte does not record the LoRA alpha it was exported with; pass "
                             "--lora-alpha (the value given to vktrain export --lora-alpha, default 16)")
        check_vocab(tokens, info.vocab_size, str(data_path))
        batches = TokenBatcher(tokens, info.batch_size, info.seq_len, seed=seed, shuffle=not args.no_shuffle,
                               source=str(data_path))
        state = TrainState()
        if resume is not None:
            if resume.data_sha256 != batches.fingerprint:
                raise CheckpointError(f"{args.resume} was trained on other data or batching (data fingerprint "
                                      f"{resume.data_sha256[:16]}..., {data_path} gives {batches.fingerprint[:16]}...); "
                                      f"resume with the same --data and --no-shuffle setting")
            restore_state(runner, resume, program_sha256, args.resume)
            state = TrainState.from_checkpoint(resume, args.resume)
            differences = _config_differences(resume.config, _run_config(schedule, optimizer, batches))
            if differences:
                print(f"vktrain train: warning: resuming with settings that differ from the checkpoint's run "
                      f"({'; '.join(differences)}): steps after {resume.step} will not match an uninterrupted run",
                      file=sys.stderr)
        start = state.step
        print(f"{program_path}: batch {info.batch_size} x {info.seq_len}, vocabulary {info.vocab_size}; {data_path}: "
              f"{tokens.size} tokens, {batches.batches_per_epoch:.1f} batches per epoch; steps {start + 1}..{args.steps}",
              file=sys.stderr)
        try:
            train(runner, batches, args.steps, schedule, optimizer, state=state,  # updates `state` in place
                  checkpoint_every=args.checkpoint_every, checkpoint_path=checkpoint_path,
                  program_sha256=program_sha256, json_path=args.json, progress=not args.no_progress,
                      log_every=args.log_every)
        except KeyboardInterrupt:
            where = (f"the last checkpoint is {state.last_checkpoint[0]} (step {state.last_checkpoint[1]})"
                     if state.last_checkpoint else "no checkpoint was written")
            print(f"vktrain train: interrupted after step {state.step}; {where}", file=sys.stderr)
            return 130
        if args.out_adapters:
            base_model = args.base_model or info.metadata.get(METADATA_SOURCE_MODEL)
            lora_state = {name: runner.read_state(name) for name in runner.state_names if name.endswith(LORA_SUFFIXES)}
            save_adapters(args.out_adapters, adapters_from_state(lora_state), alpha, base_model)

    if args.plot and state.records:
        from vktrain.train.plot import plot_losses

        plot_losses(state.records, args.plot, title=f"vktrain train {Path(program_path).name}")
    new_records = state.records[start:]
    summary = f"trained steps {start + 1}..{state.step}" if new_records else f"nothing to train (already at step {state.step})"
    if new_records:
        summary += f": loss {new_records[0]['loss']:.4f} -> {new_records[-1]['loss']:.4f}"
    print(summary)
    for label, value in (("checkpoint", checkpoint_path), ("records", args.json), ("adapters", args.out_adapters),
                         ("loss plot", args.plot)):
        if value:
            print(f"{label}: {value}")
    return 0


__all__ = ["AdamWConfig", "NonFiniteLossError", "ProgramInfo", "StepRunner", "TrainState", "add_train_arguments",
           "describe_program", "run_train", "train"]

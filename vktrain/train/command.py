"""`vktrain train`: arguments, their checks before anything runs, and the run itself (torch-free).

Two kinds of step train: a token model's (token_ids, labels: `--data`, a token stream batched by
TokenBatcher) and any other exported module's (`--inputs DATA.npz`, its named input arrays:
vktrain/train/input_data.py), with the same loop, schedule, checkpoints and outputs; the token data
flags (TOKEN_DATA_FLAGS) are refused with `--inputs`, naming them.

Everything that can be checked before the first step is: argument ranges as the program receives them
(float32), every output path (vktrain.train.outputs: writable, no input, no file vktrain did not write,
no other run's checkpoint), the checkpoint to resume
(read and verified in full), the data and the program. A run never trains for minutes to fail on a flag.
With VKTRAIN_VALIDATION=1 the Vulkan validation layer's messages are printed when the run ends, and a
run that produced validation errors fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import signal
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from vktrain.contract import ACCUMULATE_METHOD, ADAMW_DEFAULTS, METADATA_BAKED_SCALARS, PRECISION_AUTO, PRECISION_CHOICES
from vktrain.errors import VktrainError
from vktrain.runtime.runtimes import add_runtime_argument, max_binding_bytes, with_device_profile
from vktrain.serialization.peft_adapters import LORA_SUFFIXES
from vktrain.train.adapters import ProgramAdapters, adapters_from_state, runner_frozen_lora, save_adapters
from vktrain.train.gguf_adapter import check_gguf_adapter_program, save_gguf_adapter
from vktrain.train.checkpoint import (
    CheckpointError,
    CheckpointSeries,
    load_checkpoint,
    restore_state,
    sha256_file,
)
from vktrain.train.best import BestKeeper, add_best_arguments, best_metric, check_best_arguments
from vktrain.train.held_out_accuracy import (accuracy_evaluation, add_accuracy_arguments, check_accuracy_arguments,
                                             describe_accuracy)
from vktrain.train.pairs import OBJECTIVE_NAMES, load_program_pairs, preference_objective
from vktrain.train.data import TokenBatcher, default_dataset_path, load_data
from vktrain.train.interrupts import Interrupted, StopOnSignal, resume_command, signal_name
from vktrain.train.lr_schedule import SCHEDULES, LRSchedule
from vktrain.serialization.tokenizer import program_tokenizer
from vktrain.train.outputs import (CHECKPOINT, GGUF_ADAPTER, PEFT_DIRECTORY, PNG, Output, OutputKind,
                                   add_overwrite_argument, check_outputs, json_records)
from vktrain.train.train_loop import (
    MAX_STEPS,
    ON_NONFINITE,
    AdamWConfig,
    TrainConfigError,
    TrainState,
    run_config,
    describe_program,
    is_token_step,
    takes_hparams,
    train,
)
from vktrain.backend.kernel_planning import plan_schedule

# Flag -> argparse dest of every hyper-parameter the program's hparams input (or the schedule) takes.
HYPERPARAMETER_FLAGS = {"--lr": "lr", "--schedule": "schedule", "--warmup": "warmup", "--min-lr-ratio": "min_lr_ratio",
                        "--beta1": "beta1", "--beta2": "beta2", "--eps": "eps", "--weight-decay": "weight_decay"}
HYPERPARAMETER_DEFAULTS = {"lr": 1e-3, "schedule": "cosine", "warmup": 0, "min_lr_ratio": 0.0, **ADAMW_DEFAULTS}
# Flag -> argparse dest of the settings of token data, which a step trained on --inputs arrays has none of.
TOKEN_DATA_FLAGS = {"--data": "data", "--seed": "seed", "--no-shuffle": "no_shuffle", "--eval-data": "eval_data",
                    "--eval-every": "eval_every", "--eval-batches": "eval_batches",
                    "--eval-generate": "eval_generate"}


class ValidationErrorsReported(VktrainError):
    """The Vulkan validation layer reported errors during the run (they were printed)."""


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `vktrain train` arguments (the subcommand's parser; run it with `run_train`)."""
    parser.add_argument("program", metavar="FILE.pte", help="training-step program (vktrain export --program train-step)")
    parser.add_argument("--data", metavar="FILE",
                        help="training data: text (one document), *.jsonl rows {\"text\"} or chat {\"messages\"} "
                             "(only assistant turns train), tokenized with the tokenizer the .pte carries (without "
                             "one: byte-level text, vocabulary 256 only); or token ids: a .npy 1-D integer array, "
                             "whitespace-separated ids in *.tokens.txt (default: the built-in corpus)")
    parser.add_argument("--inputs", metavar="DATA.npz",
                        help="for a step exported from any module (not a token model): an .npz with one array per "
                             "program input but hparams, named as the program's inputs; an array of the input's "
                             "shape is fed every step, one with a leading axis [N, ...] gives step t its batch "
                             "(t-1) mod N (cycled in file order)")
    parser.add_argument("--steps", type=int, required=True, metavar="N",
                        help=f"train up to step N (a resumed run continues from its checkpoint's step; N <= {MAX_STEPS})")
    # The hyper-parameter flags default to None so that a program with baked ones can tell which were
    # given (HYPERPARAMETER_DEFAULTS fills in the rest).
    parser.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    parser.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule after warmup (default cosine)")
    parser.add_argument("--warmup", type=int, metavar="W", help="linear warmup steps (default 0)")
    parser.add_argument("--min-lr-ratio", type=float, help="cosine floor as a fraction of --lr (default 0)")
    parser.add_argument("--beta1", type=float, help=f"AdamW beta1 (default {ADAMW_DEFAULTS['beta1']})")
    parser.add_argument("--beta2", type=float, help=f"AdamW beta2 (default {ADAMW_DEFAULTS['beta2']})")
    parser.add_argument("--eps", type=float, help=f"AdamW eps (default {ADAMW_DEFAULTS['eps']})")
    parser.add_argument("--weight-decay", type=float,
                        help=f"AdamW decoupled weight decay (default {ADAMW_DEFAULTS['weight_decay']}, torch.optim.AdamW's)")
    parser.add_argument("--checkpoint-every", type=int, metavar="K",
                        help="write a checkpoint every K >= 1 steps (default: only after the last step)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="checkpoint file (safetensors), written atomically; default with --resume: that file; "
                             "an existing one is only continued (--resume), never replaced by another run unless "
                             "--overwrite")
    parser.add_argument("--keep-checkpoints", type=int, default=1, metavar="K",
                        help="keep the last K checkpoints: PATH is the newest, the K-1 before it stay as "
                             "PATH's name with .step<N> before the suffix (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="N micro-batches (of the .pte's batch shape) per optimizer step, their gradients summed "
                             "on the device: the update of one batch N times as large (default 1; N > 1 needs a .pte "
                             "from vktrain export --grad-accum)")
    parser.add_argument("--on-nonfinite", choices=ON_NONFINITE, default="stop",
                        help="a NaN/inf loss or state: stop, keeping the last good checkpoint (default), or skip "
                             "the batch and retry the step on the next one")
    parser.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint of this same .pte")
    parser.add_argument("--json", metavar="FILE",
                        help="write the per-step records [{step, loss, lr, seconds}, ...] as JSON")
    parser.add_argument("--out-adapters", metavar="DIR",
                        help="write the trained adapters in PEFT format (adapter_model.safetensors + adapter_config.json)")
    parser.add_argument("--out-gguf-adapter", metavar="FILE.gguf",
                        help="write the trained adapters as a llama.cpp LoRA GGUF (llama-cli --lora FILE.gguf)")
    parser.add_argument("--lora-alpha", type=float,
                        help="LoRA alpha for adapter_config.json (needed with --out-adapters when the .pte does not record it)")
    parser.add_argument("--base-model", help="base_model_name_or_path for adapter_config.json")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO,
                        help="GEMM precision policy (docs/PRECISION.md): auto (default: fp16-tc where the device has "
                             "tensor cores, else fp16 where its profile prefers it, else fp32), fp32 (the parity "
                             "reference), fp16-tc (the large GEMMs on tensor cores, fp16 inputs, fp32 accumulation) "
                             "or fp16 (the 4-bit base GEMMs with fp16 operands and fp32 sums, no tensor cores)")
    add_runtime_argument(parser)
    parser.add_argument("--seed", type=int, help="data shuffling seed (default 0; a resumed run keeps its checkpoint's)")
    parser.add_argument("--no-shuffle", action="store_true", help="read windows in file order")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none when stderr is not a terminal: a log file gets the "
                             "--log-every lines alone)")
    parser.add_argument("--plot", metavar="FILE.png", help="write the loss curve of the whole run as a PNG")
    parser.add_argument("--eval-data", metavar="FILE",
                        help="held-out token data: its loss (the .pte's eval method) is printed before training, "
                             "every --eval-every steps and after the last step, and recorded as eval_loss in --json; "
                             "for a preference step (dpo / simpo / orpo), held-out pairs: their mean preference loss "
                             "(eval_loss) and reward accuracy (eval_reward_accuracy), as vktrain eval reports them")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="with --eval-data: evaluate every N steps (default 0: only before and after training)")
    parser.add_argument("--eval-batches", type=int, metavar="N",
                        help="with --eval-data: evaluate only its first N batches (a preference step: its first N "
                             "pairs; default: all of it)")
    parser.add_argument("--log-every", type=int, default=1, metavar="N",
                        help="print step, loss and lr every N steps (default 1; 0: only the summary)")
    add_overwrite_argument(parser)
    add_accuracy_arguments(parser)  # --eval-generate (vktrain/train/held_out_accuracy.py)
    add_best_arguments(parser)  # --keep-best, --early-stopping (vktrain/train/best.py)
    return parser


# ------------------------------------------------------------------------------------------------
# Checks before the run
# ------------------------------------------------------------------------------------------------

# What train writes to --json (the per-step records): a file of this kind may be replaced.
TRAIN_RECORDS = OutputKind("vktrain train's JSON records", json_records("step"))


def check_train_outputs(args: argparse.Namespace) -> None:
    """Every output of the run (vktrain.train.outputs' rules): not an input, not a file vktrain did not
    write, not another run's checkpoint, writable. `--resume` alone writes its own checkpoint; resuming a
    kept checkpoint of the --checkpoint series (PATH's .step<N> file) continues the run PATH holds."""
    continued = args.resume
    if args.resume and args.checkpoint and CheckpointSeries(args.checkpoint).holds(args.resume):
        continued = args.checkpoint
    checkpoint = Output("--checkpoint", args.checkpoint, CHECKPOINT, continues=continued) if args.checkpoint else \
        Output("--resume", args.resume, CHECKPOINT, continues=continued)
    check_outputs(
        [checkpoint, Output("--json", args.json, TRAIN_RECORDS), Output("--plot", args.plot, PNG),
         Output("--out-adapters", args.out_adapters, PEFT_DIRECTORY),
         Output("--out-gguf-adapter", args.out_gguf_adapter, GGUF_ADAPTER)],
        inputs=[("the program", args.program), ("--data", args.data), ("--inputs", args.inputs),
                ("--eval-data", args.eval_data), ("--resume", args.resume)],
        overwrite=args.overwrite)


def hyperparameter(args: argparse.Namespace, dest: str):
    """The value of a hyper-parameter flag: the one given, else its default."""
    given = getattr(args, dest)
    return HYPERPARAMETER_DEFAULTS[dest] if given is None else given


def check_arguments(args: argparse.Namespace) -> tuple[LRSchedule, AdamWConfig]:
    """Every argument in range as the run will use it; the schedule and optimizer settings."""
    lr, warmup = hyperparameter(args, "lr"), hyperparameter(args, "warmup")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise TrainConfigError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every} (leave it out to "
                               f"checkpoint only after the last step)")
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", warmup, 0), ("--log-every", args.log_every, 0),
                             ("--keep-checkpoints", args.keep_checkpoints, 1), ("--eval-every", args.eval_every, 0)):
        if value < low:
            raise TrainConfigError(f"{flag} must be >= {low}, got {value}")
    if args.steps > MAX_STEPS:
        raise TrainConfigError(f"--steps {args.steps}: at most {MAX_STEPS} (AdamW's step counter is float32)")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise TrainConfigError(f"--seed must lie in [0, 2**32), got {args.seed}")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        raise TrainConfigError(f"--lora-alpha must be a positive number, got {args.lora_alpha}")
    if args.checkpoint_every and not (args.checkpoint or args.resume):
        raise TrainConfigError("--checkpoint-every needs --checkpoint PATH (where to write them)")
    if args.keep_checkpoints > 1 and not (args.checkpoint or args.resume):
        raise TrainConfigError("--keep-checkpoints needs --checkpoint PATH (where to write them)")
    if args.inputs is not None:  # first: the token data flags' own needs (--eval-every's --eval-data) do not apply
        given = [flag for flag, dest in TOKEN_DATA_FLAGS.items() if getattr(args, dest)]
        if given:
            raise TrainConfigError(f"{', '.join(given)} cannot apply with --inputs: they describe token data (a "
                                   f"token model's step); --inputs {args.inputs} gives the step's input arrays")
    if args.eval_every and not args.eval_data:
        raise TrainConfigError("--eval-every needs --eval-data FILE (the held-out data)")
    if args.eval_batches is not None and args.eval_data is None:
        raise TrainConfigError("--eval-batches needs --eval-data FILE (the held-out data)")
    from vktrain.train.held_out import check_max_batches

    check_max_batches("--eval-batches", args.eval_batches)
    check_accuracy_arguments(args)
    check_best_arguments(args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise TrainConfigError("--plot needs matplotlib (pip install matplotlib)")
    schedule = LRSchedule(hyperparameter(args, "schedule"), lr, args.steps, warmup, hyperparameter(args, "min_lr_ratio"))
    optimizer = AdamWConfig(*(hyperparameter(args, name) for name in ("beta1", "beta2", "eps", "weight_decay")))
    optimizer.check_lr(lr)
    return schedule, optimizer


def baked_hyperparameters(args: argparse.Namespace, metadata: dict,
                          steps: int) -> tuple[LRSchedule, AdamWConfig, str]:
    """For a program without an hparams input: the schedule and optimizer its baked AdamW scalars amount to
    (a constant learning rate), and a line saying so. Any hyper-parameter flag given is refused: the
    program cannot change them."""
    entries = [entry["scalars"] for entry in json.loads(metadata.get(METADATA_BAKED_SCALARS, "[]"))
               if "lr" in entry.get("scalars", {})]
    if not entries:
        raise TrainConfigError(f"{args.program} has no hparams input and records no baked AdamW hyper-parameters "
                               f"(metadata {METADATA_BAKED_SCALARS!r}); it is not a training step vktrain can run")
    distinct = {name: sorted({entry[name] for entry in entries if name in entry}) for name in entries[0]}
    described = ", ".join(f"{name}={values[0]!r}" if len(values) == 1 else f"{name} in {values}"
                          for name, values in distinct.items())
    given = [flag for flag, dest in HYPERPARAMETER_FLAGS.items() if getattr(args, dest) is not None]
    if given:
        raise TrainConfigError(f"{args.program}: {', '.join(given)} cannot apply: the program's hyper-parameters "
                               f"are baked into it (it has no hparams input): {described}; re-export the step to "
                               f"change them")
    first = entries[0]  # the records' lr and the checkpoint's config: the first AdamW update's values
    schedule = LRSchedule("constant", first["lr"], steps)
    optimizer = AdamWConfig(first["beta1"], first["beta2"], first["eps"], first["weight_decay"])
    return schedule, optimizer, f"hyper-parameters and schedule baked into the program (constant): {described}"


def _config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    differences = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            differences += _config_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            differences.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return differences


def _resolve_alpha(args: argparse.Namespace, recorded: ProgramAdapters) -> Optional[float]:
    return args.lora_alpha if args.lora_alpha is not None else recorded.lora_alpha


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

def print_validation_messages(device) -> int:
    """Print what the Vulkan validation layer reported on `device` (nothing when it is off, i.e. without
    VKTRAIN_VALIDATION=1); returns how many of the messages are errors."""
    take = getattr(device, "take_validation_messages", None)
    messages = take() if take is not None else []
    for message in messages:
        print(f"vktrain train: vulkan validation: {message}", file=sys.stderr)
    return sum(1 for message in messages if message.severity == "error")


@with_device_profile
def run_train(args: argparse.Namespace, device=None) -> int:
    """`vktrain train`: 0 on success; 130 (SIGINT) / 143 (SIGTERM) when a signal stopped the loop, after
    checkpointing (with --checkpoint), writing --json / --plot and saying how to resume
    (vktrain.train.interrupts; a signal outside the loop, or a second one, raises Interrupted). Bad input
    and divergence raise (a VktrainError; NonFiniteLossError for a diverged loss): vktrain.cli turns them
    into one line and an exit code. `device`: a vktrain.runtime Device to run on, whose validation
    messages stay with it (None: the runner opens the default one, and its validation messages are
    printed here)."""
    with StopOnSignal("train") as stop:
        return _run_train(args, device, stop)


def _run_train(args: argparse.Namespace, device, stop: StopOnSignal) -> int:
    from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan: imported only when a run starts

    program_path = Path(args.program)
    if not program_path.is_file():
        raise TrainConfigError(f"program {program_path} does not exist (or is not a file)")
    schedule, optimizer = check_arguments(args)
    checkpoint_path = args.checkpoint or args.resume
    check_train_outputs(args)  # found now, not when the first checkpoint is due after minutes of training
    resume = load_checkpoint(args.resume) if args.resume else None
    if resume is not None and args.seed is not None and args.seed != resume.data_seed:
        raise TrainConfigError(f"--seed {args.seed} differs from the checkpoint's data seed {resume.data_seed}: the "
                               f"resumed run would read other batches; drop --seed to keep the checkpoint's")
    seed = resume.data_seed if resume is not None else (0 if args.seed is None else args.seed)
    data_path = Path(args.inputs) if args.inputs else Path(args.data) if args.data else default_dataset_path()
    program_sha256 = sha256_file(program_path)
    if resume is not None and resume.program_sha256 != program_sha256:  # before the data, whose batching it sets
        raise CheckpointError(f"--resume {args.resume} was written by a run of a different program (.pte sha256 "
                              f"{resume.program_sha256[:16]}..., {args.program} is {program_sha256[:16]}...: another "
                              f"export, e.g. of another --batch or --seq); a checkpoint resumes only onto the .pte "
                              f"it came from")

    # timing=False: no GPU timestamps (train reads none; on a GPU they cost time per dispatch).
    runner = TrainingRunner.from_pte(program_path, device, planner=plan_schedule, precision=args.precision,
                                     timing=False, runtime=getattr(args, "runtime", None),
                                     max_binding_bytes=max_binding_bytes(args))
    own_device = getattr(runner, "device", None) if device is None else None  # a caller's device: its messages
    try:
        with runner:
            state, start, before = _train_loaded(args, runner, schedule, optimizer, resume, seed, data_path,
                                                 program_sha256, checkpoint_path, stop)
    except BaseException:
        print_validation_messages(own_device)  # shown, but the error in flight wins
        raise
    errors = print_validation_messages(own_device)
    if errors:
        raise ValidationErrorsReported(f"the Vulkan validation layer reported {errors} error(s) (printed above); "
                                       f"the run's results are not trustworthy")
    if args.plot and state.records:
        from vktrain.train.plot import plot_losses

        plot_losses(([before] if before else []) + state.records, args.plot,
                    title=f"vktrain train {program_path.name}")
    if _stopped_early(args, state, stop):
        _report_stop(args, state, stop)
        return stop.exit_code
    new_records = state.records[start:]
    summary = f"trained steps {start + 1}..{state.step}" if new_records else f"nothing to train (already at step {state.step})"
    if new_records:
        summary += f": loss {new_records[0]['loss']:.4f} -> {new_records[-1]['loss']:.4f}"
    print(summary)
    for label, value in (("checkpoint", checkpoint_path), ("records", args.json), ("adapters", args.out_adapters),
                         ("GGUF adapter", args.out_gguf_adapter), ("loss plot", args.plot)):
        if value:
            print(f"{label}: {value}")
    return 0


def _stopped_early(args, state: TrainState, stop: StopOnSignal) -> bool:
    """A signal ended the loop before --steps (one that came after the last step stops nothing)."""
    return stop.requested() and state.step < args.steps


def _report_stop(args, state: TrainState, stop: StopOnSignal) -> None:
    """What a run stopped by a signal kept, and the command that continues it."""
    lines = [f"vktrain train: stopped by {signal_name(stop.signum)} after step {state.step} of {args.steps}"]
    if state.last_checkpoint is not None:
        path, step = state.last_checkpoint
        lines.append(f"saved checkpoint {path} (step {step}); resume with:")
        lines.append(f"  {resume_command(getattr(args, 'command_line', None) or sys.argv[1:], path)}")
    else:
        lines.append("nothing to resume from was saved: pass --checkpoint PATH to have an interrupted run "
                     "checkpointed (and --resume PATH to continue it)")
    for label, value in (("records", args.json), ("loss plot", args.plot)):
        if value and state.records:
            lines.append(f"saved {label} {value} (steps 1..{state.step})")
    for flag in ("--out-adapters", "--out-gguf-adapter"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            lines.append(f"not written: {flag} {value} (the run did not finish; resume it to write them)")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _held_out_evaluation(args, runner, info, start: int):
    """`train`'s after_step for --eval-data (None without it): the held-out loss at the --eval-every steps
    and the last one; and the record of the loss before training ({"step": start, "eval_loss"}, for the
    JSON log and the plot). Evaluates once right away, so a program without an eval method fails before
    training. A preference step (`info` None: --inputs arrays are refused with --eval-data up front)
    evaluates held-out pairs instead (_held_out_pairs_evaluation)."""
    if args.eval_data is None:
        return None, None
    if info is None:
        return _held_out_pairs_evaluation(args, runner, start)
    from vktrain.train.held_out import evaluate_batches, prepare_eval_batches

    held_out = load_data(args.eval_data, info.vocab_size, program_tokenizer(runner, args.program))
    batches = prepare_eval_batches(held_out, runner.batch_shape, args.eval_batches,  # once: the data is fixed
                                   getattr(runner, "takes_positions", False))
    accuracy = accuracy_evaluation(args, runner)  # --eval-generate: the task accuracy too
    before = evaluate_batches(runner, batches)
    first = {"step": start, "eval_loss": before["loss"], **(accuracy() if accuracy else {})}
    print(f"eval before training: loss {before['loss']:.6f} over {before['tokens']} tokens ({args.eval_data})"
          + (f"; {describe_accuracy(first)}" if accuracy else ""))

    def after_step(step: int) -> dict:
        if not _evaluation_due(args, step):
            return {}
        record = {"eval_loss": evaluate_batches(runner, batches)["loss"], **(accuracy() if accuracy else {})}
        tqdm.write(f"step {step:6d}  eval loss {record['eval_loss']:.6f}"
                   + (f", {describe_accuracy(record)}" if accuracy else ""), file=sys.stdout)
        return record
    return after_step, first


def _evaluation_due(args, step: int) -> bool:
    """A held-out evaluation follows every --eval-every-th step and the last one."""
    return bool(args.eval_every and step % args.eval_every == 0) or step == args.steps


def _held_out_pairs_evaluation(args, runner, start: int):
    """_held_out_evaluation of a preference step: the mean preference loss (eval_loss) and the reward accuracy
    (eval_reward_accuracy) of --eval-data's pairs (the first --eval-batches), as `vktrain eval` computes them
    (vktrain/train/preference_eval.py)."""
    from vktrain.train.preference_eval import EVAL_REWARD_ACCURACY, evaluate_pairs, held_out_pairs

    if args.eval_generate:
        raise TrainConfigError(f"--eval-generate decodes answers to held-out chats; {args.program} is a preference "
                               f"step, whose --eval-data holds pairs (their loss and reward accuracy are recorded)")
    pairs, settings = held_out_pairs(runner, args.eval_data, args.program)  # once, refused before training

    def evaluate() -> tuple[dict, str]:
        result = evaluate_pairs(runner, pairs, settings, args.eval_batches)
        return ({"eval_loss": result["loss"], EVAL_REWARD_ACCURACY: result["reward_accuracy"]},
                f"{OBJECTIVE_NAMES[result['objective']]} loss {result['loss']:.6f}, reward accuracy "
                f"{result['reward_accuracy']:.1%} of {result['pairs']} pair(s) ({result['ties']} tied)")
    record, described = evaluate()
    print(f"eval before training: {described} ({args.eval_data})")

    def after_step(step: int) -> dict:
        if not _evaluation_due(args, step):
            return {}
        record, described = evaluate()
        tqdm.write(f"step {step:6d}  eval {described}", file=sys.stdout)
        return record
    return after_step, {"step": start, **record}


def _training_batches(args, runner, data_path: Path, seed: int):
    """(the batches, the token program's ProgramInfo or None, a line describing both) of the run: --inputs
    arrays for any step, else token data, which only a token model's step takes."""
    if args.inputs:
        from vktrain.train.input_data import load_input_arrays  # reads the program's input specs

        batches = load_input_arrays(data_path, runner.input_specs)
        inputs = ", ".join(f"{name} {spec.describe()}" for name, spec in runner.input_specs.items())
        return batches, None, (f"{args.program}: inputs {inputs}; {data_path}: {batches.n_batches} batch(es), "
                               f"cycled")
    objective = preference_objective(runner)
    if objective is not None:  # vktrain export --objective dpo|simpo|orpo: pairs
        from vktrain.train.pairs import pair_batches

        pairs, seq_len = load_program_pairs(runner, data_path, args.program)
        return pair_batches(pairs, runner.input_specs, str(data_path), args.grad_accum), None, (
            f"{args.program}: {OBJECTIVE_NAMES[objective]}, {args.grad_accum} preference pair(s) a step, {seq_len} "
            f"tokens a side; "
            f"{data_path}: {len(pairs)} "
            f"pair(s), cycled in file order" + (f" ({pairs.truncated} completion(s) cut at the window)"
                                               if pairs.truncated else ""))
    if not is_token_step(runner):
        raise TrainConfigError(f"{args.program} is not a token model's step (its inputs are {runner.input_names}, "
                               f"not token_ids and labels): give its input arrays with --inputs DATA.npz")
    info = describe_program(runner)
    data = load_data(data_path, info.vocab_size, program_tokenizer(runner, args.program))
    # A step exported with --packing documents gets the documents' boundaries (a token file has none: the
    # runner then gives it each window as one document).
    documents = data.starts if getattr(runner, "takes_positions", False) else None
    batches = TokenBatcher(data.tokens, info.batch_size, info.seq_len, seed=seed, shuffle=not args.no_shuffle,
                           source=str(data_path), labels=data.labels, documents=documents)
    return batches, info, (f"{args.program}: batch {info.batch_size} x {info.seq_len}, vocabulary {info.vocab_size}; "
                           f"{data_path}: {data.tokens.size} tokens ({data.trained_tokens} trained), "
                           f"{batches.batches_per_epoch:.1f} batches per epoch"
                           + ("" if documents is None else f"; {len(documents)} packed document(s), attention "
                              f"within each"))


def _check_grad_accum(args, runner) -> None:
    if args.grad_accum < 1:
        raise TrainConfigError(f"--grad-accum must be >= 1 (micro-batches per optimizer step), got {args.grad_accum}")
    if args.grad_accum > 1 and ACCUMULATE_METHOD not in getattr(getattr(runner, "pte", None), "method_names", ()):
        raise TrainConfigError(f"--grad-accum {args.grad_accum}: {args.program} has no {ACCUMULATE_METHOD!r} method; "
                               f"export it with vktrain export --grad-accum")
    if args.grad_accum > 1 and hasattr(runner, "accumulate_method"):
        # Loaded now, with the program: built on first use, its verification, planning and pipelines fell in
        # the first step (on the H100, SmolLM2-135M's 30 steps summed ~2.8 s over 30 x their median).
        runner.accumulate_method()


def _train_loaded(args, runner, schedule, optimizer, resume, seed, data_path, program_sha256,
                  checkpoint_path, stop: StopOnSignal) -> tuple[TrainState, int, Optional[dict]]:
    """The run once the program is loaded: (final state, first step's index, the record of the held-out
    loss before training or None); no adapters are written when a signal stopped it early."""
    metadata = dict(getattr(getattr(runner, "graph", None), "metadata", {}) or {})
    if not takes_hparams(runner):
        schedule, optimizer, baked = baked_hyperparameters(args, metadata, args.steps)
        print(f"{args.program}: {baked}")
    recorded = ProgramAdapters.from_metadata(metadata, args.program)
    alpha = _resolve_alpha(args, recorded)
    wants_adapters = args.out_adapters or args.out_gguf_adapter
    if wants_adapters and alpha is None:
        raise TrainConfigError("--out-adapters / --out-gguf-adapter: the .pte does not record the LoRA alpha it "
                               "was exported with; pass --lora-alpha (the value given to vktrain export "
                               "--lora-alpha, default 16)")
    if args.out_gguf_adapter:
        check_gguf_adapter_program(recorded, args.program)
    batches, info, described = _training_batches(args, runner, data_path, seed)
    _check_grad_accum(args, runner)
    metric = best_metric(args, preference_objective(runner) is not None)  # --keep-best's measure
    state = TrainState()
    if resume is not None:
        if resume.data_sha256 != batches.fingerprint:
            raise CheckpointError(f"{args.resume} was trained on other data or batching (data fingerprint "
                                  f"{resume.data_sha256[:16]}..., {data_path} gives {batches.fingerprint[:16]}...); "
                                  + ("resume with the same --inputs arrays" if args.inputs else
                                     "resume with the same --data and --no-shuffle setting"))
        restore_state(runner, resume, program_sha256, args.resume)
        state = TrainState.from_checkpoint(resume, args.resume)
        if resume.config.get("grad_accum", 1) != args.grad_accum:  # its data position counts micro-batches
            raise TrainConfigError(f"--grad-accum {args.grad_accum}: {args.resume} was trained with --grad-accum "
                                   f"{resume.config.get('grad_accum', 1)}; resume with that")
        differences = _config_differences(resume.config, run_config(schedule, optimizer, batches, args.grad_accum))
        if differences:
            print(f"vktrain train: warning: resuming with settings that differ from the checkpoint's run "
                  f"({'; '.join(differences)}): steps after {resume.step} will not match an uninterrupted run",
                  file=sys.stderr)
    start = state.step
    after_step, evaluated = _held_out_evaluation(args, runner, info, start)
    # The loss before a fresh run leads its JSON log as step 0; a resumed run's log is its checkpoint's steps.
    before = evaluated if start == 0 else None
    keeper = BestKeeper.for_run(args, runner, state, program_sha256, batches,
                                run_config(schedule, optimizer, batches, args.grad_accum), metric)
    if keeper is not None:
        after_step = keeper.wrap(after_step)

    def stop_requested() -> bool:  # a signal, or --early-stopping's rule
        return stop.requested() or (keeper is not None and keeper.should_stop())
    print(f"{described}; steps {start + 1}..{args.steps}", file=sys.stderr)
    print(f"{args.program}: {runner.gemm_report()}", file=sys.stderr)
    try:
        with stop.deferred():
            train(runner, batches, args.steps, schedule, optimizer, state=state,  # updates `state` in place
                  checkpoint_every=args.checkpoint_every or 0, checkpoint_path=checkpoint_path,
                  keep_checkpoints=args.keep_checkpoints, program_sha256=program_sha256, json_path=args.json,
                  progress=not args.no_progress and sys.stderr.isatty(), log_every=args.log_every,
                  on_nonfinite=args.on_nonfinite, after_step=after_step, stop_requested=stop_requested,
                  first_record=before, grad_accum=args.grad_accum)
    except KeyboardInterrupt as exc:  # a second signal (or a Ctrl-C no handler caught): nothing more is saved
        signum = getattr(exc, "signum", signal.SIGINT)
        where = "no checkpoint was written"
        if state.last_checkpoint:
            path, step = state.last_checkpoint
            where = (f"the last checkpoint is {path} (step {step}); resume with: "
                     f"{resume_command(getattr(args, 'command_line', None) or sys.argv[1:], path)}")
        print(f"vktrain train: interrupted after step {state.step} ({signal_name(signum)}, stopping at once); "
              f"{where}", file=sys.stderr, flush=True)
        raise Interrupted(signum, reported=True) from None
    if _stopped_early(args, state, stop):
        return state, start, before
    if keeper is not None:
        keeper.finish()  # the best state back in the runner: its adapters are written
    if wants_adapters:
        lora_state = {name: runner.read_state(name) for name in runner.state_names if name.endswith(LORA_SUFFIXES)}
        # A --freeze-lora-a program's lora_A are constants, not state.
        adapters = adapters_from_state({**runner_frozen_lora(runner), **lora_state})
        recorded.check_layers(adapters, args.program)
    if args.out_adapters:
        base_model = args.base_model or recorded.base_model or recorded.source_model
        save_adapters(args.out_adapters, adapters, alpha, base_model, recorded.target_modules)
    if args.out_gguf_adapter:
        save_gguf_adapter(args.out_gguf_adapter, adapters, alpha, recorded, args.program)
    return state, start, before


__all__ = ["HYPERPARAMETER_DEFAULTS", "HYPERPARAMETER_FLAGS", "TOKEN_DATA_FLAGS", "ValidationErrorsReported", "add_train_arguments",
           "baked_hyperparameters", "check_arguments", "check_train_outputs", "hyperparameter",
           "print_validation_messages", "run_train"]

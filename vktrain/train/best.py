"""`vktrain train --keep-best[=loss|accuracy]` and `--early-stopping N`: the adapters of the lowest held-out
loss (or of the highest held-out exact-match accuracy, with --eval-generate; of a preference step, the highest
reward accuracy on its held-out pairs), not the last, and a run that stops once that measure stops improving
(torch-free).

Candidates are the held-out evaluations after steps (every --eval-every steps and after the last step),
compared by their eval_loss (or eval_accuracy, eval_reward_accuracy); the first of equal values is kept. The
comparison reads the run's records, so a resumed run goes on from its checkpoint's evaluations. A new best is
written at once, atomically, as a complete checkpoint next to --checkpoint (<stem>.best<suffix>: `--resume`
takes it), and its adapters become what --out-adapters / --out-gguf-adapter write at the end. `--early-stopping N` ends the
run after N evaluations in a row without a new best, saying so (the last state is checkpointed as usual).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tqdm import tqdm

from vktrain.train.checkpoint import (Checkpoint, capture_state, load_checkpoint, remove_stale_temp_files,
                                     save_checkpoint)
from vktrain.train.held_out_accuracy import EVAL_ACCURACY
from vktrain.train.preference_eval import EVAL_REWARD_ACCURACY
from vktrain.train.train_loop import TrainConfigError

EVAL_LOSS = "eval_loss"
# The measure compared (best_metric: --keep-best's value, and the step's kind) -> (the record key compared,
# whether higher is better, how it is named)
METRICS = {"loss": (EVAL_LOSS, False, "held-out loss"), "accuracy": (EVAL_ACCURACY, True, "held-out accuracy"),
           "reward_accuracy": (EVAL_REWARD_ACCURACY, True, "held-out reward accuracy")}
KEEP_BEST_CHOICES = ("loss", "accuracy")


def add_best_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-best", nargs="?", const="loss", default=None, choices=KEEP_BEST_CHOICES,
                        help="with --eval-data and --eval-every: keep the state of the lowest held-out loss (or, "
                             "`--keep-best accuracy` with --eval-generate, of the highest exact-match accuracy, or on a "
                             "preference step of the highest reward accuracy; the "
                             "word after --keep-best is its value only if it is loss or accuracy, so `--keep-best "
                             "step.pte` is --keep-best=loss and the program) as "
                             "CHECKPOINT's <stem>.best<suffix> (written at each new best) and write its adapters "
                             "as --out-adapters / --out-gguf-adapter instead of the last step's")
    parser.add_argument("--early-stopping", type=int, metavar="N",
                        help="with --eval-data and --eval-every: stop after N held-out evaluations in a row "
                             "without a better one (by --keep-best's measure: the loss by default)")


def best_checkpoint_path(checkpoint: str) -> Path:
    """ck.safetensors -> ck.best.safetensors."""
    path = Path(checkpoint)
    return path.with_name(f"{path.stem}.best{path.suffix}")


def check_best_arguments(args: argparse.Namespace) -> None:
    """--keep-best / --early-stopping need periodic held-out evaluations (and --keep-best somewhere to keep)."""
    wanted = [flag for flag, given in (("--keep-best", args.keep_best), ("--early-stopping",
                                                                         args.early_stopping is not None)) if given]
    for flag in wanted:
        if not (args.eval_data and args.eval_every):
            raise TrainConfigError(f"{flag} compares held-out losses: it needs --eval-data FILE and --eval-every N "
                                   f"(got {'--eval-data' if args.eval_data else 'no --eval-data'}, --eval-every "
                                   f"{args.eval_every})")
    if args.early_stopping is not None and args.early_stopping < 1:
        raise TrainConfigError(f"--early-stopping must be >= 1 evaluation, got {args.early_stopping}")
    if args.keep_best and not (args.checkpoint or args.resume or args.out_adapters or args.out_gguf_adapter):
        raise TrainConfigError("--keep-best needs --checkpoint PATH (the best state is kept next to it) or "
                               "--out-adapters DIR / --out-gguf-adapter FILE (written from the best state)")


def best_metric(args: argparse.Namespace, preference: bool) -> str:
    """The METRICS entry --keep-best compares: the loss, or with `--keep-best accuracy` the exact-match accuracy
    (--eval-generate) or, on a preference step (`preference`), the reward accuracy of its held-out pairs."""
    if args.keep_best != "accuracy":
        return "loss"
    if preference:
        return "reward_accuracy"
    if not getattr(args, "eval_generate", False):
        raise TrainConfigError("--keep-best accuracy compares the held-out exact-match accuracy: it needs "
                               "--eval-generate (and --eval-data FILE of chats); on a preference step (vktrain export "
                               "--objective dpo|simpo|orpo) it compares the reward accuracy of the --eval-data pairs")
    return "accuracy"


def best_so_far(records: list[dict], metric: str = "loss") -> Optional[tuple[int, float, int]]:
    """(step, value, evaluations after it) of the best evaluation among `records` by `metric` (METRICS:
    the lowest eval loss, or the highest eval accuracy; the first of equals); None before any."""
    key, higher, _ = METRICS[metric]
    evaluated = [(record["step"], record[key]) for record in records if key in record]
    if not evaluated:
        return None
    sign = -1.0 if higher else 1.0
    index = min(range(len(evaluated)), key=lambda i: sign * evaluated[i][1])
    return evaluated[index][0], evaluated[index][1], len(evaluated) - 1 - index


class BestKeeper:
    """The after_step hook (wrapping the held-out evaluation's) and the stop test of `train`."""

    def __init__(self, args: argparse.Namespace, runner, state, program_sha256: str,
                 make_checkpoint: Callable[[list[dict], dict], Checkpoint], metric: str = "loss"):
        self.keep, self.patience = args.keep_best is not None, args.early_stopping
        self.metric = metric
        self.key, _, self.what = METRICS[self.metric]
        checkpoint = args.checkpoint or args.resume
        self.path = best_checkpoint_path(checkpoint) if self.keep and checkpoint else None
        if self.path is not None:
            remove_stale_temp_files(self.path)
        self.runner, self.state, self.program_sha256 = runner, state, program_sha256
        self.make_checkpoint = make_checkpoint
        self.best_state: Optional[dict[str, np.ndarray]] = None
        self.stopped: Optional[str] = None

    @classmethod
    def for_run(cls, args: argparse.Namespace, runner, state, program_sha256: str, batches,
                config: dict, metric: str = "loss") -> Optional["BestKeeper"]:
        """The keeper of a `vktrain train` run (None without --keep-best and --early-stopping); `config`:
        run_config of the run, recorded in the best checkpoint as in the others; `metric`: best_metric's."""
        if not (args.keep_best is not None or args.early_stopping is not None):
            return None

        def make_checkpoint(records: list[dict], tensors: dict) -> Checkpoint:
            return Checkpoint(records[-1]["step"], state.data_position, program_sha256, batches.fingerprint,
                              batches.seed, tensors, records, config, source=str(best_checkpoint_path(
                                  args.checkpoint or args.resume)))
        return cls(args, runner, state, program_sha256, make_checkpoint, metric)

    def wrap(self, evaluate: Callable[[int], dict]) -> Callable[[int], dict]:
        def after_step(step: int) -> dict:
            result = evaluate(step)
            if self.key in result:
                self._evaluated(step, result)
            return result
        return after_step

    def _evaluated(self, step: int, result: dict) -> None:
        records = self.state.records[:-1] + [{**self.state.records[-1], **result}]  # this step's, evaluated
        best_step, value, since = best_so_far(records, self.metric)
        if best_step == step and math.isfinite(value) and self.keep:
            self.best_state = capture_state(self.runner)
            if self.path is not None:
                save_checkpoint(self.path, self.make_checkpoint(records, self.best_state))
            tqdm.write(f"step {step:6d}  new best {self.what} {value:.6f}"
                       + (f": {self.path}" if self.path is not None else ""), file=sys.stdout)  # under the bar
        if self.patience is not None and since >= self.patience:
            better = "a loss below" if self.metric == "loss" else "an accuracy above"
            self.stopped = (f"early stopping after step {step}: {since} held-out evaluation(s) without {better} "
                            f"step {best_step}'s {value:.6f} (--early-stopping {self.patience})")

    def should_stop(self) -> bool:
        return self.stopped is not None

    def finish(self) -> None:
        """Say why the run stopped early; put the best state back so the adapters written are its."""
        if self.stopped is not None:
            print(self.stopped)
        if self.keep and self.best_state is None and self.path is not None and self.path.is_file():
            saved = load_checkpoint(self.path)  # a best of the run this one resumed
            if (saved.program_sha256 == self.program_sha256
                    and (best_so_far(self.state.records, self.metric) or (None,))[0] == saved.step):
                self.best_state = saved.tensors
        if self.best_state is not None:
            for name, array in self.best_state.items():
                self.runner.write_state(name, array)
            best_step, value, _ = best_so_far(self.state.records, self.metric)
            print(f"best {self.what} {value:.6f} at step {best_step}: its adapters are the ones written"
                  + (f"; its checkpoint: {self.path}" if self.path is not None else ""))


__all__ = ["BestKeeper", "add_best_arguments", "best_checkpoint_path", "best_metric", "best_so_far",
           "check_best_arguments"]

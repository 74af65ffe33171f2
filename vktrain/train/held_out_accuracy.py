"""`vktrain train --eval-generate`: the task accuracy of the adapters at each held-out evaluation.

With `--eval-data CHATS.jsonl --eval-generate`, each evaluation of the run (before training, every
--eval-every steps, after the last step) also decodes a greedy answer to every held-out chat with the
current adapters and scores it against the chat's last assistant turn, exactly as `vktrain eval
--generate` does (vktrain/generate/task_accuracy.py: the prefill/decode program is exported on the host
from the .pte's model and the adapters, so each evaluation costs an export, and this path imports torch).
The exact-match accuracy is recorded as eval_accuracy (and the number-within-rounding accuracy, where the
references have numbers, as eval_number_accuracy); `--keep-best accuracy` keeps the state of the highest.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from vktrain.train.train_loop import TrainConfigError

EVAL_ACCURACY, EVAL_NUMBER_ACCURACY = "eval_accuracy", "eval_number_accuracy"


def add_accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eval-generate", action="store_true",
                        help="with --eval-data (chats): at each held-out evaluation also decode a greedy answer to "
                             "each chat and record the exact-match accuracy as eval_accuracy (as vktrain eval "
                             "--generate; an export on the host each time)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=32, metavar="N",
                        help="with --eval-generate: at most N answer tokens (default 32)")


def check_accuracy_arguments(args: argparse.Namespace) -> None:
    if args.eval_generate and not args.eval_data:
        raise TrainConfigError("--eval-generate scores the held-out chats of --eval-data FILE, which was not given")
    if args.eval_max_new_tokens < 1:
        raise TrainConfigError(f"--eval-max-new-tokens must be >= 1, got {args.eval_max_new_tokens}")


def accuracy_evaluation(args: argparse.Namespace, runner) -> Optional[Callable[[], dict]]:
    """A function returning {"eval_accuracy"[, "eval_number_accuracy"]} of `runner`'s current adapters on
    --eval-data's chats; None without --eval-generate. The chats are read (and refused) here, before training."""
    if not args.eval_generate:
        return None
    from vktrain.generate.task_accuracy import evaluate_generation, read_chats
    from vktrain.runtime.runtimes import max_binding_bytes
    from vktrain.serialization.tokenizer import program_tokenizer
    from vktrain.train.adapters import runner_frozen_lora

    chats = read_chats(args.eval_data)
    tokenizer = program_tokenizer(runner, args.program)

    def evaluate() -> dict:
        lora = {**runner_frozen_lora(runner), **runner.lora_state()}
        result = evaluate_generation(args.program, lora, tokenizer, chats, args.eval_max_new_tokens, runner.device,
                                     max_binding_bytes=max_binding_bytes(args), log=lambda *_: None)
        record = {EVAL_ACCURACY: result["exact_match"]}
        if result["number_accuracy"] is not None:
            record[EVAL_NUMBER_ACCURACY] = result["number_accuracy"]
        return record
    return evaluate


def describe_accuracy(record: dict) -> str:
    number = record.get(EVAL_NUMBER_ACCURACY)
    return f"exact match {record[EVAL_ACCURACY]:.1%}" + ("" if number is None else f", number {number:.1%}")


__all__ = ["EVAL_ACCURACY", "EVAL_NUMBER_ACCURACY", "accuracy_evaluation", "add_accuracy_arguments",
           "check_accuracy_arguments", "describe_accuracy"]

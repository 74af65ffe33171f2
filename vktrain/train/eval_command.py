"""`vktrain eval STEP.pte --data FILE [--adapters DIR|CHECKPOINT] [--json FILE]` (torch-free): mean loss
and perplexity on held-out data, by the eval method exported with the training step.

Held-out batches (`eval_batches`) cover every next-token target of the stream exactly once: rows of S
targets start every S tokens (row r predicts tokens r*S + 1 .. r*S + S from the S before), the last row
takes what is left, and rows of the last batch that the data does not fill are padding. Padding is label
-100 (ignored): the loss is the cross-entropy summed over every real target divided by their number,
`tokens` in the report. No optimizer state is read or written; the adapters are the .pte's initial ones,
or those of `--adapters` (a PEFT directory written by `vktrain train --out-adapters`, or a vktrain
checkpoint .safetensors), written into the training state the eval method reads.

A step of any other module (`vktrain train --inputs`) is evaluated on `--inputs DATA.npz` (the arrays
`vktrain train --inputs` reads, named as the eval method's inputs: one batch, or a stack cycled through
once): the loss is the mean of the eval method's loss over those batches, each weighted alike (the
module's loss defines its own reduction within a batch). This needs the eval method
(vktrain.export.export_training_and_eval_steps); a .pte without one is refused, saying so. `--adapters`
is then a vktrain checkpoint (its model.* tensors: everything the step trained).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from vktrain.contract import METADATA_LORA_ALPHA, MODEL_PREFIX
from vktrain.runtime.runtimes import add_runtime_argument, max_binding_bytes
from vktrain.train.adapters import (ADAPTER_CONFIG, AdapterError, check_frozen_lora, runner_frozen_lora,
                                    load_adapter_config, load_adapters)
from vktrain.train.checkpoint import atomic_write_json, load_checkpoint
from vktrain.train.data import IGNORED_LABEL, DataError, TrainingData, load_data
from vktrain.train.tokenizer import program_tokenizer
from vktrain.train.train_loop import TrainConfigError, describe_program, is_token_step



def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("program", metavar="STEP.pte", help="training-step program with its eval method (vktrain export)")
    parser.add_argument("--data", metavar="FILE",
                        help="held-out token data, in any format `vktrain train --data` reads (a token model's step)")
    parser.add_argument("--inputs", metavar="DATA.npz",
                        help="held-out input arrays of a step of any module, as `vktrain train --inputs` reads them "
                             "(named as the eval method's inputs); the loss is the mean over their batches")
    parser.add_argument("--adapters", metavar="DIR|CHECKPOINT",
                        help="adapters to evaluate: a PEFT directory (vktrain train --out-adapters) or a vktrain "
                             "checkpoint .safetensors (default: the adapters the .pte was exported with)")
    parser.add_argument("--max-batches", type=int, metavar="N",
                        help="evaluate only the first N batches of the data (default: all of it)")
    parser.add_argument("--json", metavar="FILE", help='write {"loss", "perplexity", "tokens"} as JSON')
    add_runtime_argument(parser)
    return parser


def check_max_batches(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise TrainConfigError(f"{flag} must be a positive number of batches, got {value}")


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 label_stream: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(token_ids, labels) int64 [B, S] covering every target of `tokens` once (module docstring).
    `label_stream` (as TrainingData.labels: each token's label as a target, -100 where it is none, e.g. a
    chat's prompt tokens) replaces the next tokens as labels."""
    n_targets = tokens.size - 1
    if n_targets < 1:
        raise DataError(f"held-out data needs at least 2 tokens (one target), got {tokens.size}")
    targets = tokens if label_stream is None else label_stream
    n_rows = -(-n_targets // seq_len)
    for first in range(0, n_rows, batch_size):
        token_ids = np.zeros((batch_size, seq_len), np.int64)
        labels = np.full((batch_size, seq_len), IGNORED_LABEL, np.int64)
        for row, start in enumerate(range(first * seq_len, min(n_rows, first + batch_size) * seq_len, seq_len)):
            length = min(seq_len, n_targets - start)
            token_ids[row, :length] = tokens[start:start + length]
            labels[row, :length] = targets[start + 1:start + 1 + length]
        yield token_ids, labels


def prepare_eval_batches(data: TrainingData, batch_shape: tuple[int, int],
                         max_batches: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The batches `evaluate_batches` runs: eval_batches of `data` (the first `max_batches`), those with a
    target. Made once for a run's every eval (vktrain train --eval-every)."""
    batches = []
    for index, (token_ids, labels) in enumerate(eval_batches(data.tokens, *batch_shape, data.labels)):
        if max_batches is not None and index >= max_batches:
            break
        if (labels >= 0).any():  # else nothing to count (e.g. a batch of prompt tokens only)
            batches.append((token_ids, labels))
    if not batches:
        raise DataError("the held-out data has no target token (every label is ignored)")
    return batches


def evaluate_batches(runner, batches: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """{"loss", "perplexity", "tokens"} of `runner`'s current adapters on prepared batches: the mean over
    every target, `tokens` of them."""
    total, count = 0.0, 0
    for token_ids, labels in batches:
        loss_sum, n = runner.evaluate(token_ids, labels)
        total += loss_sum  # float64 accumulation of the per-batch float32 sums
        count += n
    loss = total / count
    if not math.isfinite(loss):
        raise TrainConfigError(f"the eval loss is {loss} (not finite): the adapters or the data are broken")
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}


def evaluate_data(runner, data: TrainingData, max_batches: int | None = None) -> dict:
    """{"loss", "perplexity", "tokens"} of `runner`'s current adapters on `data` (its token stream, and its
    labels when some tokens are no targets): the mean over every target, `tokens` of them; with
    `max_batches`, over the targets of the first max_batches batches (a quick estimate on a slow device)."""
    return evaluate_batches(runner, prepare_eval_batches(data, runner.batch_shape, max_batches))


def adapter_state(path: Path, lora_names: list[str], program_alpha: float | None,
                  frozen: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The LoRA state (`model.<module>.lora_A` / `.lora_B`) of a PEFT directory or a vktrain checkpoint,
    exactly the program's adapter state `lora_names` (same modules; shapes are checked when written).
    `frozen`: the LoRA tensors that are constants of the program (frozen_lora_tensors); a directory must
    hold exactly those, and they are not part of the returned state."""
    frozen = frozen or {}
    if path.is_dir():
        config = load_adapter_config(path)
        alpha = config.get("lora_alpha")
        if program_alpha is not None and alpha is not None and float(alpha) != program_alpha:
            raise AdapterError(f"{path / ADAPTER_CONFIG}: lora_alpha is {alpha}, the program was exported with "
                               f"{program_alpha:g}; its scaling alpha/r is part of the program")
        adapters = load_adapters(path)
        check_frozen_lora(adapters, frozen, str(path))
        state = {}
        for module, (lora_a, lora_b) in adapters.items():
            state[f"{MODEL_PREFIX}{module}.lora_A"], state[f"{MODEL_PREFIX}{module}.lora_B"] = lora_a, lora_b
        state = {name: array for name, array in state.items() if name not in frozen}
    elif path.is_file():
        state = {name: array for name, array in load_checkpoint(path).tensors.items() if name in lora_names}
    else:
        raise AdapterError(f"--adapters {path} does not exist (expected a PEFT directory or a checkpoint file)")
    missing, unknown = sorted(set(lora_names) - set(state)), sorted(set(state) - set(lora_names))
    if missing or unknown:
        raise AdapterError(f"--adapters {path} does not match the program's adapters: missing {missing[:4]}, "
                           f"not in the program {unknown[:4]}")
    return state


def load_adapter_state(runner, state: Mapping[str, np.ndarray]) -> None:
    for name, array in state.items():
        runner.write_state(name, array)


def run_eval(args: argparse.Namespace, device=None) -> int:
    """`vktrain eval`: prints the loss, perplexity and token count (and writes them with --json)."""
    from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan: imported only when a run starts
    from vktrain.train.command import ValidationErrorsReported, prepare_output_file, print_validation_messages

    if (args.data is None) == (args.inputs is None):
        raise TrainConfigError("give the held-out data: --data FILE (token data) or --inputs DATA.npz (a step of any "
                               "module), exactly one of the two")
    program_path, data_path = Path(args.program), Path(args.data or args.inputs)
    check_max_batches("--max-batches", args.max_batches)
    if not program_path.is_file():
        raise TrainConfigError(f"program {program_path} does not exist (or is not a file)")
    if args.json:
        prepare_output_file("--json", args.json)
    runner = TrainingRunner.from_pte(program_path, device, runtime=getattr(args, "runtime", None),
                                     max_binding_bytes=max_binding_bytes(args))
    own_device = runner.device if device is None else None  # a caller's device keeps its messages
    try:
        with runner:
            if args.inputs is not None:
                result = _evaluate_inputs(args, runner, data_path)
            elif not is_token_step(runner):
                raise TrainConfigError(f"{args.program} is not a token model's step (its inputs are "
                                       f"{runner.input_names}): evaluate it on its input arrays with --inputs "
                                       f"DATA.npz, not token --data")
            else:
                result = _evaluate_tokens(args, runner, data_path)
    finally:
        errors = print_validation_messages(own_device)
    if errors:
        raise ValidationErrorsReported(f"the Vulkan validation layer reported {errors} error(s) (printed above)")
    if args.inputs is not None:
        print(f"eval {data_path}: loss {result['loss']:.6f} (mean over {result['batches']} batches)")
    else:
        print(f"eval {data_path}: loss {result['loss']:.6f}, perplexity {result['perplexity']:.4f} over "
              f"{result['tokens']} tokens")
    if args.json:
        atomic_write_json(args.json, result)
        print(f"results: {args.json}")
    return 0


def _evaluate_inputs(args: argparse.Namespace, runner, data_path: Path) -> dict:
    """{"loss", "batches"}: the eval method's mean loss over the --inputs batches (module docstring)."""
    from vktrain.train.input_data import load_input_arrays  # reads the program's input specs

    method = runner.eval_method()  # refused here when the .pte has none
    batches = load_input_arrays(data_path, method.input_specs)
    if args.adapters:
        load_adapter_state(runner, trained_state(Path(args.adapters), runner.state_names))
    count = batches.n_batches if args.max_batches is None else min(args.max_batches, batches.n_batches)
    losses = [runner.evaluate_inputs(batches.batch(position)) for position in range(count)]
    loss = math.fsum(losses) / count
    if not math.isfinite(loss):
        raise TrainConfigError(f"the eval loss is {loss} (not finite): the trained state or the data are broken")
    return {"loss": loss, "batches": count}


def trained_state(path: Path, state_names: list[str]) -> dict[str, np.ndarray]:
    """The model.* tensors (what the step trains) of a vktrain checkpoint: exactly the program's."""
    if not path.is_file():
        raise AdapterError(f"--adapters {path}: a step of any module takes a vktrain checkpoint file (vktrain train "
                           f"--checkpoint); {path} is not a file")
    wanted = [name for name in state_names if name.startswith(MODEL_PREFIX)]
    state = {name: array for name, array in load_checkpoint(path).tensors.items() if name.startswith(MODEL_PREFIX)}
    missing, unknown = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if missing or unknown:
        raise AdapterError(f"--adapters {path} does not match the program's trained tensors: missing {missing[:4]}, "
                           f"not in the program {unknown[:4]}")
    return state


def _evaluate_tokens(args: argparse.Namespace, runner, data_path: Path) -> dict:
    """{"loss", "perplexity", "tokens"} of a token model's step on --data."""
    info = describe_program(runner)
    data = load_data(data_path, info.vocab_size, program_tokenizer(runner, args.program))
    if args.adapters:
        alpha = info.metadata.get(METADATA_LORA_ALPHA)
        lora_names = list(runner.lora_state())
        load_adapter_state(runner, adapter_state(Path(args.adapters), lora_names,
                                                 None if alpha is None else float(alpha), runner_frozen_lora(runner)))
    return evaluate_data(runner, data, args.max_batches)

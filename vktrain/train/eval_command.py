"""`vktrain eval STEP.pte --data FILE [--adapters DIR|CHECKPOINT] [--json FILE]` (torch-free): mean loss
and perplexity on held-out data, by the eval method exported with the training step.

The held-out batches and their loss are vktrain/train/held_out.py's (`vktrain train --eval-data` uses
them too). No optimizer state is read or written; the adapters are the .pte's initial ones, or those of
`--adapters` (a PEFT directory written by `vktrain train --out-adapters`, or a vktrain checkpoint
.safetensors), written into the training state the eval method reads.

A step of any other module (`vktrain train --inputs`) is evaluated on `--inputs DATA.npz` (the arrays
`vktrain train --inputs` reads, named as the eval method's inputs: one batch, or a stack cycled through
once): the loss is the mean of the eval method's loss over those batches, each weighted alike (the
module's loss defines its own reduction within a batch). This needs the eval method
(vktrain.export.export_training_and_eval_steps); a .pte without one is refused, saying so. `--adapters`
is then a vktrain checkpoint (its model.* tensors: everything the step trained).

A preference step (`vktrain export --objective dpo|simpo|orpo`) is evaluated on `--data PAIRS.jsonl`: the mean
preference loss over the pairs and the reward accuracy, the fraction of pairs whose chosen completion's
implicit reward beats the rejected one's (vktrain/train/preference_eval.py); --max-batches N: the first N
pairs.

`--generate` measures task accuracy instead of the loss: greedy answers to the held-out chats of --data
by the model the .pte holds with the adapters given (vktrain/generate/task_accuracy.py; it exports a
prefill/decode program on the host, so this path imports torch).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Mapping

import numpy as np

from vktrain.contract import METADATA_LORA_ALPHA, MODEL_PREFIX, PRECISION_AUTO, PRECISION_CHOICES
from vktrain.runtime.runtimes import add_runtime_argument, max_binding_bytes, with_device_profile
from vktrain.serialization.peft_adapters import ADAPTER_CONFIG, AdapterError, load_adapter_config, load_adapters
from vktrain.train.adapters import check_frozen_lora, runner_frozen_lora
from vktrain.train.checkpoint import atomic_write_json, load_checkpoint
from vktrain.train.data import load_data
from vktrain.serialization.tokenizer import program_tokenizer
from vktrain.train.held_out import check_max_batches, evaluate_data
from vktrain.train.pairs import OBJECTIVE_NAMES, preference_objective
from vktrain.train.outputs import Output, OutputKind, add_overwrite_argument, check_outputs, json_object
from vktrain.train.train_loop import TrainConfigError, describe_program, is_token_step
from vktrain.backend.kernel_planning import plan_schedule


EVAL_RESULT = OutputKind("vktrain eval's JSON result", json_object("loss"))  # what --json writes


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("program", metavar="STEP.pte", help="training-step program with its eval method (vktrain export)")
    parser.add_argument("--data", metavar="FILE",
                        help="held-out token data, in any format `vktrain train --data` reads (a token model's step), "
                             "or preference pairs (a DPO / SimPO step: loss and reward accuracy)")
    parser.add_argument("--inputs", metavar="DATA.npz",
                        help="held-out input arrays of a step of any module, as `vktrain train --inputs` reads them "
                             "(named as the eval method's inputs); the loss is the mean over their batches")
    parser.add_argument("--adapters", metavar="DIR|CHECKPOINT",
                        help="adapters to evaluate: a PEFT directory (vktrain train --out-adapters) or a vktrain "
                             "checkpoint .safetensors (default: the adapters the .pte was exported with)")
    parser.add_argument("--max-batches", type=int, metavar="N",
                        help="evaluate only the first N batches of the data (default: all of it)")
    parser.add_argument("--json", metavar="FILE", help='write {"loss", "perplexity", "tokens"} as JSON (with '
                        '--generate: the accuracies and each example\'s answer)')
    parser.add_argument("--generate", action="store_true",
                        help="task accuracy instead of the loss: decode a greedy answer to each held-out chat of --data "
                             "(the messages before its last assistant turn) and score it against that turn: exact "
                             "match, and its last number within the rounding of the reference's")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                        help="with --generate: at most N answer tokens (default 32)")
    parser.add_argument("--max-examples", type=int, metavar="N",
                        help="with --generate: score only the first N chats (default: all of them)")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO,
                        help="GEMM precision policy, as `vktrain train --precision` (docs/PRECISION.md; default auto)")
    add_runtime_argument(parser)
    add_overwrite_argument(parser)
    return parser


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


@with_device_profile
def run_eval(args: argparse.Namespace, device=None) -> int:
    """`vktrain eval`: prints the loss, perplexity and token count (and writes them with --json)."""
    from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan: imported only when a run starts
    from vktrain.train.command import ValidationErrorsReported, print_validation_messages

    if (args.data is None) == (args.inputs is None):
        raise TrainConfigError("give the held-out data: --data FILE (token data) or --inputs DATA.npz (a step of any "
                               "module), exactly one of the two")
    program_path, data_path = Path(args.program), Path(args.data or args.inputs)
    check_max_batches("--max-batches", args.max_batches)
    _check_generate_arguments(args)
    if not program_path.is_file():
        raise TrainConfigError(f"program {program_path} does not exist (or is not a file)")
    check_outputs([Output("--json", args.json, EVAL_RESULT)], overwrite=args.overwrite,
                  inputs=[("the program", args.program), ("--data", args.data), ("--inputs", args.inputs),
                          ("--adapters", args.adapters)])
    runner = TrainingRunner.from_pte(program_path, device, planner=plan_schedule,
                                     runtime=getattr(args, "runtime", None), max_binding_bytes=max_binding_bytes(args),
                                     precision=getattr(args, "precision", PRECISION_AUTO))
    own_device = runner.device if device is None else None  # a caller's device keeps its messages
    try:
        with runner:
            if args.generate:
                result = _evaluate_generation(args, runner, data_path)
            elif args.inputs is not None:
                result = _evaluate_inputs(args, runner, data_path)
            elif preference_objective(runner) is not None:
                result = _evaluate_pairs(args, runner, data_path)
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
    if args.generate:
        numbers = ("" if result["number_accuracy"] is None else
                   f", number within rounding {result['number_accuracy']:.1%} (of {result['with_number']})")
        print(f"eval {data_path}: exact match {result['exact_match']:.1%} of {result['examples']} chat(s){numbers}; "
              f"greedy, at most {result['max_new_tokens']} new tokens")
    elif args.inputs is not None:
        print(f"eval {data_path}: loss {result['loss']:.6f} (mean over {result['batches']} batches)")
    elif "reward_accuracy" in result:
        print(f"eval {data_path}: {OBJECTIVE_NAMES[result['objective']]} loss {result['loss']:.6f}, reward accuracy "
              f"{result['reward_accuracy']:.1%} of {result['pairs']} pair(s) ({result['ties']} tied)")
    else:
        print(f"eval {data_path}: loss {result['loss']:.6f}, perplexity {result['perplexity']:.4f} over "
              f"{result['tokens']} tokens")
    if args.json:
        atomic_write_json(args.json, result)
        print(f"results: {args.json}")
    return 0


def _check_generate_arguments(args: argparse.Namespace) -> None:
    generate = getattr(args, "generate", False)
    if not generate:
        given = [flag for flag, value in (("--max-examples", getattr(args, "max_examples", None)),) if value is not None]
        if given:
            raise TrainConfigError(f"{', '.join(given)} applies to --generate (task accuracy), which was not given")
        return
    if args.inputs is not None or args.max_batches is not None:
        raise TrainConfigError("--generate scores the held-out chats of --data; --inputs and --max-batches belong to "
                               "the loss, not to it")
    if args.max_new_tokens < 1:
        raise TrainConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_examples is not None and args.max_examples < 1:
        raise TrainConfigError(f"--max-examples must be a positive number of chats, got {args.max_examples}")


def _evaluate_generation(args: argparse.Namespace, runner, data_path: Path) -> dict:
    """Task accuracy of the adapters on --data's chats (vktrain.generate.task_accuracy; exports on the host)."""
    from vktrain.generate.task_accuracy import evaluate_generation, read_chats

    chats = read_chats(data_path, args.max_examples)
    _load_given_adapters(args, runner)
    lora = {**runner_frozen_lora(runner), **runner.lora_state()}
    print(f"generating answers to {len(chats)} chat(s) of {data_path} (greedy, at most {args.max_new_tokens} tokens)")
    return evaluate_generation(args.program, lora, program_tokenizer(runner, args.program), chats,
                               args.max_new_tokens, runner.device, max_binding_bytes=max_binding_bytes(args))


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
    _load_given_adapters(args, runner)
    return evaluate_data(runner, data, args.max_batches)


def _load_given_adapters(args: argparse.Namespace, runner) -> None:
    """Write --adapters (when given) into a token model's step, checked against the program's."""
    if args.adapters:
        alpha = _metadata(runner).get(METADATA_LORA_ALPHA)
        load_adapter_state(runner, adapter_state(Path(args.adapters), list(runner.lora_state()),
                                                 None if alpha is None else float(alpha), runner_frozen_lora(runner)))


def _metadata(runner) -> dict:
    return dict(getattr(getattr(runner, "graph", None), "metadata", {}) or {})


def _evaluate_pairs(args: argparse.Namespace, runner, data_path: Path) -> dict:
    """A preference step's held-out loss and reward accuracy on --data's pairs (vktrain/train/preference_eval.py)."""
    from vktrain.train.preference_eval import evaluate_pairs, held_out_pairs

    pairs, settings = held_out_pairs(runner, data_path, args.program)
    _load_given_adapters(args, runner)
    return evaluate_pairs(runner, pairs, settings, args.max_batches)

"""vktrain command line.

    vktrain export --model tiny-llama|HF_DIR|FILE.gguf --lora-rank 8 --batch 4 --seq 64 --out step.pte
    vktrain inspect step.pte [--json] [--device-profile NAME|FILE.json|all]
    vktrain train step.pte --steps 100 [--data FILE --lr 1e-3 --schedule cosine --warmup 10 ...]
    vktrain eval step.pte --data FILE [--adapters DIR|CHECKPOINT] [--json FILE]
    vktrain generate --model PATH [--adapters DIR] --prompt TEXT [--chat] [--max-new-tokens N] [--json FILE]
    vktrain merge step.pte --adapters DIR|--checkpoint CK --out MERGED_DIR
    vktrain adapters convert step.pte --adapters DIR|--checkpoint CK --out adapter.gguf
    vktrain devices [--runtime vulkan|webgpu] [--json] [--builtin | --profiles | --profile FILE]
    vktrain bench kernels|step [benchmark args]

`export` and `inspect` run on the host (torch + executorch); `train` and `eval` are the on-device runner
and import neither, nor do `merge` and `adapters convert`; `generate` exports on the host, then runs on the
device.

Exit codes: 0 done; 1 the training loss diverged; 2 bad input or an environmental failure (no device,
out of memory, disk full), printed as one line `vktrain <cmd>: error: <message>`; 70 an internal error
(one line; VKTRAIN_TRACEBACK=1 shows the traceback); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM):
`train` and `federate` then save what they have and print how to resume.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import signal
import sys
import warnings
from pathlib import Path

from vktrain.contract import checkpointing_name, layers_per_segment
from vktrain.contract import METADATA_OBJECTIVE, OBJECTIVE_DPO, OBJECTIVE_ORPO, OBJECTIVE_SIMPO, OBJECTIVES, PACKINGS
from vktrain.contract import PRECISION_AUTO, PRECISION_CHOICES
from vktrain.errors import VktrainError
# main() repeats vktrain/__init__'s silencing (idempotent) in case a library reset the filters.
from vktrain.import_noise import silence_known_import_noise as _silence_known_import_noise
from vktrain.inspect_command import cmd_inspect
from vktrain.train.checkpoint import atomic_write_bytes  # torch-free; the one atomic writer
from vktrain.train.model_options import (UsageError, add_quantization_arguments, parse_model_args,
                                         quantization_importance)
from vktrain.train.outputs import PTE, Output, add_overwrite_argument, check_outputs
from vktrain.train.interrupts import EXIT_CODES, StopOnSignal, signal_name
from vktrain.train.train_loop import NonFiniteLossError

PROGRAMS = ("train-step", "forward", "forward-base")

# How a command ends. EXIT_BAD_INPUT covers environmental failures too (no device, out of memory, disk full);
# a signal ends it with 128 + its number (EXIT_CODES: 130 SIGINT, 143 SIGTERM).
EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 70
TRACEBACK_ENV = "VKTRAIN_TRACEBACK"  # set to 1: an internal error shows its traceback




def summarize_layer_paths(paths: list[str]) -> str:
    """Layer paths grouped by their pattern over numbered blocks, in first-seen order:
    ['m.layers.0.q', 'm.layers.1.q', 'head'] -> 'm.layers.{0..1}.q, head' (the numbers listed when not a range)."""
    groups: dict[str, list[int]] = {}
    for path in paths:
        match = re.fullmatch(r"(.*?\.)(\d+)(\..*)", path)
        key = f"{match[1]}{{}}{match[3]}" if match else path
        groups.setdefault(key, []).append(int(match[2]) if match else -1)
    parts = []
    for key, numbers in groups.items():
        if len(numbers) == 1:
            parts.append(key if numbers == [-1] else key.replace("{}", str(numbers[0])))
        elif numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
            parts.append(key.replace("{}", f"{{{numbers[0]}..{numbers[-1]}}}"))
        else:
            parts.append(key.replace("{}", "{" + ",".join(map(str, numbers)) + "}"))
    return ", ".join(parts)


def check_head_dim(model, model_name: str) -> None:
    """Refuse, before minutes of export, a head dim the runtime's attention kernels cannot run."""
    from vktrain.opdefs.vktrain_ops import ATTENTION_HEAD_DIMS

    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim in ATTENTION_HEAD_DIMS:
        return
    if getattr(config, "attn_head_dim", None) is None and hasattr(config, "n_heads"):
        how, flag = f"dim / n_heads = {config.dim} / {config.n_heads} = {head_dim}", "dim=... or --model-arg n_heads=..."
    else:
        how, flag = f"attn_head_dim = {head_dim}", "attn_head_dim=..."
    raise UsageError(f"--model {model_name}: head dim {how} is not supported; the attention kernels take head dims "
                     f"{ATTENTION_HEAD_DIMS} (change --model-arg {flag})")


def _checkpointing_value(text: str) -> str:
    """--activation-checkpointing's value in its canonical spelling (every-layer or N)."""
    try:
        return checkpointing_name(layers_per_segment(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _preference_step(args: argparse.Namespace, model):
    """(the model with --objective's loss, its example inputs, its settings for the blob) of dpo / simpo / orpo."""
    if args.objective == OBJECTIVE_DPO:
        from vktrain.export.dpo import DEFAULT_BETA, example_dpo_inputs, with_dpo_loss

        beta = DEFAULT_BETA if args.beta is None else args.beta
        return (with_dpo_loss(model, beta), example_dpo_inputs(args.seq, model.vocab_size),
                {"objective": OBJECTIVE_DPO, "beta": beta})
    if args.objective == OBJECTIVE_ORPO:
        from vktrain.export.orpo import DEFAULT_LAMBDA, example_orpo_inputs, with_orpo_loss

        lambda_ = DEFAULT_LAMBDA if args.beta is None else args.beta
        return (with_orpo_loss(model, lambda_), example_orpo_inputs(args.seq, model.vocab_size),
                {"objective": OBJECTIVE_ORPO, "beta": lambda_})
    from vktrain.export.simpo import DEFAULT_BETA, DEFAULT_GAMMA_BETA_RATIO, example_simpo_inputs, with_simpo_loss

    beta = DEFAULT_BETA if args.beta is None else args.beta
    ratio = DEFAULT_GAMMA_BETA_RATIO if args.gamma_beta_ratio is None else args.gamma_beta_ratio
    return (with_simpo_loss(model, beta, ratio), example_simpo_inputs(args.seq, model.vocab_size),
            {"objective": OBJECTIVE_SIMPO, "beta": beta, "gamma": beta * ratio})


def cmd_export(args: argparse.Namespace) -> int:
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import open_model
    from vktrain.serialization.tokenizer import TokenizerError

    if args.freeze_lora_a and args.program != "train-step":
        raise UsageError(f"--freeze-lora-a freezes lora_A in a training step; --program is {args.program}")
    if args.grad_accum and args.program != "train-step":
        raise UsageError(f"--grad-accum accumulates a training step's gradients; --program is {args.program}")
    if args.activation_checkpointing is not None and args.program != "train-step":
        raise UsageError(f"--activation-checkpointing recomputes activations in a training step's backward; "
                         f"--program is {args.program}")
    packing = None if args.packing == "none" else args.packing
    if packing and args.program != "train-step":
        raise UsageError(f"--packing {args.packing} packs a training step's documents; --program is {args.program}")
    preference = args.objective != "lm"  # dpo, simpo or orpo: a step over preference pairs
    if args.beta is not None and not preference:
        raise UsageError(f"--beta is DPO's, SimPO's and ORPO's; --objective is {args.objective}")
    if args.beta is not None and not (math.isfinite(args.beta) and args.beta > 0):
        raise UsageError(f"--beta must be a finite number > 0 ({args.objective}'s scale of the reward margin), got "
                         f"{args.beta}")
    if args.gamma_beta_ratio is not None and args.objective != OBJECTIVE_SIMPO:
        raise UsageError(f"--gamma-beta-ratio is SimPO's target margin over beta; --objective is {args.objective}")
    if args.gamma_beta_ratio is not None and not (math.isfinite(args.gamma_beta_ratio) and args.gamma_beta_ratio >= 0):
        raise UsageError(f"--gamma-beta-ratio must be a finite number >= 0 (SimPO's margin gamma = beta x ratio), got "
                         f"{args.gamma_beta_ratio}")
    if preference and (args.program != "train-step" or packing or args.batch != 1):
        raise UsageError(f"--objective {args.objective} exports a training step (--program train-step) of one "
                         f"preference pair a call: --batch 1 (N pairs a step: --grad-accum here, vktrain train "
                         f"--grad-accum N), no --packing; got --program {args.program} --batch {args.batch} "
                         f"--packing {args.packing}")
    check_outputs([Output("--out", args.out, PTE)], overwrite=args.overwrite,  # before minutes of export
                  inputs=[("--model", args.model), ("--calibration-data", args.calibration_data)])
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    targets = resolve_targets(args.target)  # a bad name is refused before minutes of export
    import torch

    torch.manual_seed(args.seed)  # a built-in model's random weights; the LoRA init has its own generator
    tokenizer = None  # a pretrained model's, embedded in the .pte for `vktrain train`
    model, loaded = open_model(args.model, **parse_model_args(args.model_arg))
    check_head_dim(model, args.model)
    if loaded is not None:
        print(f"loaded {args.model}: {loaded.describe()}")
        try:
            tokenizer = loaded.tokenizer.build()
        except TokenizerError as e:  # the model still trains, on token ids
            print(f"warning: the .pte will carry no tokenizer: {e}", file=sys.stderr)
        if tokenizer is not None:
            print(f"tokenizer: {tokenizer.vocab_size} tokens, {'a' if tokenizer.chat_template else 'no'} chat "
                  f"template (carried in the .pte, for `vktrain train --data` text and chat JSONL)")
    config = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.targets, group_size=args.group_size,
                        scale_rule=args.scale_rule, seed=args.seed)
    importance, calibration = quantization_importance(args, model, tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_lora(model, config, importance)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"adapting {len(report.replaced)} layer(s) with LoRA rank {config.rank}, alpha {config.alpha:g} over a "
          f"q4gsw base ({config.scale_rule} scales, {calibration}): {summarize_layer_paths(report.replaced)}")
    if report.excluded_heads:
        print(f"not adapted (output head; name it in --targets to adapt it): {', '.join(report.excluded_heads)}")

    # executorch is imported only once the model and adapters are known to be valid (it is slow to import).
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import (export_accumulating_methods, export_forward, export_training_and_eval_steps,
                                lower_methods_to_pte)
    from vktrain.export.recompute import CheckpointingError
    from vktrain.export.training import activation_checkpointing_spec, adapter_metadata_specs
    from vktrain.partitioner import VktrainPartitioner

    batch_shape = (args.batch, args.seq)
    step_options = dict(freeze_lora_a=args.freeze_lora_a, activation_checkpointing=args.activation_checkpointing)
    objective_settings = None  # a preference step's, recorded in the blob (contract.METADATA_OBJECTIVE)
    try:
        if preference:
            preference_model, inputs, objective_settings = _preference_step(args, model)
            methods = export_accumulating_methods(preference_model, example_inputs=inputs, **step_options) \
                if args.grad_accum else dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(
                    preference_model, example_inputs=inputs, **step_options)))
        elif args.program == "train-step":  # with its eval method (`vktrain eval`), sharing the frozen base
            methods = export_accumulating_methods(model, batch_shape, packing=packing, **step_options) \
                if args.grad_accum else dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(
                    model, batch_shape, packing=packing, **step_options)))
        else:
            methods = {TRAIN_METHOD: export_forward(model, batch_shape, with_adapters=args.program == "forward")}
    except CheckpointingError as e:  # refused before the trace
        raise UsageError(f"--activation-checkpointing {args.activation_checkpointing}: {e}") from None
    specs = adapter_metadata_specs(model, args.model, loaded)
    if args.activation_checkpointing is not None:
        specs.append(activation_checkpointing_spec(args.activation_checkpointing))
    if objective_settings is not None:
        from vktrain.backend.preprocess import metadata_spec

        specs.append(metadata_spec(METADATA_OBJECTIVE, json.dumps(objective_settings)))
    partitioner = VktrainPartitioner(compile_specs=specs)
    embedder = TargetEmbedder(targets) if targets else None
    pte = lower_methods_to_pte(methods, {TRAIN_METHOD: partitioner},
                               named_data=tokenizer.to_named_data() if tokenizer else None, rewrite_blobs=embedder)
    if embedder:  # what `portable` / `all` left out is reported, not warned about: it is the planner's limit today
        print(f"schedules embedded for device profiles: {', '.join(embedder.embedded)}")
        for reason in embedder.left_out:
            print(f"not embedded: {reason.removeprefix('--target ')}")
    atomic_write_bytes(Path(args.out), pte)
    print(f"wrote {args.out}: {len(pte)} bytes, {' and '.join(methods)} ({args.program}"
          f"{' and eval' if EVAL_METHOD in methods else ''}) of {args.model} "
          f"(LoRA on {len(report.replaced)} layer(s), listed above; "
          f"{partitioner.num_partitions} delegate(s), {len(partitioner.refusals)} refused node(s))")
    for refusal in partitioner.refusals:
        print(f"refused: {refusal.reason}", file=sys.stderr)
    return 0


def version() -> str:
    """The installed distribution's version (pyproject.toml's), or say that vktrain runs uninstalled."""
    from importlib.metadata import PackageNotFoundError, version as distribution_version

    try:
        return distribution_version("vktrain")
    except PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append '(default: X)' to the help of every option of `parser` and its subcommands that has a
    default worth naming and whose help does not already name one (argparse's
    ArgumentDefaultsHelpFormatter would also print 'default: None' beside help that explains it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)
            continue
        help_text = action.help or ""
        if (not action.option_strings or action.help == argparse.SUPPRESS or "default" in help_text
                or action.default is None or action.default is False or action.default == []
                or action.default == argparse.SUPPRESS):
            continue
        action.help = f"{help_text} (default: %(default)s)".lstrip()


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, but an option whose value is optional and one of fixed choices (`--keep-best
    [loss|accuracy]`) takes the next word only when it is one of them (or a near miss of one, refused as an
    invalid choice): `--keep-best step.pte` keeps the best by loss and step.pte is the program, where argparse
    alone reads step.pte as --keep-best's value and refuses it. `--keep-best=accuracy` is always the value.
    Each (sub)command's parser applies this to its own options (the subcommands' parsers are of this class)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._values_apart(args), namespace)

    def _values_apart(self, args: list[str]) -> list[str]:
        """`args` with each such option that a word other than its choices follows written `--option=CONST`."""
        out = []
        for i, word in enumerate(args):
            if word == "--":
                return out + args[i:]
            action = self._optional_choice(word)
            following = args[i + 1] if i + 1 < len(args) else None
            if (action is not None and following is not None and not following.startswith("-")
                    and following not in action.choices and not _near_miss(following, action.choices)):
                word = f"{word}={action.const}"
            out.append(word)
        return out

    def _optional_choice(self, word: str):
        """The option `word` names (in full or, as argparse allows, by a unique prefix) if its value is an
        optional one of fixed choices; else None."""
        if not word.startswith("--") or "=" in word:
            return None
        actions = {self._option_string_actions[word]} if word in self._option_string_actions else \
            {a for flag, a in self._option_string_actions.items() if self.allow_abbrev and flag.startswith(word)}
        action = actions.pop() if len(actions) == 1 else None
        return action if action is not None and action.nargs == argparse.OPTIONAL and action.choices else None


def _near_miss(word: str, choices) -> bool:
    """A misspelt choice (`acuracy`), not a path or another argument: it is refused as an invalid choice."""
    return not set("./\\") & set(word) and bool(difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6))


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="vktrain", description="LoRA training through a frozen q4gsw base on Vulkan")
    parser.add_argument("--version", action="version", version=f"vktrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="export a model's training step (or forward) to a .pte")
    export.add_argument("--model", required=True,
                        help="built-in model name (e.g. tiny-llama), a Hugging Face model directory or a .gguf file")
    export.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model config field (repeatable), e.g. --model-arg dim=32")
    export.add_argument("--program", choices=PROGRAMS, default="train-step",
                        help="train-step (forward+backward+AdamW), forward (logits with adapters), "
                             "forward-base (logits of the q4gsw base alone)")
    export.add_argument("--lora-rank", type=int, default=8)
    export.add_argument("--freeze-lora-a", action="store_true",
                        help="train only lora_B (FFA-LoRA, vktrain federate --strategy ffa): lora_A stays its "
                             "initial value, a constant of the program, and its gradient is not computed")
    export.add_argument("--grad-accum", action="store_true",
                        help="also export an 'accumulate' method, so that vktrain train --grad-accum N can take N "
                             "micro-batches per optimizer step (the step gains one float32 gradient buffer per "
                             "LoRA tensor)")
    export.add_argument("--activation-checkpointing", metavar="every-layer|N", type=_checkpointing_value, default=None,
                        help="keep only the decoder layers' inputs and recompute their forward inside the backward, "
                             "one layer at a time (every-layer) or in segments of N layers: less device memory "
                             "(vktrain inspect's planned GPU memory), more time per step; the same losses")
    export.add_argument("--packing", choices=PACKINGS, default="none",
                        help="documents: the step takes each token's position in its document, so a window packing "
                             "several documents (or chats) attends within each and restarts rope positions at each "
                             "start: the loss the documents have one by one; vktrain train feeds the boundaries of "
                             "its --data (default none: a window attends across them)")
    export.add_argument("--objective", choices=OBJECTIVES, default="lm",
                        help="dpo: the step trains on preference pairs (vktrain train --data pairs.jsonl, TRL's "
                             "{prompt, chosen, rejected}) with DPO's loss, the frozen base as the reference; simpo: "
                             "SimPO's loss (length-normalised log-probabilities, no reference); orpo: ORPO's (the "
                             "chosen completion's NLL plus lambda times the odds-ratio loss, no reference); one pair "
                             "a call (--batch 1), so N pairs a step is --grad-accum (default lm)")
    export.add_argument("--beta", type=float, default=None,
                        help="the reward scale beta: DPO's (default 0.1) or SimPO's (default 2.0); ORPO's lambda, "
                             "the odds-ratio term's weight (TRL's beta; default 0.1)")
    export.add_argument("--gamma-beta-ratio", type=float, default=None,
                        help="SimPO's target reward margin gamma over beta (default 0.5: gamma = beta / 2)")
    export.add_argument("--lora-alpha", type=float, default=16.0)
    export.add_argument("--seed", type=int, default=0,
                        help="seeds the LoRA init and a built-in model's random weights (default 0): exports of one "
                             "model with one seed start from the same adapters")
    export.add_argument("--targets", default="all-linear",
                        help="module-name glob(s), comma-separated; 're:' prefix for a regex; 'all-linear' (default): "
                             "every linear layer but the output head")
    add_quantization_arguments(export)
    export.add_argument("--batch", type=int, default=4)
    export.add_argument("--seq", type=int, default=64)
    export.add_argument("--target", default="portable", metavar="NAME[,NAME...]",
                        help="device profiles to plan for and embed the schedules of (built-in names, FILE.json, "
                             "local, all, none: plan at load); default portable: this machine's Vulkan device, "
                             "desktop-gpu, adreno-6xx (those the program's plan fits)")
    export.add_argument("--out", required=True, help="output .pte path (written atomically)")
    add_overwrite_argument(export)
    export.set_defaults(run=cmd_export)

    inspect = sub.add_parser("inspect", help="describe a .pte: delegates, ops, constants, memory, state, refusals")
    inspect.add_argument("file")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON (every state tensor)")
    inspect.add_argument("--verbose", action="store_true",
                         help="list every state tensor (default: their count and bytes by kind)")
    inspect.add_argument("--device-profile", metavar="NAME|FILE.json|all", default=None,
                         help="instead: plan the program for this device profile (a built-in: `vktrain devices "
                              "--profiles`, or a profile file; `all`: every built-in, one line each), opening no "
                              "device, and say whether it fits: dispatches, shader variants, device memory against "
                              "the profile's memory budget, largest allocation and binding against its limits, "
                              "the refusals and what to change")
    inspect.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO,
                         help="with --device-profile: plan the GEMMs at this precision policy, as `vktrain train "
                              "--precision` does (default auto: the profile's pick, fp16 on phones); the dispatches "
                              "counted are that precision's")
    inspect.set_defaults(run=cmd_inspect)

    from vktrain.train.command import add_train_arguments, run_train  # torch-free

    train = sub.add_parser("train", help="train the LoRA adapters of a training-step .pte on the Vulkan device")
    add_train_arguments(train)
    train.set_defaults(run=run_train)

    from vktrain.train.eval_command import add_eval_arguments, run_eval  # torch-free

    evaluate = sub.add_parser("eval", help="mean loss and perplexity on held-out data, by a .pte's eval method")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(run=run_eval)

    from vktrain.generate.command import add_generate_arguments, run_generate

    generate = sub.add_parser("generate", help="generate text with a model (and adapters) on the Vulkan device")
    add_generate_arguments(generate)
    generate.set_defaults(run=run_generate)

    from vktrain.train.merge import add_merge_arguments, run_merge  # torch-free

    merge = sub.add_parser("merge", help="write a training program's base with its adapters merged in, as a "
                                         "Hugging Face model directory")
    add_merge_arguments(merge)
    merge.set_defaults(run=run_merge)

    from vktrain.train.gguf_adapter import add_convert_arguments, run_convert  # torch-free

    adapters = sub.add_parser("adapters", help="convert trained adapters (convert: to a llama.cpp LoRA GGUF)")
    convert = adapters.add_subparsers(dest="action", required=True).add_parser(
        "convert", help="write a program's adapters (directory or checkpoint) as a llama.cpp LoRA GGUF")
    add_convert_arguments(convert)
    convert.set_defaults(run=run_convert)

    from vktrain.fleet.command import add_federate_arguments, run_federate  # imports no Flower until it runs

    federate = sub.add_parser("federate", help="federated fine-tuning of a training step's adapters: N simulated "
                                               "clients on Flower (Ray), FedAvg or FFA-LoRA")
    add_federate_arguments(federate)
    federate.set_defaults(run=run_federate)

    from vktrain.train.devices import add_devices_arguments, run_devices  # torch-free

    devices = sub.add_parser("devices", help="print each local device's profile: what kernel planning reads of it")
    add_devices_arguments(devices)
    devices.set_defaults(run=run_devices)
    from vktrain.fleet.deployment import add_fleet_arguments  # imports no Flower until it runs
    add_fleet_arguments(sub.add_parser("fleet", help="federated fine-tuning over the network on Flower's deployment "
                                                     "engine: certs, server, node (TLS, node authentication)"))

    bench = sub.add_parser("bench", help="run a benchmark script (kernels: per-kernel GPU times; step: training steps)")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    bench.set_defaults(run=cmd_bench)
    show_defaults(parser)
    return parser


BENCHMARKS = {"kernels": "bench_kernels.py", "step": "bench_step.py"}


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmarks live in scripts/ of the checkout (they compare against PyTorch and are not part of the runtime)."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "scripts" / BENCHMARKS[args.which]
    if not script.is_file():
        print(f"vktrain bench: {script} not found (benchmarks need a source checkout of vktrain)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; every way it can end is an exit code (see EXIT_*), never a traceback for bad
    input or an environmental failure."""
    _silence_known_import_noise()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = argv  # as given: `vktrain train` prints it back with --resume when interrupted
    prefix = " ".join(["vktrain", args.command, *([args.action] if getattr(args, "action", None) else [])])
    try:
        with StopOnSignal(args.command):  # SIGTERM, like Ctrl-C, ends in one line and its exit code
            return args.run(args)
    except BrokenPipeError:  # the reader went away (`vktrain inspect x.pte | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM
        signum = getattr(exc, "signum", signal.SIGINT)
        if not getattr(exc, "reported", False):  # train and federate say what they kept themselves
            print(f"\n{prefix}: interrupted ({signal_name(signum)})", file=sys.stderr)
        return EXIT_CODES[signum]
    except NonFiniteLossError as exc:
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except VktrainError as exc:
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError:
        print(f"{prefix}: error: out of host memory", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # an environmental failure that was not wrapped where it happened
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"{prefix}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:
        if args.command not in ("export", "generate"):  # model configurations still raise plain ValueError
            return _internal_error(prefix, exc)
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        return _internal_error(prefix, exc)


def _internal_error(prefix: str, exc: Exception) -> int:
    """A bug in vktrain: one line naming it, and how to see where it happened."""
    if os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
        raise exc
    print(f"{prefix}: internal error: {type(exc).__name__}: {exc} (a bug in vktrain; run with {TRACEBACK_ENV}=1 "
          f"for the traceback)", file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

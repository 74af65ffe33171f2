"""`vktrain generate`: export the model's prefill + decode program on the host (torch), run it on the
Vulkan device with the torch-free GenerationRunner, print the text and tokens/s.

The base is q4gsw as in training (same --group-size / --scale-rule defaults as `vktrain export`); with
--adapters the PEFT adapters run as LoRA layers over it (not merged: merging would re-quantize the base).
--program-cache DIR keeps the lowered program as DIR/<key>.pte, the key a SHA-256 of everything the
program depends on (model files' names, sizes and modification times, the adapter files' bytes, the
export options, the vktrain sources that shape the program), so a second run skips the export.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

from vktrain.errors import VktrainError
from vktrain.train.model_options import add_quantization_arguments
from vktrain.runtime.runtimes import add_runtime_argument, max_binding_bytes, with_device_profile
from vktrain.train.outputs import Output, OutputKind, add_overwrite_argument, check_outputs, json_object

# Sources whose change changes the lowered program (the cache key hashes them; "backend" holds the kernel
# planning, whose ops the partitioner accepts).
_PROGRAM_SOURCES = ("export", "backend", "partitioner", "serialization", "opdefs", "ops", "lora", "models", "quant")


# What generate writes: --json its result; --program-cache DIR programs named by their key (never replaced).
GENERATION = OutputKind("vktrain generate's JSON result", json_object("prompt_tokens", "tokens"))
PROGRAM_CACHE = OutputKind("a program cache", lambda path: True, directory=True)


class GenerateUsageError(VktrainError, ValueError):
    """Arguments of `vktrain generate` that do not fit together."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="built-in model name, a Hugging Face model directory or a .gguf")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model config field (repeatable)")
    parser.add_argument("--adapters", help="PEFT adapter directory (as `vktrain train --out-adapters` writes it)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--cache-length", type=int, default=None,
                        help="KV-cache positions (default: min(max_seq_len, 512))")
    parser.add_argument("--prefill-length", type=int, default=32, help="prompt tokens per prefill call")
    add_quantization_arguments(parser)  # the same flags and defaults as `vktrain export`: the same base
    parser.add_argument("--program-cache", help="directory keeping lowered programs by a hash of their inputs")
    parser.add_argument("--json", help="write {prompt_tokens, tokens, text, tokens_per_s} to this file")
    add_runtime_argument(parser)
    add_overwrite_argument(parser)


def _prompt_ids(args, codec) -> list[int]:
    if args.prompt_ids is not None:
        if args.chat:
            raise GenerateUsageError("--chat renders text; it cannot be used with --prompt-ids")
        try:
            return [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise GenerateUsageError(f"--prompt-ids expects comma-separated integers, got {args.prompt_ids!r}") from None
    if args.chat:
        from vktrain.generate.text import chat_prompt

        return codec.encode(chat_prompt(codec, args.prompt), False)
    return codec.encode(args.prompt, True)


def _files_fingerprint(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def program_key(args, model_fingerprint) -> str:
    digest = hashlib.sha256()
    options = {k: getattr(args, k) for k in ("model_arg", "cache_length", "prefill_length", "group_size", "scale_rule",
                                             "calibration_data", "calibration_tokens")}
    digest.update(json.dumps([model_fingerprint, options], sort_keys=True).encode())
    if args.adapters:
        for path in sorted(Path(args.adapters).iterdir()):
            if path.is_file():
                digest.update(path.name.encode() + path.read_bytes())
    package = Path(__file__).resolve().parent.parent
    for sub in _PROGRAM_SOURCES:
        for path in sorted((package / sub).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _model_tokenizer(loaded):
    """The ModelTokenizer of a loaded checkpoint, None for a preset or a checkpoint whose vocabulary cannot be built."""
    from vktrain.serialization.tokenizer import TokenizerError

    if loaded is None:
        return None
    try:
        return loaded.tokenizer.build()
    except TokenizerError:
        return None


def _build_model(args):
    """(LlamaForCausalLM with q4gsw bases and, with --adapters, the loaded adapters; tokenizer info; fingerprint)."""
    from vktrain.train.model_options import parse_model_args, quantization_importance
    from vktrain.lora import LoRAConfig, apply_lora, load_adapters
    from vktrain.models import open_model
    from vktrain.serialization.peft_adapters import load_adapter_config
    from vktrain.train.adapters import peft_target_patterns

    from vktrain.models.llama import LlamaForCausalLM

    model, loaded = open_model(args.model, **parse_model_args(args.model_arg))
    if not isinstance(model, LlamaForCausalLM):
        raise GenerateUsageError(f"--model {args.model} is not a Llama-family language model ({type(model).__name__}); "
                                 f"generate runs one with a KV cache: tiny-llama, a Hugging Face Llama/Qwen2/Qwen3 "
                                 f"directory or a .gguf")
    if loaded is None:
        tokenizer, fingerprint = None, args.model
    else:
        print(f"loaded {args.model}: {loaded.describe()}")
        tokenizer, fingerprint = loaded.tokenizer, _files_fingerprint(loaded.path)
    if args.adapters:
        config = load_adapter_config(args.adapters)
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise GenerateUsageError(f"{args.adapters}: adapters with per-module ranks or alphas (rank_pattern / "
                                     f"alpha_pattern) are not supported")
        lora = LoRAConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                          targets=tuple(peft_target_patterns(config["target_modules"])), group_size=args.group_size,
                          scale_rule=args.scale_rule)
    else:  # the q4gsw base alone: every linear but the head, adapters disabled at export
        lora = LoRAConfig(rank=1, group_size=args.group_size, scale_rule=args.scale_rule)
    importance, calibration = quantization_importance(args, model, _model_tokenizer(loaded))
    print(f"q4gsw base: {args.scale_rule} scales, {calibration}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, lora, importance)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    if args.adapters:
        loaded_layers = load_adapters(model, args.adapters)
        print(f"adapters from {args.adapters}: {len(loaded_layers)} layer(s), rank {lora.rank}, alpha {lora.alpha:g}")
    return model, tokenizer, fingerprint


def kv_cache_length(args, model) -> int:
    """The KV-cache positions of the program: --cache-length, default min(max_seq_len, 512)."""
    return args.cache_length or min(model.config.max_seq_len, 512)


def check_cache_fits(args, model, prompt: list[int]) -> None:
    """The prompt and the new tokens fit the cache (refused before the export, naming the flags)."""
    needed, length = len(prompt) + args.max_new_tokens, kv_cache_length(args, model)
    if args.max_new_tokens < 1:
        raise GenerateUsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if needed > length:
        limit = model.config.max_seq_len
        flag = "--cache-length" if args.cache_length else "the default --cache-length"
        way_out = (f"pass --cache-length {needed} or more (up to the model's max_seq_len, {limit})" if needed <= limit
                   else f"the model's max_seq_len is {limit}: pass at most --max-new-tokens {limit - len(prompt)} "
                        f"with --cache-length {limit}")
        raise GenerateUsageError(f"{len(prompt)} prompt tokens + --max-new-tokens {args.max_new_tokens} need {needed} "
                                 f"KV-cache positions; {flag} is {length}: {way_out}")


def _program(args, model, fingerprint) -> bytes:
    args.cache_length = cache_length = kv_cache_length(args, model)
    cached = None
    if args.program_cache:
        cached = Path(args.program_cache) / f"{program_key(args, fingerprint)}.pte"
        if cached.is_file():
            print(f"program from the cache: {cached}")
            return cached.read_bytes()
    from vktrain.export.decode import export_generation, lower_generation

    pte = lower_generation(export_generation(model, min(args.prefill_length, cache_length), cache_length,
                                             with_adapters=bool(args.adapters)))
    if cached is not None:
        from vktrain.train.checkpoint import atomic_write_bytes

        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, pte)
        print(f"program cached: {cached}")
    return pte


@with_device_profile
def run_generate(args: argparse.Namespace) -> int:
    from vktrain.generate.runner import GenerationRunner
    from vktrain.generate.sampling import Sampler
    from vktrain.generate.text import TokenizerError, codec_for
    from vktrain.serialization.pte import PteFile

    sampler = Sampler(args.temperature, args.top_p, args.seed)  # settings refused before the slow export
    check_outputs([Output("--json", args.json, GENERATION), Output("--program-cache", args.program_cache, PROGRAM_CACHE)],
                  inputs=[("--model", args.model), ("--adapters", args.adapters),
                          ("--calibration-data", args.calibration_data)], overwrite=args.overwrite)
    model, tokenizer, fingerprint = _build_model(args)
    try:
        codec = codec_for(tokenizer, model.config.vocab_size)
    except TokenizerError:
        if args.prompt_ids is None:
            raise
        codec = None
    prompt = _prompt_ids(args, codec)
    check_cache_fits(args, model, prompt)
    pte = PteFile.from_bytes(_program(args, model, fingerprint), source=f"the generation program of {args.model}")
    with GenerationRunner(pte, runtime=args.runtime, max_binding_bytes=max_binding_bytes(args)) as runner:
        result = runner.generate(prompt, args.max_new_tokens, sampler, codec.stop_ids if codec else ())
    text = codec.decode(result.tokens) if codec else None
    print(text if text is not None else " ".join(map(str, result.tokens)))
    print(f"{len(result.tokens)} token(s) in {result.prefill_seconds + result.decode_seconds:.2f} s: "
          f"{result.tokens_per_s:.2f} tokens/s (prefill of {len(prompt)} token(s) {result.prefill_seconds:.2f} s)")
    if args.json:
        from vktrain.train.checkpoint import atomic_write_bytes

        record = {"prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": text,
                  "tokens_per_s": result.tokens_per_s}
        atomic_write_bytes(Path(args.json), json.dumps(record, indent=2).encode())
    return 0

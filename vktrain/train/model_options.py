"""The model and quantization flags `vktrain export` and `vktrain generate` share: both must build the same
frozen base from the same flags. torch is imported only inside the functions that calibrate."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vktrain.errors import VktrainError
from vktrain.quant.q4gsw import SCALE_RULES  # numpy only

DEFAULT_CALIBRATION_TOKENS = 1024


class UsageError(VktrainError, ValueError):
    """A command-line argument that cannot be parsed (beyond what argparse checks)."""


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """How the frozen base is quantized: `export` and `generate` must build the same base from the same flags."""
    parser.add_argument("--scale-rule", choices=SCALE_RULES, default="mse",
                        help="q4gsw scale rule of the frozen base: mse (default: per-group least squared error) or "
                             "absmax (absmax/7); GGUF Q4_0 weights keep their own codes and scales")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--calibration-data", default="auto", metavar="FILE|auto|none",
                        help="data whose activations weight the mse scale search (imatrix): auto (default) is the "
                             "built-in corpus for a pretrained model with a tokenizer, none for the built-in models")
    parser.add_argument("--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, metavar="N")


def quantization_importance(args: argparse.Namespace, model, tokenizer) -> tuple[dict | None, str]:
    """(importance per layer or None, a line saying what calibrated the base) for apply_lora."""
    from vktrain.data import DEFAULT_CORPUS

    source = args.calibration_data
    if source == "auto":
        source = str(DEFAULT_CORPUS) if tokenizer is not None and args.scale_rule == "mse" else "none"
    if source == "none":
        return None, "no calibration"
    if args.scale_rule != "mse":
        raise UsageError(f"--calibration-data weights the mse scale rule; --scale-rule is {args.scale_rule}")
    from vktrain.lora.calibration import input_importance

    tokens = calibration_tokens(source, model.config.vocab_size, tokenizer, args.calibration_tokens)
    return input_importance(model, tokens), f"calibrated on {tokens.size} tokens of {Path(source).name}"


def parse_model_args(items: list[str]) -> dict:
    """KEY=VALUE strings -> config overrides; values parse as JSON when they can (ints, floats, bools)."""
    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def calibration_tokens(path, vocab_size: int, tokenizer, count: int) -> np.ndarray:
    """The first `count` tokens of a data file (any format `vktrain train --data` reads: text and chat JSONL
    through the model's tokenizer, .npy ids), e.g. the built-in corpus."""
    from vktrain.lora.calibration import CalibrationError
    from vktrain.train.data import load_data

    if count < 2:
        raise CalibrationError(f"--calibration-tokens must be at least 2, got {count}")
    tokens = load_data(path, vocab_size, tokenizer).tokens[:count]
    if tokens.size < count:
        raise CalibrationError(f"calibration data {path} gives {tokens.size} tokens, fewer than the {count} asked for")
    return tokens

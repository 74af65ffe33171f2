"""Held-out loss of a pretrained model's float base against its q4gsw (4-bit) base, per scale rule.

    .venv/bin/python scripts/quant_quality.py [--model FILE.gguf|HF_DIR] [--tokens 8192] [--out JSON]

The float base is the checkpoint's weights as loaded (for a GGUF: its dequantized tensors). Each q4gsw
base re-quantizes every linear that `vktrain export` would freeze (all-linear: never the output head) with
one scale rule, exactly as export does (vktrain.lora.layers.LoRAQ4Linear), and runs the same eager forward.
Held-out text: the tail of the built-in corpus, tokenized by the model's own tokenizer, in windows of --seq
tokens; the imatrix variant's calibration tokens (vktrain.lora.calibration) come just before it. Prints the figures and writes them as JSON (default
bench/results/quant_quality_cpu_<model>.json).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vktrain.data import DEFAULT_CORPUS
from vktrain.lora.inject import output_head_paths
from vktrain.lora.calibration import input_importance
from vktrain.lora.layers import LoRAQ4Linear
from vktrain.models import load
from vktrain.models.bundled import bundled_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_results import default_out, out_error  # noqa: E402

# (name, scale rule, weighted by calibration importance); rule None: the float base.
VARIANTS = [("float", None, False), ("q4gsw-absmax", "absmax", False), ("q4gsw-mse", "mse", False),
            ("q4gsw-mse-imatrix", "mse", True)]


def corpus_tokens(tokenizer, n_tokens: int) -> np.ndarray:
    """The last n_tokens of the built-in corpus under the model's own tokenizer."""
    ids = tokenizer.encode(DEFAULT_CORPUS.read_text(encoding="utf-8")[-8 * n_tokens:])
    if len(ids) < n_tokens:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than asked for ({n_tokens})")
    return np.asarray(ids[-n_tokens:], dtype=np.int64)


@torch.no_grad()
def mean_loss(model: nn.Module, tokens: np.ndarray, seq: int) -> float:
    windows = torch.from_numpy(tokens[: len(tokens) // seq * seq].reshape(-1, seq))
    total, count = 0.0, 0
    for row in windows:
        logits = model(row[None])[0, :-1].double()
        total += float(nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
        count += seq - 1
    return total / count


def frozen_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears `vktrain export` freezes as q4gsw by default (all-linear: never the output head)."""
    heads = output_head_paths(model)
    return {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear) and path not in heads}


def quantize_linears(model: nn.Module, group_size: int, rule: str,
                     importance: dict[str, np.ndarray] | None = None) -> float:
    """Replace each frozen linear's weight by its q4gsw dequantization in place; returns the relative
    squared error of all replaced weights together."""
    err, ref = 0.0, 0.0
    for path, module in frozen_linears(model).items():
        q4 = LoRAQ4Linear.from_linear(module, 1, 1.0, group_size, None, scale_rule=rule,
                                      importance=None if importance is None else importance[path])
        deq = q4.dequantized_weight().to(module.weight.dtype)
        weight = module.weight.detach()
        err += float((deq.double() - weight.double()).square().sum())
        ref += float(weight.double().square().sum())
        module.weight.data = deq
    return err / ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF or HF dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calibration-tokens", type=int, default=4096,
                        help="tokens before the held-out ones whose activations weight the 'mse' search")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if out_error(args.out):
        parser.error(out_error(args.out))
    model_path = args.model or bundled_checkpoint("smollm2-135m-instruct")
    out = args.out or default_out("quant_quality", "cpu", model_path)
    if out is None:
        parser.error(f"--model {args.model}: no bench/results name for this model; pass --out")
    loaded = load(model_path)
    model = loaded.model.float().eval()
    tokens = corpus_tokens(loaded.tokenizer.build(), args.tokens + args.calibration_tokens)
    calibration, tokens = tokens[:args.calibration_tokens], tokens[args.calibration_tokens:]
    float_weights = {path: m.weight.detach().clone() for path, m in frozen_linears(model).items()}
    importance = input_importance(model, calibration, args.seq)
    rows = {}
    for name, rule, weighted in VARIANTS:
        start = time.perf_counter()
        for path, module in frozen_linears(model).items():
            module.weight.data = float_weights[path].clone()
        rel_sq_err = quantize_linears(model, args.group_size, rule, importance if weighted else None) if rule else 0.0
        loss = mean_loss(model, tokens, args.seq)
        rows[name] = {"loss": loss, "perplexity": math.exp(loss), "relative_squared_weight_error": rel_sq_err}
        print(f"{name:>16}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}), "
              f"weight rel. sq. error {rel_sq_err:.5f}  [{time.perf_counter() - start:.0f} s]", flush=True)
    gaps = {name: rows[name]["loss"] - rows["float"]["loss"] for name, rule, _ in VARIANTS if rule}
    for name, gap in gaps.items():
        print(f"gap to float, {name}: {gap:+.4f}" + (f" ({gap / gaps['q4gsw-absmax']:.0%} of absmax's)"
                                                      if gaps["q4gsw-absmax"] > 0 else ""))
    out.write_text(json.dumps({"model": model_path.name, "group_size": args.group_size, "tokens": int(len(tokens)),
                               "seq": args.seq, "heldout": f"tail of {DEFAULT_CORPUS.name}",
                               "calibration_tokens": args.calibration_tokens,
                               "results": rows, "gap_to_float": gaps}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

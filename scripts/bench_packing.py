#!/usr/bin/env python
"""Benchmark document-masked packing against padding each chat to the window, on the bundled chats.

    python scripts/bench_packing.py export --shape 4x512      # here (needs executorch): SmolLM2-135M-Instruct
                                                              #   bench/packing_documents_4x512.pte (--packing
                                                              #   documents) and bench/packing_none_4x512.pte
    python3 scripts/bench_packing.py run bench/packing_documents_4x512.pte bench/packing_none_4x512.pte \
        --steps 20 --out bench/results/packing_<machine>_smollm2-135m.json  # on the GPU machine

run: the bundled unit-conversion chats (vktrain/data/unit_conversions.train.jsonl), tokenized with the .pte's
tokenizer and chat template, trained two ways on one device:
  * packed: the --packing documents step on TokenBatcher windows with the chats' boundaries (several
    chats a row, attention within each, positions restarting at each chat);
  * padded: the plain step with one chat per row, padded to the window (labels -100 past the chat;
    chats longer than S + 1 tokens truncated, counted in the JSON).
Each: `--warmup` steps, then `--steps` steps timed by the wall clock (TrainingRunner.step, as bench_train.py's
"step alone"). Reported: ms per step, trained tokens (assistant targets) per second, and the figure,
packed / padded trained tokens/s. Both programs have the same shape, so the
step times differ only by the DOCUMENTS attention kernels (and their tile skipping) against the plain
ones (with --precision auto, fp16-tc attention where the GPU has tensor cores: the packed step's attention
stays fp32, kernels/coopmat_attention.py has no DOCUMENTS variant).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
CHATS = REPO_ROOT / "vktrain" / "data" / "unit_conversions.train.jsonl"
MODEL = "smollm2-135m-instruct"


def parse_shape(text: str) -> tuple[int, int]:
    batch, sep, seq = text.partition("x")
    if not (sep and batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BATCHxSEQ with positive integers (e.g. 4x512)")
    return int(batch), int(seq)


def export(args) -> None:
    from vktrain.cli import main

    batch, seq = args.shape
    for packing in ("documents", "none"):
        out = Path(args.out_dir) / f"packing_{packing}_{batch}x{seq}.pte"
        code = main(["export", "--model", args.model, "--lora-rank", "16", "--lora-alpha", str(args.lora_alpha),
                     "--batch", str(batch), "--seq", str(seq), "--packing", packing, "--calibration-data", "none",
                     "--target", "none", "--out", str(out), "--overwrite"])  # planned at load on the GPU machine
        if code:
            sys.exit(code)


def padded_batches(data, batch: int, seq: int):
    """(token_ids, labels) batches of one chat per row padded to the window, and how many were truncated."""
    bounds = list(data.starts) + [data.tokens.size]
    rows, truncated = [], 0
    labels_stream = data.labels if data.labels is not None else data.tokens
    for start, chat_end in zip(bounds[:-1], bounds[1:]):
        end = min(chat_end, start + seq + 1)
        truncated += int(chat_end > end)
        tokens = np.zeros(seq + 1, np.int64)
        labels = np.full(seq + 1, -100, np.int64)
        tokens[:end - start] = data.tokens[start:end]
        labels[:end - start] = labels_stream[start:end]
        rows.append((tokens[:-1], labels[1:]))
    batches = [(np.stack([r[0] for r in rows[i:i + batch]]), np.stack([r[1] for r in rows[i:i + batch]]))
               for i in range(0, len(rows) - batch + 1, batch)]
    return batches, int(truncated), len(rows)


def timed(runner, batches, steps: int, warmup: int, hparams) -> dict:
    for i in range(warmup):
        runner.step(*batches[i % len(batches)][:2], hparams, **_positions(batches[i % len(batches)]))
    trained, seconds = 0, []
    for i in range(steps):
        batch = batches[(warmup + i) % len(batches)]
        started = time.perf_counter()
        runner.step(*batch[:2], hparams, **_positions(batch))
        seconds.append(time.perf_counter() - started)
        trained += int(np.count_nonzero(batch[1] >= 0))
    total = sum(seconds)
    return {"step_ms_median": 1e3 * statistics.median(seconds), "seconds": total, "steps": steps,
            "trained_tokens": trained, "trained_tokens_per_s": trained / total}


def _positions(batch) -> dict:
    return {"positions": batch[2]} if len(batch) > 2 else {}


def run(args) -> dict:
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.serialization.tokenizer import program_tokenizer
    from vktrain.train.data import TokenBatcher, load_data

    hparams = np.array([1e-4, 0.9, 0.999, 1e-8, 0.0], np.float32)
    results = {"meta": {"host": platform.node(), "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "chats": str(CHATS.relative_to(REPO_ROOT)), "steps": args.steps, "warmup": args.warmup}}
    for path in (args.packed, args.padded):
        with TrainingRunner.from_pte(path, planner=plan_schedule, precision=args.precision) as runner:
            batch, seq = runner.batch_shape
            data = load_data(CHATS, runner.vocab_size, program_tokenizer(runner, str(path)))
            results["meta"].setdefault("device", runner.device.name if hasattr(runner.device, "name") else "")
            if runner.takes_positions:
                batcher = TokenBatcher(data.tokens, batch, seq, shuffle=False, labels=data.labels,
                                       documents=data.starts)
                batches = [batcher.batch(p) for p in range(int(batcher.batches_per_epoch))]
                entry = timed(runner, batches, args.steps, args.warmup, hparams)
                results["packed"] = {"pte": str(path), "shape": [batch, seq], **entry}
            else:
                batches, truncated, chats = padded_batches(data, batch, seq)
                entry = timed(runner, batches, args.steps, args.warmup, hparams)
                results["padded"] = {"pte": str(path), "shape": [batch, seq], "truncated_chats": truncated,
                                     "chats": chats, **entry}
    if "packed" not in results or "padded" not in results:
        sys.exit("give one .pte exported with --packing documents and one without")
    results["packed_over_padded_trained_tokens_per_s"] = (results["packed"]["trained_tokens_per_s"]
                                                          / results["padded"]["trained_tokens_per_s"])
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="write the packed and the plain step (needs executorch)")
    exporting.add_argument("--model", default=MODEL)
    exporting.add_argument("--shape", type=parse_shape, default=(4, 512))
    exporting.add_argument("--out-dir", default=str(REPO_ROOT / "bench"))
    exporting.add_argument("--lora-alpha", type=float, default=16.0)
    running = commands.add_parser("run", help="time both on this machine's device")
    running.add_argument("packed", help="the .pte exported with --packing documents")
    running.add_argument("padded", help="the .pte exported without (--packing none)")
    running.add_argument("--steps", type=int, default=20)
    running.add_argument("--warmup", type=int, default=3)
    running.add_argument("--precision", default="auto")
    running.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    export(args) if args.command == "export" else run(args)


if __name__ == "__main__":
    main()

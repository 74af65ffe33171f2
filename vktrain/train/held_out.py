"""Held-out loss of a token model's training step: the batches and their mean loss (`vktrain eval`,
`vktrain train --eval-data`, the fleet's evaluation).

Held-out batches (`eval_batches`) cover every next-token target of the stream exactly once: rows of S
targets start every S tokens (row r predicts tokens r*S + 1 .. r*S + S from the S before), the last row
takes what is left, and rows of the last batch that the data does not fill are padding. Padding is label
-100 (ignored): the loss is the cross-entropy summed over every real target divided by their number,
`tokens` in the report.

A step exported with packed documents (runner.takes_positions) gets each row's positions from the data's
document starts, and a document's first token is no target, as in training (vktrain/train/data.py).
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from vktrain.train.data import IGNORED_LABEL, DataError, TrainingData, document_labels, document_positions
from vktrain.train.train_loop import TrainConfigError


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


def prepare_eval_batches(data: TrainingData, batch_shape: tuple[int, int], max_batches: int | None = None,
                         documents: bool = False) -> list[tuple[np.ndarray, ...]]:
    """The batches `evaluate_batches` runs: eval_batches of `data` (the first `max_batches`), those with a
    target. Made once for a run's every eval (vktrain train --eval-every). `documents` (a packed-documents
    step) and data with document starts: (token_ids, labels, positions) batches."""
    batches = []
    packed = documents and data.starts is not None
    label_stream = document_labels(data.tokens, data.labels, data.starts) if packed else data.labels
    batch_size, seq_len = batch_shape
    for index, (token_ids, labels) in enumerate(eval_batches(data.tokens, *batch_shape, label_stream)):
        if max_batches is not None and index >= max_batches:
            break
        if not (labels >= 0).any():  # nothing to count (e.g. a batch of prompt tokens only)
            continue
        if packed:
            offsets = (index * batch_size + np.arange(batch_size))[:, None] * seq_len + np.arange(seq_len)[None, :]
            batches.append((token_ids, labels, document_positions(data.starts, offsets)))
        else:
            batches.append((token_ids, labels))
    if not batches:
        raise DataError("the held-out data has no target token (every label is ignored)")
    return batches


def evaluate_batches(runner, batches: list[tuple[np.ndarray, ...]]) -> dict:
    """{"loss", "perplexity", "tokens"} of `runner`'s current adapters on prepared batches: the mean over
    every target, `tokens` of them."""
    total, count = 0.0, 0
    for batch in batches:
        loss_sum, n = runner.evaluate(*batch[:2], **({"positions": batch[2]} if len(batch) > 2 else {}))
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
    return evaluate_batches(runner, prepare_eval_batches(data, runner.batch_shape, max_batches,
                                                         getattr(runner, "takes_positions", False)))

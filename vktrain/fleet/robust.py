"""Robust aggregation: every client update is screened before it is aggregated, and the aggregators of
`vktrain federate --aggregation mean|median|trimmed-mean[:FRACTION]` (numpy, torch-free).

Screening (`screen_updates`), in this order, a reply being dropped at the first check it fails:
  1. its tensors: exactly the global adapters' names, each with the global tensor's shape and dtype;
  2. all finite (no NaN or inf), and its weight (`num-examples`) and training loss finite, weight > 0;
  3. its update norm ||client - global|| (L2 over all its tensors, float64) at most `max_norm_ratio`
     times the round's median update norm over the replies that passed 1 and 2 (the lower middle one
     for an even count, so that one huge update of two does not set its own bound).
A dropped update is left out of the round as a failed client is; the round goes on with the others.

Aggregators, over the accepted clients in partition order (the same inputs give the same bits):
  mean          the `num-examples`-weighted mean (FedAvg), accumulated in float64, rounded once to the
                global tensors' dtype;
  median        the coordinate-wise median (unweighted, as Flower's FedMedian);
  trimmed-mean  per coordinate, drop the floor(FRACTION * n) smallest and largest values and average the
                rest (unweighted, scipy's trim_mean; FRACTION in [0, 0.5), default 0.2).
With FFA-LoRA (lora_B alone) every aggregator gives one global B for the shared, frozen A: B A stays the
product of the global tensors, so the global model is exactly the aggregated one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional

import numpy as np

from vktrain.errors import VktrainError

MEAN, MEDIAN, TRIMMED_MEAN = "mean", "median", "trimmed-mean"
AGGREGATIONS = (MEAN, MEDIAN, TRIMMED_MEAN)
DEFAULT_TRIM_FRACTION = 0.2
# An honest client's update norm varies with its data and shard size by small factors; 10x the median
# is far outside that and far inside a poisoned (1e3..1e6x) update.
DEFAULT_MAX_NORM_RATIO = 10.0


class AggregationError(VktrainError, ValueError):
    """A bad --aggregation or --max-update-norm-ratio."""


@dataclass(frozen=True)
class Aggregation:
    kind: str = MEAN
    trim_fraction: float = 0.0  # trimmed-mean only

    @classmethod
    def parse(cls, text: str) -> "Aggregation":
        kind, sep, value = text.partition(":")
        if kind in (MEAN, MEDIAN) and not sep:
            return cls(kind)
        if kind == TRIMMED_MEAN:
            try:
                fraction = float(value) if sep else DEFAULT_TRIM_FRACTION
            except ValueError:
                fraction = math.nan
            if not 0.0 <= fraction < 0.5:
                raise AggregationError(f"--aggregation {text}: the trimmed fraction must lie in [0, 0.5), got {value!r}")
            return cls(kind, fraction)
        raise AggregationError(f"--aggregation expects mean, median or trimmed-mean[:FRACTION], got {text!r}")

    def __str__(self) -> str:
        return f"{TRIMMED_MEAN}:{self.trim_fraction:g}" if self.kind == TRIMMED_MEAN else self.kind

    def trimmed(self, n: int) -> int:
        """How many values each end of a coordinate loses among n clients."""
        return int(self.trim_fraction * n) if self.kind == TRIMMED_MEAN else 0

    def combine(self, updates: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
        """The aggregate of `updates` (same names, shapes and dtypes, checked by `screen_updates`)."""
        if not updates:
            raise ValueError("nothing to aggregate")
        result = {}
        for name, first in updates[0].items():
            tensors = [update[name] for update in updates]
            if self.kind == MEAN:
                result[name] = weighted_mean(tensors, weights).astype(first.dtype)
                continue
            stack = np.stack(tensors).astype(np.float64)
            if self.kind == MEDIAN:
                value = np.median(stack, axis=0)
            else:
                cut = self.trimmed(len(updates))
                value = np.sort(stack, axis=0)[cut:len(updates) - cut].mean(axis=0)
            result[name] = value.astype(first.dtype)
        return result


def weighted_mean(tensors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum_k w_k x_k / sum_k w_k in float64: the bits of `(stack * w).sum(axis=0) / w.sum()` over the float64
    stack of the tensors, without the stack (n float64 copies of the adapters: 1 GB for 50 SmolLM2-135M
    clients). numpy sums a stack's axis 0 one tensor after another into a zeroed float64 total, as here,
    except for one-element tensors, whose stack it sums pairwise (a 1-D reduction): those go through it."""
    w = np.asarray(weights, dtype=np.float64)
    if tensors[0].size == 1:
        stack = np.stack(tensors).astype(np.float64)
        return (stack * w.reshape((-1,) + (1,) * tensors[0].ndim)).sum(axis=0) / w.sum()
    total = np.zeros(tensors[0].shape, np.float64)
    term = np.empty_like(total)
    for tensor, weight in zip(tensors, w):
        total += np.multiply(tensor, weight, out=term, dtype=np.float64)
    return total / w.sum()


def parse_norm_ratio(value: str) -> Optional[float]:
    """--max-update-norm-ratio: a number >= 1, or `inf`/`off` (no norm bound; None)."""
    if value.lower() in ("inf", "off", "none"):
        return None
    try:
        ratio = float(value)
    except ValueError:
        ratio = math.nan
    if not (math.isfinite(ratio) and ratio >= 1.0):
        raise AggregationError(f"--max-update-norm-ratio expects a number >= 1 (or inf), got {value!r}")
    return ratio


def update_norm(arrays: dict[str, np.ndarray], global_arrays: dict[str, np.ndarray]) -> float:
    """||client - global||, each tensor's squares summed in float64 (one temporary a tensor)."""
    total = 0.0
    for name, global_array in global_arrays.items():
        delta = np.subtract(arrays[name], global_array, dtype=np.float64)
        total += float(np.sum(np.square(delta, out=delta)))
    return math.sqrt(total)


def _shape_problem(arrays: dict[str, np.ndarray], global_arrays: dict[str, np.ndarray]) -> Optional[str]:
    missing, extra = sorted(set(global_arrays) - set(arrays)), sorted(set(arrays) - set(global_arrays))
    if missing or extra:
        return (f"tensor names differ from the global adapters' (missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})")
    for name, expected in global_arrays.items():
        got = arrays[name]
        if got.shape != expected.shape or got.dtype != expected.dtype:
            return f"{name} is {got.dtype}{list(got.shape)}, the global tensor {expected.dtype}{list(expected.shape)}"
    return None


def _value_problem(arrays: dict[str, np.ndarray], weight: float, loss: float, finite_norm: bool) -> Optional[str]:
    """finite_norm: the update's norm against finite global tensors is finite, so every value is (a NaN or
    an inf makes the norm NaN or inf) and the tensors need not be searched for one."""
    for name, array in () if finite_norm else arrays.items():
        if not np.all(np.isfinite(array)):
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            return f"{name} holds {bad} non-finite value(s)"
    if not (math.isfinite(weight) and weight > 0):
        return f"num-examples must be a positive number, got {weight}"
    if not math.isfinite(loss):
        return f"non-finite train-loss {loss}"
    return None


@dataclass
class Screened:
    accepted: list  # keys of the accepted updates, in the order given
    dropped: dict  # key -> reason
    norms: dict  # key -> update norm (the replies that reached the norm check)
    median_norm: Optional[float]


def screen_updates(updates: dict[Hashable, tuple[dict[str, np.ndarray], float, float]],
                   global_arrays: dict[str, np.ndarray], max_norm_ratio: Optional[float]) -> Screened:
    """updates: key -> (arrays, weight, train loss), in aggregation order. See the module docstring."""
    dropped, norms = {}, {}
    globals_finite = all(np.all(np.isfinite(array)) for array in global_arrays.values())
    for key, (arrays, weight, loss) in updates.items():
        problem = _shape_problem(arrays, global_arrays)
        if problem is None:
            norm = update_norm(arrays, global_arrays)
            problem = _value_problem(arrays, weight, loss, globals_finite and math.isfinite(norm))
        if problem:
            dropped[key] = problem
        else:
            norms[key] = norm
    median = None
    if norms:
        ordered = sorted(norms.values())
        median = ordered[(len(ordered) - 1) // 2]  # the lower middle
    if max_norm_ratio is not None and median is not None:
        bound = max_norm_ratio * median
        for key, norm in norms.items():
            if norm > bound:
                dropped[key] = (f"update norm {norm:.4g} exceeds {max_norm_ratio:g} x the round's median update "
                                f"norm {median:.4g}")
    accepted = [key for key in updates if key not in dropped]
    return Screened(accepted, dropped, norms, median)


__all__ = ["AGGREGATIONS", "Aggregation", "AggregationError", "DEFAULT_MAX_NORM_RATIO", "DEFAULT_TRIM_FRACTION",
           "MEAN", "MEDIAN", "Screened", "TRIMMED_MEAN", "parse_norm_ratio", "screen_updates", "update_norm",
           "weighted_mean"]

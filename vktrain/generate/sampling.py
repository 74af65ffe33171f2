"""Choosing the next token from logits, on the host in numpy.

Greedy (temperature 0): argmax, ties broken by the lowest id (numpy's argmax returns the first maximum).
Sampling: softmax(logits / temperature) in float64, cut to the top-p nucleus (the fewest most likely
tokens whose probability reaches top_p; ties in probability ordered by id), renormalised, drawn with a
seeded numpy Generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vktrain.errors import VktrainError


class SamplingError(VktrainError, ValueError):
    """A sampling setting out of range."""


@dataclass
class Sampler:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        order = np.lexsort((np.arange(probs.size), -probs))  # most likely first, ties by lower id
        cumulative = np.cumsum(probs[order])
        kept = order[:int(np.searchsorted(cumulative, self.top_p * cumulative[-1])) + 1]
        return int(self._rng.choice(kept, p=probs[kept] / probs[kept].sum()))

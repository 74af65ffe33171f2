"""Learning-rate schedules: a pure function of the step number.

Steps are numbered t = 1, 2, ..., total_steps (t is the step being taken, like AdamW's t). With
W = warmup_steps, peak = base_lr and floor = base_lr * min_lr_ratio:
  warmup (t <= W)     lr = peak * t / W                 (linear; reaches the peak at t = W)
  constant (t > W)    lr = peak
  cosine (t > W)      lr = floor + (peak - floor) * (1 + cos(pi * p)) / 2,   p = min(1, (t - W) / (T + 1 - W))
                      (continuing from the peak at t = W; the floor is reached at t = T + 1, after the
                      last step, so the last step still trains (with floor 0 it would train nothing);
                      held there for t > T)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from vktrain.errors import VktrainError

SCHEDULES = ("constant", "cosine")


class ScheduleError(VktrainError, ValueError):
    """Learning-rate schedule settings that cannot work."""


@dataclass(frozen=True)
class LRSchedule:
    kind: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ScheduleError(f"LR schedule must be one of {SCHEDULES}, got {self.kind!r}")
        lr32 = np.float32(self.base_lr)  # what the program receives
        if not (np.isfinite(lr32) and lr32 > 0):
            raise ScheduleError(f"the learning rate must be a positive finite float32, got {self.base_lr!r} "
                                f"(float32: {float(lr32)!r})")
        if self.total_steps <= 0:
            raise ScheduleError(f"the number of steps must be positive, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ScheduleError(f"warmup steps must be >= 0, got {self.warmup_steps}")
        if self.kind == "cosine" and self.warmup_steps >= self.total_steps:
            raise ScheduleError(f"cosine schedule: warmup ({self.warmup_steps} steps) must be shorter than the run "
                             f"({self.total_steps} steps), or there is nothing to decay")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ScheduleError(f"min LR ratio must lie in [0, 1], got {self.min_lr_ratio}")

    def lr(self, step: int) -> float:
        """The learning rate of step `step` (1-based)."""
        if step < 1:
            raise ScheduleError(f"steps are numbered from 1, got {step}")
        if step <= self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        floor = self.base_lr * self.min_lr_ratio
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps + 1 - self.warmup_steps))
        return floor + (self.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __call__(self, step: int) -> float:
        return self.lr(step)

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["LRSchedule", "SCHEDULES", "ScheduleError"]

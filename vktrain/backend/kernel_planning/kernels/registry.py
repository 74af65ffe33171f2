"""The kernel registry: op key -> plan function.

A kernel family module (`vktrain/backend/kernel_planning/kernels/<family>.py`) decorates each plan function with
`@register_kernel("<namespace>.<name>.<overload>")`, the op's key in every registry (op definitions,
partitioner, lowerings, the blob's op names). A plan function turns shapes (and buffer handles) into a list of
`Dispatch` records (vktrain/runtime/vk/schedule.py): data, not recorded commands.
"""
from __future__ import annotations

from typing import Callable

KERNELS: dict[str, Callable] = {}


def register_kernel(op_name: str) -> Callable[[Callable], Callable]:
    """Register `fn` as the plan function of `op_name` (e.g. "vktrain.linear_q4gsw.default"); one plan per op."""
    if not isinstance(op_name, str) or len(op_name.split(".")) != 3 or not all(op_name.split(".")):
        raise ValueError(f"op_name must be an op key '<namespace>.<name>.<overload>', got {op_name!r}")

    def decorate(fn: Callable) -> Callable:
        existing = KERNELS.get(op_name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"kernel for op {op_name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; cannot register "
                f"{fn.__module__}.{fn.__qualname__} as well")
        KERNELS[op_name] = fn
        return fn

    return decorate


def get_kernel(op_name: str) -> Callable:
    """The plan function of `op_name`; a clear KeyError listing the registered ops if absent."""
    try:
        return KERNELS[op_name]
    except KeyError:
        raise KeyError(f"no kernel registered for op {op_name!r}; registered: {sorted(KERNELS)}") from None

"""Memory planning for the delegate: tensors whose lifetimes do not overlap share one memory object.

Lifetimes are inclusive op-index intervals [first, last] over the op chain: an op's output is live from
the op that writes it to the last op that reads it, so an op's inputs and outputs always overlap (an
op never writes into the buffer it is reading). Greedy by size: the largest tensors are placed first,
each into the smallest existing object whose tensors are all dead during its interval, or a new object.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LiveInterval:
    value_id: int
    nbytes: int
    first: int  # index of the op that writes the tensor
    last: int   # index of the last op that reads it (>= first)

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.first < 0 or self.last < self.first:
            raise ValueError(f"invalid live interval {self}: need nbytes >= 0 and 0 <= first <= last")

    def overlaps(self, other: "LiveInterval") -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass
class MemoryPlan:
    assignment: dict[int, int]   # value id -> memory object id
    object_sizes: list[int]      # memory object id -> bytes

    @property
    def planned_bytes(self) -> int:
        return sum(self.object_sizes)


def plan_memory(intervals: list[LiveInterval]) -> MemoryPlan:
    """Assign every interval's tensor to a memory object; object sizes are the largest tensor each holds."""
    order = sorted(intervals, key=lambda t: (-t.nbytes, t.first, t.value_id))
    residents: list[list[LiveInterval]] = []
    sizes: list[int] = []
    assignment: dict[int, int] = {}
    for tensor in order:
        if tensor.value_id in assignment:
            raise ValueError(f"value {tensor.value_id} has more than one live interval")
        best = None
        for object_id, held in enumerate(residents):
            if any(tensor.overlaps(other) for other in held):
                continue
            # Objects are created largest-first, so every candidate already fits; take the smallest.
            if best is None or sizes[object_id] < sizes[best]:
                best = object_id
        if best is None:
            residents.append([])
            sizes.append(tensor.nbytes)
            best = len(sizes) - 1
        residents[best].append(tensor)
        assignment[tensor.value_id] = best
    return MemoryPlan(assignment, sizes)

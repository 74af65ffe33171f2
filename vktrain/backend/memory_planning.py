"""Memory planning for the delegate: tensors whose lifetimes do not overlap share one memory object.

Lifetimes are inclusive op-index intervals [first, last] over the op chain: an op's output is live from
the op that writes it to the last op that reads it, so an op's inputs and outputs always overlap (an
op never writes into the buffer it is reading). Greedy by size: the largest tensors are placed first,
each into the smallest existing object whose tensors are all dead during its interval, or a new object.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from vktrain.serialization import graph as vk

from .lifetimes import analyze_uses


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
    tensor_bytes: int = 0        # what the planned tensors would take with an allocation each

    @property
    def planned_bytes(self) -> int:
        return sum(self.object_sizes)


def plan_memory(intervals: list[LiveInterval]) -> MemoryPlan:
    """Assign every interval's tensor to a memory object; object sizes are the largest tensor each holds.

    An object's residents never overlap each other, so each object keeps them sorted by `first` (their
    `last`s are then sorted too) and a candidate is checked against its two neighbours only: O(log n)
    per object instead of a scan of every resident, which made a 30-layer model's step quadratic."""
    order = sorted(intervals, key=lambda t: (-t.nbytes, t.first, t.value_id))
    firsts: list[list[int]] = []  # per object: its residents' `first`, ascending
    lasts: list[list[int]] = []   # per object: the same residents' `last`, in the same order
    sizes: list[int] = []
    assignment: dict[int, int] = {}
    for tensor in order:
        if tensor.value_id in assignment:
            raise ValueError(f"value {tensor.value_id} has more than one live interval")
        best = None
        for object_id, size in enumerate(sizes):
            if best is not None and size >= sizes[best]:
                continue  # not smaller than the best free object so far
            at = bisect.bisect_left(firsts[object_id], tensor.first)
            if at > 0 and lasts[object_id][at - 1] >= tensor.first:
                continue  # the resident starting before it is still live when it starts
            if at < len(firsts[object_id]) and firsts[object_id][at] <= tensor.last:
                continue  # a resident starts while it is live
            best = object_id
        if best is None:
            firsts.append([])
            lasts.append([])
            sizes.append(tensor.nbytes)
            best = len(sizes) - 1
        at = bisect.bisect_left(firsts[best], tensor.first)
        firsts[best].insert(at, tensor.first)
        lasts[best].insert(at, tensor.last)
        assignment[tensor.value_id] = best
    return MemoryPlan(assignment, sizes, sum(t.nbytes for t in intervals))


def _round4(nbytes: int) -> int:
    """Buffer bytes of a tensor: GPU kernels move 32-bit words, so storage is a whole number of them."""
    return max(4, -(-nbytes // 4) * 4)


def plan_graph_memory(graph: vk.VkGraph) -> MemoryPlan:
    """Place every op output with storage of its own into memory objects (after the passes: sizes are the
    stored bytes, lifetimes span every tensor sharing that storage, views and in-place outputs included),
    and record it in `graph`: each such tensor, and each tensor using its storage, gets the object's id at
    offset 0; every other tensor (inputs, constants, state and what uses their storage) gets none.
    Refuses a tensor that is read but that nothing provides."""
    uses = analyze_uses(graph)
    provided = set(graph.inputs) | {s.state_id for s in graph.mutable_state} | set(uses.producer)
    sharing: dict[int, list[int]] = {}
    for value_id in uses.readers:
        tensor = graph.values[value_id]
        if not isinstance(tensor, vk.TensorValue):
            continue
        if tensor.constant_id < 0 and value_id not in provided:
            raise vk.GraphError(f"value {value_id} ({tensor.name or 'unnamed'}) is read but nothing writes it: not an "
                                f"input, constant, mutable state or op output")
    for value_id in set(uses.producer) | set(uses.readers):
        tensor = graph.values[value_id]
        if isinstance(tensor, vk.TensorValue) and tensor.storage_of >= 0:
            sharing.setdefault(tensor.storage_of, []).append(value_id)
    intervals = []
    for value_id in sorted(uses.producer):
        tensor = graph.tensor(value_id)
        if tensor.storage_of >= 0:
            continue
        spans = [uses.lifetime(v) for v in [value_id] + sharing.get(value_id, [])]
        intervals.append(LiveInterval(value_id, _round4(tensor.stored_nbytes), min(s[0] for s in spans),
                                      max(s[1] for s in spans)))
    plan = plan_memory(intervals)
    object_of = {**plan.assignment, **{member: plan.assignment[root] for root, members in sharing.items()
                                        if root in plan.assignment for member in members}}
    for value_id, value in enumerate(graph.values):
        if isinstance(value, vk.TensorValue):
            graph.values[value_id] = replace(value, mem_obj_id=object_of.get(value_id, -1), mem_offset=0)
    graph.memory_objects = [vk.MemoryObject(i, size) for i, size in enumerate(plan.object_sizes)]
    return plan

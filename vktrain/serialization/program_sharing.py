"""Which tensors of a program's other methods bind the training step's buffers, known without a device.

A .pte's eval and accumulate methods bind the training step executor's buffers instead of allocating their
own (vktrain/runtime/program/evaluation.py, accumulation.py): the step's mutable state under the same name
(the adapters, grad_acc), and its named constants held byte for byte (the frozen base:
GraphExecutor.shared_state / constants_matching). Their schedules are planned with those tensors as
`shared` (planner.py), at the offsets the step's schedule places them; `vktrain export --target` plans
them here the same way, so the schedule embedded for a method equals the one planned at load.
"""
from __future__ import annotations

from dataclasses import dataclass

from vktrain.serialization import graph as g
from vktrain.serialization.schedule import Schedule


@dataclass(frozen=True)
class SharedRecord:
    """What the planner reads of a SharedTensor: the byte offset in the owner's buffer, and the owner's tensor."""

    offset: int
    tensor: g.TensorValue


def shared_from(owner: g.VkGraph, owner_schedule: Schedule, graph: g.VkGraph) -> dict[str, SharedRecord]:
    """Name -> SharedRecord of every tensor of `graph` bound to `owner`'s buffers (module docstring):
    `owner`'s state under a name `graph` has, then its named constants `graph` holds byte for byte (same
    name, shape, dtype, layout and stored dtype; a name the owner gives two constants is left out)."""
    offsets = {p.value_id: p.offset for p in owner_schedule.placements}
    names = {v.name for v in graph.values if isinstance(v, g.TensorValue) and v.name}
    shared = {}
    for state in owner.mutable_state:
        tensor = owner.tensor(state.state_id)
        if tensor.name and tensor.name in names:
            shared[tensor.name] = SharedRecord(offsets[state.state_id], tensor)
    owned: dict[str, list[int]] = {}
    for value_id, value in enumerate(owner.values):
        if isinstance(value, g.TensorValue) and value.constant_id >= 0 and value.name and value.storage_of < 0 \
                and value_id in offsets:
            owned.setdefault(value.name, []).append(value_id)
    for value in graph.values:
        if not (isinstance(value, g.TensorValue) and value.constant_id >= 0 and len(owned.get(value.name, ())) == 1):
            continue
        value_id = owned[value.name][0]
        mine = owner.tensor(value_id)
        if (mine.shape, mine.dtype, mine.layout, mine.storage_dtype) != \
                (value.shape, value.dtype, value.layout, value.storage_dtype):
            continue
        if g.same_stored_bytes(graph.constants[value.constant_id], owner.constants[mine.constant_id]):
            shared[value.name] = SharedRecord(offsets[value_id], mine)
    return shared


__all__ = ["SharedRecord", "shared_from"]

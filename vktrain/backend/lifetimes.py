"""Who writes and who reads every value of a VkGraph's op chain: the ONE lifetime analysis, shared by the
passes that need readers (views, in-place updates) and by memory planning."""
from __future__ import annotations

from dataclasses import dataclass

from vktrain.serialization import graph as vk


@dataclass(frozen=True)
class GraphUses:
    """`producer[v]`: index of the op writing v; `readers[v]`: op indices reading it, with len(ops) for
    values read after the step (graph outputs, state updates). A tensor list argument counts as a read
    of each of its tensors."""

    n_ops: int
    producer: dict[int, int]
    readers: dict[int, list[int]]

    @property
    def after_the_step(self) -> int:
        return self.n_ops

    def lifetime(self, value_id: int) -> tuple[int, int]:
        """Inclusive op-index interval [written, last read] (-1: before the first op, n_ops: after the
        last); an op's inputs and outputs always overlap, so an op never writes what it reads."""
        first = self.producer.get(value_id, -1)
        return first, max(self.readers.get(value_id, [first]) + [first])


def analyze_uses(graph: vk.VkGraph) -> GraphUses:
    """Producers and readers of the graph's current op chain. Refuses an op writing a value that is an
    input, mutable state or another op's output (the chain is functional)."""
    inputs = set(graph.inputs)
    states = {s.state_id for s in graph.mutable_state}
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for index, op in enumerate(graph.ops):
        for arg in op.args:
            value = graph.values[arg]
            for read in (value.items if isinstance(value, vk.ValueListValue) else (arg,)):
                readers.setdefault(read, []).append(index)
        for out in op.outputs:
            if out in producer or out in inputs or out in states:
                raise vk.GraphError(f"op {index} ({op.name}) writes value {out}, which is an input, mutable state "
                                    f"or another op's output")
            producer[out] = index
    for value_id in list(graph.outputs) + [s.update_id for s in graph.mutable_state]:
        readers.setdefault(value_id, []).append(len(graph.ops))
    return GraphUses(len(graph.ops), producer, readers)


def storage_root(graph: vk.VkGraph, value_id: int) -> int:
    """The value whose storage `value_id` uses (itself unless it is a view or an in-place output)."""
    tensor = graph.values[value_id]
    return tensor.storage_of if isinstance(tensor, vk.TensorValue) and tensor.storage_of >= 0 else value_id


def storage_sharers(graph: vk.VkGraph) -> dict[int, list[int]]:
    """Storage root -> the tensors using its storage (views and in-place outputs), in value order."""
    sharing: dict[int, list[int]] = {}
    for value_id, value in enumerate(graph.values):
        if isinstance(value, vk.TensorValue) and value.storage_of >= 0:
            sharing.setdefault(value.storage_of, []).append(value_id)
    return sharing

"""In-place optimizer updates: adamw updates (param, exp_avg, exp_avg_sq) in place on the GPU, so where an
output is the update of the very state it reads and nothing reads that state (or a view of it) later in
the step, the output is stored in the state's storage and no end-of-step copy is needed. Every other
state update is copied into its state at the end of the step (the executor records those copies); an
update order that would make those copies depend on each other is refused here."""
from __future__ import annotations

from dataclasses import replace

from vktrain.serialization import graph as vk

from ..lifetimes import analyze_uses, storage_root, storage_sharers

ADAMW = "vktrain.adamw.default"


def update_state_in_place(graph: vk.VkGraph) -> None:
    uses = analyze_uses(graph)
    update_of = {s.state_id: s.update_id for s in graph.mutable_state}
    sharing = storage_sharers(graph)
    for index, op in enumerate(graph.ops):
        if op.name != ADAMW or len(op.args) != 6 or len(op.outputs) != 3:
            continue
        others = {storage_root(graph, arg) for arg in op.args[3:]}  # grad, hparams, step
        for source, target in zip(op.args[:3], op.outputs):
            root = storage_root(graph, source)
            if update_of.get(source) != target or root in others:
                continue
            if any(reader > index for v in [root] + sharing.get(root, []) for reader in uses.readers.get(v, ())):
                continue  # the old value is still needed
            graph.values[target] = replace(graph.tensor(target), storage_of=root)
    check_state_copies(graph)


def check_state_copies(graph: vk.VkGraph) -> None:
    """The state updates not made in place are copies at the end of the step, in any order: none may read
    a state that is itself overwritten then, and no graph output may be such a state."""
    copied = [s for s in graph.mutable_state if storage_root(graph, s.update_id) != s.state_id]
    overwritten = {s.state_id for s in copied}
    for state in copied:
        if storage_root(graph, state.update_id) in overwritten:
            raise vk.GraphError(f"the update of state value {state.state_id} reads the storage of another state that "
                                f"is itself updated at the end of the step; the copy order would matter (unsupported)")
    for value_id in graph.outputs:
        if storage_root(graph, value_id) in overwritten:
            raise vk.GraphError(f"graph output value {value_id} is a mutable state tensor updated at the end of the "
                                f"step; return its update instead")

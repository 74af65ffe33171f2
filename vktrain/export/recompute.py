"""Activation checkpointing of a joint graph: the backward recomputes each decoder layer's forward instead of
reading activations kept from the forward (`vktrain export --activation-checkpointing`).

The joint graph (vktrain/export/training.py) runs the forward, then the backward, and the backward reads
the forward's intermediates, so every layer's activations stay live until that layer's backward: the
step's memory grows with layers x tokens. Here the decoder layers are cut into segments of N consecutive
layers; a segment's intermediates that its backward reads are computed again, by copies of the segment's
forward nodes placed just before the first backward node that reads one of them, and the backward reads
the copies. What stays live across the step is each segment's output (the next segment's input, the
residual stream); the memory planner (vktrain/backend/memory_planning.py) frees the originals after their
last forward reader, and a segment's copies after its backward.

Why the graph and not torch.utils.checkpoint in the model: torch.export inlines a checkpointed call, and the
joint graph it gives is the unchecked one (no op is recomputed), so the recomputation is written here.
The copies run the same ops on the same inputs as the forward (the graph is functional), so the step
computes what the unchecked step computes; where the same kernels run, bit for bit.

Segments: layer i's forward is the run of forward nodes from the first that reads one of layer i's
parameters or buffers (model.<layers>.<i>.*) up to the first node of layer i + 1, and for the last layer up
to the first forward node after it reading a tensor of no layer (the final norm's weight).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from vktrain.contract import MODEL_PREFIX, layers_per_segment as parse_layers_per_segment
from vktrain.errors import VktrainError

from .step_graph import _loss_and_gradients


class CheckpointingError(VktrainError, ValueError):
    """A model, or a number of layers per segment, that activation checkpointing cannot take."""


def decoder_layers(model: nn.Module) -> tuple[str, int]:
    """(path, count) of the model's decoder layers: its one nn.ModuleList named `layers` (HF's
    `model.layers` in a Llama-family model)."""
    found = [(name, len(module)) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers" and len(module)]
    if len(found) != 1:
        what = "none" if not found else f"{len(found)}: {[name for name, _ in found]}"
        raise CheckpointingError(f"activation checkpointing recomputes decoder layers, the model's nn.ModuleList "
                                 f"named 'layers'; {type(model).__name__} has {what}")
    return found[0]


def checkpointed_layers(model: nn.Module, value: str | int) -> tuple[str, int, int]:
    """(layers path, number of layers, layers per segment) of `model` checkpointed as `value` says;
    CheckpointingError for a bad value or a model without decoder layers (before any trace)."""
    layers_per_segment = parse_layers_per_segment(value)
    layers_path, n_layers = decoder_layers(model)
    if layers_per_segment > n_layers:
        raise CheckpointingError(f"segments of {layers_per_segment} decoder layers asked for, but "
                                 f"{type(model).__name__} has {n_layers}; give at most {n_layers}")
    return layers_path, n_layers, layers_per_segment


def recompute_layers_in_backward(joint: ExportedProgram, layers_path: str, n_layers: int,
                                 layers_per_segment: int) -> None:
    """Rewrite `joint` (in place) so that its backward recomputes each segment of `layers_per_segment`
    decoder layers (model `layers_path`.<i>, i < n_layers) from the segment's input."""
    graph = joint.graph
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    loss, _ = _loss_and_gradients(joint)
    end_of_forward = position[loss]
    layer_of, other_state = _state_placeholders(joint, layers_path)
    starts = [math.inf] * n_layers
    for node in nodes[:end_of_forward]:
        if node.op == "call_function":
            for arg in node.all_input_nodes:
                if arg in layer_of:
                    starts[layer_of[arg]] = min(starts[layer_of[arg]], position[node])
    if any(start == math.inf for start in starts):
        raise CheckpointingError(f"decoder layer(s) {[i for i, s in enumerate(starts) if s == math.inf]} read none "
                                 f"of their parameters in the forward: cannot tell where the layers are")
    end_of_layers = next((position[node] for node in nodes[starts[-1]:end_of_forward] if node.op == "call_function"
                          and any(arg in other_state for arg in node.all_input_nodes)), end_of_forward)
    bounds = [starts[i] for i in range(0, n_layers, layers_per_segment)] + [end_of_layers]
    for begin, end in zip(bounds, bounds[1:]):
        _recompute_segment(graph, nodes, begin, end, position, end_of_forward)


def _state_placeholders(joint: ExportedProgram, layers_path: str) -> tuple[dict[torch.fx.Node, int], set]:
    """The placeholders of the layers' tensors (-> layer index) and those of every other state tensor."""
    prefix = MODEL_PREFIX + layers_path + "."
    layer_of, other = {}, set()
    placeholders = [node for node in joint.graph.nodes if node.op == "placeholder"]
    for node, spec in zip(placeholders, joint.graph_signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            continue
        index = spec.target.removeprefix(prefix).partition(".")[0] if spec.target.startswith(prefix) else ""
        if index.isdigit():
            layer_of[node] = int(index)
        else:
            other.add(node)
    return layer_of, other


def _recompute_segment(graph: torch.fx.Graph, nodes: list[torch.fx.Node], begin: int, end: int,
                       position: dict[torch.fx.Node, int], end_of_forward: int) -> None:
    """Copy the forward nodes of nodes[begin:end] that the backward reads (with what they need inside that
    span) to just before the first of those backward readers, and make the backward read the copies."""
    inside = {node for node in nodes[begin:end] if node.op == "call_function"}

    def in_backward(user: torch.fx.Node) -> bool:  # copies of other segments are backward nodes too
        return user.op != "output" and position.get(user, math.inf) > end_of_forward

    # The segment's outputs (read later in the forward: the next segment's input) stay live anyway.
    outputs = {node for node in inside if any(user not in inside and not in_backward(user) for user in node.users)}
    saved = [node for node in inside if node not in outputs and any(in_backward(user) for user in node.users)]
    if not saved:
        return
    needed, stack = set(), list(saved)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(arg for arg in node.all_input_nodes if arg in inside and arg not in outputs)
    first_reader = min(position.get(user, math.inf) for node in saved for user in node.users if in_backward(user))
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(nodes[first_reader]):
        for node in sorted(needed, key=position.__getitem__):
            copies[node] = graph.node_copy(node, lambda arg: copies.get(arg, arg))
    for node in saved:
        for user in [user for user in node.users if in_backward(user)]:
            user.replace_input_with(node, copies[node])

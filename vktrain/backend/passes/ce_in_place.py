"""The cross-entropy gradient over its logits: vktrain.fused_ce's dlogits output takes the storage of the logits
it reads when nothing reads those logits after it (and they are no graph output, input, constant or state), so
the step holds one [R, V] tensor instead of two: Llama-3.2-1B's head at 4 x 512 tokens is 1002 MiB of each. The
kernel has an in-place variant for exactly this (fused_ce.slang IN_PLACE: each thread overwrites only elements it
has just read; kernels/cross_entropy.py takes it when both bindings are the same), and the arithmetic is the
same, so the step computes the same bits.

After the view decisions (a view of the logits is one of their readers, and the views of dlogits are re-pointed
at the shared storage) and the state updates' in-place pass; before memory planning, which then sizes the one
storage over the lifetime of everything using it."""
from __future__ import annotations

from dataclasses import replace

from vktrain.serialization import graph as vk

from ..lifetimes import analyze_uses, storage_root, storage_sharers

FUSED_CE = "vktrain.fused_ce.default"


def write_ce_gradient_in_place(graph: vk.VkGraph) -> None:
    uses = analyze_uses(graph)
    states = {s.state_id for s in graph.mutable_state} | {s.update_id for s in graph.mutable_state}
    outside = set(graph.inputs) | set(graph.outputs) | states
    sharing = storage_sharers(graph)
    for index, op in enumerate(graph.ops):
        if op.name != FUSED_CE or len(op.outputs) != 2:
            continue
        read, dlogits = graph.tensor(op.args[0]), op.outputs[1]
        root = storage_root(graph, op.args[0])
        logits, gradient = graph.tensor(root), graph.tensor(dlogits)
        users = [root] + sharing.get(root, [])
        if (root not in uses.producer or logits.constant_id >= 0 or gradient.storage_of >= 0
                or any(v in outside for v in users + [dlogits])
                or not _whole(read, logits) or not _whole(gradient, logits)):
            continue
        if any(reader > index for v in users for reader in uses.readers.get(v, ())):
            continue  # the logits are read after the gradient overwrites them
        graph.values[dlogits] = replace(gradient, storage_of=root)
        for view in sharing.get(dlogits, []):  # one level of sharing: dlogits' views now use the root's storage
            graph.values[view] = replace(graph.tensor(view), storage_of=root)


def _whole(tensor: vk.TensorValue, storage: vk.TensorValue) -> bool:
    """Whether `tensor` reads `storage`'s bytes as they lie: same element type and byte count, row-major from
    element 0 (so the kernel's logits and dlogits bindings are the same range and its in-place variant runs)."""
    contiguous = not tensor.view_strides or tuple(tensor.view_strides) == _row_major(tensor.shape)
    return (tensor.storage_dtype == storage.storage_dtype and tensor.stored_nbytes == storage.stored_nbytes
            and tensor.view_offset == 0 and contiguous)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))

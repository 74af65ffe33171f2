"""View decisions: which ops move no data on the GPU, so that their output is a view of their source's
storage (the op stays in the chain, recorded as producing a view; the executor dispatches nothing for it).

* Byte-preserving ops: view_copy / unsqueeze_copy / squeeze_copy / alias_copy of a contiguous tensor (all
  stored tensors are contiguous), and _to_copy / _to_dim_order_copy between dtypes with the same stored
  representation (int64 <-> int32 once int64 is stored as int32, or no change). A reshape of a strided
  view moves data, so it is not a view.
* Lazy transposes: permute / t / transpose whose every reader takes strided operands (mm, addmm, other
  transposes) become strided views of their source's bytes (chains compose); transposes that cancel out
  are plain views. A transpose read by anything else, or after the step, is materialised by its op.

A view of mutable state that is read after the step (a graph output or state update) is not made: the
state's storage changes at the end of the step. Views always point at the storage root (a tensor with
storage of its own), with strides relative to the root's bytes.
"""
from __future__ import annotations

from dataclasses import replace

from vktrain.serialization.strided_view import TRANSPOSE_OPS, StridedView, transposed_view
from vktrain.serialization.graph import decode_scalar
from vktrain.serialization import graph as vk

from ..lifetimes import GraphUses, analyze_uses, storage_root

# Ops whose lowering reads any StridedView of its tensor inputs (the TensorArg's view).
VIEW_ACCEPTING_OPS = frozenset(TRANSPOSE_OPS + ("aten.mm.default", "aten.addmm.default",
                                               "vktrain.mm_scaled.default"))
SHAPE_ONLY_VIEWS = frozenset({
    "aten.view_copy.default", "aten.unsqueeze_copy.default", "aten.squeeze_copy.dims", "aten.squeeze_copy.dim",
    "aten.squeeze_copy.default", "aten.alias_copy.default",
})
TO_COPY = "aten._to_copy.default"
TO_DIM_ORDER_COPY = "dim_order_ops._to_dim_order_copy.default"


def _contiguous_dim_order(dim_order, rank: int) -> bool:
    return tuple(dim_order) == tuple(range(rank))


def alias_source(graph: vk.VkGraph, op: vk.OpCall) -> int | None:
    """The value id whose stored bytes `op`'s output has exactly, when the op moves no data; else None."""
    if len(op.outputs) != 1 or not op.args:
        return None
    source = graph.values[op.args[0]]
    out = graph.values[op.outputs[0]]
    if not isinstance(source, vk.TensorValue) or not isinstance(out, vk.TensorValue):
        return None
    if source.layout != vk.Layout.PLAIN or out.layout != vk.Layout.PLAIN or source.numel != out.numel:
        return None
    if op.name in SHAPE_ONLY_VIEWS and source.dtype == out.dtype:
        return op.args[0]
    if source.storage_dtype != out.storage_dtype:
        return None
    if op.name == TO_COPY:
        memory_format = graph.values[op.args[-1]]
        if isinstance(memory_format, vk.NullValue) or (
                isinstance(memory_format, vk.StringValue)
                and memory_format.value in ("preserve_format", "contiguous_format")):
            return op.args[0]
    if op.name == TO_DIM_ORDER_COPY:
        dim_order = graph.values[op.args[-1]]
        if isinstance(dim_order, vk.NullValue) or (
                isinstance(dim_order, vk.IntListValue) and _contiguous_dim_order(dim_order.items, len(source.shape))):
            return op.args[0]
    return None


def _transpose_source(graph: vk.VkGraph, op: vk.OpCall) -> int | None:
    """The input of a transpose op on a plain tensor."""
    if op.name not in TRANSPOSE_OPS or len(op.outputs) != 1 or not op.args:
        return None
    source = graph.values[op.args[0]]
    if not isinstance(source, vk.TensorValue) or source.layout != vk.Layout.PLAIN:
        return None
    return op.args[0]


def _view_of(graph: vk.VkGraph, op: vk.OpCall, uses: GraphUses,
             views: dict[int, StridedView]) -> tuple[int, StridedView | None] | None:
    """(source, strided view or None for a contiguous one) when `op`'s output can be a view; else None."""
    source = alias_source(graph, op)
    if source is not None:
        return None if source in views else (source, None)  # reshaping a strided view moves data
    source = _transpose_source(graph, op)
    if source is None:
        return None
    input_view = views.get(source, StridedView.contiguous(graph.tensor(source).shape))
    view = transposed_view(op.name, [decode_scalar(graph.values[arg]) for arg in op.args[1:]], input_view)
    if view.is_contiguous:
        return source, None
    for reader in uses.readers.get(op.outputs[0], ()):
        if reader == uses.after_the_step or graph.ops[reader].name not in VIEW_ACCEPTING_OPS:
            return None
    return source, view


def decide_views(graph: vk.VkGraph) -> None:
    uses = analyze_uses(graph)
    states = {s.state_id for s in graph.mutable_state}
    read_after_the_step = set(graph.outputs) | {s.update_id for s in graph.mutable_state}
    views: dict[int, StridedView] = {}  # strided views decided so far, relative to their root's bytes
    for op in graph.ops:
        found = _view_of(graph, op, uses, views)
        if found is None:
            continue
        (source, view), out = found, op.outputs[0]
        root = storage_root(graph, source)
        if root in states and out in read_after_the_step:
            continue  # the state's storage changes at the end of the step; such a view needs its own bytes
        strides, offset = (view.strides, view.offset) if view is not None else ((), 0)
        graph.values[out] = replace(graph.tensor(out), storage_of=root, is_view=True, view_strides=strides,
                                    view_offset=offset)
        if view is not None:
            views[out] = view

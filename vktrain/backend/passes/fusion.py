"""Fusion: op patterns no kernel implements, rewritten into one op that a kernel does, then ops left
with no reader dropped.

* ReLU's backward arrives as `where(le(x, t), 0, grad)` (bool mask, scalar tensor, select); it is exactly
  `threshold_backward(grad, x, t)` (except for NaN inputs: le(NaN) is False so `where` passes grad,
  threshold_backward zeroes it), which the elementwise family implements in one pass.
* SiLU's backward builds `1 - sigmoid` as `sub(full_like(t, c), y, alpha)`; that is
  `rsub.Scalar(y, c, alpha)` = c - alpha * y (a fill kernel would only materialise a constant).

Both rewrite fp32 tensors of one shape only. The mask, scalar, fill (and the `empty` tensor a fill was
shaped after) then have no reader and are dropped; ops whose outputs are still read stay (and are refused
at load if they have no kernel).
"""
from __future__ import annotations

from vktrain.serialization import graph as vk

THRESHOLD_BACKWARD = "aten.threshold_backward.default"
RSUB_SCALAR = "aten.rsub.Scalar"


def _scalar_zero(graph: vk.VkGraph, value_id: int, producers: dict[int, vk.OpCall]) -> bool:
    """Whether `value_id` is the scalar 0: aten.scalar_tensor(0) or a constant 0-d / 1-element zero."""
    value = graph.values[value_id]
    if not isinstance(value, vk.TensorValue) or value.numel != 1:
        return False
    if value.constant_id >= 0:
        return float(graph.constant_array(value_id).reshape(-1)[0]) == 0.0
    producer = producers.get(value_id)
    if producer is None or producer.name != "aten.scalar_tensor.default" or not producer.args:
        return False
    fill = graph.values[producer.args[0]]
    return isinstance(fill, (vk.IntValue, vk.DoubleValue)) and float(fill.value) == 0.0


def _same_shape_fp32_tensors(graph: vk.VkGraph, *value_ids: int) -> bool:
    values = [graph.values[i] for i in value_ids]
    return (all(isinstance(v, vk.TensorValue) and v.dtype == vk.DType.FLOAT32 for v in values)
            and len({v.shape for v in values}) == 1)


def _threshold_backward(graph: vk.VkGraph, op: vk.OpCall, producers: dict[int, vk.OpCall]) -> vk.OpCall | None:
    """where(le(x, t), 0, grad) -> threshold_backward(grad, x, t)."""
    if op.name != "aten.where.self" or len(op.args) != 3 or len(op.outputs) != 1:
        return None
    condition, then_value, else_value = op.args
    compare = producers.get(condition)
    if compare is None or compare.name != "aten.le.Scalar" or len(compare.args) != 2:
        return None
    x_id, threshold_id = compare.args
    threshold = graph.values[threshold_id]
    if not isinstance(threshold, (vk.IntValue, vk.DoubleValue)) or not _scalar_zero(graph, then_value, producers):
        return None
    if not _same_shape_fp32_tensors(graph, x_id, else_value, op.outputs[0]):
        return None
    return vk.OpCall(THRESHOLD_BACKWARD, (else_value, x_id, threshold_id), op.outputs)


def _rsub_of_full(graph: vk.VkGraph, op: vk.OpCall, producers: dict[int, vk.OpCall]) -> vk.OpCall | None:
    """sub(full_like(t, c), y, alpha) -> rsub.Scalar(y, c, alpha)."""
    if op.name != "aten.sub.Tensor" or len(op.args) != 3 or len(op.outputs) != 1:
        return None
    full_id, y_id, alpha_id = op.args
    full = producers.get(full_id)
    if full is None or full.name != "aten.full_like.default" or len(full.args) != 7:
        return None
    fill, dtype = graph.values[full.args[1]], graph.values[full.args[2]]
    if not isinstance(fill, (vk.IntValue, vk.DoubleValue)):
        return None
    if not (isinstance(dtype, vk.NullValue) or (isinstance(dtype, vk.StringValue) and dtype.value == "float32")):
        return None
    if not _same_shape_fp32_tensors(graph, y_id, full_id, op.outputs[0]):
        return None
    return vk.OpCall(RSUB_SCALAR, (y_id, full.args[1], alpha_id), op.outputs)


_REWRITES = (_threshold_backward, _rsub_of_full)


def fuse_patterns(graph: vk.VkGraph) -> None:
    """Rewrite the patterns above in `graph.ops`, then drop the ops none of whose outputs is read."""
    producers = {out: op for op in graph.ops for out in op.outputs}
    ops = []
    for op in graph.ops:
        for rewrite in _REWRITES:
            replacement = rewrite(graph, op, producers)
            if replacement is not None:
                op = replacement
                break
        ops.append(op)
    # The graph is functional, so an op none of whose outputs is read can go; repeat until nothing
    # changes, since dropping an op can leave its inputs' producers unread too.
    kept_reads = set(graph.outputs) | {s.update_id for s in graph.mutable_state}
    while True:
        read = kept_reads | {arg for op in ops for arg in op.args}
        live = [op for op in ops if any(out in read for out in op.outputs)]
        if len(live) == len(ops):
            break
        ops = live
    graph.ops = ops

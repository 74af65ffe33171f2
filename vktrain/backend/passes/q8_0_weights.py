"""Q8_0 weights on the device: a frozen float32 matrix W [N, K] stored as GGUF Q8_0 blocks (the previous
pass, constant_storage, found its values exact; SmolLM2's token embedding) and read only as an embedding
table and through aten.mm, is held on the device as Q8_0 too (vktrain.quant.q8_0: int8 codes and a
float32 scale per 32, 1.125 bytes a value instead of 4) and read by the Q8_0 ops (vktrain/opdefs/q8_0_ops.py):

    aten.embedding(W, indices, ...)     -> vktrain.embedding_q8_0(codes, scales, indices)
    aten.mm(x, W^T)  (a transposed view) -> vktrain.linear_q8_0(x, codes, scales)          the tied head
    aten.mm(d, W)    (W or a plain view)  -> vktrain.linear_q8_0_backward(d, codes, scales) its d_h

Every reader must be one of these (W as mm's second operand, read through views the views pass made);
otherwise, or when W is stored float32 (an untied head, a float checkpoint), the graph is left as it
is. The ops that only made W's views are dropped. The constant's record becomes the codes (int8 [N, K]);
the scales are a new constant, stored as float16 when exact (always, for GGUF's float16 scales), so the
blob holds as many bytes as GGUF's blocks. Kernels compute bit for bit what the float32 ones computed
over W (kernels/q8_0.py). Requires K % 32 == 0: rows of whole blocks.
"""
from __future__ import annotations

from dataclasses import replace

from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES, Q8_0_CODES_SUFFIX, Q8_0_SCALES_SUFFIX, q8_0_device_arrays
from vktrain.serialization import graph as vk

from ..lifetimes import analyze_uses, storage_root

EMBEDDING = "aten.embedding.default"
MM = "aten.mm.default"
EMBEDDING_Q8_0 = "vktrain.embedding_q8_0.default"
LINEAR_Q8_0 = "vktrain.linear_q8_0.default"
LINEAR_Q8_0_BACKWARD = "vktrain.linear_q8_0_backward.default"


def _q8_0_matrix(graph: vk.VkGraph, constant_id: int, readers: list[int]) -> tuple[int, int] | None:
    """(N, K) when constant `constant_id` is GGUF Q8_0 blocks read as float32 [N, K] (K % 32 == 0) by
    `readers` (tensor value ids), all the same tensor."""
    constant = graph.constants[constant_id]
    if not (isinstance(constant, vk.NarrowConstant) and constant.encoding == vk.ConstantEncoding.GGUF_Q8_0):
        return None
    shapes = {graph.tensor(value_id).shape for value_id in readers}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        return None
    n, k = next(iter(shapes))
    return (n, k) if k % Q8_0_BLOCK_VALUES == 0 and n > 0 else None


def _orientation(tensor: vk.TensorValue, n: int, k: int) -> str | None:
    """How an mm's mat2 reads W [N, K]: "W^T" (a [K, N] view of strides (1, K)), "W" (contiguous [N, K])."""
    if tensor.view_offset != 0:
        return None
    if tensor.shape == (k, n) and tuple(tensor.view_strides) == (1, k):
        return "W^T"
    if tensor.shape == (n, k) and tuple(tensor.view_strides) in ((), (k, 1)):
        return "W"
    return None


def _rewrites(graph: vk.VkGraph, roots: set[int], n: int, k: int) -> dict[int, str] | None:
    """Op index -> the Q8_0 op replacing it, for every op reading W (value ids `roots` or views of them)
    but the ones making views of it (dropped later); None when some reader is none of those."""
    uses = analyze_uses(graph)
    rewrites: dict[int, str] = {}
    readers_of_w = [v for v, value in enumerate(graph.values) if isinstance(value, vk.TensorValue)
                    and storage_root(graph, v) in roots and (v in roots or value.is_view)]
    for value_id in readers_of_w:
        for index in uses.readers.get(value_id, ()):
            if index == uses.after_the_step:
                return None
            op = graph.ops[index]
            if all(graph.values[out].is_view and storage_root(graph, out) in roots for out in op.outputs) \
                    and op.args[0] == value_id:
                continue  # a view of W: dropped once nothing reads it
            position = [i for i, arg in enumerate(op.args) if arg == value_id]
            tensor = graph.tensor(value_id)
            if op.name == EMBEDDING and position == [0] and tensor.shape == (n, k) and not tensor.view_strides:
                rewrites[index] = EMBEDDING_Q8_0
            elif op.name == MM and position == [1] and _orientation(tensor, n, k) is not None:
                rewrites[index] = LINEAR_Q8_0 if _orientation(tensor, n, k) == "W^T" else LINEAR_Q8_0_BACKWARD
            else:
                return None
    return rewrites


def _hold_as_q8_0(graph: vk.VkGraph, constant_id: int, roots: list[int], n: int, k: int,
                  rewrites: dict[int, str]) -> None:
    codes, scales = q8_0_device_arrays(graph.constants[constant_id].stored_bytes, n, k)
    name = graph.tensor(roots[0]).name or f"constant{constant_id}"
    graph.constants[constant_id] = codes
    for value_id in roots:
        graph.values[value_id] = vk.TensorValue(vk.DType.INT8, (n, k), constant_id=constant_id,
                                                name=name + Q8_0_CODES_SUFFIX)
    narrow_scales = vk.narrow_losslessly(scales)
    scales_id = graph.add_value(vk.TensorValue(vk.DType.FLOAT32, scales.shape,
                                               constant_id=graph.add_constant(narrow_scales or scales),
                                               name=name + Q8_0_SCALES_SUFFIX))
    codes_id = roots[0]
    for index, key in rewrites.items():
        op = graph.ops[index]
        first = op.args[1] if key == EMBEDDING_Q8_0 else op.args[0]  # the indices, or mm's first operand
        graph.ops[index] = vk.OpCall(key, (codes_id, scales_id, first) if key == EMBEDDING_Q8_0
                                     else (first, codes_id, scales_id), op.outputs)
    # The views of W are no longer read: their ops go, their values keep no storage of the codes.
    root_set = set(roots)
    views = {v for v, value in enumerate(graph.values) if isinstance(value, vk.TensorValue) and value.is_view
             and value.storage_of in root_set}
    graph.ops = [op for op in graph.ops if not (op.outputs and set(op.outputs) <= views)]
    for value_id in views:
        graph.values[value_id] = replace(graph.tensor(value_id), storage_of=-1, is_view=False, view_strides=(),
                                         view_offset=0)


def hold_q8_0_weights(graph: vk.VkGraph) -> None:
    readers: dict[int, list[int]] = {}
    for value_id, value in enumerate(graph.values):
        if isinstance(value, vk.TensorValue) and value.constant_id >= 0:
            readers.setdefault(value.constant_id, []).append(value_id)
    initial_values = {s.initial_constant_id for s in graph.mutable_state}
    for constant_id, roots in sorted(readers.items()):
        if constant_id in initial_values:
            continue
        dims = _q8_0_matrix(graph, constant_id, roots)
        if dims is None:
            continue
        rewrites = _rewrites(graph, set(roots), *dims)
        if rewrites:
            _hold_as_q8_0(graph, constant_id, roots, *dims, rewrites)


__all__ = ["hold_q8_0_weights"]

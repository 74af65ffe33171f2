"""Prepacked-layout typing: q4gsw_requant writes W_4X8 words (what linear_q4gsw reads), not the flat
uint8 [N, Kp/2] codes its torch op returns. Its output is retyped to what is stored, uint32
[w4x8_num_words(N, K)] in layout Q4GSW_W4X8 (CONTRACTS.md: dtype and shape describe the stored buffer),
so memory planning sizes it right and the kernels see the layout they check. Such a tensor can only feed
GPU ops: returning it or making it a state update is refused (the caller would get packed words)."""
from __future__ import annotations

from dataclasses import replace

from vktrain.quant import w4x8_num_words
from vktrain.serialization import graph as vk

REQUANT = "vktrain.q4gsw_requant.default"


def type_prepacked_outputs(graph: vk.VkGraph) -> None:
    read_after_the_step = set(graph.outputs) | {s.update_id for s in graph.mutable_state}
    for index, op in enumerate(graph.ops):
        if op.name != REQUANT or len(op.args) != 3 or len(op.outputs) != 1:
            continue
        scales, group_size = graph.values[op.args[1]], graph.values[op.args[2]]
        if not (isinstance(scales, vk.TensorValue) and len(scales.shape) == 2 and isinstance(group_size, vk.IntValue)):
            continue  # malformed: the op's lowering refuses it with the reason
        (out,) = op.outputs
        if out in read_after_the_step:
            raise vk.GraphError(f"value {out} (the q4gsw_requant result of op {index}, W_4X8 words on the GPU) is a "
                                f"graph output or state update; only linear_q4gsw ops can read it")
        n, k = scales.shape[1], scales.shape[0] * group_size.value
        graph.values[out] = replace(graph.tensor(out), dtype=vk.DType.UINT32, shape=(w4x8_num_words(n, k),),
                                    layout=vk.Layout.Q4GSW_W4X8, stored_dtype=None)

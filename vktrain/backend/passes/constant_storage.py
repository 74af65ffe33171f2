"""Constant storage: a float32 constant whose values are all exactly bfloat16 or float16 numbers is
stored in the blob in those 2-byte elements (serialization/narrow_constant.py) and widened back bit for
bit when it is read. SmolLM2's or Llama's embedding from a bf16 / F16 checkpoint then takes half the
file. Only constants every reader of which is a PLAIN float32 tensor (or a float32 state starting from
it) qualify; the decision is made from the bits, so a constant that would change stays float32."""
from __future__ import annotations

import numpy as np

from vktrain.serialization import graph as vk


def _float32_constant_ids(graph: vk.VkGraph) -> set[int]:
    """Constants read only as PLAIN float32 (by tensors, or as a state's initial value)."""
    readers: dict[int, list[vk.TensorValue]] = {}
    for value in graph.values:
        if isinstance(value, vk.TensorValue) and value.constant_id >= 0:
            readers.setdefault(value.constant_id, []).append(value)
    for state in graph.mutable_state:
        if state.initial_constant_id >= 0:
            readers.setdefault(state.initial_constant_id, []).append(graph.tensor(state.state_id))
    return {constant_id for constant_id, tensors in readers.items()
            if all((t.dtype, t.layout) == (vk.DType.FLOAT32, vk.Layout.PLAIN) for t in tensors)}


def narrow_float_constants(graph: vk.VkGraph) -> None:
    for constant_id in sorted(_float32_constant_ids(graph)):
        data = graph.constants[constant_id]
        if isinstance(data, (vk.SyntheticConstant, vk.NarrowConstant)):
            continue
        narrow = vk.narrow_losslessly(np.frombuffer(vk.constant_bytes(data), np.float32))
        if narrow is not None:
            graph.constants[constant_id] = narrow

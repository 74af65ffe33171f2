"""Constant storage: a float32 constant whose values all round-trip exactly through a smaller form is
stored in the blob in the smallest such form (serialization/narrow_constant.py): GGUF Q8_0 blocks (8.5
bits a value), else bfloat16 or float16 elements (16 bits), and widened back bit for bit when it is read.
SmolLM2's Q8_0 token embedding (dequantized by the GGUF importer) then takes 8.5/32 of its float32 bytes,
an embedding from a bf16 / F16 checkpoint half. Only constants every reader of which is a PLAIN float32
tensor (or a float32 state starting from it) qualify; the decision is made from the bits, so a constant
that would change stays float32."""
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

"""int64 -> int32 storage: every int64 tensor is stored as int32 on the GPU (every index a model uses
fits; the executor range-checks int64 inputs and constants when it converts them, and widens outputs
back to int64 when it reads them). The tensor's `dtype` stays int64: it is the program's interface."""
from __future__ import annotations

from dataclasses import replace

from vktrain.serialization import graph as vk

# Graph dtype -> the dtype its bytes are stored as on the GPU (others are stored as they are).
GPU_STORAGE_DTYPE = {vk.DType.INT64: vk.DType.INT32}


def downcast_int64_storage(graph: vk.VkGraph) -> None:
    for value_id, value in enumerate(graph.values):
        if isinstance(value, vk.TensorValue) and value.dtype in GPU_STORAGE_DTYPE:
            graph.values[value_id] = replace(value, stored_dtype=GPU_STORAGE_DTYPE[value.dtype])

"""The ground floor the AOT side and the runtime both stand on: the formats and the facts about them.

The vktrain delegate blob: graph dataclasses (graph.py), schema.fbs, and the blob container (blob.py); the
.pte reader (pte.py, pte_objects.py, pte_schema/) and its load-time verifier (verify.py); strided tensor
views (strided_view.py); the model tokenizer (tokenizer.py); PEFT adapter files (peft_adapters.py); device
profiles (device_profile.py); the schedule of a graph on a device: its Dispatch records (dispatch.py),
the Schedule record and its bytes (schedule.py, the Schedule table of schema.fbs) and its verifier
(verify_schedule.py); the schedules a blob embeds per target profile and the shader modules they run
(embedded.py, with the matching rule a runtime picks one by), and which tensors a program's other methods
bind of the training step's (program_sharing.py). No torch, no executorch, nothing of vktrain above this floor
(tests/test_layers.py). Names are exported lazily so that the code generator
(`python -m vktrain.serialization.generate`) still runs when the generated code is missing or stale.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "graph": ("DType", "Layout", "GraphError", "VkGraph", "OpCall", "MutableState", "MemoryObject",
              "TensorValue", "NullValue", "IntValue", "DoubleValue", "BoolValue", "StringValue",
              "IntListValue", "DoubleListValue", "BoolListValue", "ValueListValue", "Value",
              "SyntheticConstant", "SyntheticKind"),
    "blob": ("BlobFormatError", "BlobHeader", "serialize_blob", "deserialize_blob", "write_blob", "read_blob"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

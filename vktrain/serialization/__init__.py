"""The vktrain delegate blob: graph dataclasses (graph.py), schema.fbs, and the blob container (blob.py).

Imports flatbuffers, numpy and vktrain.quant (numpy) only. Names are exported lazily so that the code generator
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

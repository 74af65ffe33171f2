"""The blob's values and synthetic constants (schema.fbs Value union, SyntheticConstant): written and read,
for blob.py."""
from __future__ import annotations

import flatbuffers
import numpy as np

from vktrain.serialization import graph as g
from vktrain.serialization.blob_header import BlobFormatError
from vktrain.serialization.flatbuffer_building import numpy_vector
from vktrain.serialization.flatbuffer_reading import (INT32, INT64, UINT8, UINT64, scalar_vector, table_scalars, text,
                                                      union_as)
from vktrain.serialization.generated.vkt_blob import Bool as FbBool
from vktrain.serialization.generated.vkt_blob import BoolList as FbBoolList
from vktrain.serialization.generated.vkt_blob import Double as FbDouble
from vktrain.serialization.generated.vkt_blob import DoubleList as FbDoubleList
from vktrain.serialization.generated.vkt_blob import Int as FbInt
from vktrain.serialization.generated.vkt_blob import IntList as FbIntList
from vktrain.serialization.generated.vkt_blob import Null as FbNull
from vktrain.serialization.generated.vkt_blob import String as FbString
from vktrain.serialization.generated.vkt_blob import SyntheticConstant as FbSyntheticConstant
from vktrain.serialization.generated.vkt_blob import Tensor as FbTensor
from vktrain.serialization.generated.vkt_blob import Value as FbValue
from vktrain.serialization.generated.vkt_blob import ValueList as FbValueList
from vktrain.serialization.generated.vkt_blob.ValueKind import ValueKind

# The list values, written and read the same way: graph type -> (flatbuffer element dtype, generated
# module (the builder functions), its table class (the reader), union kind).
_LIST_VALUES = {
    g.IntListValue: (np.int64, FbIntList, FbIntList.IntList, ValueKind.IntList),
    g.DoubleListValue: (np.float64, FbDoubleList, FbDoubleList.DoubleList, ValueKind.DoubleList),
    g.BoolListValue: (np.bool_, FbBoolList, FbBoolList.BoolList, ValueKind.BoolList),
    g.ValueListValue: (np.int32, FbValueList, FbValueList.ValueList, ValueKind.ValueList),
}


def build_value(builder: flatbuffers.Builder, value) -> int:
    """Build one `Value` table (the union wrapper) and return its offset."""
    if isinstance(value, g.TensorValue):
        name = builder.CreateString(value.name) if value.name else None
        shape = numpy_vector(builder, value.shape, np.int64)
        view_strides = numpy_vector(builder, value.view_strides, np.int64) if value.view_strides else None
        FbTensor.Start(builder)
        FbTensor.AddDtype(builder, int(value.dtype))
        FbTensor.AddShape(builder, shape)
        FbTensor.AddLayout(builder, int(value.layout))
        FbTensor.AddConstantId(builder, value.constant_id)
        FbTensor.AddMemObjId(builder, value.mem_obj_id)
        if name is not None:
            FbTensor.AddName(builder, name)
        FbTensor.AddMemOffset(builder, value.mem_offset)
        FbTensor.AddStorageOf(builder, value.storage_of)
        FbTensor.AddIsView(builder, value.is_view)
        if view_strides is not None:
            FbTensor.AddViewStrides(builder, view_strides)
        FbTensor.AddViewOffset(builder, value.view_offset)
        if value.stored_dtype is not None:
            FbTensor.AddStoredDtype(builder, int(value.stored_dtype))
        kind, payload = ValueKind.Tensor, FbTensor.End(builder)
    elif isinstance(value, g.NullValue):
        FbNull.Start(builder)
        kind, payload = ValueKind.Null, FbNull.End(builder)
    elif isinstance(value, g.IntValue):
        FbInt.Start(builder)
        FbInt.AddValue(builder, int(value.value))
        kind, payload = ValueKind.Int, FbInt.End(builder)
    elif isinstance(value, g.DoubleValue):
        FbDouble.Start(builder)
        FbDouble.AddValue(builder, float(value.value))
        kind, payload = ValueKind.Double, FbDouble.End(builder)
    elif isinstance(value, g.BoolValue):
        FbBool.Start(builder)
        FbBool.AddValue(builder, bool(value.value))
        kind, payload = ValueKind.Bool, FbBool.End(builder)
    elif isinstance(value, g.StringValue):
        text = builder.CreateString(value.value)
        FbString.Start(builder)
        FbString.AddValue(builder, text)
        kind, payload = ValueKind.String, FbString.End(builder)
    elif type(value) in _LIST_VALUES:
        dtype, module, _, kind = _LIST_VALUES[type(value)]
        items = numpy_vector(builder, value.items, dtype)
        module.Start(builder)
        module.AddItems(builder, items)
        payload = module.End(builder)
    else:  # validate() refuses this earlier; kept so a new value type cannot be silently dropped
        raise g.GraphError(f"cannot serialise value of type {type(value).__name__}")
    FbValue.Start(builder)
    FbValue.AddValueType(builder, kind)
    FbValue.AddValue(builder, payload)
    return FbValue.End(builder)


def build_synthetic(builder: flatbuffers.Builder, synthetic: g.SyntheticConstant) -> int:
    shape = numpy_vector(builder, synthetic.shape, np.int64)
    q4gsw_shape = numpy_vector(builder, synthetic.q4gsw_shape, np.int64) if synthetic.q4gsw_shape else None
    FbSyntheticConstant.Start(builder)
    FbSyntheticConstant.AddKind(builder, int(synthetic.kind))
    FbSyntheticConstant.AddSeed(builder, int(synthetic.seed))
    FbSyntheticConstant.AddDtype(builder, int(synthetic.dtype))
    FbSyntheticConstant.AddShape(builder, shape)
    FbSyntheticConstant.AddStd(builder, synthetic.std)
    FbSyntheticConstant.AddValue(builder, synthetic.value)
    FbSyntheticConstant.AddLayout(builder, int(synthetic.layout))
    if q4gsw_shape is not None:
        FbSyntheticConstant.AddQ4gswShape(builder, q4gsw_shape)
    return FbSyntheticConstant.End(builder)


# schema.fbs Tensor's slots: dtype, shape (vector), layout, constant_id, mem_obj_id, name (string), mem_offset,
# storage_of, is_view, view_strides (vector), view_offset, stored_dtype (optional: None when absent); the scalars
# read by table_scalars with their schema defaults (tests/test_serialization.py checks them against the accessors).
_TENSOR_SCALARS = ((UINT8, 0), None, (UINT8, 0), (INT32, -1), (INT32, -1), None, (UINT64, 0), (INT32, -1), (UINT8, 0),
                   None, (INT64, 0), (UINT8, None))


def read_value(fb_value, value_id: int):
    kind = fb_value.ValueType()
    table = fb_value.Value()
    if table is None:
        raise BlobFormatError(f"value {value_id} has no payload (union type {kind})")
    if kind == ValueKind.Tensor:
        t = union_as(table, FbTensor.Tensor)
        dtype, layout, constant_id, mem_obj_id, mem_offset, storage_of, is_view, view_offset, stored_dtype = \
            table_scalars(t, _TENSOR_SCALARS)
        try:
            return g.TensorValue(dtype, scalar_vector(t, "Shape"), layout, constant_id, mem_obj_id, text(t.Name()),
                                 mem_offset=mem_offset, storage_of=storage_of, is_view=bool(is_view),
                                 view_strides=scalar_vector(t, "ViewStrides"), view_offset=view_offset,
                                 stored_dtype=stored_dtype)
        except g.GraphError as exc:
            raise BlobFormatError(f"value {value_id}: {exc}") from None
    if kind == ValueKind.Null:
        return g.NullValue()
    if kind == ValueKind.Int:
        return g.IntValue(union_as(table, FbInt.Int).Value())
    if kind == ValueKind.Double:
        return g.DoubleValue(union_as(table, FbDouble.Double).Value())
    if kind == ValueKind.Bool:
        return g.BoolValue(bool(union_as(table, FbBool.Bool).Value()))
    if kind == ValueKind.String:
        return g.StringValue(text(union_as(table, FbString.String).Value()))
    for value_type, (_, _, table_class, list_kind) in _LIST_VALUES.items():
        if kind == list_kind:
            return value_type(scalar_vector(union_as(table, table_class), "Items"))
    raise BlobFormatError(f"value {value_id} has unknown union type {kind} (blob from a newer vktrain?)")


def read_synthetic(table, constant_id: int) -> g.SyntheticConstant:
    try:
        return g.SyntheticConstant(table.Kind(), table.Seed(), table.Dtype(), scalar_vector(table, "Shape"),
                                   table.Std(), table.Value(), table.Layout(), scalar_vector(table, "Q4gswShape"))
    except g.GraphError as exc:
        raise BlobFormatError(f"constant {constant_id}: {exc}") from None


__all__ = ["build_synthetic", "build_value", "read_synthetic", "read_value"]

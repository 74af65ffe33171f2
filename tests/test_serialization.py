"""The delegate blob: schema parity, round trip, byte layout, dedup, streaming, and refusal of bad data.

Layout checks read the blob independently of blob.py's reader: the header with `struct`, the constant
records with the flatc-generated accessors.
"""
from __future__ import annotations

import io
import shutil
import struct
import zlib

import numpy as np
import pytest

from vktrain.quant import pack_w4x8, quantize, unpack_flat
from vktrain.serialization import generate
from vktrain.serialization.blob import BlobFormatError, deserialize_blob, read_blob, serialize_blob, write_blob
from vktrain.serialization.generated.vkt_blob.DataType import DataType as FbDataType
from vktrain.serialization.generated.vkt_blob.TensorLayout import TensorLayout as FbTensorLayout
from vktrain.serialization.generated.vkt_blob.ValueKind import ValueKind
from vktrain.serialization.generated.vkt_blob.VkGraph import VkGraph as FbVkGraph
from vktrain.serialization.graph import (
    VALUE_TYPES, BoolListValue, BoolValue, DoubleListValue, DoubleValue, DType, GraphError, IntListValue,
    IntValue, Layout, MemoryObject, MutableState, NullValue, OpCall, StringValue, TensorValue, ValueListValue,
    VkGraph,
)

from _helpers import assert_import_loads_none

# The documented header, restated independently of blob.py: the fields, then (CHECKSUMS flag) graph_crc32.
HEADER = struct.Struct("<4sIIIQQQQ")
GRAPH_CRC32 = struct.Struct("<I")


def _raw_header(blob: bytes) -> dict:
    magic, size, version, flags, fb_off, fb_size, seg_off, seg_size = HEADER.unpack_from(blob, 0)
    return dict(magic=magic, size=size, version=version, flags=flags, fb_off=fb_off, fb_size=fb_size,
                seg_off=seg_off, seg_size=seg_size)


def _graph_crc32(blob: bytes) -> int:
    """CRC-32 of the header fields and the flatbuffer, as documented."""
    h = _raw_header(blob)
    return zlib.crc32(blob[h["fb_off"]:h["fb_off"] + h["fb_size"]], zlib.crc32(blob[:HEADER.size]))


def _resign(blob: bytes) -> bytes:
    """`blob` with its graph_crc32 recomputed: lets a test reach the checks behind the checksum."""
    blob = bytearray(blob)
    GRAPH_CRC32.pack_into(blob, HEADER.size, _graph_crc32(bytes(blob)))
    return bytes(blob)


def _constant_records(blob: bytes) -> list[tuple[int, int]]:
    h = _raw_header(blob)
    root = FbVkGraph.GetRootAs(blob[h["fb_off"]:h["fb_off"] + h["fb_size"]], 0)
    return [(root.Constants(i).Offset(), root.Constants(i).Length()) for i in range(root.ConstantsLength())]


def _constant_crc32_records(blob: bytes) -> list[int]:
    h = _raw_header(blob)
    root = FbVkGraph.GetRootAs(blob[h["fb_off"]:h["fb_off"] + h["fb_size"]], 0)
    return [root.Constants(i).Crc32() for i in range(root.ConstantsLength())]


def _rich_graph() -> tuple[VkGraph, dict]:
    """A graph using every value type, packed q4gsw layouts, mutable state and memory planning."""
    rng = np.random.default_rng(0)
    N, K, gs = 8, 24, 8
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), gs)
    w4x8 = pack_w4x8(flat, K)
    lora_a = rng.standard_normal((4, K)).astype(np.float32)

    graph = VkGraph()
    ids = {}
    ids["weights"] = graph.add_constant_tensor(flat, Layout.Q4GSW_FLAT, name="layer0.weight")
    ids["prepacked"] = graph.add_constant_tensor(w4x8, Layout.Q4GSW_W4X8, name="layer0.weight_w4x8")
    ids["scales"] = graph.add_constant_tensor(scales, name="layer0.scales")
    ids["odd"] = graph.add_constant_tensor(np.arange(3, dtype=np.uint8), name="three_bytes")
    ids["empty"] = graph.add_constant_tensor(np.zeros((0, 4), np.float32), name="empty")
    ids["labels_const"] = graph.add_constant_tensor(np.array([3, -100, 1], np.int64))
    graph.memory_objects = [MemoryObject(0, 4 * 2 * K), MemoryObject(7, 4 * 2 * N)]
    ids["x"] = graph.add_value(TensorValue(DType.FLOAT32, (2, K), mem_obj_id=0, name="x"))
    ids["y"] = graph.add_value(TensorValue(DType.FLOAT32, (2, N), mem_obj_id=7))
    ids["lora_a"] = graph.add_value(TensorValue(DType.FLOAT32, (4, K), name="lora_A"))
    ids["lora_a_new"] = graph.add_value(TensorValue(DType.FLOAT32, (4, K), storage_of=ids["lora_a"]))  # in place
    # The storage records the backend's passes write: a strided view at an element offset, a reshape
    # view of a planned tensor, and int64 stored as int32 at a byte offset inside a memory object.
    ids["x_t"] = graph.add_value(TensorValue(DType.FLOAT32, (K, 2), storage_of=ids["x"], is_view=True,
                                             view_strides=(1, K), view_offset=0))
    ids["y_flat"] = graph.add_value(TensorValue(DType.FLOAT32, (2 * N,), mem_obj_id=7, storage_of=ids["y"],
                                                is_view=True))
    ids["index"] = graph.add_value(TensorValue(DType.INT64, (3,), mem_obj_id=0, mem_offset=8,
                                               stored_dtype=DType.INT32))
    lora_init = graph.add_constant(lora_a)
    ids["gs"] = graph.add_value(IntValue(gs))
    ids["big_int"] = graph.add_value(IntValue(-(2 ** 62)))
    ids["none"] = graph.add_value(NullValue())
    ids["eps"] = graph.add_value(DoubleValue(1e-8))
    ids["flag"] = graph.add_value(BoolValue(True))
    ids["mode"] = graph.add_value(StringValue("tanh ≈ ünïcode"))
    ids["dims"] = graph.add_value(IntListValue([-1, 0, 2 ** 40]))
    ids["betas"] = graph.add_value(DoubleListValue([0.9, 0.999]))
    ids["mask"] = graph.add_value(BoolListValue([True, False, True]))
    ids["empty_list"] = graph.add_value(IntListValue([]))
    ids["tensors"] = graph.add_value(ValueListValue([ids["x"], ids["y"]]))
    graph.ops = [
        OpCall("vktrain.linear_q4gsw.default", (ids["x"], ids["weights"], ids["scales"], ids["gs"], ids["none"]),
               (ids["y"],)),
        OpCall("vktrain.adamw.default", (ids["lora_a"], ids["betas"], ids["eps"]), (ids["lora_a_new"],)),
    ]
    graph.inputs = [ids["x"]]
    graph.outputs = [ids["y"], ids["tensors"]]
    graph.mutable_state = [MutableState(ids["lora_a"], ids["lora_a_new"], lora_init)]
    graph.metadata = {"source_model": "tiny-test", "planned_memory_bytes": "1234"}
    arrays = {"flat_array": flat, "scales_array": scales, "w4x8_array": w4x8, "K": K}
    return graph, {**ids, **arrays}


def _assert_graphs_equal(actual: VkGraph, expected: VkGraph) -> None:
    assert actual.values == expected.values
    assert actual.ops == expected.ops
    assert list(actual.inputs) == list(expected.inputs)
    assert list(actual.outputs) == list(expected.outputs)
    assert actual.mutable_state == expected.mutable_state
    assert actual.memory_objects == expected.memory_objects
    assert actual.metadata == expected.metadata
    assert len(actual.constants) == len(expected.constants)
    for got, want in zip(actual.constants, expected.constants):
        want_bytes = np.ascontiguousarray(want).tobytes() if isinstance(want, np.ndarray) else bytes(want)
        assert bytes(got) == want_bytes


# --- schema / generated code ---------------------------------------------------------------------

def test_python_enums_match_the_schema():
    for member in DType:
        assert getattr(FbDataType, member.name) == member.value
    assert {k for k in vars(FbDataType) if not k.startswith("_")} == {m.name for m in DType}
    for member in Layout:
        assert getattr(FbTensorLayout, member.name) == member.value
    assert {k for k in vars(FbTensorLayout) if not k.startswith("_")} == {m.name for m in Layout}
    union_members = {k for k in vars(ValueKind) if not k.startswith("_")} - {"NONE"}
    assert union_members == {t.__name__.removesuffix("Value") for t in VALUE_TYPES}


def test_generated_code_is_up_to_date_with_the_schemas():
    assert generate.main(["--check"]) == 0


def test_serialization_and_runtime_never_import_torch_or_executorch():
    assert_import_loads_none(
        ["vktrain.serialization.blob", "vktrain.serialization.graph", "vktrain.serialization.generate"],
        forbidden=["torch", "executorch"])


# --- round trip ----------------------------------------------------------------------------------

def test_round_trip_preserves_every_field():
    graph, _ = _rich_graph()
    parsed = deserialize_blob(serialize_blob(graph))
    _assert_graphs_equal(parsed, graph)


def test_tensor_scalars_read_fast_equal_the_generated_accessors():
    """blob_values.read_value reads a Tensor's scalar fields through table_scalars (one vtable lookup); tensor for
    tensor it gives what the flatc-generated accessors give, absent (default) and optional fields included."""
    from vktrain.serialization.blob_header import BlobHeader
    from vktrain.serialization.blob_values import _TENSOR_SCALARS
    from vktrain.serialization.flatbuffer_reading import table_scalars, union_as
    from vktrain.serialization.generated.vkt_blob import Tensor as FbTensor
    from vktrain.serialization.generated.vkt_blob import VkGraph as FbVkGraph

    graph, _ = _rich_graph()
    blob = serialize_blob(graph)
    header = BlobHeader.parse(memoryview(blob))
    start = header.flatbuffer_offset
    root = FbVkGraph.VkGraph.GetRootAs(blob[start:start + header.flatbuffer_size], 0)
    tensors = [union_as(root.Values(i).Value(), FbTensor.Tensor) for i in range(root.ValuesLength())
               if root.Values(i).ValueType() == ValueKind.Tensor]
    assert {t.StoredDtype() for t in tensors} == {None, DType.INT32} and {t.IsView() for t in tensors} == {True, False}
    for t in tensors:
        assert table_scalars(t, _TENSOR_SCALARS) == [t.Dtype(), t.Layout(), t.ConstantId(), t.MemObjId(),
                                                     t.MemOffset(), t.StorageOf(), t.IsView(), t.ViewOffset(),
                                                     t.StoredDtype()]


def test_constants_come_back_as_zero_copy_views_with_their_values():
    graph, ref = _rich_graph()
    blob = serialize_blob(graph)
    parsed = deserialize_blob(blob)
    blob_array = np.frombuffer(blob, np.uint8)
    for constant in parsed.constants:
        assert isinstance(constant, memoryview)
        if len(constant):
            assert np.shares_memory(np.frombuffer(constant, np.uint8), blob_array)
    np.testing.assert_array_equal(parsed.constant_array(ref["weights"]), ref["flat_array"])
    np.testing.assert_array_equal(parsed.constant_array(ref["scales"]), ref["scales_array"])
    np.testing.assert_array_equal(parsed.constant_array(ref["prepacked"]), ref["w4x8_array"])
    # The stored flat codes still decode to the quantizer's codes (layout untouched by the container).
    np.testing.assert_array_equal(unpack_flat(parsed.constant_array(ref["weights"]), ref["K"]),
                                  unpack_flat(ref["flat_array"], ref["K"]))
    assert parsed.constant_array(ref["empty"]).shape == (0, 4)


def test_serialization_is_deterministic_and_ignores_metadata_order():
    graph, _ = _rich_graph()
    first = serialize_blob(graph)
    graph.metadata = dict(reversed(list(graph.metadata.items())))
    assert serialize_blob(graph) == first


def test_empty_graph_round_trips():
    blob = serialize_blob(VkGraph())
    _assert_graphs_equal(deserialize_blob(blob), VkGraph())
    assert _raw_header(blob)["seg_size"] == 0


# --- byte layout ---------------------------------------------------------------------------------

def test_header_fields_and_16_byte_alignment():
    graph, _ = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    assert (h["magic"], h["size"], h["version"], h["flags"]) == (b"VKTB", 56, 1, 1)
    assert GRAPH_CRC32.unpack_from(blob, 48)[0] == _graph_crc32(blob)
    assert h["fb_off"] >= 56 and h["fb_off"] % 16 == 0
    assert h["seg_off"] >= h["fb_off"] + h["fb_size"] and h["seg_off"] % 16 == 0
    assert h["seg_off"] + h["seg_size"] == len(blob)
    assert blob[h["fb_off"] + 4:h["fb_off"] + 8] == b"VKT1"  # flatbuffer file identifier
    covered = np.zeros(h["seg_size"], bool)
    for (offset, length), crc32, data in zip(_constant_records(blob), _constant_crc32_records(blob), graph.constants):
        assert offset % 16 == 0
        assert (h["seg_off"] + offset) % 16 == 0
        start = h["seg_off"] + offset
        assert blob[start:start + length] == np.ascontiguousarray(data).tobytes()
        assert crc32 == zlib.crc32(np.ascontiguousarray(data).tobytes())
        covered[offset:offset + length] = True
    # Everything in the segment area that is not constant data is zero padding.
    segment = np.frombuffer(blob, np.uint8, h["seg_size"], h["seg_off"])
    assert not segment[~covered].any()
    assert not np.frombuffer(blob, np.uint8, h["fb_off"] - 52, 52).any()


def test_weights_live_outside_the_flatbuffer():
    graph = VkGraph()
    graph.add_constant_tensor(np.ones((512, 512), np.float32))  # 1 MiB
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    assert h["fb_size"] < 1024
    assert h["seg_size"] == 512 * 512 * 4


def test_equal_constants_are_stored_once():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((64, 64)).astype(np.float32)  # 16 KiB
    graph = VkGraph()
    first = graph.add_constant_tensor(weight)
    second = graph.add_constant_tensor(weight.copy())  # equal content, different object
    as_bytes = graph.add_constant(weight.tobytes())  # same bytes given as bytes
    near = weight.copy()
    near[-1, -1] = np.nextafter(near[-1, -1], np.float32(np.inf))  # differs in one ulp
    distinct = graph.add_constant_tensor(near)
    blob = serialize_blob(graph)

    records = _constant_records(blob)
    first_record, second_record, near_record = (records[graph.tensor(v).constant_id] for v in (first, second, distinct))
    assert first_record == second_record == records[as_bytes]
    assert near_record[0] != first_record[0]
    total_constant_bytes = 4 * weight.nbytes
    assert len(blob) < total_constant_bytes
    assert _raw_header(blob)["seg_size"] == 2 * weight.nbytes
    parsed = deserialize_blob(blob)
    np.testing.assert_array_equal(parsed.constant_array(first), weight)
    np.testing.assert_array_equal(parsed.constant_array(second), weight)
    np.testing.assert_array_equal(parsed.constant_array(distinct), near)


def test_non_contiguous_numpy_constants_are_stored_in_row_major_order():
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    graph = VkGraph()
    transposed = graph.add_constant_tensor(base.T)
    parsed = deserialize_blob(serialize_blob(graph))
    np.testing.assert_array_equal(parsed.constant_array(transposed), base.T)


# --- streaming -----------------------------------------------------------------------------------

def test_write_blob_streams_the_same_bytes(tmp_path):
    graph, ref = _rich_graph()
    expected = serialize_blob(graph)
    buffer = io.BytesIO()
    assert write_blob(graph, buffer) == len(expected)
    assert buffer.getvalue() == expected

    path = tmp_path / "graph.vkt"
    with open(path, "wb") as f:
        write_blob(graph, f)
    parsed = read_blob(path)
    _assert_graphs_equal(parsed, graph)
    np.testing.assert_array_equal(parsed.constant_array(ref["scales"]), ref["scales_array"])


def test_read_blob_refuses_an_empty_file(tmp_path):
    path = tmp_path / "empty.vkt"
    path.write_bytes(b"")
    with pytest.raises(BlobFormatError, match="empty"):
        read_blob(path)


# --- bad input -----------------------------------------------------------------------------------

def _patch_header(blob: bytes, **fields) -> bytes:
    """`blob` with header fields replaced and the graph checksum re-signed (so the field check speaks)."""
    h = _raw_header(blob)
    h.update(fields)
    patched = HEADER.pack(*h.values()) + blob[HEADER.size:]
    return _resign(patched) if len(patched) >= HEADER.size + GRAPH_CRC32.size else patched


@pytest.mark.parametrize("fields, message", [
    (dict(magic=b"VKTX"), "magic"),
    (dict(version=2), "version"),
    (dict(size=64), "header_size"),
    (dict(size=48), "header_size"),  # a checksummed blob may not pass for one written before checksums
    (dict(flags=5), "flags"),
    (dict(fb_off=8), "flatbuffer_offset"),
    (dict(fb_off=56), "flatbuffer_offset"),
    (dict(fb_size=4), "flatbuffer_size"),
    (dict(fb_size=1 << 40), "past the end"),
    (dict(seg_off=16), "segment_offset"),
    (dict(seg_size=1 << 40), "past the end"),
    (dict(seg_size=16), "constant"),  # constants now extend past the shrunken segment area
])
def test_corrupt_header_fields_are_named(fields, message):
    graph, _ = _rich_graph()
    blob = _patch_header(serialize_blob(graph), **fields)
    with pytest.raises(BlobFormatError, match=message):
        deserialize_blob(blob)


def test_every_truncation_is_refused():
    graph, _ = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    cuts = {0, 1, 47, 48, h["fb_off"], h["fb_off"] + 8, h["fb_off"] + h["fb_size"] - 1, h["seg_off"],
            len(blob) - 1}
    cuts |= set(range(0, len(blob), 37))
    for cut in sorted(cuts):
        if cut < len(blob):
            with pytest.raises(BlobFormatError):
                deserialize_blob(blob[:cut])


def test_wrong_flatbuffer_identifier_is_refused():
    graph, _ = _rich_graph()
    blob = bytearray(serialize_blob(graph))
    fb_off = _raw_header(bytes(blob))["fb_off"]
    blob[fb_off + 4:fb_off + 8] = b"VKT9"
    with pytest.raises(BlobFormatError, match="identifier"):
        deserialize_blob(_resign(bytes(blob)))


def test_random_flatbuffer_corruption_raises_only_blob_format_error():
    # Python flatbuffers has no verifier: corruption must still surface as BlobFormatError (or, when the
    # flipped byte is harmless, as a graph that passes validation), never as a stray exception type.
    graph, _ = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    rng = np.random.default_rng(2)
    refused = 0
    for _ in range(300):
        corrupt = bytearray(blob)
        position = int(rng.integers(h["fb_off"] + 8, h["fb_off"] + h["fb_size"]))
        corrupt[position] ^= int(rng.integers(1, 256))
        try:
            # Re-signed: the graph checksum alone would refuse every one of them before parsing.
            parsed = deserialize_blob(_resign(bytes(corrupt)))
        except BlobFormatError:
            refused += 1
        else:
            parsed.validate()
    assert refused > 0


# --- integrity -----------------------------------------------------------------------------------

def test_any_edit_of_the_header_fields_or_the_graph_is_refused_by_the_graph_checksum():
    graph, _ = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    # Header fields that pass their own bounds checks, and every byte of the flatbuffer past its identifier.
    edits = [("segment_size", 40, (h["seg_size"] - 16).to_bytes(8, "little"))]
    edits += [(f"flatbuffer byte {p}", p, bytes([blob[p] ^ 0x10])) for p in range(h["fb_off"] + 8, h["fb_off"] + h["fb_size"])]
    for what, position, replacement in edits:
        corrupt = blob[:position] + replacement + blob[position + len(replacement):]
        with pytest.raises(BlobFormatError, match="graph checksum mismatch") as caught:
            deserialize_blob(corrupt)
        assert f"{h['fb_size']}-byte graph flatbuffer" in str(caught.value), what


def test_a_changed_constant_byte_is_refused_naming_the_constant_unless_verification_is_off():
    graph, ref = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    constant_id = graph.tensor(ref["scales"]).constant_id
    offset, length = _constant_records(blob)[constant_id]
    corrupt = bytearray(blob)
    corrupt[h["seg_off"] + offset + length - 1] ^= 0x01  # one bit of the last scale
    with pytest.raises(BlobFormatError, match=rf"constant {constant_id} \(read by tensor value {ref['scales']} "
                                              rf"\(layer0.scales\)\): crc32 of its {length} bytes"):
        deserialize_blob(bytes(corrupt))
    unchecked = deserialize_blob(bytes(corrupt), verify_constants=False)
    assert not np.array_equal(unchecked.constant_array(ref["scales"]), ref["scales_array"])  # what the check catches


def test_blobs_written_before_checksums_existed_are_still_read():
    graph, ref = _rich_graph()
    blob = serialize_blob(graph)
    h = _raw_header(blob)
    legacy = bytearray(_patch_header(blob, size=48, flags=0))  # the old header; its flatbuffer is at fb_off
    legacy[48:52] = bytes(4)
    parsed = deserialize_blob(bytes(legacy))
    _assert_graphs_equal(parsed, graph)
    np.testing.assert_array_equal(parsed.constant_array(ref["scales"]), ref["scales_array"])
    assert h["fb_off"] >= 48


@pytest.mark.parametrize("mutate, message", [
    (lambda g, r: g.ops.append(OpCall("vktrain.linear_dW.default", (r["x"], 999), (r["y"],))), "out of range"),
    (lambda g, r: g.ops.append(OpCall("", (r["x"],), (r["y"],))), "empty name"),
    (lambda g, r: g.values.__setitem__(r["weights"], TensorValue(DType.FLOAT32, (8, 12), Layout.Q4GSW_FLAT, 0)),
     "Q4GSW_FLAT"),
    (lambda g, r: g.values.__setitem__(r["scales"], TensorValue(DType.FLOAT32, (3, 9), constant_id=2)),
     "needs 108"),
    (lambda g, r: g.values.__setitem__(r["scales"], TensorValue(DType.FLOAT32, (3, 8), constant_id=42)),
     "constant_id 42"),
    (lambda g, r: g.values.__setitem__(r["y"], TensorValue(DType.FLOAT32, (4, 8), mem_obj_id=7)),
     "memory object 7"),
    (lambda g, r: g.values.__setitem__(r["y"], TensorValue(DType.FLOAT32, (2, 8), mem_obj_id=3)),
     "mem_obj_id 3"),
    (lambda g, r: g.memory_objects.append(MemoryObject(7, 16)), "unique"),
    (lambda g, r: g.values.__setitem__(r["index"], TensorValue(DType.INT64, (3,), mem_obj_id=0, mem_offset=190,
                                                               stored_dtype=DType.INT32)),
     r"occupies bytes \[190, 202\) of memory object 0, which has 192"),
    (lambda g, r: g.values.__setitem__(r["y"], TensorValue(DType.FLOAT32, (2, 8), storage_of=r["gs"])),
     "which must be a tensor with storage of its own"),
    (lambda g, r: g.values.__setitem__(r["y"], TensorValue(DType.FLOAT32, (2, 8), storage_of=r["y_flat"])),
     "which must be a tensor with storage of its own"),
    (lambda g, r: g.values.__setitem__(r["y"], TensorValue(DType.FLOAT32, (2, 8), is_view=True)),
     "is a view but has no storage_of"),
    (lambda g, r: g.values.__setitem__(r["x_t"], TensorValue(DType.FLOAT32, (r["K"], 2), storage_of=r["x"],
                                                             is_view=True, view_strides=(1,))),
     r"view strides \[1\]: strides belong to a view and need one per dim"),
    (lambda g, r: g.values.__setitem__(r["x_t"], TensorValue(DType.INT64, (r["K"], 2), storage_of=r["x"],
                                                             is_view=True)),
     "must have the same stored bytes"),
    (lambda g, r: g.mutable_state.append(MutableState(r["x"], r["y"])), "update value"),
    (lambda g, r: g.mutable_state.append(MutableState(r["gs"], r["gs"])), "expected TensorValue"),
    (lambda g, r: g.mutable_state.__setitem__(0, MutableState(r["lora_a"], r["lora_a_new"], 3)),
     "initial constant 3"),
    (lambda g, r: g.outputs.append(-1), "graph outputs"),
    (lambda g, r: g.values.append(ValueListValue([len(g.values) + 5])), "ValueList"),
    (lambda g, r: g.metadata.__setitem__("n", 3), "str to str"),
])
def test_inconsistent_graphs_are_refused_on_write(mutate, message):
    graph, ref = _rich_graph()
    mutate(graph, ref)
    with pytest.raises(GraphError, match=message):
        serialize_blob(graph)


def test_unknown_dtype_or_layout_is_refused():
    with pytest.raises(GraphError, match="99 is not a valid DType"):
        TensorValue(99, (2,))
    with pytest.raises(GraphError, match="7 is not a valid Layout"):
        TensorValue(DType.UINT8, (2,), layout=7)


def test_bad_constant_types_are_refused():
    graph = VkGraph()
    with pytest.raises(GraphError, match="not bytes"):
        graph.add_constant([1, 2, 3])
    with pytest.raises(GraphError, match="big-endian"):
        graph.add_constant(np.arange(4, dtype=">f4"))
    with pytest.raises(GraphError, match="no vktrain DType"):
        graph.add_constant_tensor(np.zeros(2, np.complex64))
    assert graph.constants == [] and graph.values == []


def test_generate_check_reports_a_stale_or_missing_file(tmp_path):
    job = generate.schema_jobs()[0]
    (tmp_path / "scratch").mkdir()
    fresh = generate.generate_into(job, generate.find_flatc(), tmp_path / "scratch")
    committed = tmp_path / "committed"
    shutil.copytree(fresh, committed)
    assert generate._differences(fresh, committed) == []
    (committed / "Tensor.py").write_text("# edited by hand\n")
    (committed / "ConstantData.py").unlink()
    problems = generate._differences(fresh, committed)
    assert any("out of date" in p and p.endswith("Tensor.py") for p in problems)
    assert any("missing" in p and p.endswith("ConstantData.py") for p in problems)

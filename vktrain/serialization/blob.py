"""The vktrain delegate blob: a fixed header, the graph flatbuffer, then the constant segment area.

Byte layout (all integers little-endian; every region starts at a multiple of 16 bytes; the header's
parsing and bounds checks live in blob_header.py):

    offset  size  field
    0       4     magic              b"VKTB"
    4       4     header_size        uint32, 56 with the CHECKSUMS flag, else 48
    8       4     format_version     uint32, 1, or 2 when the graph holds synthetic constants
    12      4     flags              uint32, bit 0 CHECKSUMS (every blob this vktrain writes), bit 1 NAMED_DATA
    16      8     flatbuffer_offset  uint64, >= header_size, multiple of 16
    24      8     flatbuffer_size    uint64, bytes of the flatbuffer (schema.fbs, identifier "VKT1")
    32      8     segment_offset     uint64, >= flatbuffer end, multiple of 16
    40      8     segment_size       uint64, bytes of the segment area (a multiple of 16)
    48      4     graph_crc32        uint32, CHECKSUMS only: CRC-32 of bytes [0, 48) and of the flatbuffer
    52      4     (zero)
    then zero padding, the flatbuffer, zero padding, the segment area.

Integrity (CHECKSUMS flag): graph_crc32 covers the header fields and the whole graph flatbuffer
(every shape, dtype, op wiring, scalar and constant record), and each `ConstantData.crc32` covers its
constant's bytes. CRC-32 detects every error burst of up to 32 bits and any other random corruption
with probability 1 - 2^-32; it is not a defence against deliberate tampering. The reader always checks
the graph (cheap) and checks constants unless asked not to (`verify_constants=False`: gigabytes of
weights take a while to hash). Blobs written before the flag existed (flags 0) are still read, without
either check; vktrain versions from before the flag refuse the new blobs ("header flags are 0x1").

The segment area holds constant data outside the flatbuffer, so weights never pass through a
flatbuffer (whose offsets are 32-bit). Each `ConstantData(offset, length)` record of the flatbuffer
points at a 16-byte-aligned range, offset relative to segment_offset. Constants with identical bytes are
stored once: several constant ids may then point at the same range.

Format version 2 (benchmark blobs) adds synthetic constants: a `ConstantData` record whose `synthetic`
table describes data generated at load (graph.SyntheticConstant), with offset = length = 0 and nothing
in the segment area. A reader of version 1 would ignore that table and misread the graph, so such blobs
say version 2, which version-1 readers refuse by name. Every other blob is still written as version 1
(readable by older vktrain), and a reader refuses either version when it disagrees with the content.

Named constants (header flag NAMED_DATA): `serialize_blob(graph, named_constants(graph, min_bytes))`
leaves those constants' bytes to the .pte's named data (one copy for every method of the .pte); their
record carries `named_key`, and `deserialize_blob(..., named_data=...)` resolves and checksums them.

Embedded schedules (`vktrain export --target`; serialization/embedded.py): the graph flatbuffer's
`schedules` (per target device profile: the profile as JSON, the Schedule's "VKS1" bytes, each dispatch's
module id) and `shader_modules` (each kernel variant's SPIR-V or WGSL once, with its reflection). They are
fields of the graph flatbuffer, so graph_crc32 covers them; a blob without them is written byte for byte as
before, and an older reader ignores them and plans at load. `read_for_rewrite` reads a blob for
`serialize_blob` to write it again with them (its named constants kept named).

`deserialize_blob` bounds-checks every header field and every constant record, validates the graph
(every id it references exists, constant sizes match their tensors) and returns constants as zero-copy
memoryviews into the given buffer; `read_blob` does the same over an mmap of a file.
"""
from __future__ import annotations

import hashlib
import io
import mmap
import zlib
import dataclasses
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Mapping

import flatbuffers
import numpy as np

from vktrain.serialization import graph as g
from vktrain.serialization.generated.vkt_blob import ConstantData as FbConstantData
from vktrain.serialization.generated.vkt_blob import MemoryObject as FbMemoryObject
from vktrain.serialization.generated.vkt_blob import MetadataEntry as FbMetadataEntry
from vktrain.serialization.generated.vkt_blob import MutableState as FbMutableState
from vktrain.serialization.generated.vkt_blob import OpCall as FbOpCall
from vktrain.serialization.generated.vkt_blob import Tensor as FbTensor
from vktrain.serialization.generated.vkt_blob import VkGraph as FbVkGraph
from vktrain.serialization.blob_values import build_synthetic, build_value, read_synthetic, read_value
from vktrain.serialization.blob_embedded import (build_embedded_schedule, build_shader_module, read_embedded_schedule,
                                                 read_shader_module)
from vktrain.serialization.flatbuffer_building import numpy_vector, table_vector
from vktrain.serialization.flatbuffer_reading import CORRUPTION_ERRORS, reading, scalar_vector, text, union_as
from vktrain.serialization.generated.vkt_blob.ValueKind import ValueKind

from vktrain.serialization.blob_header import (  # noqa: F401  (re-exported: blob.X names them)
    ALIGNMENT, FLATBUFFER_IDENTIFIER, BlobFormatError, BlobHeader, _align)


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------

@dataclass
class _Layout:
    """Everything needed to emit a blob: header, flatbuffer and the unique segments in file order."""

    header: BlobHeader
    flatbuffer: bytes
    segments: list[tuple[int, memoryview]]  # (offset in the segment area, bytes), ascending offsets

    @property
    def total_size(self) -> int:
        return self.header.segment_offset + self.header.segment_size


NAMED_KEY_PREFIX = "vktrain.sha256."


def named_constants(graph: g.VkGraph, min_bytes: int) -> dict[int, tuple[str, memoryview]]:
    """Constant id -> (named-data key, bytes) of every stored constant of at least `min_bytes`: what a
    blob written with `serialize_blob(graph, named=...)` leaves to the .pte's named data. The key names
    the content (sha256), so every method of a .pte that holds the same bytes refers to one copy."""
    named = {}
    for constant_id, data in enumerate(graph.constants):
        if isinstance(data, g.SyntheticConstant):
            continue
        view = g.stored_bytes(data)
        if view.nbytes >= min_bytes:
            named[constant_id] = (NAMED_KEY_PREFIX + hashlib.sha256(view).hexdigest(), view)
    return named


def _plan_segments(constants: list, named: dict[int, tuple[str, memoryview]]
                   ) -> tuple[list[tuple[int, int, int, str | None]], list[tuple[int, memoryview]], int]:
    """Place constants in the segment area, storing identical bytes once; those in `named` stay outside.

    Returns the (offset, length, crc32, named key) record of each constant id ((0, 0, 0, None) for a
    synthetic constant, which has no bytes; offset 0 and the key for a named one), the unique segments to
    write, and the size of the segment area.
    """
    records: list[tuple[int, int, int, str | None]] = []
    segments: list[tuple[int, memoryview]] = []
    by_digest: dict[tuple[int, bytes], list[int]] = {}  # (length, sha256) -> indices into `segments`
    end = 0
    for constant_id, data in enumerate(constants):
        if isinstance(data, g.SyntheticConstant):
            records.append((0, 0, 0, None))
            continue
        view = g.stored_bytes(data)
        if constant_id in named:
            records.append((0, view.nbytes, zlib.crc32(view), named[constant_id][0]))
            continue
        key = (view.nbytes, hashlib.sha256(view).digest())
        match = None
        for index in by_digest.get(key, ()):
            # Confirm byte equality: dedup must never depend on a hash alone.
            if np.array_equal(np.frombuffer(segments[index][1], np.uint8), np.frombuffer(view, np.uint8)):
                match = segments[index][0]
                break
        if match is None:
            match = end
            by_digest.setdefault(key, []).append(len(segments))
            segments.append((end, view))
            end = _align(end + view.nbytes)
        records.append((match, view.nbytes, zlib.crc32(view), None))
    return records, segments, end


def _build_flatbuffer(graph: g.VkGraph, constant_records: list[tuple[int, int, int, str | None]]) -> bytes:
    builder = flatbuffers.Builder(4096)
    values = [build_value(builder, value) for value in graph.values]

    ops = []
    for op in graph.ops:
        name = builder.CreateSharedString(op.name)
        args = numpy_vector(builder, op.args, np.int32)
        outputs = numpy_vector(builder, op.outputs, np.int32)
        FbOpCall.Start(builder)
        FbOpCall.AddName(builder, name)
        FbOpCall.AddArgs(builder, args)
        FbOpCall.AddOutputs(builder, outputs)
        ops.append(FbOpCall.End(builder))

    states = []
    for state in graph.mutable_state:
        FbMutableState.Start(builder)
        FbMutableState.AddStateId(builder, state.state_id)
        FbMutableState.AddUpdateId(builder, state.update_id)
        FbMutableState.AddInitialConstantId(builder, state.initial_constant_id)
        states.append(FbMutableState.End(builder))

    constants = []
    for (offset, length, crc32, named_key), data in zip(constant_records, graph.constants):
        synthetic = build_synthetic(builder, data) if isinstance(data, g.SyntheticConstant) else None
        key = builder.CreateString(named_key) if named_key is not None else None
        FbConstantData.Start(builder)
        FbConstantData.AddOffset(builder, offset)
        FbConstantData.AddLength(builder, length)
        FbConstantData.AddCrc32(builder, crc32)
        if synthetic is not None:
            FbConstantData.AddSynthetic(builder, synthetic)
        if key is not None:
            FbConstantData.AddNamedKey(builder, key)
        if isinstance(data, g.NarrowConstant):
            if data.stored_dtype is not None:
                FbConstantData.AddStoredDtype(builder, int(data.stored_dtype))
            FbConstantData.AddStoredEncoding(builder, int(data.encoding))  # not written when ELEMENTS (the default)
        constants.append(FbConstantData.End(builder))

    memory_objects = []
    for mem in graph.memory_objects:
        FbMemoryObject.Start(builder)
        FbMemoryObject.AddId(builder, mem.id)
        FbMemoryObject.AddSizeBytes(builder, mem.size_bytes)
        memory_objects.append(FbMemoryObject.End(builder))

    metadata = []
    for key in sorted(graph.metadata):  # sorted: the same graph always gives the same bytes
        key_offset = builder.CreateString(key)
        value_offset = builder.CreateString(graph.metadata[key])
        FbMetadataEntry.Start(builder)
        FbMetadataEntry.AddKey(builder, key_offset)
        FbMetadataEntry.AddValue(builder, value_offset)
        metadata.append(FbMetadataEntry.End(builder))

    modules = [build_shader_module(builder, module) for module in graph.shader_modules]
    schedules = [build_embedded_schedule(builder, embedded) for embedded in graph.schedules]

    # A flatbuffer table cannot be open while vectors are built, so build all of them first.
    vectors = {
        "values": table_vector(builder, values),
        "chain": table_vector(builder, ops),
        "input_ids": numpy_vector(builder, graph.inputs, np.int32),
        "output_ids": numpy_vector(builder, graph.outputs, np.int32),
        "mutable_state": table_vector(builder, states),
        "constants": table_vector(builder, constants),
        "memory_objects": table_vector(builder, memory_objects),
        "metadata": table_vector(builder, metadata),
        "schedules": table_vector(builder, schedules) if schedules else None,
        "shader_modules": table_vector(builder, modules) if modules else None,
    }
    FbVkGraph.Start(builder)
    FbVkGraph.AddValues(builder, vectors["values"])
    FbVkGraph.AddChain(builder, vectors["chain"])
    FbVkGraph.AddInputIds(builder, vectors["input_ids"])
    FbVkGraph.AddOutputIds(builder, vectors["output_ids"])
    FbVkGraph.AddMutableState(builder, vectors["mutable_state"])
    FbVkGraph.AddConstants(builder, vectors["constants"])
    FbVkGraph.AddMemoryObjects(builder, vectors["memory_objects"])
    FbVkGraph.AddMetadata(builder, vectors["metadata"])
    if schedules:  # absent, not empty, without targets: such a blob's bytes are those from before the fields
        FbVkGraph.AddSchedules(builder, vectors["schedules"])
        FbVkGraph.AddShaderModules(builder, vectors["shader_modules"])
    builder.Finish(FbVkGraph.End(builder), file_identifier=FLATBUFFER_IDENTIFIER)
    return bytes(builder.Output())


def _plan_blob(graph: g.VkGraph, named: dict[int, tuple[str, memoryview]]) -> _Layout:
    if not isinstance(graph, g.VkGraph):
        raise TypeError(f"expected a VkGraph, got {type(graph).__name__}")
    graph.validate()
    records, segments, segment_size = _plan_segments(graph.constants, named)
    flatbuffer = _build_flatbuffer(graph, records)
    flatbuffer_offset = _align(BlobHeader.CHECKSUMMED_SIZE)
    segment_offset = _align(flatbuffer_offset + len(flatbuffer))
    version = BlobHeader.SYNTHETIC_VERSION if graph.synthetic_constant_ids else BlobHeader.PLAIN_VERSION
    fields = BlobHeader(flatbuffer_offset, len(flatbuffer), segment_offset, segment_size, version, graph_crc32=0,
                        named_data=bool(named))
    header = dataclasses.replace(fields, graph_crc32=_graph_crc32(fields, flatbuffer))
    return _Layout(header, flatbuffer, segments)


def _graph_crc32(header: BlobHeader, flatbuffer) -> int:
    return zlib.crc32(flatbuffer, zlib.crc32(header.fields_bytes()))


def _chunks(layout: _Layout) -> Iterator[tuple[int, memoryview | bytes]]:
    """(absolute offset, bytes) of every non-padding piece of the blob, in ascending order."""
    yield 0, layout.header.to_bytes()
    yield layout.header.flatbuffer_offset, layout.flatbuffer
    for offset, data in layout.segments:
        yield layout.header.segment_offset + offset, data


def serialize_blob(graph: g.VkGraph, named: dict[int, tuple[str, memoryview]] | None = None) -> bytes:
    """The blob bytes of `graph` (validated first: an inconsistent graph raises GraphError); the constants in
    `named` (named_constants()) are left to the .pte's named data, referred to by key."""
    out = io.BytesIO()
    write_blob(graph, out, named)
    return out.getvalue()  # hands over BytesIO's buffer without another copy


def write_blob(graph: g.VkGraph, fileobj: BinaryIO, named: dict[int, tuple[str, memoryview]] | None = None) -> int:
    """Stream the blob of `graph` to a binary file object without assembling it in memory.

    Returns the number of bytes written. Each constant is written straight from its own buffer.
    """
    layout = _plan_blob(graph, named or {})
    position = 0
    for offset, data in _chunks(layout):
        if offset > position:
            fileobj.write(bytes(offset - position))
        fileobj.write(data)
        position = offset + len(data)
    if layout.total_size > position:
        fileobj.write(bytes(layout.total_size - position))
    return layout.total_size


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------

def _read_graph(flatbuffer: memoryview, segment_area: memoryview, verify_constants: bool,
                named_data: Mapping[str, memoryview] | None) -> g.VkGraph:
    """The graph; with `verify_constants`, each constant's crc32 is checked as soon as its record is read,
    before the rest of the graph is parsed."""
    root = FbVkGraph.VkGraph.GetRootAs(flatbuffer, 0)
    graph = g.VkGraph()
    graph.constants = _read_constants(root, segment_area, verify_constants, named_data)
    for i in range(root.ValuesLength()):
        with reading(f"VkGraph.values[{i}]", BlobFormatError):
            graph.values.append(read_value(root.Values(i), i))
    for i in range(root.ChainLength()):
        with reading(f"VkGraph.chain[{i}]", BlobFormatError):
            op = root.Chain(i)
            graph.ops.append(g.OpCall(text(op.Name()), scalar_vector(op, "Args"), scalar_vector(op, "Outputs")))
    with reading("VkGraph.input_ids / output_ids", BlobFormatError):
        graph.inputs = list(scalar_vector(root, "InputIds"))
        graph.outputs = list(scalar_vector(root, "OutputIds"))
    for i in range(root.MutableStateLength()):
        with reading(f"VkGraph.mutable_state[{i}]", BlobFormatError):
            state = root.MutableState(i)
            graph.mutable_state.append(g.MutableState(state.StateId(), state.UpdateId(), state.InitialConstantId()))
    for i in range(root.MemoryObjectsLength()):
        with reading(f"VkGraph.memory_objects[{i}]", BlobFormatError):
            mem = root.MemoryObjects(i)
            graph.memory_objects.append(g.MemoryObject(mem.Id(), mem.SizeBytes()))
    for i in range(root.MetadataLength()):
        with reading(f"VkGraph.metadata[{i}]", BlobFormatError):
            entry = root.Metadata(i)
            key = text(entry.Key())
            if key in graph.metadata:
                raise BlobFormatError(f"metadata key {key!r} appears twice")
            graph.metadata[key] = text(entry.Value())
    graph.shader_modules = [read_shader_module(root, i) for i in range(root.ShaderModulesLength())]
    graph.schedules = [read_embedded_schedule(root, i) for i in range(root.SchedulesLength())]
    return graph


def _read_constants(root, segment_area: memoryview, verify: bool, named_data: Mapping[str, memoryview] | None) -> list:
    constants = []
    hashed: dict[tuple[int, int], int] = {}  # deduplicated constants share a range: hash it once
    for i in range(root.ConstantsLength()):
        with reading(f"VkGraph.constants[{i}]", BlobFormatError):
            record = root.Constants(i)
            offset, length, crc32 = record.Offset(), record.Length(), record.Crc32()
            synthetic, named_key = record.Synthetic(), text(record.NamedKey())
            stored_dtype, encoding = record.StoredDtype(), record.StoredEncoding()
        if synthetic is not None:
            if stored_dtype is not None or encoding != g.ConstantEncoding.ELEMENTS:
                raise BlobFormatError(f"constant {i} is synthetic but has stored_dtype {stored_dtype} / stored_encoding "
                                      f"{encoding} (expected neither: it has no stored bytes)")
            if offset or length:
                raise BlobFormatError(f"constant {i} is synthetic but also has segment bytes "
                                      f"(offset {offset}, length {length}; expected 0, 0)")
            with reading(f"VkGraph.constants[{i}].synthetic", BlobFormatError):
                constants.append(read_synthetic(synthetic, i))
            continue
        if named_key:
            data = _named_constant(i, named_key, offset, length, named_data)
        else:
            if offset % ALIGNMENT:
                raise BlobFormatError(f"constant {i} offset {offset} is not a multiple of {ALIGNMENT}")
            if offset + length > len(segment_area):
                raise BlobFormatError(f"constant {i} [{offset}, {offset + length}) extends past the "
                                      f"{len(segment_area)}-byte segment area")
            data = segment_area[offset:offset + length]
        if verify:
            actual = zlib.crc32(data) if named_key else hashed.get((offset, length))
            if actual is None:
                actual = hashed[offset, length] = zlib.crc32(data)
            if actual != crc32:
                raise BlobFormatError(f"constant {i} (read by {_constant_reader(root, i)}): crc32 of its {length} bytes "
                                      f"is {actual:#010x}, its record says {crc32:#010x} (the constant data "
                                      "was modified or corrupted)")
        try:
            constants.append(g.stored_constant(data, stored_dtype, encoding))
        except g.GraphError as exc:
            raise BlobFormatError(f"constant {i} (read by {_constant_reader(root, i)}): {exc}") from None
    return constants


def _named_constant(constant_id: int, key: str, offset: int, length: int,
                    named_data: Mapping[str, memoryview] | None) -> memoryview:
    """The bytes of a constant kept in the .pte's named data (schema.fbs ConstantData.named_key)."""
    if named_data is None:
        raise BlobFormatError(f"constant {constant_id} lives in the .pte's named data (key {key!r}), but no named "
                              f"data was given: read the blob with the .pte around it")
    if offset:
        raise BlobFormatError(f"constant {constant_id} is named data {key!r} but has segment offset {offset} "
                              f"(expected 0)")
    if key not in named_data:
        raise BlobFormatError(f"constant {constant_id} names data {key!r}, which the .pte does not hold "
                              f"({len(named_data)} named data entries)")
    data = memoryview(named_data[key]).cast("B")
    if data.nbytes < length:
        raise BlobFormatError(f"constant {constant_id}: named data {key!r} has {data.nbytes} bytes, its record "
                              f"says {length}")
    return data[:length]


def _constant_reader(root, constant_id: int) -> str:
    """The first tensor value reading `constant_id`, for an error message."""
    for value_id in range(root.ValuesLength()):
        fb_value = root.Values(value_id)
        if fb_value.ValueType() == ValueKind.Tensor:
            tensor = union_as(fb_value.Value(), FbTensor.Tensor)
            if tensor.ConstantId() == constant_id:
                return f"tensor value {value_id} ({text(tensor.Name()) or 'unnamed'})"
    return "no tensor: a state's initial value, or unused"


def _verify_graph_checksum(header: BlobHeader, flatbuffer: memoryview) -> None:
    if header.graph_crc32 is None:
        return
    actual = _graph_crc32(header, flatbuffer)
    if actual != header.graph_crc32:
        raise BlobFormatError(f"graph checksum mismatch: header graph_crc32 is {header.graph_crc32:#010x}, the header "
                              f"fields and the {len(flatbuffer)}-byte graph flatbuffer give {actual:#010x} "
                              "(the graph was modified or corrupted)")


def deserialize_blob(data: bytes | bytearray | memoryview | mmap.mmap, *, verify_constants: bool = True,
                     named_data: Mapping[str, memoryview] | None = None) -> g.VkGraph:
    """Parse a blob. Constants come back as memoryviews into `data` (no copy): keep `data` alive.

    The graph checksum is always verified (when the blob has one); `verify_constants=False` skips
    hashing the constant bytes. `named_data` (key -> bytes: the .pte's named data) holds the constants
    the blob refers to by key (header flag NAMED_DATA); their views point into it."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"expected bytes-like blob data, got {type(data).__name__}") from None
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    header = BlobHeader.parse(view)
    flatbuffer = view[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size]
    _verify_graph_checksum(header, flatbuffer)
    identifier = bytes(flatbuffer[4:8])
    if identifier != FLATBUFFER_IDENTIFIER:
        raise BlobFormatError(f"flatbuffer file identifier is {identifier!r}, expected {FLATBUFFER_IDENTIFIER!r} "
                              "(graph written with an incompatible schema version)")
    segment_area = view[header.segment_offset:header.segment_offset + header.segment_size]
    try:
        graph = _read_graph(flatbuffer, segment_area, verify_constants and header.graph_crc32 is not None, named_data)
    except BlobFormatError:
        raise
    except CORRUPTION_ERRORS as exc:  # outside every field: the root table itself
        raise BlobFormatError(f"graph flatbuffer is corrupt at its root table ({type(exc).__name__}: {exc})") from None
    synthetic = graph.synthetic_constant_ids
    if synthetic and header.format_version < BlobHeader.SYNTHETIC_VERSION:
        raise BlobFormatError(f"blob format version {header.format_version} cannot hold synthetic constants, but "
                              f"constants {synthetic[:5]} are synthetic (expected version "
                              f"{BlobHeader.SYNTHETIC_VERSION})")
    if not synthetic and header.format_version == BlobHeader.SYNTHETIC_VERSION:
        raise BlobFormatError(f"blob format version {header.format_version} is written only for graphs with "
                              f"synthetic constants, and this one has none (header corrupt?)")
    try:
        graph.validate()
    except g.GraphError as exc:
        raise BlobFormatError(f"blob holds an inconsistent graph: {exc}") from None
    return graph


def read_for_rewrite(data: bytes | bytearray | memoryview, named_data: Mapping[str, memoryview] | None = None
                     ) -> tuple[g.VkGraph, dict[int, tuple[str, memoryview]]]:
    """(graph, named) of a blob, for `serialize_blob(graph, named)` to write it again with the same
    constants left to the .pte's named data (e.g. with embedded schedules added: `vktrain export --target`)."""
    graph = deserialize_blob(data, verify_constants=False, named_data=named_data)
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.ndim != 1 else data
    header = BlobHeader.parse(view)
    root = FbVkGraph.VkGraph.GetRootAs(view[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size], 0)
    named = {}
    for i in range(root.ConstantsLength()):
        key = text(root.Constants(i).NamedKey())
        if key:
            named[i] = (key, g.stored_bytes(graph.constants[i]))
    return graph, named


def read_blob(path, *, verify_constants: bool = True) -> g.VkGraph:
    """Parse a blob file through a read-only mmap; constants are views into the mapping (no copy)."""
    with open(path, "rb") as f:
        try:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap refuses empty files
            raise BlobFormatError(f"{path}: file is empty, not a vktrain delegate blob") from None
    try:
        return deserialize_blob(mapping, verify_constants=verify_constants)
    except BlobFormatError as exc:
        raise BlobFormatError(f"{path}: {exc}") from None

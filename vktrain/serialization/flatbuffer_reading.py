"""Reading helpers for flatc-generated Python tables, shared by the delegate blob reader (blob.py) and the
.pte reader (vktrain.serialization.pte). flatbuffers only."""
from __future__ import annotations

import struct
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from vktrain.errors import VktrainError

# What the Python flatbuffers runtime raises on a corrupt or cut buffer: it has no verifier, so a bad
# offset or length surfaces as one of these wherever it is followed.
CORRUPTION_ERRORS = (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError, OverflowError)


@contextmanager
def reading(field: str, error: type[VktrainError]) -> Iterator[None]:
    """Raise `error` naming `field` when reading it hits a corrupt buffer (errors of the family pass)."""
    try:
        yield
    except VktrainError:
        raise
    except CORRUPTION_ERRORS as exc:
        raise error(f"flatbuffer is corrupt at {field} ({type(exc).__name__}: {exc})") from None


def scalar_vector(table, field_name: str) -> tuple:
    """A scalar vector field of a generated table as a tuple of Python numbers (() when absent)."""
    if getattr(table, f"{field_name}Length")() == 0:
        return ()
    return tuple(getattr(table, f"{field_name}AsNumpy")().tolist())


_SOFFSET, _VOFFSET = struct.Struct("<i"), struct.Struct("<H")
# Scalar formats of a table's fields, by schema type (the generated accessors' flags).
UINT8, INT32, UINT32 = struct.Struct("<B"), struct.Struct("<i"), struct.Struct("<I")
INT64, UINT64 = struct.Struct("<q"), struct.Struct("<Q")


def table_scalars(table, layout: Sequence[tuple[struct.Struct, Any] | None]) -> list:
    """The scalar fields of a generated `table`, `layout` giving per slot (in schema order, from the first) its
    (format, default) as the schema declares them, or None for a slot not read here (a vector, a string): what
    its accessors return, read with one vtable lookup and no accessor calls (a schedule holds tens of thousands
    of bindings and placements, a graph thousands of tensors; their accessors were most of the read)."""
    buf, pos = table._tab.Bytes, table._tab.Pos
    vtable = pos - _SOFFSET.unpack_from(buf, pos)[0]
    size = _VOFFSET.unpack_from(buf, vtable)[0]
    values = []
    for slot, field in enumerate(layout):
        if field is None:
            continue
        form, default = field
        entry = 4 + 2 * slot
        offset = _VOFFSET.unpack_from(buf, vtable + entry)[0] if entry < size else 0
        values.append(form.unpack_from(buf, pos + offset)[0] if offset else default)
    return values


def union_as(holder, table_class):
    """The table a union field points at (`holder`, the flatbuffers.Table its accessor returned), as
    `table_class`."""
    table = table_class()
    table.Init(holder.Bytes, holder.Pos)
    return table


def text(raw) -> str:
    """A flatbuffer string field as str ("" where absent)."""
    return "" if raw is None else bytes(raw).decode("utf-8")

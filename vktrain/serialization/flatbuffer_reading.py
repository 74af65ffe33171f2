"""Reading helpers for flatc-generated Python tables, shared by the delegate blob reader (blob.py) and the
.pte reader (vktrain.runtime.program.pte). flatbuffers only."""
from __future__ import annotations


def scalar_vector(table, field_name: str) -> tuple:
    """A scalar vector field of a generated table as a tuple of Python numbers (() when absent)."""
    if getattr(table, f"{field_name}Length")() == 0:
        return ()
    return tuple(getattr(table, f"{field_name}AsNumpy")().tolist())


def union_as(holder, table_class):
    """The table a union field points at (`holder`, the flatbuffers.Table its accessor returned), as
    `table_class`."""
    table = table_class()
    table.Init(holder.Bytes, holder.Pos)
    return table

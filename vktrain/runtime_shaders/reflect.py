"""Minimal SPIR-V reflection: what a compute shader expects from the host.

The runtime uses it to check a Dispatch against its shader before recording (number of storage-buffer
bindings, push-constant block size) and to know whether the shader opted into split dispatches (its
push block starts with `vktrain_group_offset`, the group-offset header of common.slangh). It reads only
the instructions it needs; a shader whose names were stripped reflects as having no header.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

SPIRV_MAGIC = 0x07230203
GROUP_OFFSET_MEMBER = "vktrain_group_offset"

# Opcodes
_OP_NAME, _OP_MEMBER_NAME = 5, 6
_OP_TYPE_BOOL, _OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR, _OP_TYPE_MATRIX = 20, 21, 22, 23, 24
_OP_TYPE_ARRAY, _OP_TYPE_RUNTIME_ARRAY, _OP_TYPE_STRUCT, _OP_TYPE_POINTER = 28, 29, 30, 32
_OP_CONSTANT, _OP_SPEC_CONSTANT_TRUE, _OP_SPEC_CONSTANT_FALSE, _OP_SPEC_CONSTANT = 43, 48, 49, 50
_OP_VARIABLE, _OP_DECORATE, _OP_MEMBER_DECORATE = 59, 71, 72
# Decorations
_DEC_SPEC_ID, _DEC_BLOCK, _DEC_BUFFER_BLOCK, _DEC_ARRAY_STRIDE, _DEC_MATRIX_STRIDE = 1, 2, 3, 6, 7
_DEC_NON_WRITABLE, _DEC_NON_READABLE = 24, 25
_DEC_BINDING, _DEC_DESCRIPTOR_SET, _DEC_OFFSET = 33, 34, 35
# Storage classes
_SC_UNIFORM, _SC_PUSH_CONSTANT, _SC_STORAGE_BUFFER = 2, 9, 12


@dataclass(frozen=True)
class BindingInfo:
    set: int
    binding: int
    readonly: bool
    writeonly: bool
    kind: str = "storage"  # "storage" (buffer block) or "uniform" (uniform block); images etc. are skipped


@dataclass(frozen=True)
class ShaderInterface:
    """What a compute shader declares: buffer bindings, push-constant block, specialization ids."""

    bindings: tuple[BindingInfo, ...]
    push_constant_size: int  # 0 when the shader has no push-constant block; -1 when not computable
    has_group_offset_header: bool
    spec_types: dict[int, str]  # specialization constant id -> "bool", "int", "uint" or "float" (32-bit)

    @property
    def spec_ids(self) -> frozenset[int]:
        return frozenset(self.spec_types)

    @property
    def binding_numbers(self) -> tuple[int, ...]:
        return tuple(sorted(b.binding for b in self.bindings if b.set == 0))


def _string(words: list[int]) -> str:
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def reflect_spirv(code: bytes) -> ShaderInterface:
    """Parse SPIR-V `code` (bytes) and return its ShaderInterface; ValueError when it is not SPIR-V."""
    if len(code) < 20 or len(code) % 4:
        raise ValueError(f"not SPIR-V: {len(code)} bytes (want a multiple of 4, at least 20)")
    words = list(struct.unpack(f"<{len(code) // 4}I", code))
    if words[0] != SPIRV_MAGIC:
        raise ValueError(f"not SPIR-V: magic {words[0]:#010x}, expected {SPIRV_MAGIC:#010x}")

    member_names: dict[tuple[int, int], str] = {}
    decorations: dict[int, dict[int, list[int]]] = {}
    member_decorations: dict[tuple[int, int], dict[int, list[int]]] = {}
    types: dict[int, tuple[int, list[int]]] = {}  # id -> (opcode, operands after the result id)
    constants: dict[int, int] = {}
    variables: list[tuple[int, int, int]] = []  # (pointer type, id, storage class)
    spec_constants: dict[int, int | None] = {}  # result id -> result type (None: boolean)

    position = 5
    while position < len(words):
        count, opcode = words[position] >> 16, words[position] & 0xFFFF
        if count == 0:
            raise ValueError(f"malformed SPIR-V: zero-length instruction at word {position}")
        operands = words[position + 1:position + count]
        if opcode == _OP_MEMBER_NAME:
            member_names[(operands[0], operands[1])] = _string(operands[2:])
        elif opcode == _OP_DECORATE:
            decorations.setdefault(operands[0], {})[operands[1]] = operands[2:]
        elif opcode == _OP_MEMBER_DECORATE:
            member_decorations.setdefault((operands[0], operands[1]), {})[operands[2]] = operands[3:]
        elif opcode in (_OP_TYPE_BOOL, _OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR, _OP_TYPE_MATRIX,
                        _OP_TYPE_ARRAY, _OP_TYPE_RUNTIME_ARRAY, _OP_TYPE_STRUCT, _OP_TYPE_POINTER):
            types[operands[0]] = (opcode, operands[1:])
        elif opcode in (_OP_CONSTANT, _OP_SPEC_CONSTANT) and len(operands) >= 3:
            constants[operands[1]] = operands[2]
            if opcode == _OP_SPEC_CONSTANT:
                spec_constants[operands[1]] = operands[0]
        elif opcode in (_OP_SPEC_CONSTANT_TRUE, _OP_SPEC_CONSTANT_FALSE):
            spec_constants[operands[1]] = None
        elif opcode == _OP_VARIABLE:
            variables.append((operands[0], operands[1], operands[2]))
        position += count

    def pointee(pointer_type: int) -> int:
        return types[pointer_type][1][1]

    def size_of(type_id: int, stride_hint: int | None = None) -> int | None:
        opcode, rest = types.get(type_id, (None, []))
        if opcode in (_OP_TYPE_INT, _OP_TYPE_FLOAT):
            return rest[0] // 8
        if opcode == _OP_TYPE_BOOL:
            return 4
        if opcode == _OP_TYPE_VECTOR:
            component = size_of(rest[0])
            return None if component is None else component * rest[1]
        if opcode == _OP_TYPE_MATRIX:
            return None if stride_hint is None else stride_hint * rest[1]
        if opcode == _OP_TYPE_ARRAY:
            stride = decorations.get(type_id, {}).get(_DEC_ARRAY_STRIDE)
            length = constants.get(rest[1])
            return None if stride is None or length is None else stride[0] * length
        if opcode == _OP_TYPE_STRUCT:
            end = 0
            for index, member_type in enumerate(rest):
                member = member_decorations.get((type_id, index), {})
                offset = member.get(_DEC_OFFSET)
                matrix_stride = member.get(_DEC_MATRIX_STRIDE)
                size = size_of(member_type, matrix_stride[0] if matrix_stride else None)
                if offset is None or size is None:
                    return None
                end = max(end, offset[0] + size)
            return end
        return None

    def all_members(struct_id: int, decoration: int) -> bool:
        members = types[struct_id][1]
        return bool(members) and all(
            decoration in member_decorations.get((struct_id, i), {}) for i in range(len(members)))

    bindings = []
    push_size = 0
    header = False
    for pointer_type, variable, storage_class in variables:
        if storage_class in (_SC_STORAGE_BUFFER, _SC_UNIFORM):
            decos = decorations.get(variable, {})
            if _DEC_BINDING not in decos:
                continue
            block = pointee(pointer_type)
            if types.get(block, (None,))[0] != _OP_TYPE_STRUCT:
                continue  # not a buffer block
            # SPIR-V < 1.3 spells a storage buffer as Uniform + BufferBlock; Uniform + Block is a UBO.
            is_ubo = storage_class == _SC_UNIFORM and _DEC_BUFFER_BLOCK not in decorations.get(block, {})
            readonly = _DEC_NON_WRITABLE in decos or all_members(block, _DEC_NON_WRITABLE)
            writeonly = _DEC_NON_READABLE in decos or all_members(block, _DEC_NON_READABLE)
            bindings.append(BindingInfo(decos.get(_DEC_DESCRIPTOR_SET, [0])[0], decos[_DEC_BINDING][0],
                                        readonly, writeonly, "uniform" if is_ubo else "storage"))
        elif storage_class == _SC_PUSH_CONSTANT:
            block = pointee(pointer_type)
            size = size_of(block)
            push_size = -1 if size is None else size
            first_offset = member_decorations.get((block, 0), {}).get(_DEC_OFFSET, [None])[0]
            header = member_names.get((block, 0)) == GROUP_OFFSET_MEMBER and first_offset == 0
    spec_types: dict[int, str] = {}
    for result_id, result_type in spec_constants.items():
        spec_id = decorations.get(result_id, {}).get(_DEC_SPEC_ID)
        if spec_id is None:
            continue
        if result_type is None:
            kind = "bool"
        else:
            opcode, rest = types.get(result_type, (None, []))
            if opcode == _OP_TYPE_FLOAT and rest[0] == 32:
                kind = "float"
            elif opcode == _OP_TYPE_INT and rest[0] == 32:
                kind = "int" if rest[1] else "uint"
            else:
                kind = "other"
        spec_types[spec_id[0]] = kind
    return ShaderInterface(tuple(sorted(bindings, key=lambda b: (b.set, b.binding))), push_size, header, spec_types)

"""What a WGSL kernel declares, read from its source: bindings, the params block, override constants.

The WebGPU runtime checks every Dispatch against this before it builds anything, because a wgpu
validation failure can take the process down (and names WGSL, not the Dispatch). It reads only the
declarations the dispatch contract uses (vktrain/runtime_shaders/wgsl/__init__.py): module-scope
`@group(0) @binding(i) var<storage, ...>` / `var<uniform>`, `@id(n) override`, `struct`, `const`
and `var<workgroup>` declarations, and the `// vktrain-requires: EXPR -- WHY` lines in which a kernel states
what its constant-sized per-thread arrays need of the override values (e.g. `BK / TPR <= MAX_KEYS`;
WGSL cannot size a function-scope array by an override). Sizes follow the WGSL memory layout rules (uniform address space
for the params block); a size it cannot compute (a type it does not know) is reported as None.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

from vktrain.serialization.dispatch import ScheduleError

GROUP_OFFSET_MEMBER = "vktrain_group_offset"
ENTRY_POINT = "main"

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ATTRIBUTES = r"((?:@\w+\s*(?:\([^)]*\))?\s*)*)"
_VARIABLE = re.compile(_ATTRIBUTES + r"var\s*<\s*(storage|uniform|workgroup)\s*(?:,\s*(\w+)\s*)?>\s*(\w+)\s*:\s*([^;]+);")
_OVERRIDE = re.compile(_ATTRIBUTES + r"override\s+(\w+)\s*(?::\s*(\w+)\s*)?(?:=\s*([^;]+))?;")
_REQUIREMENT = re.compile(r"^\s*//\s*vktrain-requires:\s*(.+?)\s*(?:--\s*(.*?))?\s*$", re.MULTILINE)
_CONST = re.compile(r"\bconst\s+(\w+)\s*(?::\s*\w+\s*)?=\s*([^;]+);")
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{([^}]*)\}")
_ATTRIBUTE = re.compile(r"@(\w+)\s*(?:\(([^)]*)\))?")
_VECTOR_SHORTHAND = re.compile(r"vec([234])([fiuh])")
_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2, "bool": 4}
_SHORTHAND_SCALARS = {"f": "f32", "i": "i32", "u": "u32", "h": "f16"}
_INTEGER_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                      ast.Div: operator.floordiv, ast.Mod: operator.mod}  # WGSL integer division truncates
_COMPARISONS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
                ast.Eq: operator.eq, ast.NotEq: operator.ne}
_INTEGER_CASTS = ("u32", "i32")  # u32(TILE_M): a value conversion, the same integer here
_OVERRIDE_TYPES = {"u32": "uint", "i32": "int", "f32": "float", "bool": "bool", "f16": "float"}


@dataclass(frozen=True)
class WGSLBinding:
    binding: int
    kind: str  # "storage" or "uniform"
    readonly: bool
    name: str
    type_name: str


@dataclass(frozen=True)
class WGSLInterface:
    """What a WGSL kernel expects from the host (the WebGPU counterpart of a reflected ShaderInterface)."""

    storage: tuple[WGSLBinding, ...]  # sorted by binding number
    params: WGSLBinding | None  # the uniform params block (the GLSL push block), if any
    params_bytes: int | None  # bytes of the GLSL push block it mirrors (end of its last member)
    params_struct_bytes: int | None  # the struct's WGSL size (the least the uniform binding may be)
    has_group_offset_header: bool
    spec_types: dict[int, str]  # override id -> "uint", "int", "float" or "bool"
    override_names: dict[str, int]  # override name -> id (for workgroup-memory sizes)
    workgroup_arrays: tuple[tuple[str, str], ...] = ()  # (name, type) of each var<workgroup>
    consts: dict[str, str] = field(default_factory=dict)  # module-scope const name -> expression
    structs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # name -> [(member, type)]
    requirements: tuple[tuple[str, str], ...] = ()  # (expression, why) of each `vktrain-requires:` line

    @property
    def binding_numbers(self) -> tuple[int, ...]:
        return tuple(b.binding for b in self.storage)

    def workgroup_memory_bytes(self, overrides: dict[int, float]) -> int | None:
        """Bytes of workgroup memory with these override values (None: a size it cannot evaluate)."""
        total = 0
        for _, type_name in self.workgroup_arrays:
            layout = _Layout(self.structs, self.consts, self.override_names, overrides, uniform=False)
            size = layout.size_align(type_name)
            if size is None:
                return None
            total += size[0]
        return total


    def unmet_requirements(self, overrides: dict[int, float]) -> list[str]:
        """The `vktrain-requires:` lines these override values break (or leave unevaluable), described."""
        layout = _Layout(self.structs, self.consts, self.override_names, overrides, uniform=False)
        unmet = []
        for expression, why in self.requirements:
            sides = layout.comparison(expression)
            reason = f" ({why})" if why else ""
            if sides is None:
                unmet.append(f"{expression}{reason} cannot be evaluated with override values {overrides}")
            elif not sides[2](sides[0], sides[1]):
                unmet.append(f"{expression}{reason} is false: {sides[0]} vs {sides[1]}")
        return unmet


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside <...> and (...)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "<(":
            depth += 1
        elif char in ">)":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _attributes(text: str) -> dict[str, str]:
    return {m.group(1): (m.group(2) or "").strip() for m in _ATTRIBUTE.finditer(text)}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Layout:
    """WGSL sizes and alignments of host-shareable types (uniform: the uniform address-space rules)."""

    def __init__(self, structs: dict, consts: dict[str, str], override_ids: dict[str, int],
                 overrides: dict[int, float], *, uniform: bool):
        self.structs, self.consts, self.override_ids = structs, consts, override_ids
        self.overrides = overrides
        self.uniform = uniform

    def count(self, text: str) -> int | None:
        """An array element count: an integer expression over literals, consts and overrides."""
        try:
            tree = ast.parse(re.sub(r"\b(\d+)[ui]\b", r"\1", text.strip()), mode="eval")
        except SyntaxError:
            return None
        return self._evaluate(tree.body)

    def comparison(self, text: str) -> tuple[int, int, object] | None:
        """(left, right, operator) of `LEFT op RIGHT` with integer sides, None when it is not one."""
        try:
            tree = ast.parse(re.sub(r"\b(\d+)[ui]\b", r"\1", text.strip()), mode="eval").body
        except SyntaxError:
            return None
        if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and type(tree.ops[0]) in _COMPARISONS):
            return None
        left, right = self._evaluate(tree.left), self._evaluate(tree.comparators[0])
        return None if left is None or right is None else (left, right, _COMPARISONS[type(tree.ops[0])])

    def _evaluate(self, node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.override_ids and self.override_ids[node.id] in self.overrides:
                return int(self.overrides[self.override_ids[node.id]])
            return self.count(self.consts[node.id]) if node.id in self.consts else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _INTEGER_CASTS \
                and len(node.args) == 1 and not node.keywords:
            return self._evaluate(node.args[0])
        if isinstance(node, ast.BinOp) and type(node.op) in _INTEGER_OPERATORS:
            left, right = self._evaluate(node.left), self._evaluate(node.right)
            if left is None or right is None or (right == 0 and type(node.op) in (ast.Div, ast.Mod)):
                return None
            return _INTEGER_OPERATORS[type(node.op)](left, right)
        return None

    def size_align(self, type_name: str) -> tuple[int, int] | None:
        """(size, alignment) of `type_name`, None when it is not a type this layout knows."""
        t = type_name.strip()
        if t in _SCALAR_BYTES:
            return _SCALAR_BYTES[t], _SCALAR_BYTES[t]
        shorthand = _VECTOR_SHORTHAND.fullmatch(t)
        if shorthand:
            t = f"vec{shorthand.group(1)}<{_SHORTHAND_SCALARS[shorthand.group(2)]}>"
        generic = re.fullmatch(r"(\w+)\s*<(.*)>", t, re.S)
        if generic:
            head, arguments = generic.group(1), _split_top_level(generic.group(2))
            if head == "atomic" and len(arguments) == 1:
                return self.size_align(arguments[0])
            vector = re.fullmatch(r"vec([234])", head)
            if vector and len(arguments) == 1 and arguments[0] in _SCALAR_BYTES:
                n, scalar = int(vector.group(1)), _SCALAR_BYTES[arguments[0]]
                return n * scalar, (2 if n == 2 else 4) * scalar
            if head == "array" and len(arguments) == 2:
                element = self.size_align(arguments[0])
                count = self.count(arguments[1])
                if element is None or count is None:
                    return None
                align = _round_up(element[1], 16) if self.uniform else element[1]
                stride = _round_up(element[0], align)
                return stride * count, align
            return None
        if t in self.structs:
            layout = self.struct_layout(t)
            return None if layout is None else layout[1:]
        return None

    def struct_layout(self, name: str) -> tuple[list[tuple[str, int, int]], int, int] | None:
        """([(member, offset, size)], struct size, struct alignment)."""
        members, offset, align = [], 0, 1
        for member_name, member_type in self.structs[name]:
            layout = self.size_align(member_type)
            if layout is None:
                return None
            size, member_align = layout
            if self.uniform and (member_type in self.structs or member_type.startswith("array")):
                member_align = _round_up(member_align, 16)
            offset = _round_up(offset, member_align)
            members.append((member_name, offset, size))
            offset += size
            align = max(align, member_align)
        if self.uniform:
            align = _round_up(align, 16)
        return members, _round_up(offset, align), align


def _parse_structs(source: str) -> dict[str, list[tuple[str, str]]]:
    structs = {}
    for match in _STRUCT.finditer(source):
        members = []
        for member in _split_top_level(match.group(2)):
            member = _ATTRIBUTE.sub("", member).strip()
            name, _, type_name = member.partition(":")
            members.append((name.strip(), type_name.strip()))
        structs[match.group(1)] = members
    return structs


def reflect_wgsl(shader: str, source: str) -> WGSLInterface:
    """The WGSLInterface of kernel `shader` from its WGSL `source`; ScheduleError when it breaks the contract."""
    requirements = tuple((m.group(1), m.group(2) or "") for m in _REQUIREMENT.finditer(source))
    text = _COMMENTS.sub("", source)
    if not re.search(r"@compute[\s\S]*?\bfn\s+" + ENTRY_POINT + r"\s*\(", text):
        raise ScheduleError(f"WGSL kernel {shader!r} has no `@compute fn {ENTRY_POINT}(...)` entry point")
    structs = _parse_structs(text)
    storage, uniforms, workgroup = [], [], []
    for match in _VARIABLE.finditer(text):
        attributes, space, access, name, type_name = match.groups()
        type_name = type_name.strip()
        if space == "workgroup":
            workgroup.append((name, type_name))
            continue
        attrs = _attributes(attributes)
        if "binding" not in attrs or "group" not in attrs:
            raise ScheduleError(f"WGSL kernel {shader!r}: `var<{space}> {name}` lacks @group/@binding")
        if int(attrs["group"]) != 0:
            raise ScheduleError(f"WGSL kernel {shader!r}: `{name}` is in @group({attrs['group']}); vktrain binds "
                                f"every buffer in group 0")
        binding = WGSLBinding(int(attrs["binding"]), space, space == "storage" and (access or "read") == "read",
                              name, type_name)
        (storage if space == "storage" else uniforms).append(binding)
    storage.sort(key=lambda b: b.binding)
    numbers = [b.binding for b in storage]
    if numbers != list(range(len(storage))):
        raise ScheduleError(f"WGSL kernel {shader!r} declares storage bindings {numbers}; the contract numbers "
                            f"them 0..n-1")
    if len(uniforms) > 1:
        raise ScheduleError(f"WGSL kernel {shader!r} declares {len(uniforms)} uniform blocks; the contract allows "
                            f"one (the params block)")
    params = uniforms[0] if uniforms else None
    if params is not None and params.binding != len(storage):
        raise ScheduleError(f"WGSL kernel {shader!r}: the params block {params.name!r} is at binding "
                            f"{params.binding}; the contract puts it at {len(storage)} (after the storage buffers)")

    spec_types, override_names = {}, {}
    for match in _OVERRIDE.finditer(text):
        attributes, name, type_name, _ = match.groups()
        attrs = _attributes(attributes)
        if "id" not in attrs:
            raise ScheduleError(f"WGSL kernel {shader!r}: `override {name}` has no @id(n) (the GLSL constant_id)")
        kind = _OVERRIDE_TYPES.get(type_name or "")
        if kind is None:
            raise ScheduleError(f"WGSL kernel {shader!r}: `override {name}` needs an explicit u32/i32/f32/bool type")
        spec_types[int(attrs["id"])] = kind
        override_names[name] = int(attrs["id"])
    consts = {m.group(1): m.group(2) for m in _CONST.finditer(text)}

    params_bytes = params_struct_bytes = None
    has_header = False
    if params is not None:
        if params.type_name not in structs:
            raise ScheduleError(f"WGSL kernel {shader!r}: the params block must be a struct declared in the "
                                f"kernel, got type {params.type_name!r}")
        members = structs[params.type_name]
        has_header = bool(members) and members[0][0] == GROUP_OFFSET_MEMBER
        if has_header and members[0][1].replace(" ", "") not in ("vec4<u32>", "vec4u"):
            raise ScheduleError(f"WGSL kernel {shader!r}: {GROUP_OFFSET_MEMBER} must be a vec4<u32>")
        layout = _Layout(structs, consts, override_names, {}, uniform=True).struct_layout(params.type_name)
        if layout is not None:
            laid_out, params_struct_bytes, _ = layout
            params_bytes = max((offset + size for _, offset, size in laid_out), default=0)
    return WGSLInterface(tuple(storage), params, params_bytes, params_struct_bytes, has_header, spec_types,
                         override_names, tuple(workgroup), consts, structs, requirements)

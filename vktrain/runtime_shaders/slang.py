"""Slang kernels: one `<name>.slang` source compiled by slangc to both SPIR-V (Vulkan) and WGSL (WebGPU).

slangc comes from the pip package slangtorch (pinned in pyproject.toml; it ships `slangtorch/bin/slangc`
and its libraries, no Python import needed). Both outputs are build products, cached by content hash
(build.py's SPIR-V cache and WGSL_CACHE_DIR here); neither is committed or edited by hand.

The kernel side of the conventions is common.slangh. What slangc emits is then fitted to the contracts the
runtimes check (reflect.py, runtime/webgpu/reflect.py), each step checked so a new slangc cannot change it
silently:
  * SPIR-V: the local size. slangc writes a specialization-constant local size as
    `OpExecutionModeId LocalSizeId`, which Vulkan accepts only with maintenance4 (Vulkan 1.3); it is
    rewritten to glslang's encoding (`LocalSize` literals plus a `WorkgroupSize` built-in
    OpSpecConstantComposite), valid from Vulkan 1.0. Also: `-O0` (slangc's optimizer needs a
    libslang-glslang the wheel lacks; the drivers optimize anyway), `-profile spirv_1_3` (our Vulkan 1.1
    target; a kernel's `// vktrain-spirv-profile:` line may name spirv_1_4, checked against Vulkan 1.2), and Slang's `OpSource Slang` dropped (the validation layer rejects its source-language
    operand 11). Under the Vulkan memory model (slangc's choice for cooperative matrices) Workgroup loads
    and stores are marked NonPrivatePointer + MakePointerVisible / MakePointerAvailable, as glslang marks
    GLSL's coherent shared variables (slangc leaves them private, unordered by the barriers).
  * WGSL: WGSL's `@workgroup_size` cannot name an override in slangc's output (E55205), so the kernel
    writes the default literal there on WGSL (VKTRAIN_LOCAL_SIZE in common.slangh) and the literal is
    replaced by the `@id(0..2)` override that carries it; slangc's `_0` suffix is taken off
    `vktrain_group_offset` (the split-dispatch header the reflection looks for) and off the overrides
    (the names `// vktrain-requires:` lines use); those lines are copied in front (the WebGPU runtime
    reads them from the WGSL); `enable subgroups;` is dropped (wgpu 0.32 rejects it, see wgsl/__init__.py);
    workgroup arrays sized by VKTRAIN_SPEC_SIZE (common.slangh), a literal in slangc's WGSL (its WGSL back
    end fails on override-sized arrays, E99999), get their size expression over the overrides back
    (read from a `slangc -E` pass), with the override declarations moved first (naga 29 needs them there).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

SLANGC_SPIRV_FLAGS = ("-target", "spirv", "-profile", "spirv_1_3", "-emit-spirv-directly", "-O0",
                      "-stage", "compute", "-entry", "main")
# A kernel may name a newer SPIR-V in a `// vktrain-spirv-profile: PROFILE` line of its .slang source: the
# cooperative-matrix kernels, whose loads and stores through buffers spirv-val accepts only in the
# StorageBuffer storage class, which slangc uses from spirv_1_4 (with spirv_1_3 it writes Uniform +
# BufferBlock; docs/ONE_SOURCE.md). Each profile with the Vulkan version spirv-val checks it against.
SPIRV_PROFILES = {"spirv_1_3": "vulkan1.1", "spirv_1_4": "vulkan1.2"}
DEFAULT_SPIRV_PROFILE = "spirv_1_3"
_SPIRV_PROFILE_LINE = re.compile(r"^\s*//\s*vktrain-spirv-profile:(.*)$", re.MULTILINE)
SLANGC_WGSL_FLAGS = ("-target", "wgsl", "-stage", "compute", "-entry", "main", "-DVKTRAIN_WGSL")
WGSL_CACHE_DIR = Path(__file__).resolve().parent / "wgsl" / "generated"
_REQUIRES_LINE = re.compile(r"^\s*//\s*vktrain-requires:.*$", re.MULTILINE)


class SlangToolError(RuntimeError):
    """slangc is missing or rejected a kernel, or its output broke an expectation of the fitting steps."""


def spirv_profile(source: Path) -> str:
    """The SPIR-V profile of kernel `source`: its `// vktrain-spirv-profile:` line, else DEFAULT_SPIRV_PROFILE."""
    named = [line.strip() for line in _SPIRV_PROFILE_LINE.findall(source.read_text())]
    if len(named) > 1 or (named and named[0] not in SPIRV_PROFILES):
        raise SlangToolError(f"{source.name}: `// vktrain-spirv-profile:` must appear at most once and name one of "
                             f"{sorted(SPIRV_PROFILES)}; found {named}")
    return named[0] if named else DEFAULT_SPIRV_PROFILE


def spirv_flags(profile: str) -> tuple[str, ...]:
    """slangc's SPIR-V flags for `profile` (SLANGC_SPIRV_FLAGS with its -profile replaced)."""
    flags = list(SLANGC_SPIRV_FLAGS)
    flags[flags.index("-profile") + 1] = profile
    return tuple(flags)


def find_slangc() -> Path | None:
    """slangc: env VKTRAIN_SLANGC, the slangtorch package's bin/ (not imported: it needs torch), then PATH."""
    override = os.environ.get("VKTRAIN_SLANGC")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("slangtorch")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "bin" / "slangc"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    which = shutil.which("slangc")
    return Path(which) if which else None


def run_slangc(source: Path, flags: tuple[str, ...], defines: list[str], include_dir: Path, what: str) -> bytes:
    """slangc's output for `source` with these flags and -D defines."""
    slangc = find_slangc()
    if slangc is None:
        raise SlangToolError("slangc not found (install the pip package slangtorch, as scripts/setup.sh does, or "
                             "set VKTRAIN_SLANGC)")
    with tempfile.TemporaryDirectory(prefix="vktrain-slang-") as tmp:
        out = Path(tmp) / "out"
        result = subprocess.run([str(slangc), str(source), *flags, f"-I{include_dir}", *defines, "-o", str(out)],
                                capture_output=True, text=True)
        if result.returncode != 0 or not out.is_file():
            output = (result.stdout + result.stderr).strip()
            raise SlangToolError(f"{what}: slangc failed (exit {result.returncode}):\n{output}")
        return out.read_bytes()


# ---- SPIR-V ----------------------------------------------------------------------------------------

_OP_SOURCE_CONTINUED, _OP_SOURCE, _OP_SOURCE_EXTENSION = 2, 3, 4
_OP_EXECUTION_MODE, _OP_EXECUTION_MODE_ID = 16, 331
_OP_TYPE_INT, _OP_TYPE_VECTOR = 21, 23
_OP_CONSTANT, _OP_SPEC_CONSTANT, _OP_SPEC_CONSTANT_COMPOSITE = 43, 50, 51
_OP_DECORATE, _OP_FUNCTION = 71, 54
_MODE_LOCAL_SIZE, _MODE_LOCAL_SIZE_ID = 17, 38
_DECORATION_BUILTIN, _BUILTIN_WORKGROUP_SIZE = 11, 25
_ANNOTATIONS = (_OP_DECORATE, 72, 73, 74, 75, 332, 5632, 5633)  # the decoration instructions


def _instruction(opcode: int, *operands: int) -> list[int]:
    return [(len(operands) + 1) << 16 | opcode, *operands]


def fit_spirv(code: bytes) -> bytes:
    """Slang's SPIR-V with OpSource* dropped and `LocalSizeId` rewritten to LocalSize + WorkgroupSize."""
    words = list(struct.unpack(f"<{len(code) // 4}I", code))
    header, bound = words[:5], words[3]
    instructions: list[list[int]] = []
    position = 5
    while position < len(words):
        count = words[position] >> 16
        instructions.append(words[position:position + count])
        position += count
    instructions = [i for i in instructions
                    if i[0] & 0xFFFF not in (_OP_SOURCE_CONTINUED, _OP_SOURCE, _OP_SOURCE_EXTENSION)]
    bound = header[3] = _workgroup_accesses_non_private(instructions, bound)

    def opcode(instruction):
        return instruction[0] & 0xFFFF

    modes = [n for n, i in enumerate(instructions) if opcode(i) == _OP_EXECUTION_MODE_ID and i[2] == _MODE_LOCAL_SIZE_ID]
    if not modes:
        return struct.pack(f"<{5 + sum(map(len, instructions))}I", *header, *(w for i in instructions for w in i))
    if len(modes) != 1:
        raise SlangToolError(f"SPIR-V from slangc has {len(modes)} LocalSizeId execution modes; expected one")
    entry, size_ids = instructions[modes[0]][1], instructions[modes[0]][3:6]
    definitions = {i[2]: i for i in instructions if opcode(i) in (_OP_CONSTANT, _OP_SPEC_CONSTANT)}
    uint = next((i[1] for i in instructions if opcode(i) == _OP_TYPE_INT and i[2:4] == [32, 0]), None)
    if uint is None or any(s not in definitions for s in size_ids):
        raise SlangToolError("SPIR-V from slangc: the LocalSizeId operands are not 32-bit constants")
    new: list[list[int]] = []

    def fresh() -> int:
        nonlocal bound
        bound += 1
        return bound - 1

    components = []
    for size_id in size_ids:
        definition = definitions[size_id]
        if opcode(definition) == _OP_SPEC_CONSTANT:
            if definition[1] != uint:
                raise SlangToolError("SPIR-V from slangc: a specialization-constant local size is not a uint")
            components.append(size_id)
        else:  # slangc spells the literal axes as int constants; the composite needs uints
            constant = fresh()
            new.append(_instruction(_OP_CONSTANT, uint, constant, definition[3]))
            components.append(constant)
    literals = [definitions[s][3] for s in size_ids]
    instructions[modes[0]] = _instruction(_OP_EXECUTION_MODE, entry, _MODE_LOCAL_SIZE, *literals)
    decorations: list[list[int]] = []
    if any(opcode(definitions[s]) == _OP_SPEC_CONSTANT for s in size_ids):
        vector = next((i[1] for i in instructions if opcode(i) == _OP_TYPE_VECTOR and i[2:4] == [uint, 3]), None)
        if vector is None:
            vector = fresh()
            new.insert(0, _instruction(_OP_TYPE_VECTOR, vector, uint, 3))
        composite = fresh()
        new.append(_instruction(_OP_SPEC_CONSTANT_COMPOSITE, vector, composite, *components))
        decorations.append(_instruction(_OP_DECORATE, composite, _DECORATION_BUILTIN, _BUILTIN_WORKGROUP_SIZE))
    else:
        new = []
    first_function = next(n for n, i in enumerate(instructions) if opcode(i) == _OP_FUNCTION)
    instructions[first_function:first_function] = new
    last_annotation = max((n for n, i in enumerate(instructions) if opcode(i) in _ANNOTATIONS), default=modes[0])
    instructions[last_annotation + 1:last_annotation + 1] = decorations
    header[3] = bound
    return struct.pack(f"<{5 + sum(map(len, instructions))}I", *header, *(w for i in instructions for w in i))


_OP_MEMORY_MODEL, _OP_TYPE_POINTER, _OP_VARIABLE, _OP_FUNCTION_PARAMETER = 14, 32, 59, 55
_OP_LOAD, _OP_STORE, _OP_COPY_OBJECT, _OP_SELECT, _OP_PHI = 61, 62, 83, 169, 245
_OP_ACCESS_CHAINS = (65, 66, 67)
_OP_COOPMAT_LOAD, _OP_COOPMAT_STORE = 4457, 4458
_MEMORY_MODEL_VULKAN, _STORAGE_WORKGROUP, _SCOPE_WORKGROUP = 3, 4, 2
_ALIGNED, _MAKE_AVAILABLE, _MAKE_VISIBLE, _NON_PRIVATE = 0x2, 0x8, 0x10, 0x20


def _workgroup_accesses_non_private(instructions: list[list[int]], bound: int) -> int:
    """Under the Vulkan memory model (slangc picks it for cooperative matrices), make every load and store
    of Workgroup memory NonPrivatePointer with MakePointerVisible / MakePointerAvailable at workgroup scope,
    what glslang writes for GLSL's (implicitly coherent) shared variables: slangc writes them private, which
    the model lets a compiler reorder across the barriers that order them between invocations. Edits
    `instructions` in place; returns the new id bound."""
    def opcode(instruction):
        return instruction[0] & 0xFFFF

    if not any(opcode(i) == _OP_MEMORY_MODEL and i[2] == _MEMORY_MODEL_VULKAN for i in instructions):
        return bound
    pointer_types = {i[1] for i in instructions if opcode(i) == _OP_TYPE_POINTER and i[2] == _STORAGE_WORKGROUP}
    pointers = {i[2] for i in instructions if opcode(i) in (_OP_VARIABLE, _OP_FUNCTION_PARAMETER, _OP_COPY_OBJECT,
                                                            _OP_SELECT, _OP_PHI, *_OP_ACCESS_CHAINS)
                and len(i) > 2 and i[1] in pointer_types}
    uint = next((i[1] for i in instructions if opcode(i) == _OP_TYPE_INT and i[2:4] == [32, 0]), None)
    scope = next((i[2] for i in instructions if opcode(i) == _OP_CONSTANT and i[1] == uint and i[3:] == [2]), None)
    if uint is None:
        raise SlangToolError("SPIR-V from slangc: no 32-bit uint type for the memory scope constant")
    if scope is None:
        scope, bound = bound, bound + 1
        first_function = next(n for n, i in enumerate(instructions) if opcode(i) == _OP_FUNCTION)
        instructions.insert(first_function, _instruction(_OP_CONSTANT, uint, scope, _SCOPE_WORKGROUP))
    # (opcode, index of the pointer operand, index of the memory-operand mask, the flag the access takes)
    accesses = {_OP_LOAD: (3, 4, _MAKE_VISIBLE), _OP_STORE: (1, 3, _MAKE_AVAILABLE),
                _OP_COOPMAT_LOAD: (3, 6, _MAKE_VISIBLE), _OP_COOPMAT_STORE: (1, 5, _MAKE_AVAILABLE)}
    for n, instruction in enumerate(instructions):
        found = accesses.get(opcode(instruction))
        if found is None or instruction[found[0]] not in pointers:
            continue
        pointer_at, mask_at, flag = found
        fixed, mask = instruction[1:mask_at], (instruction[mask_at] if len(instruction) > mask_at else 0)
        if mask & ~_ALIGNED or len(fixed) != mask_at - 1:
            raise SlangToolError(f"SPIR-V from slangc: a Workgroup access (opcode {opcode(instruction)}) with memory "
                                 f"operands {mask:#x} or a missing stride; expected at most Aligned")
        aligned = instruction[mask_at + 1:mask_at + 2] if mask & _ALIGNED else []
        instructions[n] = _instruction(opcode(instruction), *fixed, mask | flag | _NON_PRIVATE, *aligned, scope)
    return bound


# ---- WGSL ------------------------------------------------------------------------------------------

_WORKGROUP_SIZE = re.compile(r"@workgroup_size\(\s*([^,)]+?)\s*,\s*([^,)]+?)\s*,\s*([^,)]+?)\s*\)")
# slangc writes `@id(0) override WG_0 : u32 = u32(64);`; a literal `64u` is taken too.
_OVERRIDE_NAME = re.compile(r"@id\(\d+\)\s*override\s+(\w+)")
# `groupshared T name[VKTRAIN_SPEC_SIZE(EXPR, LITERAL)];` in a preprocessed .slang source (slangc -E spaces
# every token).
_SPEC_SIZED_ARRAY = re.compile(r"groupshared\s+\w+\s+(\w+)\s*\[\s*VKTRAIN_SPEC_SIZE\s*\((.+?),\s*(\d+)\s*\)\s*\]\s*;")
_OVERRIDE = re.compile(r"@id\((\d+)\)\s*override\s+(\w+)\s*:\s*\w+\s*=\s*(?:\w+\()?\s*(\d+)u?\s*\)?\s*;")


def preprocessed(source: Path, defines: list[str], include_dir: Path, what: str) -> str:
    """The WGSL build's preprocessed `source` (slangc -E) with VKTRAIN_SPEC_SIZE left unexpanded, for
    fit_wgsl to read the size expressions of this variant's workgroup arrays; "" when it has none."""
    if "VKTRAIN_SPEC_SIZE" not in source.read_text():
        return ""
    slangc = find_slangc()
    if slangc is None:
        raise SlangToolError("slangc not found (install the pip package slangtorch, as scripts/setup.sh does, or "
                             "set VKTRAIN_SLANGC)")
    result = subprocess.run([str(slangc), str(source), "-E", "-DVKTRAIN_WGSL", "-DVKTRAIN_SPEC_SIZE_KEEP",
                             f"-I{include_dir}", *defines], capture_output=True, text=True)
    if result.returncode != 0:
        raise SlangToolError(f"{what}: slangc -E failed (exit {result.returncode}):\n{result.stderr.strip()}")
    return result.stdout


def fit_wgsl(text: str, source_text: str, origin: str, preprocessed_text: str = "") -> str:
    """slangc's WGSL fitted to the WebGPU contract (module docstring); `origin` names it in the header,
    `preprocessed_text` (preprocessed()) gives the sizes of VKTRAIN_SPEC_SIZE arrays."""
    overrides = {int(i): (name, int(default)) for i, name, default in _OVERRIDE.findall(text)}
    sizes = _WORKGROUP_SIZE.findall(text)
    if len(sizes) != 1:
        raise SlangToolError(f"{origin}: expected one @workgroup_size in slangc's WGSL, found {len(sizes)}")
    axes = []
    for axis, literal in enumerate(sizes[0]):
        if axis in overrides:
            name, default = overrides[axis]
            if literal.rstrip("u") != str(default):
                raise SlangToolError(f"{origin}: @workgroup_size axis {axis} is {literal}, but override @id({axis}) "
                                     f"{name} defaults to {default} (use VKTRAIN_LOCAL_SIZE of common.slangh)")
            axes.append(name)
        else:
            axes.append(literal)
    text = _WORKGROUP_SIZE.sub(f"@workgroup_size({', '.join(axes)})", text, count=1)
    text = re.sub(r"\bvktrain_group_offset_\d+\b", "vktrain_group_offset", text)
    # Overrides under their source names, which `// vktrain-requires:` lines use (`WG`, not `WG_0`).
    for name in _OVERRIDE_NAME.findall(text):
        source_name = re.sub(r"_\d+$", "", name)
        if source_name != name and not re.search(rf"\b{source_name}\b", text):
            text = re.sub(rf"\b{name}\b", source_name, text)
    text = _override_sized_arrays(text, preprocessed_text, origin,
                                  {re.sub(r"_\d+$", "", name): default for name, default in overrides.values()})
    # wgpu 0.32 (naga 29) rejects `enable subgroups;` and takes the built-ins on a device with the feature.
    text = re.sub(r"^enable subgroups;\n", "", text, flags=re.MULTILINE)
    requires = "".join(line + "\n" for line in _REQUIRES_LINE.findall(source_text))
    return f"// Generated from {origin} by slangc (vktrain/runtime_shaders/slang.py); do not edit.\n{requires}{text}"


def _override_sized_arrays(text: str, preprocessed_text: str, origin: str, defaults: dict[str, int]) -> str:
    """The workgroup arrays the variant sizes with VKTRAIN_SPEC_SIZE(EXPR, LITERAL) (common.slangh), sized
    by EXPR over the overrides instead of slangc's LITERAL; LITERAL must be EXPR at the defaults."""
    sized = False
    for name, expression, literal in _SPEC_SIZED_ARRAY.findall(preprocessed_text):
        expression = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", " ".join(expression.split())))
        declaration = re.compile(rf"(var<workgroup>\s+{name}(?:_\d+)?\s*:\s*array<.+?,\s*)(?:i32|u32)?\(?\s*"
                                 rf"(\d+)u?\s*\)?(>\s*;)")
        found = declaration.search(text)
        if found is None:
            raise SlangToolError(f"{origin}: slangc's WGSL has no workgroup array {name} with literal size {literal}")
        names = set(re.findall(r"(?<!\w)[A-Za-z_]\w*", expression))
        missing = sorted(n for n in names if n not in defaults or not re.search(rf"\boverride\s+{n}\b", text))
        if missing or re.search(r"[^\w\s+*/()-]", expression):
            raise SlangToolError(f"{origin}: VKTRAIN_SPEC_SIZE({expression}, {literal}) of {name}: the size may use "
                                 f"only overrides, literals, + - * / and parentheses (not overrides here: {missing})")
        at_defaults = re.sub(r"(?<!\w)[A-Za-z_]\w*", lambda m: str(defaults[m.group()]), expression)
        at_defaults = re.sub(r"(\d+)u\b", r"\1", at_defaults).replace("/", "//")
        value = eval(at_defaults, {"__builtins__": {}})  # digits and operators only (checked above)
        if value != int(literal) or int(found.group(2)) != int(literal):
            raise SlangToolError(f"{origin}: {name} is VKTRAIN_SPEC_SIZE({expression}, {literal}): the literal must "
                                 f"be the expression at the overrides' defaults ({value}); slangc wrote "
                                 f"{found.group(2)}")
        text = text[:found.start()] + found.group(1) + expression + found.group(3) + text[found.end():]
        sized = True
    if sized:
        # naga 29 panics (pipeline_constants.rs, "unreachable") building a pipeline whose override-sized
        # array precedes an override's declaration; their initializers are literals, so all go first.
        declarations = re.findall(r"^@id\(\d+\)\s*override\s[^;\n]*;\n", text, flags=re.MULTILINE)
        text = "".join(declarations) + re.sub(r"^@id\(\d+\)\s*override\s[^;\n]*;\n", "", text, flags=re.MULTILINE)
    return text


def wgsl_cache_path(stem: str, key: str) -> Path:
    return WGSL_CACHE_DIR / f"{stem}.{key}.wgsl"


def wgsl_cache_key(hash_input: list[tuple[str, str]], defines: list[str]) -> str:
    digest = hashlib.sha256(repr((SLANGC_WGSL_FLAGS, sorted(defines))).encode())
    for file_name, text in hash_input:
        digest.update(b"\0" + file_name.encode() + b"\0" + text.encode())
    return digest.hexdigest()[:20]


def write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    gitignore = target.parent / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# build output of python -m vktrain.runtime_shaders.build\n*\n")
    staged = target.with_suffix(f".{os.getpid()}.tmp")
    staged.write_bytes(data)
    os.replace(staged, target)

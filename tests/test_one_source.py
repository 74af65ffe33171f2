"""One kernel source (docs/ONE_SOURCE.md): each kernel is written once, as `<name>.slang`, and its SPIR-V and
WGSL are generated from it. Also: slangc's output fitted to the runtimes'
contracts (slang.py), checked on a private kernel.
"""
from __future__ import annotations

import struct

import pytest

from vktrain.runtime_shaders import build, reflect_spirv, slang
from vktrain.runtime_shaders.wgsl import WGSL_DIR

def test_every_kernel_has_one_source():
    """Every kernel is a `<name>.slang`: no GLSL `.comp` and no hand-written WGSL kernel is left (the last five,
    the tensor-core ones, were ported on 2026-12-06); a new kernel is written in Slang (docs/ONE_SOURCE.md)."""
    sources = build.source_names()
    slang_kernels = {path.stem for path in build.SHADER_DIR.glob("*.slang")}
    assert sorted(path.name for path in build.SHADER_DIR.glob("*.comp")) == [], "write kernels in Slang"
    assert sorted(path.name for path in WGSL_DIR.glob("*.wgsl")) == [], "WGSL is generated from the .slang"
    assert set(sources) == slang_kernels and "swiglu" in slang_kernels


needs_slangc = pytest.mark.skipif(slang.find_slangc() is None, reason="slangc not installed (pip package slangtorch)")

KERNEL = """// vktrain-variants: -, TWICE
// vktrain-requires: WG <= 256 -- a test line carried into the WGSL
#include "common.slangh"
[vk::constant_id(0)] const uint WG = 32;
[vk::constant_id(3)] const float BIAS = 0.5;
struct Params { uint4 vktrain_group_offset; uint count; float scale; };
[[vk::binding(0, 0)]] StructuredBuffer<float> src;
[[vk::binding(1, 0)]] RWStructuredBuffer<float> dst;
VKTRAIN_PARAMS(Params, 2);
[shader("compute")]
[numthreads(VKTRAIN_LOCAL_SIZE(WG, DEFAULT_WG), 1, 1)]
void main(uint3 group : SV_GroupID, uint3 local : SV_GroupThreadID) {
  uint i = VKTRAIN_GLOBAL_GROUP_ID(group).x * WG + local.x;
  if (i >= params.count) return;
#ifdef TWICE
  dst[i] = 2.0 * src[i] * params.scale + BIAS;
#else
  dst[i] = src[i] * params.scale + BIAS;
#endif
}
"""


def _opcodes(code: bytes) -> set[int]:
    words = struct.unpack(f"<{len(code) // 4}I", code)
    found, position = set(), 5
    while position < len(words):
        found.add(words[position] & 0xFFFF)
        position += words[position] >> 16
    return found


@pytest.fixture
def slang_dir(tmp_path, monkeypatch):
    """A private shader directory with common.slangh and the kernel `demo` (the build looks only there)."""
    (tmp_path / "common.slangh").write_text((build.SHADER_DIR / "common.slangh").read_text())
    (tmp_path / "demo.slang").write_text(KERNEL.replace("DEFAULT_WG", "32"))
    monkeypatch.setattr(build, "SHADER_DIR", tmp_path)
    monkeypatch.setattr(build, "SPIRV_DIR", tmp_path / "spirv")
    monkeypatch.setattr(slang, "WGSL_CACHE_DIR", tmp_path / "generated")
    return tmp_path


@needs_slangc
def test_slang_kernel_builds_to_the_contracts_of_both_runtimes(slang_dir):
    from vktrain.runtime.webgpu.reflect import reflect_wgsl

    assert build.all_shader_names() == ["demo", "demo@TWICE"]
    built, failures = build.build_all()
    assert failures == [] and sorted(built) == ["demo", "demo@TWICE"]
    # SPIR-V (spirv-val --target-env vulkan1.1 passed in the build): no LocalSizeId (needs maintenance4),
    # local size from spec id 0, the push block with the split-dispatch header.
    code = build.load_spirv("demo")
    interface = reflect_spirv(code)
    assert interface.spec_types == {0: "uint", 3: "float"}
    assert interface.has_group_offset_header and interface.push_constant_size == 24
    assert [(b.binding, b.readonly) for b in interface.bindings] == [(0, True), (1, False)]
    assert 3 not in _opcodes(code) and 331 not in _opcodes(code)  # no OpSource, no OpExecutionModeId
    assert 3 in _opcodes(slang.run_slangc(slang_dir / "demo.slang", slang.SLANGC_SPIRV_FLAGS, [], slang_dir, "raw"))
    # WGSL: the override sizes the workgroup, the header keeps its contract name, requirements are carried.
    source = build.load_generated_wgsl("demo@TWICE")
    assert build.generated_wgsl_path("demo@TWICE").read_text() == source
    wgsl = reflect_wgsl("demo@TWICE", source)
    assert wgsl.spec_types == {0: "uint", 3: "float"}
    assert "@workgroup_size(WG, 1, 1)" in source
    assert wgsl.has_group_offset_header and wgsl.params_bytes == 24
    assert [(b.binding, b.readonly) for b in wgsl.storage] == [(0, True), (1, False)]
    assert wgsl.requirements == (("WG <= 256", "a test line carried into the WGSL"),)
    assert wgsl.override_names == {"WG": 0, "BIAS": 3}  # source names, which the requirement uses
    assert wgsl.unmet_requirements({0: 256}) == [] and wgsl.unmet_requirements({0: 512})
    assert "2.0" in source and "2.0" not in build.load_generated_wgsl("demo")
    # An edit invalidates both outputs; the stale files are pruned.
    (slang_dir / "demo.slang").write_text(KERNEL.replace("DEFAULT_WG", "32") + "\n")
    assert not build.is_fresh("demo")
    build.build_all()
    assert len(build.prune_stale()) == 4 and build.is_fresh("demo")


@needs_slangc
def test_workgroup_literal_that_disagrees_with_the_override_is_refused(slang_dir):
    (slang_dir / "demo.slang").write_text(KERNEL.replace("DEFAULT_WG", "64"))
    with pytest.raises(build.ShaderBuildError, match=r"axis 0 is 64, but override @id\(0\) WG_0 defaults to 32"):
        build.compile_wgsl("demo")


@needs_slangc
def test_slangc_errors_name_the_kernel(slang_dir):
    (slang_dir / "demo.slang").write_text(KERNEL.replace("DEFAULT_WG", "32").replace("src[i]", "nowhere[i]"))
    with pytest.raises(build.ShaderBuildError, match=r"compiling demo: slangc failed .*\n.*undefined identifier"):
        build.compile_shader("demo")


@needs_slangc
def test_spirv_only_variants_build_to_spirv_and_webgpu_refuses_them(slang_dir):
    """A `// vktrain-spirv-variants:` line declares variants for Vulkan only (the linear GEMMs' 64-bit CPU bodies,
    fp16 tiles): built to SPIR-V, never to WGSL (which has no 64-bit integers), fresh without WGSL, and refused by the WebGPU lookup, which names the variants it serves."""
    from vktrain.runtime_shaders.wgsl import WGSLKernelNotFoundError, wgsl_source

    wide = KERNEL.replace("DEFAULT_WG", "32").replace(
        "// vktrain-variants: -, TWICE", "// vktrain-variants: -, TWICE\n// vktrain-spirv-variants: WIDE")
    wide = wide.replace("#ifdef TWICE", "#ifdef WIDE\n  dst[i] = float(uint64_t(src[i]) << 33u);\n#elif defined(TWICE)")
    (slang_dir / "demo.slang").write_text(wide)
    assert build.all_shader_names() == ["demo", "demo@TWICE", "demo@WIDE"]
    built, failures = build.build_all()
    assert failures == [] and sorted(built) == ["demo", "demo@TWICE", "demo@WIDE"]
    assert build.is_fresh("demo@WIDE") and not build.generated_wgsl_path("demo@WIDE").exists()
    int64_capability = struct.pack("<2I", 2 << 16 | 17, 11)  # OpCapability Int64
    assert int64_capability in build.load_spirv("demo@WIDE") and int64_capability not in build.load_spirv("demo")
    assert not build.has_wgsl("demo@WIDE") and build.has_wgsl("demo@TWICE")
    with pytest.raises(WGSLKernelNotFoundError, match=r"demo\.slang serves only demo, demo@TWICE$"):
        wgsl_source("demo@WIDE")
    assert wgsl_source("demo@TWICE") == build.load_generated_wgsl("demo@TWICE")


@needs_slangc
def test_a_kernel_with_only_spirv_variants_has_no_wgsl_at_all(slang_dir):
    """A Slang kernel whose only variant line is `// vktrain-spirv-variants:` (the tensor-core attention, which
    WebGPU never dispatches) builds to SPIR-V only, its on-demand variants too; the WebGPU lookup serves none
    of its names (not even the plain one) and says why."""
    from vktrain.runtime_shaders.wgsl import WGSLKernelNotFoundError, all_wgsl_shader_names, wgsl_source

    only = KERNEL.replace("DEFAULT_WG", "32").replace("// vktrain-variants: -, TWICE", "// vktrain-spirv-variants: -")
    # 64-bit integers: slangc's WGSL has none, so any attempt to build this kernel's WGSL fails.
    only = only.replace("#ifdef TWICE", "#ifdef TWICE\n  dst[i] = float(uint64_t(src[i]) << 33u);\n#elif 0")
    (slang_dir / "demo.slang").write_text(only)
    built, failures = build.build_all()
    assert failures == [] and built == ["demo"]
    assert build.spirv_only("demo") and build.is_fresh("demo") and not build.generated_wgsl_path("demo").exists()
    assert not build.has_wgsl("demo") and not build.has_wgsl("demo@TWICE")
    assert build.load_spirv("demo@TWICE")  # built on demand, SPIR-V only
    assert not any(name.startswith("demo") for name in all_wgsl_shader_names())
    for name in ("demo", "demo@TWICE"):
        with pytest.raises(WGSLKernelNotFoundError, match=r"demo\.slang is built to SPIR-V only"):
            wgsl_source(name)


@needs_slangc
def test_a_kernel_may_name_a_newer_spirv_profile(slang_dir):
    """`// vktrain-spirv-profile: spirv_1_4` (the cooperative-matrix kernels: slangc puts buffers in the
    StorageBuffer class only from 1.4) builds that SPIR-V version, validated for Vulkan 1.2; others stay 1.3;
    an unknown profile is refused naming the kernel."""
    assert struct.unpack("<I", build.load_spirv("demo")[4:8])[0] == 0x00010300
    (slang_dir / "demo.slang").write_text("// vktrain-spirv-profile: spirv_1_4\n" + KERNEL.replace("DEFAULT_WG", "32"))
    assert struct.unpack("<I", build.load_spirv("demo")[4:8])[0] == 0x00010400
    (slang_dir / "demo.slang").write_text("// vktrain-spirv-profile: spirv_9\n" + KERNEL.replace("DEFAULT_WG", "32"))
    with pytest.raises(build.ShaderBuildError, match=r"demo.slang: `// vktrain-spirv-profile:` must .*'spirv_9'"):
        build.compile_shader("demo")


def test_cooperative_matrix_kernels_access_workgroup_memory_non_private():
    """slangc's cooperative-matrix SPIR-V uses the Vulkan memory model, where a private access (slangc's
    default) to shared memory is not ordered by the workgroup barriers: the build marks every Workgroup load
    and store NonPrivatePointer with MakePointerVisible / MakePointerAvailable, as glslang does (slang.py)."""
    code = build.load_spirv("coopmat_mm@AB_SCALE+BM=64+ADDEND")
    words = struct.unpack(f"<{len(code) // 4}I", code)
    instructions, position = [], 5
    while position < len(words):
        instructions.append(words[position:position + (words[position] >> 16)])
        position += words[position] >> 16
    assert words[1] == 0x00010400 and any(i[0] & 0xFFFF == 14 and i[2] == 3 for i in instructions)  # Vulkan model
    loads = [i for i in instructions if i[0] & 0xFFFF == 4457]  # OpCooperativeMatrixLoadKHR
    stores = [i for i in instructions if i[0] & 0xFFFF == 4458]
    workgroup_loads = [i for i in loads if len(i) > 6 and i[6] & 0x20]  # NonPrivatePointer
    assert len(workgroup_loads) == 2 and all(i[6] & 0x10 for i in workgroup_loads)  # the A and B fragments
    assert len(loads) == 3 and len(stores) == 2  # + the addend block from its buffer; the output and the edge
    assert sum(1 for i in stores if i[5] & 0x28 == 0x28) == 1  # the edge block, MakePointerAvailable

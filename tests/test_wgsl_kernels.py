"""The WGSL kernels (vktrain/runtime_shaders/wgsl) on the WebGPU runtime (wgpu on lavapipe here).

Kernel checks run the Vulkan kernel tests' own bodies (tests/test_kernels_*.py) with the WebGPU device
in place of the Vulkan one: the same plan functions, shape sets, references (the op library's CPU
definitions, torch eager, float64 formulas, bit-exact layouts) and tolerances, derived in those
modules' docstrings; `vktrain.runtime`'s Buffer / Program build the WebGPU objects for a WebGPU
device. `on_webgpu` turns such a test into one taking `webgpu_device` (tests/conftest.py: skipped where
wgpu or an adapter is missing; a test during which wgpu logged an error fails), with the Vulkan test's
cases, all of them (small shapes: the whole module takes about a minute of CPU on lavapipe).

Feature variants: the session's `webgpu_device` takes every WGSL feature body its adapter has (lavapipe:
the subgroup reductions of rms_norm, fused_ce, fused_ce_sum), so the wrapped tests check those; the
kernels with feature bodies are checked once more on `webgpu_defaults_device` (kernel_features=(): the
browser-valid defaults). The Vulkan tests' tolerances for these kernels hold for any summation order
of their sums (see their docstrings and subgroup_reduce.slangh); the sum of fused_ce_sum is also
checked against the bound of the subgroup order itself.

Besides: every WGSL kernel declares exactly the interface of the GLSL shader it mirrors (bindings and
their access, push block size and header, specialization ids), every shader the mlp-lora and
tiny-llama training steps dispatch has one, and the lookup refuses names it cannot serve.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

import test_generate as generate  # the Vulkan kernel tests whose bodies run here
import test_kernels_aten as aten
import test_kernels_ce_adamw_requant as ce_adamw
import test_kernels_linear as linear
import test_kernels_transformer as transformer
import test_gemm_scale as gemm_scale
import test_matmul_thin as thin
import test_q8_0_weights as q8_0
from _helpers import export_mlp_lora_training_step

from vktrain.backend.kernel_planning.kernels import kv_cache
from vktrain.backend.kernel_planning.kernels.attention import AttentionTiles
from vktrain.runtime_shaders import load_spirv, reflect_spirv
from vktrain.runtime_shaders.build import spirv_path
from vktrain.runtime_shaders.wgsl import (
    FEATURE_DEFINES,
    WGSLKernelNotFoundError,
    WGSLSourceError,
    all_wgsl_shader_names,
    declared_wgsl_features,
    missing_wgsl_kernels,
    wgsl_source,
)
from _helpers import planned

UNIT_ROUNDOFF = 2.0 ** -24


# The fixtures the Vulkan tests' bodies take besides their device, on the WebGPU device.
@pytest.fixture
def rng():
    return np.random.default_rng(aten.RNG_SEED)


@pytest.fixture
def buffers(request):
    """Buffers on the test's WebGPU device (webgpu_defaults_device where the test takes it)."""
    name = "webgpu_defaults_device" if "webgpu_defaults_device" in request.fixturenames else "webgpu_device"
    made = ce_adamw.Buffers(request.getfixturevalue(name))
    yield made
    made.destroy()


@pytest.fixture(scope="module")
def _defaults_device(webgpu_device):
    from vktrain.runtime.webgpu import Device

    device = Device(kernel_features=())
    yield device
    device.close()


@pytest.fixture
def webgpu_defaults_device(_defaults_device):
    """A WebGPU device running the browser-valid default bodies only; a test during which wgpu logged an
    error on it fails (as conftest does for webgpu_device)."""
    _defaults_device.take_validation_messages()
    yield _defaults_device
    messages = _defaults_device.take_validation_messages()
    if messages:
        pytest.fail(f"wgpu logged {len(messages)} error(s): {[m.message for m in messages]}", pytrace=False)


def on_webgpu(vulkan_test, device: str = "webgpu_device"):
    """`vulkan_test` (a test of tests/test_kernels_*.py whose device argument is `vk_device`) as a test on
    the WebGPU device fixture `device`, with the Vulkan test's parametrize marks."""
    signature = inspect.signature(vulkan_test)
    parameters = [p.replace(name=device) if p.name == "vk_device" else p
                  for p in signature.parameters.values()]

    def test(**arguments):
        arguments["vk_device"] = arguments.pop(device)
        vulkan_test(**arguments)

    test.__signature__ = signature.replace(parameters=parameters)
    test.__name__ = vulkan_test.__name__
    test.__doc__ = f"{vulkan_test.__module__}.{vulkan_test.__name__} on the WebGPU device."
    for mark in reversed(getattr(vulkan_test, "pytestmark", [])):
        if mark.name != "parametrize":
            raise TypeError(f"{vulkan_test.__name__}: cannot carry over mark {mark.name!r}")
        test = pytest.mark.parametrize(*mark.args, **mark.kwargs)(test)
    return test


# ---- the lookup and the kernels' interfaces ---------------------------------------------------------

def _names_and_features():
    """(shader name, feature set) of every default kernel and every feature body, and of the kernels that exist
    only with a feature (the f16 GEMMs of fp16-tc: shader-f16)."""
    cases = []
    for name in all_wgsl_shader_names():
        cases.append((name, ()))
        cases += [(name, (feature,)) for feature in sorted(declared_wgsl_features(name.partition("@")[0]))]
    default = set(all_wgsl_shader_names())
    cases += [(name, ("shader-f16",)) for name in all_wgsl_shader_names({"shader-f16"}) if name not in default]
    return cases


@pytest.mark.parametrize("name,features", _names_and_features())
def test_wgsl_kernel_compiles_and_declares_the_glsl_interface(webgpu_device, name, features):
    """The WGSL (default and feature bodies) compiles (wgpu validates it) and declares what the GLSL of the
    same name does: bindings 0..n-1 with the same read-only ones, the push block's size and header, the
    specialization ids (local size ids 1 and 2 may be absent: the runtime only passes them when they are
    not 1)."""
    from vktrain.runtime.webgpu import reflect_wgsl

    if not set(features) <= webgpu_device.features:
        pytest.skip(f"the adapter lacks {features}")
    source = wgsl_source(name, features)
    webgpu_device.handle.create_shader_module(code=source)
    wgsl = reflect_wgsl(name, source)
    if not spirv_path(name).is_file():
        pytest.skip(f"no SPIR-V of {name} built here to compare with (python -m vktrain.runtime_shaders.build)")
    glsl = reflect_spirv(load_spirv(name))
    glsl_storage = sorted((b.binding, b.readonly) for b in glsl.bindings if b.set == 0 and b.kind == "storage")
    assert [(b.binding, b.readonly) for b in wgsl.storage] == glsl_storage
    assert wgsl.has_group_offset_header == glsl.has_group_offset_header
    assert (wgsl.params_bytes or 0) == glsl.push_constant_size
    assert set(wgsl.spec_types) <= set(glsl.spec_types) <= set(wgsl.spec_types) | {1, 2}
    for spec_id, kind in wgsl.spec_types.items():
        assert kind == glsl.spec_types[spec_id], f"override @id({spec_id})"


# GLSL shaders WebGPU never dispatches: the register-tile bodies of the CPU GEMM tuning, the tensor-core
# (cooperative-matrix) kernels, and the Vulkan runtime's self-test kernels (the WebGPU layer has its own).
def _webgpu_dispatches(name: str) -> bool:
    """Whether the WebGPU runtime may dispatch GLSL shader `name`: not the tests', the coopmat kernels (served
    in f16 only), the CPU register tiles (WebGPU runs the GPU tuning), nor the FP16 variants (the fp16 policy
    runs the f16 WGSL GEMMs on WebGPU: kernels/coopmat.py)."""
    base, _, variant = name.partition("@")
    defines = variant.split("+")
    return not (base.startswith(("coopmat_", "test_")) or "CPU_REGISTER_TILES" in defines or "FP16" in defines)


def test_every_glsl_shader_webgpu_can_dispatch_has_a_wgsl_kernel():
    from vktrain.runtime_shaders import all_shader_names

    names = all_shader_names()
    assert missing_wgsl_kernels([name for name in names if _webgpu_dispatches(name)]) == []
    assert len([name for name in names if _webgpu_dispatches(name)]) > 40  # the filter keeps the kernels


def test_lookup_refuses_what_it_cannot_serve():
    with pytest.raises(WGSLKernelNotFoundError, match="'no_such_kernel'.*does not exist") as missing:
        wgsl_source("no_such_kernel")
    assert missing.value.shader == "no_such_kernel"
    # The GLSL has register-tile CPU variants; WebGPU runs the GPU tuning only.
    with pytest.raises(WGSLKernelNotFoundError, match=r"linear_q4gsw\.slang serves only linear_q4gsw, "
                                                      r"linear_q4gsw@HAS_BIAS"):
        wgsl_source("linear_q4gsw@CPU_REGISTER_TILES")
    with pytest.raises(WGSLKernelNotFoundError, match="bad define"):
        wgsl_source("fused_ce@VEC4+")
    # Defines in any order name the same variant.
    assert wgsl_source("fused_ce@IN_PLACE+VEC4") == wgsl_source("fused_ce@VEC4+IN_PLACE")
    assert missing_wgsl_kernels(["fused_ce@IN_PLACE+VEC4", "nope", "copy", "nope"]) == ["nope"]


def test_variants_select_lines_and_define_values(tmp_path, monkeypatch):
    # fused_ce's WGSL is generated from fused_ce.slang (slangc, with the variant's defines).
    plain, vec4 = wgsl_source("fused_ce"), wgsl_source("fused_ce@VEC4+IN_PLACE")
    assert "array<f32>;" in plain and "array<vec4<f32>>" not in plain and "@binding(5)" in plain
    assert "array<vec4<f32>>" in vec4 and "@binding(5)" not in vec4  # IN_PLACE: one binding fewer
    assert not any(line.lstrip().startswith("#") for name in all_wgsl_shader_names()
                   for line in wgsl_source(name).splitlines())
    # A hand-written source: defines read as values become consts, `#if !NAME` declares the defaults.
    from vktrain.runtime_shaders import wgsl

    monkeypatch.setattr(wgsl, "WGSL_DIR", tmp_path)
    (tmp_path / "tiled.wgsl").write_text("// vktrain-variants: HAS_BIAS=0, HAS_BIAS=1+TILE_M=16\n#if !TILE_M\n"
                                         "const TILE_M = 64;\n#endif\n#if HAS_BIAS\nbias\n#endif\nx = TILE_M;\n")
    tiles = wgsl_source("tiled@HAS_BIAS=1+TILE_M=16")
    assert tiles.startswith("const TILE_M = 16;\n") and "const TILE_M = 64;" not in tiles
    assert "\nbias\n" in tiles and "HAS_BIAS =" not in tiles  # a define only `#if` reads declares nothing
    untiled = wgsl_source("tiled@HAS_BIAS=0")
    assert "const TILE_M = 64;" in untiled and "bias" not in untiled


def test_feature_bodies_are_chosen_by_the_device_and_reported(webgpu_device, webgpu_defaults_device):
    """A feature body replaces the default's reductions only when asked for; the device takes every one
    it has unless told otherwise, refuses what it lacks, and its report names the kernels that took them."""
    from vktrain.runtime.webgpu import Device, WebGPUUnavailableError

    assert set(FEATURE_DEFINES) == {"subgroup", "shader-f16"}  # shader-f16: the fp16-tc kernels (test_wgsl_f16.py)
    for name in ("rms_norm@VEC4+BACKWARD", "fused_ce@VEC4", "fused_ce_sum"):
        assert "subgroupAdd" in wgsl_source(name, {"subgroup"}) and "subgroupAdd" not in wgsl_source(name)
        assert wgsl_source(name, {"shader-f16"}) == wgsl_source(name)  # no f16 body: the default
    assert wgsl_source("reduce", {"subgroup"}) == wgsl_source("reduce")  # keeps its Kahan sums
    if "subgroup" not in webgpu_device.features:
        pytest.skip("the adapter has no subgroup feature")
    assert webgpu_device.kernel_features == set(FEATURE_DEFINES) & webgpu_device.features
    assert webgpu_defaults_device.kernel_features == set()
    webgpu_device.pipelines.source("fused_ce_sum")
    assert "subgroup bodies in " in webgpu_device.kernel_report()
    assert "fused_ce_sum" in webgpu_device.kernel_report()
    webgpu_defaults_device.pipelines.source("fused_ce_sum")
    assert webgpu_defaults_device.kernel_report().startswith("WGSL kernels: shader-f16, subgroup: browser-valid "
                                                             "defaults (not chosen); runtime checks ")
    with pytest.raises(WebGPUUnavailableError, match=r"\['nope'\] have no WGSL bodies"):
        Device(kernel_features=("nope",))


@pytest.mark.parametrize("R", [1, 255, 3000])
def test_fused_ce_sum_stays_within_the_bound_of_its_summation_order(webgpu_device, webgpu_defaults_device, R):
    """loss = the sum of R row losses, on both bodies, against float64: each thread adds ceil(R / WG)
    values in order, then the tree (log2 WG levels) or the subgroups (subgroupAdd over at most WG values,
    then the subgroups' results in order, at most WG more) combine them, so no value passes through
    more than ceil(R / WG) + 2 WG additions: |error| <= that count * u * sum |x|. Positive terms of
    similar size: dropping or repeating one term moves the sum by ~1/R of it, beyond the bound. Two
    runs of one body agree bit for bit."""
    from vktrain.runtime import Buffer, Program
    from vktrain.backend.kernel_planning.kernels.cross_entropy import plan_fused_ce

    workgroup = 256
    row_loss = np.random.default_rng(R).uniform(0.5, 1.5, R).astype(np.float32)
    expected = float(np.sum(row_loss, dtype=np.float64))
    bound = (-(-R // workgroup) + 2 * workgroup) * UNIT_ROUNDOFF * expected
    assert bound < 0.5 * expected / R  # the check can see one term too many or too few
    for device in (webgpu_device, webgpu_defaults_device):
        sum_dispatch = plan_fused_ce(R=R, V=4, logits="x", labels="l", n_valid="n", loss="loss", dlogits="d",
                                     row_loss="rows")[1]
        assert sum_dispatch.shader == "fused_ce_sum" and sum_dispatch.local_size[0] == workgroup
        rows = Buffer.from_array(device, row_loss, name="rows")
        loss = Buffer.from_array(device, np.full(1, np.nan, np.float32), name="loss")
        try:
            results = []
            with Program(device, [sum_dispatch], {"rows": rows, "loss": loss}) as program:
                for _ in range(2):
                    program.replay()
                    results.append(loss.read(np.float32, (1,))[0])
        finally:
            rows.destroy()
            loss.destroy()
        assert results[0] == results[1], device.kernel_report()
        assert abs(float(results[0]) - expected) <= bound, (R, results[0], expected, device.kernel_report())


def test_malformed_directives_are_reported_with_file_and_line(tmp_path, monkeypatch):
    from vktrain.runtime_shaders import wgsl

    monkeypatch.setattr(wgsl, "WGSL_DIR", tmp_path)
    for text, message in (("#if A < 2\n#endif\n", r"broken.wgsl:1: `#if A < 2` is not NAME"),
                          ("#if A\n", "1 #if without #endif"), ("#else\n", "broken.wgsl:1: #else without #if"),
                          ('#include "other.glsl"\n', "broken.wgsl:1: #include \"other.glsl\": not codes.glsl"),
                          ("#pragma x\n", "unknown directive")):
        (tmp_path / "broken.wgsl").write_text(text)
        with pytest.raises(WGSLSourceError, match=message):
            wgsl_source("broken")


# ---- every shader of the training programs ------------------------------------------------------------

def _dispatched_shaders(device, path) -> set[str]:
    from vktrain.runtime.delegate.executor import GraphExecutor
    from vktrain.serialization.pte import PteFile
    from vktrain.serialization import deserialize_blob

    pte = PteFile.load(path)
    graph = deserialize_blob(bytes(pte.execution_plan().delegates[0].data), named_data=pte.named_data)
    with GraphExecutor(device, graph, planned(device, graph)) as executor:  # builds every pipeline: a missing kernel fails here
        if "subgroup" in device.kernel_features:  # the startup line names the feature bodies taken
            # (the device's report names every feature's bodies taken so far: shader-f16 ones, listed
            # first, when an fp16-tc test ran on this device before)
            assert "WGSL kernels: " in executor.gemm_report() and "subgroup bodies in " in executor.gemm_report()
            assert "fused_ce_sum" in executor.gemm_report()
        return {dispatch.shader for dispatch in executor.dispatches}


def test_every_shader_of_the_training_programs_has_a_wgsl_kernel(webgpu_device, tmp_path):
    """The mlp-lora and tiny-llama training steps (the shapes of test_runner_parity / test_llama_parity)
    load on the WebGPU device, and every Dispatch.shader they plan has a WGSL kernel."""
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    export_mlp_lora_training_step(tmp_path / "mlp.pte", (2, 8), 64)
    llama = build_model("tiny-llama")
    apply_lora(llama, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    (tmp_path / "llama.pte").write_bytes(lower_to_pte(export_training_step(llama, (2, 16))))

    mlp = _dispatched_shaders(webgpu_device, tmp_path / "mlp.pte")
    llama_shaders = _dispatched_shaders(webgpu_device, tmp_path / "llama.pte")
    assert missing_wgsl_kernels(mlp | llama_shaders) == []
    # The programs exercise the families the kernels below are checked for.
    assert {"adamw@VEC4", "fused_ce@VEC4+IN_PLACE", "fused_ce_sum", "linear_q4gsw", "linear_q4gsw_backward"} <= mlp
    assert {"attention_fwd", "attention_bwd@DQ", "attention_bwd@DKV", "rms_norm@VEC4+BACKWARD", "rope",
            "swiglu@VEC4+BACKWARD"} <= llama_shaders


# ---- kernels: elementwise, copies, embedding (test_kernels_aten.py) ---------------------------------

test_unary_ops_match_torch = on_webgpu(aten.test_unary_ops_match_torch)
test_unary_special_values_match_torch = on_webgpu(aten.test_unary_special_values_match_torch)
test_gelu_is_accurate_far_into_the_negative_tail = on_webgpu(aten.test_gelu_is_accurate_far_into_the_negative_tail)
test_tanh_erf_log_keep_relative_accuracy = on_webgpu(
    aten.test_tanh_erf_log_keep_relative_accuracy_where_textbook_formulas_cancel)
test_pow_special_values = on_webgpu(aten.test_pow_special_values)
test_binary_broadcasting_matches_torch = on_webgpu(aten.test_binary_broadcasting_matches_torch)
test_binary_ops_propagate_nan_like_torch = on_webgpu(aten.test_binary_ops_propagate_nan_like_torch)
test_activation_backwards_match_torch = on_webgpu(aten.test_activation_backwards_match_torch)
test_elementwise_reads_strided_views_in_place = on_webgpu(aten.test_elementwise_reads_strided_views_in_place)
test_elementwise_split_dispatch = on_webgpu(aten.test_elementwise_split_dispatch)
test_layout_copies_are_exact = on_webgpu(aten.test_layout_copies_are_exact)
test_to_copy_converts_like_torch = on_webgpu(aten.test_to_copy_converts_like_torch)
test_fills_match_torch = on_webgpu(aten.test_fills_match_torch)
test_cat_along_each_dim = on_webgpu(aten.test_cat_along_each_dim)
test_strided_copy_into_a_region_of_a_larger_output = on_webgpu(aten.test_strided_copy_into_a_region_of_a_larger_output)
test_embedding_forward_gathers_rows = on_webgpu(aten.test_embedding_forward_gathers_rows)
test_embedding_forward_out_of_range_index_gives_nan_row = on_webgpu(
    aten.test_embedding_forward_out_of_range_index_gives_nan_row)
test_embedding_dense_backward_repeated_indices = on_webgpu(aten.test_embedding_dense_backward_repeated_indices)
test_embedding_dense_backward_sums_in_index_order_and_splits = on_webgpu(
    aten.test_embedding_dense_backward_sums_in_index_order_and_splits)

# ---- kernels: reductions (test_kernels_aten.py) ---------------------------------------------------------

test_sum_and_mean_match_torch = on_webgpu(aten.test_sum_and_mean_match_torch)
test_sums_are_compensated = on_webgpu(aten.test_sums_are_compensated)
test_sum_of_infinities_is_not_nan = on_webgpu(aten.test_sum_of_infinities_is_not_nan)
test_amax_matches_torch = on_webgpu(aten.test_amax_matches_torch)
test_amax_propagates_nan_and_refuses_empty = on_webgpu(aten.test_amax_propagates_nan_and_refuses_empty)
test_reduction_strategies_are_both_exercised_and_deterministic = on_webgpu(
    aten.test_reduction_strategies_are_both_exercised_and_deterministic)
test_reduction_of_a_strided_view_and_empty_reductions = on_webgpu(
    aten.test_reduction_of_a_strided_view_and_empty_reductions)
test_long_loops_are_not_truncated = on_webgpu(aten.test_long_loops_are_not_truncated)

# ---- kernels: dense GEMM (test_kernels_aten.py) --------------------------------------------------------

test_mm_matches_torch_including_partial_tiles = on_webgpu(aten.test_mm_matches_torch_including_partial_tiles)
test_bmm_matches_torch = on_webgpu(aten.test_bmm_matches_torch)
test_addmm_broadcast_bias_alpha_beta = on_webgpu(aten.test_addmm_broadcast_bias_alpha_beta)
test_addmm_beta_zero_ignores_nan_bias = on_webgpu(aten.test_addmm_beta_zero_ignores_nan_bias)
test_gemm_transposes_and_batch_broadcast_as_strides = on_webgpu(aten.test_gemm_transposes_and_batch_broadcast_as_strides)
test_baddbmm_and_split_batch_grid = on_webgpu(aten.test_baddbmm_and_split_batch_grid)
test_thin_gemm_matches_float64_within_the_fp32_bound_unsplit_and_split = on_webgpu(
    thin.test_thin_gemm_matches_float64_within_the_fp32_bound_unsplit_and_split)
test_thin_addmm_is_the_mm_followed_by_the_add_bit_for_bit = on_webgpu(
    thin.test_thin_addmm_is_the_mm_followed_by_the_add_bit_for_bit)
test_a_scaled_gemm_is_the_mm_followed_by_the_mul_bit_for_bit = on_webgpu(
    gemm_scale.test_a_scaled_gemm_is_the_mm_followed_by_the_mul_bit_for_bit)
test_the_in_place_scale_is_the_elementwise_mul_bit_for_bit = on_webgpu(
    gemm_scale.test_the_in_place_scale_is_the_elementwise_mul_bit_for_bit)

# ---- kernels: the 4-bit linear family (test_kernels_linear.py) ----------------------------------------

def _gemm_cases():
    """(label, dispatches, inputs, output shape) of GEMMs at the Vulkan tests' edge shapes: partial tiles,
    odd N / 4, K % 8 == 4, split-K with an empty slice, a bias, scalar and vec4 C, strided operands."""
    from vktrain.quant import quantize
    from vktrain.backend.kernel_planning.kernels.linear import (GemmTiles, plan_linear_dw, plan_linear_q4gsw,
                                                         plan_linear_q4gsw_backward, prepack_weights,
                                                         split_k_scratch_nbytes)
    from vktrain.backend.kernel_planning.kernels.matmul import plan_addmm, plan_gemm, plan_mm
    from vktrain.serialization.strided_view import StridedView

    rng = np.random.default_rng(5)
    cases = []
    for M, N, K, gs, tiles, split_k, bias in ((70, 100, 132, 4, None, None, True),
                                              (37, 68, 72, 8, GemmTiles(4, 4, 8), 3, False),
                                              (9, 36, 44, 4, GemmTiles(4, 8, 16), None, False)):
        flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), gs)
        w, x = prepack_weights(flat, K), rng.standard_normal((M, K)).astype(np.float32)
        d_out, b = rng.standard_normal((M, N)).astype(np.float32), rng.standard_normal(N).astype(np.float32)
        scratch = split_k_scratch_nbytes(M, max(N, K), split_k or 1)
        q4 = dict(M=M, N=N, K=K, group_size=gs, weights="w", scales="s", out="out", tiles=tiles, split_k=split_k,
                  scratch="scratch" if scratch else None)
        inputs = {"x": x, "d_out": d_out, "w": w, "s": scales, "b": b}
        if scratch:
            inputs["scratch"] = np.zeros(scratch // 4, np.float32)
        cases += [(f"linear_q4gsw {M}x{N}x{K}", plan_linear_q4gsw(x="x", bias="b" if bias else None, **q4), inputs,
                   (M, N)),
                  (f"linear_q4gsw_backward {M}x{N}x{K}", plan_linear_q4gsw_backward(d_out="d_out", **q4), inputs,
                   (M, K)),
                  (f"linear_dw {M}x{N}x{K}", plan_linear_dw(M=M, N=N, K=K, out="out", d_out="d_out", x="x",
                                                           tiles=tiles, split_k=split_k,
                                                           scratch="scratch" if scratch else None), inputs, (N, K))]
    for M, N, K in ((70, 37, 50), (5, 64, 300), (130, 16, 20)):
        a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
        bias = rng.standard_normal(N).astype(np.float32)
        cases.append((f"mm {M}x{N}x{K}", plan_mm(out="out", self="a", self_shape=(M, K), mat2="b", mat2_shape=(K, N)),
                      {"a": a, "b": b}, (M, N)))
        # vktrain.mm_scaled on the tiles: alpha unsplit, the SCALE reduce after forced slices.
        scratch = {"scratch": np.zeros(3 * M * N, np.float32)}
        for split_k in (None, 3) if (M * N) % 4 == 0 else (None,):  # the reduce adds vec4s
            cases.append((f"mm_scaled {M}x{N}x{K} split {split_k}",
                          plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", StridedView.contiguous((K, N)),
                                    scale=1 / 3, split_k=split_k, scratch="scratch" if split_k else None),
                          {"a": a, "b": b, **scratch}, (M, N)))
        cases.append((f"addmm {M}x{N}x{K}", plan_addmm(out="out", self="bias", self_shape=(N,), mat1="a",
                                                      mat1_shape=(M, K), mat2="b", mat2_shape=(K, N), beta=0.5,
                                                      alpha=1.5), {"a": a, "b": b, "bias": bias}, (M, N)))
        # A read transposed (A_M_FASTEST) and B through its transpose view (B_K_FASTEST).
        a_t, b_t = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
        cases.append((f"mm transposed {M}x{N}x{K}",
                      plan_gemm("out", "a_t", StridedView((M, K), (1, M)), "b_t", StridedView((K, N), (1, K))),
                      {"a_t": a_t, "b_t": b_t}, (M, N)))
    # matmul_thin (the thin LoRA products on the GPU tuning): both layouts, the thin side either side, split
    # with an empty slice, an addend unsplit and split (tests/test_matmul_thin.py).
    from vktrain.backend.kernel_planning.kernels.matmul_thin import plan_thin_gemm, thin_layout
    for M, K, N, a_t, b_t in ((70, 260, 16, False, True), (200, 301, 12, True, False), (16, 300, 72, True, False),
                              (5, 520, 36, False, True)):
        a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
        views = (StridedView((M, K), (1, M)) if a_t else StridedView.contiguous((M, K)),
                 StridedView((K, N), (1, K)) if b_t else StridedView.contiguous((K, N)))
        stored = {"a": np.ascontiguousarray(a.T) if a_t else a, "b": np.ascontiguousarray(b.T) if b_t else b,
                  "d": rng.standard_normal((M, N)).astype(np.float32), "scratch": np.zeros(4 * M * N * 8, np.float32)}
        layout = thin_layout(*views)
        for split_k in (1, 5):
            for addend in (None, "d"):
                cases.append((f"matmul_thin {M}x{N}x{K} split {split_k} addend {addend}",
                              plan_thin_gemm("out", "a", "b", layout, addend=addend, scratch="scratch", split_k=split_k),
                              stored, (M, N)))
            # vktrain.mm_scaled (the gemm_scale pass): the SCALE store unsplit, the SCALE reduce split.
            cases.append((f"matmul_thin {M}x{N}x{K} split {split_k} scaled",
                          plan_thin_gemm("out", "a", "b", layout, scale=1 / 3, scratch="scratch", split_k=split_k),
                          stored, (M, N)))
    return cases


def run_gemm_case(device, dispatches, inputs, shape) -> np.ndarray:
    """The `out` of one _gemm_cases() case on `device` (NaN-poisoned before, so a skipped write shows)."""
    from vktrain.runtime import Buffer, Program

    buffers = {key: Buffer.from_array(device, value, name=key) for key, value in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.full(shape, np.nan, np.float32), name="out")
    try:
        with Program(device, dispatches, buffers) as program:
            program.replay()
        return buffers["out"].read(np.float32, shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def test_wgsl_gemms_equal_the_glsl_gemms_bit_for_bit(vk_device, webgpu_device):
    """The WGSL GEMMs sum every output's products in the GLSL's order, one multiply and one add each, and
    apply alpha / beta / bias in the same roundings: on one driver (lavapipe compiles both) the two
    runtimes' outputs are the same bits, at the edge shapes of the Vulkan kernel tests."""
    for label, dispatches, inputs, shape in _gemm_cases():
        vulkan = run_gemm_case(vk_device, dispatches, inputs, shape)
        webgpu = run_gemm_case(webgpu_device, dispatches, inputs, shape)
        assert np.isfinite(vulkan).all(), label
        np.testing.assert_array_equal(webgpu.view(np.uint32), vulkan.view(np.uint32),
                                      err_msg=f"{label} via {[d.shader for d in dispatches]}")


test_identity_activation_reproduces_deq_exactly = on_webgpu(linear.test_identity_activation_reproduces_deq_exactly)
test_linear_q4gsw_gemv = on_webgpu(linear.test_linear_q4gsw_gemv)
test_linear_q4gsw_gemm = on_webgpu(linear.test_linear_q4gsw_gemm)
test_linear_q4gsw_all_zero_scales_give_bias_exactly = on_webgpu(
    linear.test_linear_q4gsw_all_zero_scales_give_bias_exactly)
test_linear_q4gsw_backward = on_webgpu(linear.test_linear_q4gsw_backward)
test_linear_q4gsw_backward_zero_scales_and_split_grid = on_webgpu(
    linear.test_linear_q4gsw_backward_zero_scales_and_split_grid)
test_linear_dw = on_webgpu(linear.test_linear_dw)
test_linear_q4gsw_split_k_with_bias = on_webgpu(linear.test_linear_q4gsw_split_k_with_bias)
test_linear_q4gsw_backward_split_k_with_empty_slice = on_webgpu(
    linear.test_linear_q4gsw_backward_split_k_with_empty_slice)
test_linear_dw_automatic_split_k_for_thin_output = on_webgpu(linear.test_linear_dw_automatic_split_k_for_thin_output)

# ---- kernels: fused cross-entropy, AdamW, requant (test_kernels_ce_adamw_requant.py) --------------------------

test_fused_ce_matches_reference = on_webgpu(ce_adamw.test_fused_ce_matches_reference)
test_fused_ce_default_body_matches_reference = on_webgpu(ce_adamw.test_fused_ce_matches_reference,
                                                         "webgpu_defaults_device")
test_fused_ce_default_body_negative_infinite_logits = on_webgpu(ce_adamw.test_fused_ce_negative_infinite_logits,
                                                                "webgpu_defaults_device")
test_fused_ce_default_body_is_deterministic_and_splits_rows = on_webgpu(
    ce_adamw.test_fused_ce_is_deterministic_and_splits_rows, "webgpu_defaults_device")
test_fused_ce_huge_logits_keep_the_small_loss = on_webgpu(ce_adamw.test_fused_ce_huge_logits_keep_the_small_loss)
test_fused_ce_negative_infinite_logits = on_webgpu(ce_adamw.test_fused_ce_negative_infinite_logits)
test_fused_ce_all_rows_masked = on_webgpu(ce_adamw.test_fused_ce_all_rows_masked)
test_fused_ce_labels_past_vocabulary_are_ignored = on_webgpu(ce_adamw.test_fused_ce_labels_past_vocabulary_are_ignored)
test_fused_ce_is_deterministic_and_splits_rows = on_webgpu(ce_adamw.test_fused_ce_is_deterministic_and_splits_rows)
test_adamw_ten_steps_one_recording_matches_torch_optim = on_webgpu(
    ce_adamw.test_adamw_ten_steps_one_recording_matches_torch_optim)
test_adamw_single_step_matches_op_library = on_webgpu(ce_adamw.test_adamw_single_step_matches_op_library)
test_requant_matches_op_library_int_for_int = on_webgpu(ce_adamw.test_requant_matches_op_library_int_for_int)
test_requant_ties_round_half_to_even = on_webgpu(ce_adamw.test_requant_ties_round_half_to_even)
test_requant_infinities_and_zero_scale = on_webgpu(ce_adamw.test_requant_infinities_and_zero_scale)
test_requant_split_dispatch = on_webgpu(ce_adamw.test_requant_split_dispatch)
test_requant_output_feeds_linear_q4gsw = on_webgpu(ce_adamw.test_requant_output_feeds_linear_q4gsw)

# ---- kernels: transformer ops (test_kernels_transformer.py) ---------------------------------------------

test_rms_norm_forward_and_backward = on_webgpu(transformer.test_rms_norm_forward_and_backward)
test_rms_norm_default_body_forward_and_backward = on_webgpu(transformer.test_rms_norm_forward_and_backward,
                                                            "webgpu_defaults_device")
test_rms_norm_default_body_eps_dominates_zero_rows_and_split_dispatch = on_webgpu(
    transformer.test_rms_norm_eps_dominates_zero_rows_and_split_dispatch, "webgpu_defaults_device")
test_rms_norm_eps_dominates_zero_rows_and_split_dispatch = on_webgpu(
    transformer.test_rms_norm_eps_dominates_zero_rows_and_split_dispatch)
test_rope_forward_and_backward = on_webgpu(transformer.test_rope_forward_and_backward)
test_rope_split_dispatch = on_webgpu(transformer.test_rope_split_dispatch)
test_swiglu_forward_and_backward = on_webgpu(transformer.test_swiglu_forward_and_backward)
test_swiglu_split_dispatch = on_webgpu(transformer.test_swiglu_split_dispatch)
test_causal_attention_forward_and_backward = on_webgpu(transformer.test_causal_attention_forward_and_backward)
test_causal_attention_matches_the_definition = on_webgpu(transformer.test_causal_attention_matches_the_definition)
test_causal_attention_large_scores_stay_finite = on_webgpu(transformer.test_causal_attention_large_scores_stay_finite)
test_causal_attention_backward_is_deterministic_and_splits = on_webgpu(
    transformer.test_causal_attention_backward_is_deterministic_and_splits)


# Besides the cases: the WGSL register arrays full (8 scores, 8 output vec4s per thread), and tiles of a
# column count that the unrolled loops' 4 steps per trip do not divide.
_ATTENTION_WGSL_CASES = [(1, 29, 2, 1, 16, AttentionTiles(4, 8, 1), AttentionTiles(4, 8, 1), AttentionTiles(4, 8, 1)),
                         (1, 21, 2, 2, 128, AttentionTiles(4, 8, 4), AttentionTiles(4, 8, 4), AttentionTiles(4, 8, 4)),
                         (1, 23, 2, 1, 16, AttentionTiles(4, 6, 2), AttentionTiles(6, 6, 2), AttentionTiles(6, 6, 2))]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,tiles,dq_tiles,dkv_tiles",
                         transformer.ATTENTION_CASES + _ATTENTION_WGSL_CASES)
def test_wgsl_attention_equals_the_glsl_attention_bit_for_bit(vk_device, webgpu_device, B, S, Hq, Hkv, D, tiles,
                                                              dq_tiles, dkv_tiles):
    """The WGSL attention passes add every score (d4 ascending), output and gradient term (streamed rows
    ascending) in the GLSL's order, one dot / multiply / add each, with the same masks and rescales: on
    one driver (lavapipe compiles both) out, lse, delta, d_q, d_k and d_v are the same bits, at the Vulkan
    attention tests' edge shapes and at the WGSL register arrays' caps."""
    q, k, v, d_out = transformer.attention_inputs(B, S, Hq, Hkv, D, seed=S + D)
    kwargs = dict(tiles=tiles, dq_tiles=dq_tiles, dkv_tiles=dkv_tiles)
    vulkan = transformer.attention_gpu(vk_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    webgpu = transformer.attention_gpu(webgpu_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    for name, value in vulkan.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_array_equal(webgpu[name].view(np.uint32), value.view(np.uint32), err_msg=name)


test_document_masked_attention_equals_each_document_alone = on_webgpu(
    transformer.test_document_masked_attention_equals_each_document_alone)
test_rope_per_token_tables = on_webgpu(transformer.test_rope_per_token_tables)


@pytest.mark.parametrize("B,S,Hq,Hkv,D,lengths,tiles", transformer.DOCUMENT_CASES)
def test_wgsl_document_attention_equals_the_glsl_bit_for_bit(vk_device, webgpu_device, B, S, Hq, Hkv, D, lengths,
                                                              tiles):
    """The DOCUMENTS variants mask and skip tiles as the GLSL ones do: the same bits on lavapipe."""
    q, k, v, d_out = transformer.attention_inputs(B, S, Hq, Hkv, D, seed=S + D)
    kwargs = dict(tiles=tiles, dq_tiles=tiles, dkv_tiles=tiles, positions=transformer.document_positions(lengths))
    vulkan = transformer.attention_gpu(vk_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    webgpu = transformer.attention_gpu(webgpu_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    for name, value in vulkan.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_array_equal(webgpu[name].view(np.uint32), value.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("B,L,Hq,Hkv,C,D,positions", [
    (1, 1, 4, 2, 200, 32, [150]),  # several 64-key tiles
    (2, 3, 6, 2, 70, 72, [69, 0, 64]),  # two dims per thread, ragged tiles
    (1, 2, 2, 1, 40, 200, [39, 17]),  # all four dims of the first threads, three of the rest
])
def test_wgsl_cached_attention_equals_the_glsl_bit_for_bit(vk_device, webgpu_device, B, L, Hq, Hkv, C, D, positions):
    """Cached attention's accumulators add their terms in the GLSL's order: the same bits on lavapipe."""
    rng = np.random.default_rng(C + D)
    q = rng.standard_normal((B, L, Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, C, Hkv, D)).astype(np.float32) for _ in range(2))
    pos = np.asarray(positions, np.int32)
    plan = kv_cache.plan_cached_attention(q="q", q_shape=q.shape, k_cache="k", k_cache_shape=k.shape, v_cache="v",
                                          v_cache_shape=v.shape, input_pos="pos", input_pos_shape=pos.shape,
                                          scale=1 / math.sqrt(D), out="out")
    inputs = {"q": q, "k": k, "v": v, "pos": pos}
    vulkan = generate._run(vk_device, plan, inputs, {"out": q.shape})["out"]
    webgpu = generate._run(webgpu_device, plan, inputs, {"out": q.shape})["out"]
    assert np.isfinite(vulkan).all()
    np.testing.assert_array_equal(webgpu.view(np.uint32), vulkan.view(np.uint32))

# ---- kernels: generation's KV cache (test_generate.py) ----------------------------------------------------

test_kv_cache_update_kernel_is_the_reference_bit_for_bit = on_webgpu(
    generate.test_kv_cache_update_kernel_is_the_reference_bit_for_bit)
test_cached_attention_kernel_matches_float64_softmax = on_webgpu(
    generate.test_cached_attention_kernel_matches_float64_softmax)

# ---- kernels: Q8_0 weights (test_q8_0_weights.py) ---------------------------------------------------------

test_embedding_q8_0_gathers_the_exact_float32_rows_and_nan_for_bad_indices = on_webgpu(
    q8_0.test_embedding_q8_0_gathers_the_exact_float32_rows_and_nan_for_bad_indices)
test_the_head_gemms_equal_the_float32_gemm_of_the_dequantized_matrix_bit_for_bit = on_webgpu(
    q8_0.test_the_head_gemms_equal_the_float32_gemm_of_the_dequantized_matrix_bit_for_bit)
test_the_head_backward_splits_a_long_vocabulary_reduction_like_the_float32_gemm = on_webgpu(
    q8_0.test_the_head_backward_splits_a_long_vocabulary_reduction_like_the_float32_gemm)

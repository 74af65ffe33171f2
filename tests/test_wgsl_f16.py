"""fp16-tc on WebGPU: the f16 WGSL bodies of the coopmat Dispatches (generated from vktrain/runtime_shaders/coopmat_*.slang, body coopmat_gemm_wgsl.slangh)
and the route that takes them (kernels/coopmat.py, _select_webgpu_route).

Kernels: every f16 WGSL body against float64 on the edge-shape sets of tests/test_kernels_coopmat.py,
within its fp16-input bound, derived there: each output is sum_k fp16(a_k) fp16(b_k), products exact in
f32 (11 x 11 significand bits), summed in f32, so
    |c - sum a_k b_k| <= ((2u + u^2 + 2^-24) + (K + 16) 2^-23) S + 2^-25 sum_k (|a_k| + |b_k|),
u = 2^-11, S = sum_k |a_k b_k| (the f32 sum here runs in one order, k ascending, so (K - 1) 2^-24 would
do: the shared bound is looser by 2x, still ~1.2e-3 S at K = 2048 against a whole term ~S / sqrt(K) for
a wrong index); the scaled operands (d_out of d_x, both of coopmat_mm) obey it times their powers of two.
The addend (ADDEND) is added in f32 after the unscaling: one more rounding, 2^-24 |c + d|.

Against the Vulkan runtime: the WGSL sums every output k ascending with one f32 multiply (exact) and one
f32 add per product, the order of the GLSL's COOPMAT_EMULATE path, and rounds the operands alike (f32
products of the scale, then to f16 nearest-even), so on lavapipe the two agree to the bit; the tests
assert that (a difference means the two staged different operands).

Training: tiny-llama's first step through WebGPU fp16-tc (every GEMM the route covers, the test path)
against the float64 eager loss within the first-order bound of tests/test_precision_policy.py (the
routed base GEMMs and the tied head's mm; attention stays fp32 on WebGPU), and a few more steps that
follow eager fp32's loss curve as PRECISION.md says runs of two precisions do.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.contract import PRECISION_AUTO, PRECISION_FP16_TC, PRECISION_FP32, PRECISIONS
from vktrain.quant import dequantize, quantize
from vktrain.backend.kernel_planning.kernels.coopmat import (
    WGSL_TILING, GemmRoute, plan_coopmat_linear_q4gsw, plan_coopmat_linear_q4gsw_backward, plan_coopmat_mm,
    select_gemm_route
)
from vktrain.errors import PrecisionPolicyError
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights
from vktrain.runtime_shaders.wgsl import (
    WGSLKernelNotFoundError,
    all_wgsl_shader_names,
    required_wgsl_features,
    wgsl_source,
)

from _helpers import LOSS_RTOL, eager_lora_adamw_training, runner_losses
from test_kernels_coopmat import (
    EMULATED_BACKWARD_SHAPES,
    GEMM_SHAPES,
    SUBGROUP_BASIC_BIT,
    _assert_fp16_gemm_close,
    _run,
    _scale_exponent,
)
from test_precision_policy import _float64_loss_and_fp16_bound
from test_webgpu_parity import BETAS, EPS, HPARAMS, LLAMA_BATCH, LLAMA_SEQ, LR, WEIGHT_DECAY, _llama_batches
from vktrain.backend.kernel_planning import plan_schedule

F16 = "shader-f16"
WGSL_KERNELS = ("coopmat_linear_q4gsw", "coopmat_linear_q4gsw_backward", "coopmat_mm")
MM_SHAPES = GEMM_SHAPES + [(64, 16, 4)]
BACKWARD_SHAPES = sorted(set(GEMM_SHAPES) | set(EMULATED_BACKWARD_SHAPES))


@pytest.fixture
def f16_device(webgpu_device):
    if F16 not in webgpu_device.kernel_features:
        pytest.skip(f"{webgpu_device.name} has no {F16} (kernel features: {sorted(webgpu_device.kernel_features)})")
    return webgpu_device


def _wgsl_route(device) -> GemmRoute:
    return select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device)


def _plan_options(device) -> dict:
    route = _wgsl_route(device)
    assert route.wgsl and route.tensor_cores, route.reason
    return route.plan_options


# ---- the kernels' declarations ----------------------------------------------------------------------

def test_f16_kernels_exist_only_with_shader_f16_and_the_absmax_stays_browser_valid():
    for base in WGSL_KERNELS:
        assert required_wgsl_features(base) == {F16}
        assert not any(name.startswith(base + "@") for name in all_wgsl_shader_names())
        served = [name for name in all_wgsl_shader_names({F16}) if name.startswith(base + "@")]
        assert served, base
        for name in served:
            assert "enable f16;" in wgsl_source(name, {F16}).splitlines(), name
            with pytest.raises(WGSLKernelNotFoundError, match=r"needs the device features \['shader-f16'\]"):
                wgsl_source(name, {"subgroup"})
    assert required_wgsl_features("coopmat_absmax") == set()
    assert "enable f16;" not in wgsl_source("coopmat_absmax").splitlines()


def _route_dispatches(options: dict) -> list:
    """Every GEMM Dispatch the WGSL route plans (both B layouts, with and without the addend)."""
    dispatches = plan_coopmat_linear_q4gsw(M=70, N=260, K=64, group_size=32, out="y", x="x", weights="w",
                                           scales="s", **options)
    dispatches += plan_coopmat_linear_q4gsw_backward(M=70, N=64, K=288, group_size=32, out="d", d_out="g",
                                                     weights="w", scales="s", absmax="m", **options)
    for b_transposed in (False, True):
        for addend in (None, "d"):
            dispatches += plan_coopmat_mm(M=70, N=260, K=64, out="c", a="a", b="b", absmax="m",
                                          b_transposed=b_transposed, addend=addend, **options)
    return dispatches


def test_the_route_plans_served_variants_that_fit_browser_limits(f16_device):
    """The route's one tiling names WGSL variants that exist, with the GLSL plans' grid, and their
    workgroups fit BROWSER_DEFAULT_LIMITS (16 KiB of workgroup storage, 256 invocations), read from the
    WGSL's own declarations."""
    from vktrain.runtime.webgpu import BROWSER_DEFAULT_LIMITS, reflect_wgsl

    served = set(all_wgsl_shader_names({F16}))
    dispatches = _route_dispatches(_plan_options(f16_device))
    assert {d.shader for d in dispatches} <= served
    for dispatch in dispatches:
        interface = reflect_wgsl(dispatch.shader, wgsl_source(dispatch.shader, {F16}))
        assert interface.workgroup_memory_bytes({}) <= BROWSER_DEFAULT_LIMITS["max-compute-workgroup-storage-size"]
        if dispatch.shader != "coopmat_absmax":
            assert dispatch.groups[:2] == (-(-(288 if "backward" in dispatch.shader else 260) // WGSL_TILING.tile_n),
                                           -(-70 // WGSL_TILING.tile_m))
    source = wgsl_source("coopmat_mm@AB_SCALE+BM=64", {F16})
    assert "@workgroup_size(16, 16, 1)" in source  # generated from coopmat_gemm_wgsl.slangh's THREADS_X, THREADS_Y
    assert 16 * 16 <= BROWSER_DEFAULT_LIMITS["max-compute-invocations-per-workgroup"]


# ---- the route ----------------------------------------------------------------------------------------

def test_webgpu_fp16_tc_takes_the_f16_wgsl_kernels_and_auto_stays_fp32(f16_device, _defaults_device):
    route = _wgsl_route(f16_device)
    assert route.precision == PRECISION_FP16_TC and route.tensor_cores and route.wgsl and not route.emulate
    assert "f16 WGSL, no tensor cores" in route.reason and "f16 WGSL kernels" in route.describe()
    assert route.plan_options["tiling"] == WGSL_TILING
    test_path = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, f16_device, emulate=True)
    assert test_path.min_workgroups == 1 and test_path.wgsl and not test_path.emulate
    auto = select_gemm_route(PRECISION_AUTO, PRECISIONS, f16_device)
    assert auto.precision == PRECISION_FP32 and not auto.tensor_cores and "auto -> fp32" in auto.reason
    assert select_gemm_route(PRECISION_FP32, PRECISIONS, f16_device).tensor_cores is False
    with pytest.raises(PrecisionPolicyError, match="allows GEMM precision fp32"):
        select_gemm_route(PRECISION_FP16_TC, (PRECISION_FP32,), f16_device)
    # Kernel features off (a device without shader-f16, as a browser may be): fp32, saying why.
    fallback = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _defaults_device)
    assert not fallback.tensor_cores and fallback.precision == PRECISION_FP16_TC
    assert "need the WebGPU feature shader-f16" in fallback.reason and "fp32 kernels run" in fallback.reason


@pytest.fixture(scope="module")
def _defaults_device(webgpu_device):
    from vktrain.runtime.webgpu import Device

    device = Device(kernel_features=())
    yield device
    device.close()


# ---- the kernels against float64 ----------------------------------------------------------------------

@pytest.mark.parametrize("M, N, K", GEMM_SHAPES)
def test_linear_q4gsw_matches_float64_within_the_fp16_bound(f16_device, M, N, K):
    rng = np.random.default_rng(M * 7 + N + K)
    group_size = 32
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    scales[rng.integers(0, scales.shape[0]), :] = 0.0  # a zero group must decode to zeros
    x = rng.standard_normal((M, K)).astype(np.float32)
    dispatches = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=group_size, out="out", x="x", weights="w",
                                           scales="s", **_plan_options(f16_device))
    actual = _run(f16_device, dispatches, {"x": x, "w": prepack_weights(flat, K), "s": scales}, (M, N))
    deq = dequantize(flat, scales, group_size).astype(np.float64)
    _assert_fp16_gemm_close(actual, x.astype(np.float64), deq.T, f"WGSL coopmat_linear_q4gsw {M}x{N}x{K}")


def test_linear_q4gsw_decodes_every_weight_to_its_fp16_value(f16_device):
    """x = identity: y[k, n] = fp16(deq[n, k]) exactly, every (n, k) of the W_4X8 decode on its own."""
    N, K, group_size = 132, 64, 32  # the last block column has rows past N (zero scale)
    flat, scales = quantize(np.random.default_rng(3).standard_normal((N, K)).astype(np.float32), group_size)
    dispatches = plan_coopmat_linear_q4gsw(M=K, N=N, K=K, group_size=group_size, out="out", x="x", weights="w",
                                           scales="s", **_plan_options(f16_device))
    actual = _run(f16_device, dispatches, {"x": np.eye(K, dtype=np.float32), "w": prepack_weights(flat, K),
                                           "s": scales}, (K, N))
    expected = dequantize(flat, scales, group_size).T.astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(actual, expected)


def _mm_inputs(M, N, K, seed, scale_a=1.0, scale_b=0.1):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((M, K)) * scale_a).astype(np.float32),
            (rng.standard_normal((K, N)) * scale_b).astype(np.float32))


def _run_mm(device, options, a, b, b_transposed=False, addend=None):
    (M, K), N = a.shape, b.shape[1]
    dispatches = plan_coopmat_mm(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax", b_transposed=b_transposed,
                                 addend=None if addend is None else "d", **options)
    inputs = {"a": a, "b": np.ascontiguousarray(b.T) if b_transposed else b}
    if addend is not None:
        inputs["d"] = addend
    return _run(device, dispatches, inputs, (M, N))


def _assert_scaled_mm_close(actual, a, b, label):
    scale_a, scale_b = 2.0 ** _scale_exponent(a), 2.0 ** _scale_exponent(b)
    _assert_fp16_gemm_close(actual * (scale_a * scale_b), a.astype(np.float64) * scale_a,
                            b.astype(np.float64) * scale_b, label)


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("M, N, K", MM_SHAPES)
def test_mm_matches_float64_within_the_fp16_bound(f16_device, M, N, K, b_transposed):
    a, b = _mm_inputs(M, N, K, M + 3 * N + 5 * K)
    actual = _run_mm(f16_device, _plan_options(f16_device), a, b, b_transposed)
    _assert_scaled_mm_close(actual, a, b, f"WGSL coopmat_mm {M}x{N}x{K} b_transposed={b_transposed}")


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("scale_a, scale_b", [(1e-7, 1.0), (1.0, 3e-8), (1e3, 1e-9)],
                         ids=["tiny-a", "tiny-b", "large-a-tiny-b"])
def test_mm_keeps_fp16_precision_for_operands_of_any_scale(f16_device, scale_a, scale_b, b_transposed):
    """Operands far below fp16's normal range keep 11 bits through their per-tensor scales."""
    a, b = _mm_inputs(37, 132, 96, 11, scale_a, scale_b)
    actual = _run_mm(f16_device, _plan_options(f16_device), a, b, b_transposed)
    _assert_scaled_mm_close(actual, a, b, f"WGSL coopmat_mm a x{scale_a} b x{scale_b}")


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("M, N, K", [(1, 4, 32), (70, 260, 96)])
def test_mm_addend_is_added_in_f32_after_the_unscaling(f16_device, M, N, K, b_transposed):
    """C = A @ B + D: the product's bound plus one f32 rounding of the sum, and exactly the bits of the
    kernel without the addend followed by an f32 add (what the fused addmm replaces)."""
    a, b = _mm_inputs(M, N, K, 7 * M + N)
    d = np.random.default_rng(M).standard_normal((M, N)).astype(np.float32)
    options = _plan_options(f16_device)
    fused = _run_mm(f16_device, options, a, b, b_transposed, addend=d)
    product = _run_mm(f16_device, options, a, b, b_transposed)
    np.testing.assert_array_equal(fused, (product.astype(np.float32) + d).astype(np.float64))
    _assert_scaled_mm_close(product, a, b, f"WGSL coopmat_mm {M}x{N}x{K} (the addend's product)")


def test_mm_runs_a_1b_reduction_whole_within_lavapipes_loop_limit(f16_device):
    """K = 8192 (Llama-3.2-1B's MLP down projection): lavapipe ends an invocation after 65535 loop trips
    and leaves its outputs unwritten (NaN here); the WGSL takes 5 trips per 32-long step (about 1300),
    so, unlike the emulated GLSL, it needs no loop budget in its plans."""
    a, b = _mm_inputs(64, 128, 8192, 17)
    actual = _run_mm(f16_device, _plan_options(f16_device), a, b, b_transposed=True)
    _assert_scaled_mm_close(actual, a, b, "WGSL coopmat_mm 64x128x8192")


def test_mm_rounds_inputs_to_fp16_not_keeping_fp32(f16_device):
    """1 + 2^-13 is 1 in fp16: [1 + 2^-13] @ [1] gives exactly 1 (an f32 kernel keeps the 2^-13)."""
    a = np.full((16, 16), 1.0 + 2.0 ** -13, dtype=np.float32)
    b = np.zeros((16, 16), dtype=np.float32)
    b[0, :] = 1.0
    np.testing.assert_array_equal(_run_mm(f16_device, _plan_options(f16_device), a, b), np.ones((16, 16)))


def _run_backward(device, options, d_out, flat, scales, group_size):
    M, N = d_out.shape
    K = scales.shape[0] * group_size
    dispatches = plan_coopmat_linear_q4gsw_backward(M=M, N=N, K=K, group_size=group_size, out="out", d_out="d_out",
                                                    weights="w", scales="s", absmax="absmax", **options)
    return _run(device, dispatches, {"d_out": d_out, "w": prepack_weights(flat, K), "s": scales}, (M, K))


def _backward_inputs(M, N, K, gradient_scale):
    rng = np.random.default_rng(M * 5 + 3 * N + K)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), 32)
    return (rng.standard_normal((M, N)) * gradient_scale).astype(np.float32), flat, scales


@pytest.mark.parametrize("gradient_scale", [1.0, 1e-7], ids=["unit", "tiny"])
@pytest.mark.parametrize("M, N, K", BACKWARD_SHAPES)
def test_linear_q4gsw_backward_matches_float64_within_the_scaled_fp16_bound(f16_device, M, N, K, gradient_scale):
    """d_x = d_out @ deq(W) (N the reduction, K the output width); d_out of 1e-7 keeps 11 bits."""
    d_out, flat, scales = _backward_inputs(M, N, K, gradient_scale)
    actual = _run_backward(f16_device, _plan_options(f16_device), d_out, flat, scales, 32)
    scale = 2.0 ** _scale_exponent(d_out)
    _assert_fp16_gemm_close(actual * scale, d_out.astype(np.float64) * scale,
                            dequantize(flat, scales, 32).astype(np.float64),
                            f"WGSL coopmat_linear_q4gsw_backward {M}x{N}x{K} x{gradient_scale}")


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_linear_q4gsw_backward_propagates_a_non_finite_gradient_and_zeros_stay_zero(f16_device, bad):
    flat, scales = quantize(np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32), 32)
    options = _plan_options(f16_device)
    np.testing.assert_array_equal(_run_backward(f16_device, options, np.zeros((16, 64), np.float32), flat, scales, 32),
                                  np.zeros((16, 64)))
    d_out = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    d_out[3, 5] = bad
    actual = _run_backward(f16_device, options, d_out, flat, scales, 32)
    assert not np.isfinite(actual[3]).any()
    rest = np.delete(np.arange(16), 3)
    _assert_fp16_gemm_close(actual[rest], d_out[rest].astype(np.float64), dequantize(flat, scales, 32).astype(np.float64),
                            f"WGSL backward with {bad} in row 3")


# ---- WebGPU against Vulkan's emulated fp16-tc ---------------------------------------------------------

def _emulated_options(vk_device) -> dict:
    if "shaderFloat16" not in vk_device.features or not vk_device.subgroup_operations & SUBGROUP_BASIC_BIT:
        pytest.skip(f"{vk_device.name} cannot run the emulated coopmat kernels")
    return dict(emulate=True, subgroup_size=vk_device.subgroup_size, tiling=WGSL_TILING)


# The emulated shapes of tests/test_kernels_coopmat.py (lavapipe runs the emulated GLSL slowly).
CROSS_SHAPES = [(1, 4, 32), (37, 132, 96), (70, 260, 64)]


@pytest.mark.parametrize("M, N, K", CROSS_SHAPES)
def test_webgpu_f16_kernels_equal_vulkans_emulated_fp16_tc_bit_for_bit(f16_device, vk_device, M, N, K):
    wgsl, emulated = _plan_options(f16_device), _emulated_options(vk_device)
    rng = np.random.default_rng(M + N + K)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), 32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    inputs = {"x": x, "w": prepack_weights(flat, K), "s": scales}
    results = [_run(device, plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=32, out="out", x="x", weights="w",
                                                      scales="s", **options), inputs, (M, N))
               for device, options in ((f16_device, wgsl), (vk_device, emulated))]
    np.testing.assert_array_equal(*results, err_msg="coopmat_linear_q4gsw")
    d_out = (rng.standard_normal((M, N)) * 1e-6).astype(np.float32)
    flat_t, scales_t = quantize(rng.standard_normal((N, K)).astype(np.float32), 32)
    np.testing.assert_array_equal(_run_backward(f16_device, wgsl, d_out, flat_t, scales_t, 32),
                                  _run_backward(vk_device, emulated, d_out, flat_t, scales_t, 32),
                                  err_msg="coopmat_linear_q4gsw_backward")
    a, b = _mm_inputs(M, N, K, 5 * M + K, scale_a=1e-7)
    d = rng.standard_normal((M, N)).astype(np.float32)
    for b_transposed in (False, True):
        for addend in (None, d):
            np.testing.assert_array_equal(_run_mm(f16_device, wgsl, a, b, b_transposed, addend),
                                          _run_mm(vk_device, emulated, a, b, b_transposed, addend),
                                          err_msg=f"coopmat_mm b_transposed={b_transposed} addend={addend is not None}")


# ---- training through WebGPU fp16-tc ------------------------------------------------------------------

TRAIN_STEPS = 4


@pytest.fixture(scope="module")
def tiny_llama_step(tmp_path_factory):
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("pte") / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (LLAMA_BATCH, LLAMA_SEQ))))
    return path, model


def test_tiny_llama_trains_through_webgpu_fp16_tc_within_the_fp16_step_bound(f16_device, tiny_llama_step):
    """Every GEMM the route covers runs the f16 WGSL kernels (no emulation variant, no tensor-core
    attention); the step-1 loss is within the first-order fp16 bound of the float64 loss
    (tests/test_precision_policy.py: every routed base GEMM and the tied head's scaled mm), and the later
    steps follow eager fp32's curve within that same bound (PRECISION.md: two precisions' runs are
    compared by loss curves; the bound is not derived for them), while differing from the fp32 route."""
    from vktrain.runtime.program.runner import TrainingRunner

    path, model = tiny_llama_step
    options = dict(precision=PRECISION_FP16_TC, emulate_tensor_cores=True)
    with TrainingRunner.from_pte(path, f16_device, planner=plan_schedule, **options) as runner:
        executor = runner.executor
        report = runner.gemm_report()
        assert executor.gemm_route.wgsl and "f16 WGSL, no tensor cores" in report
        assert f"{len(executor.tensor_core_ops)} of" in report and "GEMM ops on f16 WGSL kernels" in report, report
        routed = {d.shader for d in executor.dispatches if d.name in executor.tensor_core_ops}
        assert {s.split("@")[0] for s in routed} == set(WGSL_KERNELS), routed
        assert not any("COOPMAT_EMULATE" in s or "attention" in s for s in routed), routed
        losses = runner_losses(runner, _llama_batches(TRAIN_STEPS), HPARAMS)
    with TrainingRunner.from_pte(path, f16_device, planner=plan_schedule) as fp32_runner:
        fp32_losses = runner_losses(fp32_runner, _llama_batches(TRAIN_STEPS), HPARAMS)
    eager, _, _ = eager_lora_adamw_training(model, _llama_batches(TRAIN_STEPS), lr=LR, betas=BETAS, eps=EPS,
                                            weight_decay=WEIGHT_DECAY)
    reference, bound, count = _float64_loss_and_fp16_bound(model, next(_llama_batches(1)), head="lm_head")
    assert count == 7 * model.config.n_layers + 1
    print(f"WebGPU fp16-tc losses {losses} vs eager fp32 {eager}; step-1 bound {bound:.2e} (float64 {reference!r})")
    assert abs(losses[0] - reference) <= bound + LOSS_RTOL * abs(reference)
    assert bound < 2e-2 * abs(reference)  # the bound says something (test_precision_policy.py)
    for step, (loss, expected) in enumerate(zip(losses, eager), 1):
        assert abs(loss - expected) <= bound + LOSS_RTOL * abs(expected), f"step {step}: {loss} vs eager {expected}"
    assert losses[-1] < losses[0] and losses != fp32_losses


def test_bench_compares_webgpu_fp16_tc_with_vulkan_fp16_tc_fp32_and_webgpu_fp32():
    """scripts/bench_webgpu.py run --precision fp32 fp16-tc: the pairs it reports, and a comparison's numbers."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_webgpu.py"
    spec = importlib.util.spec_from_file_location("bench_webgpu", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.compared_pairs([PRECISION_FP32]) == [("vulkan", "webgpu")]
    assert bench.compared_pairs([PRECISION_FP32, PRECISION_FP16_TC]) == [
        ("vulkan", "webgpu"), ("vulkan:fp16-tc", "webgpu:fp16-tc"), ("vulkan", "webgpu:fp16-tc"),
        ("webgpu", "webgpu:fp16-tc")]
    base = dict(ms_per_step=10.0, losses=[2.0, 1.0], gpu_ms_per_step=8.0, encode_ms=None,
                last_step_ms_by_shader={"a": 1.0, "b": 5.0})
    other = dict(ms_per_step=15.0, losses=[2.0, 1.001], gpu_ms_per_step=None, encode_ms=3.0,
                 last_step_ms_by_shader={"b": 2.0, "c": 4.0})
    result = bench.compare(base, other, top=2)
    assert result["other_over_base"] == 1.5 and result["step_ms_difference"] == 5.0
    assert result["max_rel_loss_diff"] == pytest.approx(1e-3) and result["gpu_ms_difference"] is None
    assert result["encode_ms"] == 3.0 and [row["shader"] for row in result["by_shader"]] == ["c", "a"]
    assert bench.compare({"error": "no device"}, other, top=2) == {}

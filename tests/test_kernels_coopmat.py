"""Tensor-core GEMMs (vktrain/backend/kernel_planning/kernels/coopmat.py) and the cooperative-matrix query.

The plan and capability checks run everywhere. The GEMM checks run in two modes: "coopmat", on a
device whose cooperative-matrix properties list 16x16x16 fp16 x fp16 + fp32 (lavapipe has none: those
skip with the reason), and "emulated", the same shaders with the cooperative-matrix operations done by
plain arithmetic (COOPMAT_EMULATE), which runs on lavapipe and covers the staging, W_4X8 decoding,
tiling, fragment offsets and edge stores everywhere the tests run.

Tolerance (derived, element by element, against a float64 reference). Each output is
sum_k a_k b_k. The kernels round a_k and b_k to fp16 (round to nearest: relative error <= u = 2^-11
each; for the 4-bit base b_k = fp16(fl32(q * scale)), whose fp32 product adds <= 2^-24), multiply
exactly (11-bit x 11-bit significands fit fp32) and sum in fp32. So
    |c - sum a_k b_k| <= ((2u + u^2 + 2^-24) + gamma) * S,   S = sum_k |a_k b_k|,
with gamma = (K + 16) * 2^-23 for the fp32 accumulation in any order (2^-23: tensor cores may
truncate rather than round their sums; +16 for the 16-wide products inside each MMA), plus an
absolute 2^-25 * sum_k (|a_k| + |b_k|) for inputs that fall into fp16's subnormal range (spacing
2^-24). For K = 2048 that is ~1.2e-3 * S, while a wrong layout or index moves an output by a whole
term |a_k b_k| ~ S / sqrt(K) or more, so the check can fail. Outputs start as NaN: an element no
workgroup writes cannot pass.

The base's d_x kernel scales d_out by 2^e before rounding it (e puts max |d_out| in [2^14, 2^15)) and
the result by 2^-e, both exact: its output times 2^e obeys the same bound with A = d_out * 2^e. So
gradients of 1e-7 (fp16 subnormals, ~50% rounding error unscaled) must come out with fp16's full
11 bits, which the bound checks. coopmat_mm scales both operands so (2^ea, 2^eb): its output times
2^(ea + eb) obeys the bound with A * 2^ea and B * 2^eb.

Emulated shapes: lavapipe cuts an invocation's loops short after 65535 iterations over all its loops;
the emulated kernels' plans refuse shapes past half that (kernels/coopmat.py emulated_loop_trips), and
the largest accepted reduction is run here, so the budget is checked against the device.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from vktrain.quant import dequantize, quantize
from vktrain.runtime import Buffer, Program
from vktrain.backend.kernel_planning.kernels.gemm_passes import ABSMAX_MAX_PARTIALS, absmax_partials
from vktrain.backend.kernel_planning.kernels.coopmat import (
    SUBGROUP_BASIC_BIT,
    _plan_absmax,
    coopmat_supported,
    plan_coopmat_linear_q4gsw,
    plan_coopmat_linear_q4gsw_backward,
    plan_coopmat_mm,
)
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (
    DEFAULT_TILINGS,
    EMULATED_DEFAULT_TILINGS,
    EMULATED_LOOP_BUDGET,
    KERNELS,
    SHARED_MEMORY_BYTES,
    TILING_BY_NAME,
    TILINGS,
    CoopmatTiling,
    default_tiling,
    emulated_loop_trips,
)
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights
from vktrain.runtime.vk.coopmat import EXTENSION_NAME, CooperativeMatrixShape, device_extensions
from vktrain.serialization.device_profile import supports_shape
from vktrain.runtime_shaders.build import all_shader_names

FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP32_TRUNCATION = 2.0 ** -23
FP16_SUBNORMAL_HALF_SPACING = 2.0 ** -25
BM64 = CoopmatTiling(tile_m=64)


def _shape(m=16, n=16, k=16, a="float16", b="float16", c="float32", r="float32", scope="subgroup"):
    return CooperativeMatrixShape(m, n, k, a, b, c, r, False, scope)


# ----------------------------------------------------------------------------------- no device needed
def test_supports_shape_needs_the_exact_shape_types_and_subgroup_scope():
    assert coopmat_supported((_shape(k=8), _shape()))
    for other in (_shape(k=8), _shape(c="float16", r="float16"), _shape(a="bfloat16", b="bfloat16"),
                  _shape(scope="workgroup"), _shape(a="int8", b="int8", c="int32", r="int32")):
        assert not coopmat_supported((other,)), other
    assert not coopmat_supported(())
    assert supports_shape((_shape(a="bfloat16", b="bfloat16"),), m=16, n=16, k=16, input_type="bfloat16")


@pytest.mark.parametrize("b_transposed", [False, True])
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: t.name)
def test_plans_name_prebuilt_variants_and_cover_the_output(b_transposed, tiling):
    declared = set(all_shader_names())
    M, N, K = 300, 260, 64
    *_, mm = plan_coopmat_mm(M=M, N=N, K=K, out="c", a="a", b="b", absmax="m", b_transposed=b_transposed,
                             tiling=tiling)
    (linear,) = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=32, out="y", x="x", weights="w",
                                          scales="s", tiling=tiling)
    # d_x: N = 260 output columns would be K of the weight, which q4gsw wants a multiple of its group.
    *_, backward = plan_coopmat_linear_q4gsw_backward(M=M, N=K, K=288, group_size=32, out="d", d_out="g",
                                                      weights="w", scales="s", absmax="m", tiling=tiling)
    for dispatch, width in ((mm, N), (linear, N), (backward, 288)):
        assert dispatch.shader in declared, dispatch.shader
        assert dispatch.groups == (-(-width // tiling.tile_n), -(-M // tiling.tile_m), 1)
        assert dispatch.local_size is None  # the shaders fix SG_M x SG_N subgroups of SUBGROUP_SIZE
    assert ("B_TRANSPOSED" in mm.shader) == b_transposed
    assert [b.access for b in linear.bindings] == ["w", "r", "r", "r"]
    assert "AB_SCALE" in mm.shader and [b.buffer for b in mm.bindings] == ["c", "a", "b", "m"]


def test_tilings_fit_shared_memory_and_have_distinct_names():
    assert len(TILING_BY_NAME) == len(TILINGS)
    for tiling in TILINGS:
        assert tiling.problems() == [] and tiling.shared_bytes <= SHARED_MEMORY_BYTES, tiling
    # The shader's arrays for the largest: 2 stages of 128 x (32 + 8) fp16 for A and for B, 4 edge blocks of
    # 16 x 16 fp32, the two operand maxima.
    assert CoopmatTiling(stages=2).shared_bytes == 2 * 2 * 2 * 128 * 40 + 4 * 4 * 256 + 8


@pytest.mark.parametrize("tiling, match", [
    (CoopmatTiling(bk=48), "bk=48 is not 32 or 64"),
    (CoopmatTiling(stages=2, prefetch=True), "prefetch only with 1"),
    (CoopmatTiling(tile_m=96, subgroups_m=4), "does not split"),
    (CoopmatTiling(tile_m=256, subgroups_m=4, stages=2), "exceed 49152"),
])
def test_plans_refuse_a_tiling_the_shader_or_shared_memory_cannot_hold(tiling, match):
    with pytest.raises(KernelArgumentError, match=match):
        plan_coopmat_mm(M=64, N=64, K=64, out="c", a="a", b="b", absmax="m", tiling=tiling)
    with pytest.raises(KernelArgumentError, match="tiling must be a CoopmatTiling"):
        plan_coopmat_mm(M=64, N=64, K=64, out="c", a="a", b="b", absmax="m", tiling="bm64")


def test_other_subgroup_sizes_name_a_variant_built_on_demand():
    dispatch = plan_coopmat_mm(M=64, N=64, K=64, out="c", a="a", b="b", absmax="m", subgroup_size=64)[-1]
    assert dispatch.shader.endswith("SUBGROUP_SIZE=64")
    with pytest.raises(KernelArgumentError, match="subgroup_size"):
        plan_coopmat_mm(M=64, N=64, K=64, out="c", a="a", b="b", absmax="m", subgroup_size=48)


def test_default_tilings_are_built_tilings_chosen_by_output_size():
    assert set(DEFAULT_TILINGS) == set(KERNELS)
    for kernel, rows in [*DEFAULT_TILINGS.items(), ("emulated", EMULATED_DEFAULT_TILINGS)]:
        assert rows[-1][:2] == (0, 0), kernel  # the last row takes every GEMM
        assert all(name in TILING_BY_NAME for *_, name in rows), kernel
        emulate, plan_kernel = kernel == "emulated", "coopmat_mm" if kernel == "emulated" else kernel
        fewest, shortest, first = rows[0]
        assert default_tiling(plan_kernel, 128 * max(fewest, 1), 128, max(shortest, 32), emulate=emulate).name == first
        if len(rows) > 1 and rows[-2][:2] != (0, 0):
            assert default_tiling(plan_kernel, 1, 4, 32, emulate=emulate).name == rows[-1][2]
    # The emulated defaults fit lavapipe's 32 KiB of shared memory.
    assert all(TILING_BY_NAME[name].shared_bytes <= 32 * 1024 for *_, name in EMULATED_DEFAULT_TILINGS)


REPO = Path(__file__).resolve().parent.parent
H200_SWEEP = REPO / "bench" / "results" / "coopmat_h200.json"
# How much slower than the fastest tiling measured at a shape its default may be: a table of a few rows
# cannot follow every shape of the sweep (scripts/bench_coopmat.py), and medians of 10 replays differ by
# a few percent between runs.
DEFAULT_TILING_SLACK = 1.10


def test_default_tilings_are_the_fastest_the_h200_sweep_measured():
    """DEFAULT_TILINGS come from the committed H200 sweep (the file's newest run; its older one holds the
    first version's shapes with four tilings): at each of its shapes every kernel's default tiling was
    measured within DEFAULT_TILING_SLACK of the fastest tiling there."""
    spec = importlib.util.spec_from_file_location("bench_results", REPO / "scripts" / "bench_results.py")
    bench_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_results)
    results = bench_results.runs(json.loads(H200_SWEEP.read_text()))[-1]["results"]
    checked = 0
    for record in results:
        M, K, N = record["M"], record["K"], record["N"]
        for kernel in KERNELS:
            times = {name.split(".", 1)[1]: entry["ms"] for name, entry in record["vk"].items()
                     if name.startswith(kernel + ".")}
            if not times:
                continue
            width, reduction = (K, N) if kernel == "coopmat_linear_q4gsw_backward" else (N, K)
            chosen = default_tiling(kernel, M, width, reduction).name
            assert chosen in times, f"{kernel} at {M}x{K}x{N}: default {chosen} was not measured"
            fastest = min(times, key=times.get)
            assert times[chosen] <= DEFAULT_TILING_SLACK * times[fastest], (
                f"{kernel} at M={M} K={K} N={N}: default {chosen} took {times[chosen]:.3f} ms, the fastest "
                f"({fastest}) {times[fastest]:.3f} ms")
            checked += 1
    assert checked == len(KERNELS) * len(results) >= 2 * len(KERNELS)  # every kernel at every measured shape


@pytest.mark.parametrize("kwargs, match", [
    (dict(M=0, N=16, K=16), "M must be an int >= 1"),
    (dict(M=16, N=18, K=16), "N=18 must be a multiple of 4"),
    (dict(M=16, N=16, K=14), "K=14 must be a multiple of 4"),
    (dict(M=2**17, N=2**16, K=16), "32 bits"),
])
def test_mm_refuses_bad_arguments_by_name(kwargs, match):
    with pytest.raises(KernelArgumentError, match=match):
        plan_coopmat_mm(out="c", a="a", b="b", absmax="m", **kwargs)


def test_linear_refuses_bad_q4gsw_shapes_by_name():
    with pytest.raises(KernelArgumentError, match="coopmat_linear_q4gsw"):
        plan_coopmat_linear_q4gsw(M=4, N=16, K=40, group_size=32, out="y", x="x", weights="w", scales="s")


# ----------------------------------------------------------------------------------- device
def test_device_reports_cooperative_matrices_exactly_when_it_has_the_extension(vk_device):
    properties = vk_device.cooperative_matrix_properties
    assert isinstance(properties, tuple)
    offered = EXTENSION_NAME in device_extensions(vk_device.vk, vk_device.physical_device)
    usable = {"shaderFloat16", "vulkanMemoryModel"} <= vk_device.features
    assert bool(properties) == (offered and usable), (offered, usable, properties)
    for shape in properties:
        assert shape.m > 0 and shape.n > 0 and shape.k > 0 and "unknown" not in shape.describe()



def _gemm_backend(device, mode: str) -> dict:
    """Plan arguments for `mode` on `device`, or a skip with the reason: "coopmat" needs the tensor
    cores (and the precompiled subgroup size 32); "emulated" (the same shaders with the matrix
    operations done by plain arithmetic, COOPMAT_EMULATE) needs fp16 arithmetic and basic subgroup
    operations, which lavapipe has."""
    if mode == "coopmat":
        if not coopmat_supported(device.cooperative_matrix_properties):
            listed = ", ".join(s.describe() for s in device.cooperative_matrix_properties) or "none"
            pytest.skip(f"{device.name} has no 16x16x16 fp16 x fp16 + fp32 cooperative matrices at subgroup "
                        f"scope (VK_KHR_cooperative_matrix; it lists: {listed})")
        if device.subgroup_size != 32:
            pytest.skip(f"{device.name} has subgroup size {device.subgroup_size}; the precompiled coopmat "
                        f"variants assume 32")
        return dict(emulate=False)
    if "shaderFloat16" not in device.features or not device.subgroup_operations & SUBGROUP_BASIC_BIT:
        pytest.skip(f"{device.name} lacks shaderFloat16 or basic subgroup operations in compute shaders")
    return dict(emulate=True, subgroup_size=device.subgroup_size)


def _run(device, dispatches, inputs, out_shape):
    # The absmax scratch starts as garbage: every partial the GEMM reads must have been written.
    inputs = {"absmax": np.full(2 * ABSMAX_MAX_PARTIALS, 0x7F7F7F7F, np.uint32), **inputs}
    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_shape, np.nan, dtype=np.float32), name="out")
    try:
        with Program(device, dispatches, buffers) as program:
            program.replay()
        return buffers["out"].read(np.float32, out_shape).astype(np.float64)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _assert_fp16_gemm_close(actual, a64, b64, label):
    """The module docstring's bound, with a64 [M, K] and b64 [K, N] the exact operands."""
    K = a64.shape[1]
    expected = a64 @ b64
    assert actual.shape == expected.shape, label
    assert np.isfinite(actual).all(), f"{label}: {np.count_nonzero(~np.isfinite(actual))} outputs not written / not finite"
    magnitude = np.abs(a64) @ np.abs(b64)
    relative = 2 * FP16_UNIT_ROUNDOFF + FP16_UNIT_ROUNDOFF ** 2 + 2.0 ** -24 + (K + 16) * FP32_TRUNCATION
    absolute = FP16_SUBNORMAL_HALF_SPACING * (np.abs(a64).sum(1, keepdims=True) + np.abs(b64).sum(0, keepdims=True))
    error = np.abs(actual - expected)
    bound = relative * magnitude + absolute
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (
        f"{label}: {np.count_nonzero(error > bound)} of {error.size} outputs outside the fp16-input bound; worst "
        f"{worst}: got {actual[worst]!r}, expected {expected[worst]!r}, |err| {error[worst]:.3e} > {bound[worst]:.3e}")
    # How tight the bound is (reported with -s): the observed error as a multiple of u * S.
    print(f"{label}: max |err| / (2^-11 * S) = {np.max(error / (FP16_UNIT_ROUNDOFF * magnitude + 1e-300)):.3f}")


# Tensor cores: every built tiling at the Llama-sized reduction K = 2048 and edges in every dimension.
# Emulated (lavapipe, slow): small shapes that still cover partial tiles in M and N, several K steps
# and a K tail.
GEMM_SHAPES = [(1, 4, 32), (37, 132, 96), (128, 256, 2048), (300, 520, 160), (513, 2048, 64)]
EMULATED_SHAPES = [(1, 4, 32), (37, 132, 96), (70, 260, 64)]
# Emulated, each variant costs lavapipe ~20 s of shader compilation (cached on disk after): two tilings
# cover both tile heights and both staging orders at every emulated shape...
EMULATED_TILINGS = [BM64, CoopmatTiling(prefetch=True)]
# ... and one shape (partial tiles in M and N, a K tail for BK = 64) covers each other code path of the
# body that fits lavapipe's 32 KiB: two shared stages, BK = 64, 64-wide tiles, 8 subgroups along M or N.
EMULATED_PATH_TILINGS = [CoopmatTiling(tile_m=64, tile_n=64, stages=2), CoopmatTiling(tile_m=64, bk=64),
                         CoopmatTiling(subgroups_m=4), CoopmatTiling(subgroups_n=4)]
EMULATED_PATH_SHAPE = (70, 260, 96)

# The d_x kernel's reduction is N: (70, 1000, 160) reduces over 1000, past what the emulated kernel ran
# before its loops were reordered for lavapipe's loop budget (256 with 64-row tiles).
EMULATED_BACKWARD_SHAPES = [(1, 4, 32), (37, 132, 96), (70, 1000, 160)]
EMULATED_64_ROW_TILINGS = [BM64, CoopmatTiling(tile_m=64, prefetch=True)]


def _cases(extra_shapes=(), emulated_tilings=EMULATED_TILINGS, emulated_shapes=EMULATED_SHAPES):
    cases = []
    for mode, shapes, tilings in (("coopmat", GEMM_SHAPES, TILINGS), ("emulated", emulated_shapes, emulated_tilings)):
        for M, N, K in list(shapes) + list(extra_shapes):
            cases += [pytest.param(mode, t, M, N, K, id=f"{mode}-{M}x{N}x{K}-{t.name}") for t in tilings]
    M, N, K = EMULATED_PATH_SHAPE
    cases += [pytest.param("emulated", t, M, N, K, id=f"emulated-{M}x{N}x{K}-{t.name}") for t in EMULATED_PATH_TILINGS]
    return cases


@pytest.mark.parametrize("mode, tiling, M, N, K", _cases())
def test_linear_q4gsw_matches_float64_within_the_fp16_bound(vk_device, mode, M, N, K, tiling):
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(M * 7 + N + K)
    group_size = 32
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    scales[rng.integers(0, scales.shape[0]), :] = 0.0  # a zero group must decode to zeros
    x = rng.standard_normal((M, K)).astype(np.float32)
    dispatches = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=group_size, out="out", x="x",
                                           weights="w", scales="s", tiling=tiling, **backend)
    actual = _run(vk_device, dispatches, {"x": x, "w": prepack_weights(flat, K), "s": scales}, (M, N))
    deq = dequantize(flat, scales, group_size).astype(np.float64)
    _assert_fp16_gemm_close(actual, x.astype(np.float64), deq.T,
                            f"coopmat_linear_q4gsw {mode} {M}x{N}x{K} {tiling.name}")


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_linear_q4gsw_decodes_every_weight_to_its_fp16_value(vk_device, mode):
    """x = identity: y[k, n] = fp16(deq[n, k]) exactly (products with 1 and sums with 0 are exact), so
    the W_4X8 decode of every (n, k) is checked on its own, not through a sum."""
    backend = _gemm_backend(vk_device, mode)
    N, K, group_size = 132, 64, 32  # N4 = 33: the last block column has rows past N (code 8, zero scale)
    rng = np.random.default_rng(3)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    dispatches = plan_coopmat_linear_q4gsw(M=K, N=N, K=K, group_size=group_size, out="out", x="x", weights="w",
                                           scales="s", **backend)
    actual = _run(vk_device, dispatches, {"x": np.eye(K, dtype=np.float32), "w": prepack_weights(flat, K),
                                          "s": scales}, (K, N))
    expected = dequantize(flat, scales, group_size).T.astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(actual, expected)


def _scale_exponent(x: np.ndarray) -> int:
    """The e of the kernels' 2^e operand scale: max |x| * 2^e in [2^14, 2^15) (0 for all zeros)."""
    largest = float(np.abs(x).max())
    return 0 if largest == 0.0 else 14 - int(np.floor(np.log2(largest)))


def _run_mm(device, backend, a, b, b_transposed=False, tiling=None):
    (M, K), N = a.shape, b.shape[1]
    stored_b = np.ascontiguousarray(b.T) if b_transposed else b
    dispatches = plan_coopmat_mm(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax",
                                 b_transposed=b_transposed, tiling=tiling, **backend)
    return _run(device, dispatches, {"a": a, "b": stored_b}, (M, N))


def _assert_scaled_mm_close(actual, a, b, label):
    """The bound for coopmat_mm's scaled operands (module docstring)."""
    scale_a, scale_b = 2.0 ** _scale_exponent(a), 2.0 ** _scale_exponent(b)
    _assert_fp16_gemm_close(actual * (scale_a * scale_b), a.astype(np.float64) * scale_a,
                            b.astype(np.float64) * scale_b, label)


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("mode, tiling, M, N, K", _cases(extra_shapes=[(64, 16, 4)]))
def test_mm_matches_float64_within_the_fp16_bound(vk_device, mode, M, N, K, tiling, b_transposed):
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(M + 3 * N + 5 * K)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    actual = _run_mm(vk_device, backend, a, b, b_transposed, tiling)
    _assert_scaled_mm_close(actual, a, b, f"coopmat_mm {mode} {M}x{N}x{K} b_transposed={b_transposed} {tiling.name}")


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("scale_a, scale_b", [(1e-7, 1.0), (1.0, 3e-8), (1e3, 1e-9)],
                         ids=["tiny-a", "tiny-b", "large-a-tiny-b"])
@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_mm_keeps_fp16_precision_for_operands_of_any_scale(vk_device, mode, scale_a, scale_b, b_transposed):
    """The head's d_h = d_logits @ W reads a gradient of ~1e-7 (a loss divided by its tokens), and
    either operand may be one: values far below fp16's normal range (6.1e-5) must keep 11 bits, which
    only the per-tensor scales give (unscaled, 1e-7 keeps ~3 bits and 3e-8 rounds to zero or 6e-8)."""
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((37, 96)) * scale_a).astype(np.float32)
    b = (rng.standard_normal((96, 132)) * scale_b).astype(np.float32)
    actual = _run_mm(vk_device, backend, a, b, b_transposed, BM64)
    _assert_scaled_mm_close(actual, a, b, f"coopmat_mm {mode} a x{scale_a} b x{scale_b}")


@pytest.mark.parametrize("numels", [(4,), (4096, 8), (4 * 1024 * ABSMAX_MAX_PARTIALS + 40,),
                                    (8, 4 * 1024 * ABSMAX_MAX_PARTIALS * 3 + 4)], ids=["one", "two", "strided", "two-strided"])
def test_absmax_partials_hold_each_tensors_largest_magnitude(vk_device, numels):
    """The partial maxima of one or two tensors (past ABSMAX_MAX_PARTIALS workgroups' worth, each
    workgroup strides over its tensor): the largest of each tensor's partials is its max |x|, placed at
    the tensor's last element where a wrong stride or bound would miss it."""
    rng = np.random.default_rng(len(numels))
    tensors = []
    for numel in numels:
        x = rng.standard_normal(numel).astype(np.float32)
        x[-1] = -7.5 * (1 + len(tensors))
        tensors.append(x)
    counts = [absmax_partials(n) for n in numels]
    assert counts[-1] == min(-(-numels[-1] // 4096), ABSMAX_MAX_PARTIALS)
    names = [f"x{i}" for i in range(len(numels))]
    dispatch = _plan_absmax("out", list(zip(names, numels)), "absmax")
    buffers = {name: Buffer.from_array(vk_device, x, name=name) for name, x in zip(names, tensors)}
    buffers["out"] = Buffer.from_array(vk_device, np.full(sum(counts), 0xFFFFFFFF, np.uint32), name="out")
    try:
        with Program(vk_device, [dispatch], buffers) as program:
            program.replay()
        partials = buffers["out"].read(np.uint32, (sum(counts),))
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    start = 0
    for x, count in zip(tensors, counts):
        assert partials[start:start + count].max() == np.abs(x).max().view(np.uint32)
        # Each workgroup's partial is the max over exactly its float4 (grid-stride: v with (v mod stride) in
        # its 128-vector window), so a load skipped or read twice in the unrolled trips shows in some partial.
        vecs = np.abs(x).reshape(-1, 4).max(axis=1)
        owner = (np.arange(vecs.size) % (count * 128)) // 128
        expected = np.zeros(count, np.float32)
        np.maximum.at(expected, owner, vecs)
        np.testing.assert_array_equal(partials[start:start + count], expected.view(np.uint32))
        start += count


def test_emulated_mm_runs_the_longest_reduction_its_loop_budget_allows(vk_device):
    """The emulated kernel at the largest reduction its plan accepts (64-row tiles): had lavapipe's
    budget been counted wrong, the invocations would stop early and leave outputs NaN."""
    backend = _gemm_backend(vk_device, "emulated")
    subgroup_size = backend["subgroup_size"]
    K = 32
    while emulated_loop_trips(BM64, K + 32, subgroup_size) <= EMULATED_LOOP_BUDGET:
        K += 32
    assert K >= 4000  # 16x what the emulated kernel ran before its loops were reordered (K < 256)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, K)).astype(np.float32)
    b = (rng.standard_normal((K, 128)) * 0.1).astype(np.float32)
    actual = _run_mm(vk_device, backend, a, b, tiling=BM64)
    _assert_scaled_mm_close(actual, a, b, f"emulated coopmat_mm 64x128x{K}")
    with pytest.raises(KernelArgumentError, match="lavapipe's limit of 65535"):
        plan_coopmat_mm(M=64, N=128, K=K + 32, out="c", a="a", b="b", absmax="m", tiling=BM64, **backend)


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_mm_rounds_inputs_to_fp16_not_keeping_fp32(vk_device, mode):
    """A check that the kernel is what it claims: 1 + 2^-13 is 1 in fp16, so [1 + 2^-13] @ [1] gives
    exactly 1 (an fp32 or TF32 kernel would keep the 2^-13; the scale 2^14 keeps the spacing relative)."""
    backend = _gemm_backend(vk_device, mode)
    a = np.full((16, 16), 1.0 + 2.0 ** -13, dtype=np.float32)
    b = np.zeros((16, 16), dtype=np.float32)
    b[0, :] = 1.0
    actual = _run_mm(vk_device, backend, a, b)
    np.testing.assert_array_equal(actual, np.ones((16, 16)))


def _run_linear_backward(device, backend, d_out, flat, scales, group_size, tiling=None):
    M, N = d_out.shape
    K = scales.shape[0] * group_size
    dispatches = plan_coopmat_linear_q4gsw_backward(M=M, N=N, K=K, group_size=group_size, out="out", d_out="d_out",
                                                    weights="w", scales="s", absmax="absmax", tiling=tiling,
                                                    **backend)
    return _run(device, dispatches, {"d_out": d_out, "w": prepack_weights(flat, K), "s": scales}, (M, K))


@pytest.mark.parametrize("gradient_scale", [1.0, 1e-7], ids=["unit", "tiny"])
@pytest.mark.parametrize("mode, tiling, M, N, K", _cases(emulated_tilings=EMULATED_64_ROW_TILINGS,
                                                       emulated_shapes=EMULATED_BACKWARD_SHAPES))
def test_linear_q4gsw_backward_matches_float64_within_the_scaled_fp16_bound(vk_device, mode, M, N, K, tiling,
                                                                             gradient_scale):
    """d_x = d_out @ deq(W) (here N is the reduction, K the output width)."""
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(M * 5 + 3 * N + K)
    group_size = 32
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    d_out = (rng.standard_normal((M, N)) * gradient_scale).astype(np.float32)
    actual = _run_linear_backward(vk_device, backend, d_out, flat, scales, group_size, tiling)
    scale = 2.0 ** _scale_exponent(d_out)
    deq = dequantize(flat, scales, group_size).astype(np.float64)
    _assert_fp16_gemm_close(actual * scale, d_out.astype(np.float64) * scale, deq,
                            f"coopmat_linear_q4gsw_backward {mode} {M}x{N}x{K} {tiling.name} x{gradient_scale}")


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_linear_q4gsw_backward_of_a_zero_gradient_is_zero(vk_device, mode):
    backend = _gemm_backend(vk_device, mode)
    flat, scales = quantize(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32), 32)
    actual = _run_linear_backward(vk_device, backend, np.zeros((16, 64), np.float32), flat, scales, 32)
    np.testing.assert_array_equal(actual, np.zeros((16, 64)))


def test_backward_plan_measures_then_multiplies():
    absmax, gemm = plan_coopmat_linear_q4gsw_backward(M=512, N=2048, K=8192, group_size=32, out="dx",
                                                      d_out="g", weights="w", scales="s", absmax="m")
    assert absmax.shader == "coopmat_absmax" and absmax.groups == (ABSMAX_MAX_PARTIALS, 1, 1)
    assert [b.buffer for b in absmax.bindings] == ["m", "g", "g"]  # one tensor: x1 unused
    assert gemm.shader in set(all_shader_names()) and gemm.shader.startswith("coopmat_linear_q4gsw_backward@A_SCALE")
    tiling = default_tiling("coopmat_linear_q4gsw_backward", 512, 8192, 2048)
    assert gemm.groups == (8192 // tiling.tile_n, 512 // tiling.tile_m, 1)
    assert [b.buffer for b in gemm.bindings] == ["dx", "g", "w", "s", "m"]


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_linear_q4gsw_backward_propagates_a_non_finite_gradient(vk_device, mode, bad):
    """A NaN or inf in d_out must reach d_x (the training loop's divergence check sees it downstream),
    not be scaled into finite values: its row is not finite, the other rows stay exact to the bound."""
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(2)
    flat, scales = quantize(rng.standard_normal((64, 64)).astype(np.float32), 32)
    d_out = rng.standard_normal((16, 64)).astype(np.float32)
    d_out[3, 5] = bad
    actual = _run_linear_backward(vk_device, backend, d_out, flat, scales, 32)
    assert not np.isfinite(actual[3]).any()
    rest = np.delete(np.arange(16), 3)
    _assert_fp16_gemm_close(actual[rest], d_out[rest].astype(np.float64),
                            dequantize(flat, scales, 32).astype(np.float64), f"backward {mode} with {bad} in row 3")


def test_emulated_plans_refuse_reductions_past_the_loop_budget_and_tensor_cores_do_not():
    for tiling, subgroup_size in ((CoopmatTiling(), 8), (BM64, 8), (BM64, 32), (CoopmatTiling(tile_m=64, bk=64), 8),
                                  (CoopmatTiling(subgroups_n=4), 8)):
        # The k-step loop and its multiply-adds: BK / 16 products per accumulator of the subgroup's tile.
        accumulators = (tiling.tile_m // tiling.subgroups_m // 16) * (tiling.tile_n // tiling.subgroups_n // 16)
        trips_per_step = 1 + tiling.bk // 16 * accumulators * 16
        assert emulated_loop_trips(tiling, 4096, subgroup_size) == (
            4096 // tiling.bk * trips_per_step + accumulators * (256 // subgroup_size))
        longest = max(K for K in range(32, 20000, 32)
                      if emulated_loop_trips(tiling, K, subgroup_size) <= EMULATED_LOOP_BUDGET)
        args = dict(M=64, N=64, out="c", a="a", b="b", absmax="m", tiling=tiling, subgroup_size=subgroup_size)
        plan_coopmat_mm(K=longest, emulate=True, **args)
        with pytest.raises(KernelArgumentError, match="within lavapipe's limit of 65535"):
            plan_coopmat_mm(K=longest + 32, emulate=True, **args)
        plan_coopmat_mm(K=longest + 32, **args)  # tensor cores: no such budget
    with pytest.raises(KernelArgumentError, match="reduction of 16384"):
        plan_coopmat_linear_q4gsw_backward(M=16, N=16384, K=64, group_size=32, out="d", d_out="g", weights="w",
                                           scales="s", absmax="m", emulate=True, subgroup_size=8)

"""The fp16 GEMM policy's kernels: linear_q4gsw@FP16 and linear_q4gsw_backward@FP16 (linear_gemm.slangh), against
float64, within the bound docs/PRECISION.md ("The fp16 policy") derives.

Bound (element by element). An output is sum_k a_k b_k. The FP16 variant rounds a_k (x, or d_out times the
power of two 2^e that puts max |d_out| in [2^14, 2^15)) and b_k = fl32(q * scale) to nearest fp16, forms each
product in fp32 (exact: 11-bit x 11-bit significands) and sums them in fp32, one chain per split-K slice plus
the fixed-order sum of the slices. With u = 2^-11, rho = (1 + u)^2 (1 + 2^-24) - 1 (both roundings and the
dequantization's fp32 product), and gamma_n = n 2^-24 / (1 - n 2^-24) for the fp32 sums of n = K + slices
terms at most deep:
    |c - sum_k a_k b_k| <= ((1 + rho)(1 + gamma_n) - 1) * S + (1 + gamma_n)(1 + u) 2^-25 (sum_k |a_k| + sum_k |b_k|)
with S = sum_k |a_k b_k|; the last term covers operands in fp16's subnormal range (spacing 2^-24). d_x's
output times 2^e obeys it with the scaled d_out. At K = 2048 that is ~1.1e-3 S, while a wrong layout or
index moves an output by a whole term |a_k b_k| ~ S / sqrt(K) or more. Outputs start as NaN, so an element
no workgroup writes cannot pass; gradients of 1e-7 (fp16 subnormals: ~50% rounding error unscaled) must come
back with fp16's full precision, which the bound checks.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.quant import dequantize, quantize
from vktrain.runtime import Buffer, Program
from vktrain.backend.kernel_planning.kernels.gemm_passes import ABSMAX_MAX_PARTIALS, absmax_scratch_nbytes
from vktrain.backend.kernel_planning.kernels.linear import (
    GemmTiles,
    plan_linear_q4gsw,
    plan_linear_q4gsw_backward,
    plan_scratch_nbytes,
    prepack_weights,
)
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit
from vktrain.runtime_shaders.build import all_shader_names
from vktrain.serialization.strided_view import KernelArgumentError

FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP32_UNIT_ROUNDOFF = 2.0 ** -24
FP16_SUBNORMAL_HALF_SPACING = 2.0 ** -25
GROUP_SIZE = 32


def fp16_gemm_bound(a: np.ndarray, b: np.ndarray, slices: int = 1) -> np.ndarray:
    """The module docstring's bound for every output of a [M, K] @ b [K, N] (float64 operands, exact)."""
    u, n = FP16_UNIT_ROUNDOFF, a.shape[1] + slices
    rho = (1 + u) ** 2 * (1 + FP32_UNIT_ROUNDOFF) - 1
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    magnitude = np.abs(a) @ np.abs(b)
    subnormal = (1 + gamma) * (1 + u) * FP16_SUBNORMAL_HALF_SPACING * (
        np.abs(a).sum(1, keepdims=True) + np.abs(b).sum(0, keepdims=True))
    return ((1 + rho) * (1 + gamma) - 1) * magnitude + subnormal


def _assert_within_bound(actual, a, b, label, slices=1):
    expected = a @ b
    assert np.isfinite(actual).all(), f"{label}: {np.count_nonzero(~np.isfinite(actual))} outputs unwritten / not finite"
    error, bound = np.abs(actual - expected), fp16_gemm_bound(a, b, slices)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (
        f"{label}: {np.count_nonzero(error > bound)} of {error.size} outputs outside the fp16 bound; worst {worst}: "
        f"got {actual[worst]!r}, expected {expected[worst]!r}, |err| {error[worst]:.3e} > {bound[worst]:.3e}")
    magnitude = np.abs(a) @ np.abs(b)
    print(f"{label}: max |err| / (2^-11 * S) = {np.max(error / (FP16_UNIT_ROUNDOFF * magnitude + 1e-300)):.3f}")
    return error


def _run(device, dispatches, inputs, out_shape, scratch_nbytes=0):
    # Scratch starts as garbage: every partial maximum and slice the GEMM reads must have been written.
    inputs = {"absmax": np.full(ABSMAX_MAX_PARTIALS, 0x7F7F7F7F, np.uint32),
              "scratch": np.full(max(1, scratch_nbytes // 4), np.nan, np.float32), **inputs}
    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_shape, np.nan, dtype=np.float32), name="out")
    try:
        with Program(device, dispatches, buffers) as program:
            program.replay()
        return buffers["out"].read(np.float32, out_shape).astype(np.float64)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _weights(rng, N, K):
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), GROUP_SIZE)
    scales[rng.integers(0, scales.shape[0]), :] = 0.0  # a zero group must decode to zeros
    return flat, scales, dequantize(flat, scales, GROUP_SIZE).astype(np.float64)


# ----------------------------------------------------------------------------------- no device needed
def test_fp16_plans_name_prebuilt_variants_at_every_m_and_scale_d_out():
    declared = set(all_shader_names())
    for M in (1, 8, 300):  # the fp32 plans take the GEMV at M <= 8: fp16 runs the tiled FP16 body there too
        (forward,) = plan_linear_q4gsw(M=M, N=64, K=96, group_size=32, out="y", x="x", weights="w", scales="s",
                                       fp16=True)
        assert forward.shader == "linear_q4gsw@FP16" and forward.shader in declared
        (biased,) = plan_linear_q4gsw(M=M, N=64, K=96, group_size=32, out="y", x="x", weights="w", scales="s",
                                      bias="b", fp16=True)
        assert biased.shader == "linear_q4gsw@HAS_BIAS+FP16" and biased.shader in declared
        absmax, backward = plan_linear_q4gsw_backward(M=M, N=64, K=96, group_size=32, out="d", d_out="g",
                                                      weights="w", scales="s", absmax="m", fp16=True)
        assert absmax.shader == "coopmat_absmax" and [b.buffer for b in absmax.bindings][:2] == ["m", "g"]
        assert backward.shader == "linear_q4gsw_backward@FP16" and backward.shader in declared
        assert [b.buffer for b in backward.bindings] == ["d", "g", "w", "s", "m"]


def test_fp16_split_k_names_its_variant_and_a_device_tiling_is_taken():
    M, N, K = 64, 128, 2048
    nbytes = plan_scratch_nbytes("linear_q4gsw_backward", M=M, N=K, K=N, group_size=32, fp16=True)
    assert nbytes > 0
    _, split, reduce = plan_linear_q4gsw_backward(M=M, N=K, K=N, group_size=32, out="d", d_out="g", weights="w",
                                                  scales="s", absmax="m", scratch="t", fp16=True)
    assert split.shader == "linear_q4gsw_backward@FP16" and reduce.shader == "linear_splitk_reduce"
    tiles = GemmTiles(8, 8, 8)
    (forward,) = plan_linear_q4gsw(M=300, N=N, K=K, group_size=32, out="y", x="x", weights="w", scales="s",
                                   fp16=True, gemm_tiles=tiles)
    assert forward.local_size == (8, 8, 1) and dict(forward.spec_constants)[3] == 8


def test_fp16_plans_refuse_what_the_variant_does_not_do():
    with pytest.raises(KernelArgumentError, match="fp16 needs an absmax scratch"):
        plan_linear_q4gsw_backward(M=16, N=64, K=96, group_size=32, out="d", d_out="g", weights="w", scales="s",
                                   fp16=True)
    with pytest.raises(KernelArgumentError, match="unwindowed; got a binding over the limit"):
        plan_linear_q4gsw(M=16, N=64, K=96, group_size=32, out="y", x="x", weights="w", scales="s", fp16=True,
                          binding_limit=BindingLimit(1024, 16))
    # Half the shared memory of the fp32 tiles: 128 x 128 over bk = 16 needs 16 KiB in fp32, 8 KiB + 8 in fp16.
    plan_linear_q4gsw(M=300, N=256, K=96, group_size=32, out="y", x="x", weights="w", scales="s", fp16=True,
                      tiles=GemmTiles(16, 16, 16), shared_memory_bytes=8192 + 8)
    with pytest.raises(KernelArgumentError, match=r"\(FP16\) needs 8200 bytes"):
        plan_linear_q4gsw(M=300, N=256, K=96, group_size=32, out="y", x="x", weights="w", scales="s", fp16=True,
                          tiles=GemmTiles(16, 16, 16), shared_memory_bytes=8192)


# ----------------------------------------------------------------------------------- on the device
# Partial tiles in M and N, several reduction steps with a tail, M <= 8 (the fp32 plans' GEMV range), and a
# reduction of 2048 split over K.
SHAPES = [(1, 64, 96), (37, 132, 160), (70, 260, 64), (64, 128, 2048)]


def _needs_fp16(device):
    if "shaderFloat16" not in device.features:
        pytest.skip(f"{device.name} has no shaderFloat16")


@pytest.mark.parametrize("M, N, K", SHAPES, ids=lambda v: str(v))
def test_fp16_forward_matches_float64_within_the_bound(vk_device, M, N, K):
    _needs_fp16(vk_device)
    rng = np.random.default_rng(M * 7 + N + K)
    flat, scales, deq = _weights(rng, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    nbytes = plan_scratch_nbytes("linear_q4gsw", M=M, N=N, K=K, group_size=GROUP_SIZE, fp16=True)
    dispatches = plan_linear_q4gsw(M=M, N=N, K=K, group_size=GROUP_SIZE, out="out", x="x", weights="w", scales="s",
                                   scratch="scratch" if nbytes else None, fp16=True)
    slices = dict(dispatches[0].spec_constants)[4]
    actual = _run(vk_device, dispatches, {"x": x, "w": prepack_weights(flat, K), "s": scales}, (M, N), nbytes)
    error = _assert_within_bound(actual, x.astype(np.float64), deq.T, f"linear_q4gsw@FP16 {M}x{N}x{K}", slices)
    # The variant really rounds to fp16: its error is far above what the fp32 kernel's sums would leave.
    assert error.max() > 50 * FP32_UNIT_ROUNDOFF * (np.abs(x.astype(np.float64)) @ np.abs(deq.T)).max()


# d_x: (M, the weight's out features = the reduction, its in features = d_x's columns, a multiple of the group).
BACKWARD_SHAPES = [(1, 96, 64), (37, 164, 96), (70, 64, 288), (64, 2048, 128)]


@pytest.mark.parametrize("M, out_features, in_features", BACKWARD_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("gradient_scale", [1.0, 1e-7])
def test_fp16_d_x_keeps_fp16_precision_for_gradients_of_any_scale(vk_device, M, out_features, in_features,
                                                                   gradient_scale):
    """d_x[M, in] = d_out[M, out] @ deq(W), W [out, in]."""
    _needs_fp16(vk_device)
    rng = np.random.default_rng(M + out_features * 3 + in_features)
    flat, scales, deq = _weights(rng, out_features, in_features)
    d_out = (rng.standard_normal((M, out_features)) * gradient_scale).astype(np.float32)
    nbytes = plan_scratch_nbytes("linear_q4gsw_backward", M=M, N=out_features, K=in_features, group_size=GROUP_SIZE,
                                 fp16=True)
    dispatches = plan_linear_q4gsw_backward(M=M, N=out_features, K=in_features, group_size=GROUP_SIZE, out="out",
                                            d_out="g", weights="w", scales="s", absmax="absmax",
                                            scratch="scratch" if nbytes else None, fp16=True)
    assert absmax_scratch_nbytes(M * out_features) <= 4 * ABSMAX_MAX_PARTIALS
    slices = dict(dispatches[1].spec_constants)[4]
    actual = _run(vk_device, dispatches, {"g": d_out, "w": prepack_weights(flat, in_features), "s": scales},
                  (M, in_features), nbytes)
    scale = 2.0 ** (14 - int(np.floor(np.log2(np.abs(d_out).max()))))
    _assert_within_bound(actual * scale, d_out.astype(np.float64) * scale, deq,
                         f"linear_q4gsw_backward@FP16 {M}x{out_features}x{in_features} d_out*{gradient_scale:g}", slices)


# ----------------------------------------------------------------------------------- matmul.slang's FP16 variant
def _scale(x: np.ndarray) -> float:
    """The kernels' operand scale 2^e: max |x| * 2^e in [2^14, 2^15)."""
    return 2.0 ** (14 - int(np.floor(np.log2(np.abs(x).max()))))


def test_fp16_mm_plans_scale_both_operands_and_refuse_what_they_cannot_read():
    from vktrain.backend.kernel_planning.kernels.matmul import plan_gemm
    from vktrain.serialization.strided_view import StridedView

    declared = set(all_shader_names())
    a, b_t = StridedView.contiguous((300, 128)), StridedView((128, 260), (1, 128))  # B: a transposed [260, 128]
    absmax, gemm = plan_gemm("c", "a", a, "b", b_t, fp16=True, absmax="m", tuning="cpu")  # any tuning: shared body
    assert absmax.shader == "coopmat_absmax" and [x.buffer for x in absmax.bindings] == ["m", "a", "b"]
    assert gemm.shader == "matmul@HAS_BIAS=0+VEC4_C+FP16" and gemm.shader in declared
    assert [x.buffer for x in gemm.bindings] == ["c", "a", "b", "m"]
    for tile in ((64, 16), (16, 64)):
        for bias in (None, "p"):
            *_, dispatch = plan_gemm("c", "a", a, "b", b_t, fp16=True, absmax="m", tile=tile, bias=bias,
                                     bias_view=None if bias is None else StridedView.contiguous((300, 260)))
            assert dispatch.shader in declared, dispatch.shader
    with pytest.raises(KernelArgumentError, match="fp16 takes 2-D float32 operands read in place"):
        plan_gemm("c", "a", StridedView((300, 128), (128, 1), 4), "b", b_t, fp16=True, absmax="m")
    with pytest.raises(KernelArgumentError, match="fp16 needs an absmax scratch"):
        plan_gemm("c", "a", a, "b", b_t, fp16=True)


# (M, N, K, B transposed, scale of A, scale of B, with an addmm addend, split over K)
MM_CASES = [(37, 132, 96, False, 1.0, 1.0, False, False), (70, 260, 64, True, 1e-7, 0.02, False, False),
            (16, 64, 1024, True, 1e3, 1e-9, True, True), (64, 16, 2048, False, 1e-6, 1.0, True, True)]


@pytest.mark.parametrize("M, N, K, transposed, scale_a, scale_b, addend, split", MM_CASES, ids=lambda v: str(v))
def test_fp16_mm_matches_float64_within_the_bound_for_operands_of_any_scale(vk_device, M, N, K, transposed, scale_a,
                                                                           scale_b, addend, split):
    from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm
    from vktrain.serialization.strided_view import StridedView

    _needs_fp16(vk_device)
    rng = np.random.default_rng(M + N + K)
    a = (rng.standard_normal((M, K)) * scale_a).astype(np.float32)
    b = (rng.standard_normal((K, N)) * scale_b).astype(np.float32)
    stored_b = np.ascontiguousarray(b.T) if transposed else b
    b_view = StridedView((K, N), (1, K)) if transposed else StridedView.contiguous((K, N))
    bias = (rng.standard_normal((M, N)) * scale_a * scale_b).astype(np.float32) if addend else None
    nbytes = gemm_scratch_nbytes(1, M, N, K) if split else 0
    dispatches = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", b_view, fp16=True, absmax="absmax",
                           bias=None if bias is None else "bias",
                           bias_view=None if bias is None else StridedView.contiguous((M, N)),
                           scratch="scratch" if nbytes else None)
    assert (len(dispatches) == 3) == split  # absmax, GEMM (, reduce)
    inputs = {"a": a, "b": stored_b, **({"bias": bias} if bias is not None else {})}
    actual = _run(vk_device, dispatches, inputs, (M, N), nbytes)
    sa, sb = _scale(a), _scale(b)
    a64, b64 = a.astype(np.float64) * sa, b.astype(np.float64) * sb
    if bias is None:
        _assert_within_bound(actual * sa * sb, a64, b64, f"matmul@FP16 {M}x{N}x{K}", slices=K)  # any split
    else:  # the addend is added in fp32 after the unscaling: one more rounding of the result
        exact = a64 @ b64 / (sa * sb) + bias
        error = np.abs(actual - exact)
        bound = fp16_gemm_bound(a64, b64, slices=K) / (sa * sb) + 2.0 ** -23 * (np.abs(a64) @ np.abs(b64) / (sa * sb)
                                                                          + np.abs(bias))
        assert np.isfinite(actual).all() and (error <= bound).all(), float(np.max(error / bound))

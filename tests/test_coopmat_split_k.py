"""Split-K on the tensor-core GEMMs (kernels/coopmat.py, coopmat_gemm.slangh's pc.k_slice).

A small output over a long reduction (M = 128 tokens: the base's d_x and down projection, the tied head's
d_h) is cut into slices of whole BK steps, each slice's partial product written to scratch and the
slices added in order by linear_splitk_reduce.slang. The plan checks need no device. The GEMM checks run
"emulated" on lavapipe (and "coopmat" on a device with the tensor cores) against float64 with the fp16
bound of tests/test_kernels_coopmat.py, its fp32-accumulation term widened by the split_k - 1 additions of
the reduce; a slice read twice or skipped moves an output by whole terms |a_k b_k| and fails it. The
addend of a split aten.addmm is added by the reduce after the slices: bit for bit the split mm's result
plus the addend in fp32.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernels_coopmat import (BM64, FP16_SUBNORMAL_HALF_SPACING, FP16_UNIT_ROUNDOFF, FP32_TRUNCATION,
                                  _gemm_backend, _run, _scale_exponent)
from vktrain.contract import PRECISION_FP16_TC
from vktrain.quant import dequantize, quantize
from vktrain.backend.kernel_planning.kernels.coopmat import (
    GemmRoute,
    plan_coopmat_linear_q4gsw,
    plan_coopmat_linear_q4gsw_backward,
    plan_coopmat_mm,
)
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (
    MAX_SPLIT_K,
    MIN_SPLIT_SLICE,
    MIN_WORKGROUPS,
    SPLIT_MIN_SIDE,
    SPLIT_TARGET_WORKGROUPS,
    default_split_k,
    default_tiling,
    split_k_scratch_nbytes,
    split_slice_length,
)
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights
from vktrain.serialization.dispatch import pack_push


# ----------------------------------------------------------------------------------- no device needed
def test_default_split_fills_the_gpu_at_128_tokens_and_leaves_large_or_narrow_outputs_whole():
    tiling = default_tiling("coopmat_linear_q4gsw_backward", 128, 2048, 8192)
    assert (tiling.tile_m, tiling.tile_n, tiling.bk) == (64, 64, 64)
    # 128 x 2048 in 64 x 64 tiles: 64 workgroups; SPLIT_TARGET_WORKGROUPS / 64 slices where K allows.
    assert SPLIT_TARGET_WORKGROUPS // 64 <= MAX_SPLIT_K
    assert default_split_k(tiling, 128, 2048, 8192) == SPLIT_TARGET_WORKGROUPS // 64
    assert default_split_k(tiling, 128, 2048, 2048) == min(SPLIT_TARGET_WORKGROUPS // 64, 2048 // MIN_SPLIT_SLICE)
    assert default_split_k(tiling, 128, 2048, 512) == 512 // MIN_SPLIT_SLICE
    assert default_split_k(tiling, 128, 2048, MIN_SPLIT_SLICE * 2 - 64) == 1  # one slice would be short
    # Outputs of MIN_WORKGROUPS size tiles or more run unsplit, as they did before split-K existed.
    assert default_split_k(tiling, 128, 8192, 2048) == 1 and default_split_k(tiling, 128, 8192 - 128, 2048) > 1
    assert default_split_k(tiling, 2048, 2048, 8192) == 1
    assert default_split_k(tiling, 128, SPLIT_MIN_SIDE - 48, 8192) == 1  # the rank-16 LoRA products
    # The tied head's d_h over a vocabulary of 128256: at most MAX_SPLIT_K slices, none empty.
    split = default_split_k(tiling, 128, 2048, 128256)
    assert split == SPLIT_TARGET_WORKGROUPS // 64 and (split - 1) * split_slice_length(tiling, 128256, split) < 128256
    # Slices of whole BK steps, the count trimmed so that none is empty: one 64 x 64 tile over 4000 asks for
    # 4000 // MIN_SPLIT_SLICE = 15 slices of 267, rounded up to 320: 13 slices cover it.
    assert split_slice_length(tiling, 1000, 4) == 256 and split_slice_length(tiling, 4000, 15) == 320
    assert default_split_k(tiling, 64, 64, 4000) == 13
    assert split_k_scratch_nbytes("coopmat_linear_q4gsw_backward", 128, 2048, 8192) == 4 * 8 * 128 * 2048
    assert split_k_scratch_nbytes("coopmat_linear_q4gsw_backward", 2048, 2048, 8192) == 0


# (output columns, reduction) of Llama-3.2-1B's base GEMMs, forward and d_x, and the tied head's d_h.
LLAMA_1B_GEMMS = ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (2048, 512), (2048, 128256))


def test_at_2048_tokens_every_llama_gemm_runs_as_before_split_k():
    """4 x 512 tokens: each of these outputs has MIN_WORKGROUPS size tiles or more, so the route sends it to
    the tensor cores unsplit, exactly as without split-K (the step's time there is unchanged by it)."""
    route = GemmRoute(PRECISION_FP16_TC, True, "test")
    for N, K in LLAMA_1B_GEMMS:
        assert route.takes_tensor_cores(2048, N) and route.takes_tensor_cores(2048, N, K)
        assert split_k_scratch_nbytes("coopmat_mm", 2048, N, K) == 0, (N, K)


def test_small_outputs_take_the_tensor_cores_when_their_split_fills_the_gpu():
    route = GemmRoute(PRECISION_FP16_TC, True, "test")
    assert not route.takes_tensor_cores(128, 2048)  # no reduction given: the tile count alone decides
    assert route.takes_tensor_cores(128, 2048, 8192) and route.takes_tensor_cores(128, 2048, 2048)
    # The k / v projections' d_x at 128 tokens: 64 tiles x 2 slices of 256 = MIN_WORKGROUPS; a reduction
    # of 256 is one slice, 64 workgroups.
    assert MIN_WORKGROUPS == 128 and MIN_SPLIT_SLICE == 256
    assert route.takes_tensor_cores(128, 2048, 512) and not route.takes_tensor_cores(128, 2048, 256)
    assert route.takes_tensor_cores(128, 512, 2048)  # 16 tiles x 8 slices
    assert not route.takes_tensor_cores(128, 16, 8192)  # narrower than SPLIT_MIN_SIDE: never split
    assert not GemmRoute(PRECISION_FP16_TC, False, "test").takes_tensor_cores(128, 2048, 8192)


def test_split_plans_write_slices_to_scratch_and_reduce_them_in_a_second_dispatch():
    M, N, K = 128, 2048, 8192
    gemm, reduce = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=32, out="y", x="x", weights="w", scales="s",
                                             scratch="scratch")
    assert gemm.groups == (N // 64, M // 64, 8) and gemm.bindings[0].buffer == "scratch"
    assert gemm.push_constants == pack_push(M, N, K, 32, 0, 0, K // 8)
    assert reduce.shader == "linear_splitk_reduce" and [b.buffer for b in reduce.bindings] == ["y", "scratch"]
    # Without scratch the plan never splits: slice length 0 is the whole reduction.
    (whole,) = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=32, out="y", x="x", weights="w", scales="s")
    assert whole.groups[2] == 1 and whole.push_constants == pack_push(M, N, K, 32, 0, 0, 0)
    # aten.addmm split: the GEMM has no ADDEND, the reduce adds the addend to each element.
    absmax, gemm, reduce = plan_coopmat_mm(M=M, N=N, K=K, out="c", a="a", b="b", absmax="m", addend="d",
                                           scratch="scratch", split_k=4)
    assert "ADDEND" not in gemm.shader and gemm.groups[2] == 4
    assert reduce.shader == "linear_splitk_reduce@HAS_BIAS" and [b.buffer for b in reduce.bindings] == [
        "c", "scratch", "d"]
    assert reduce.push_constants == pack_push(M * N // 4, M * N // 4, 4)
    (_, unsplit) = plan_coopmat_mm(M=M, N=N, K=K, out="c", a="a", b="b", absmax="m", addend="d")
    assert unsplit.shader.endswith("+ADDEND")


@pytest.mark.parametrize("kwargs, match", [
    (dict(split_k=2), "needs a scratch buffer of 2097152 bytes"),
    (dict(split_k=0, scratch="s"), "split_k must be an int >= 1"),
    (dict(split_k=True, scratch="s"), "split_k must be an int >= 1"),
])
def test_split_plans_refuse_bad_split_arguments_by_name(kwargs, match):
    with pytest.raises(KernelArgumentError, match=match):
        plan_coopmat_mm(M=128, N=2048, K=8192, out="c", a="a", b="b", absmax="m", **kwargs)


# ----------------------------------------------------------------------------------- device
# Emulated: partial tiles in M and N, three slices of which the last is shorter (K = 320 in slices of 128).
M, N, K, SPLIT = 37, 132, 320, 3


def _assert_split_close(actual, a64, b64, split_k, label):
    """tests/test_kernels_coopmat.py's bound with split_k - 1 more fp32 additions per output."""
    expected = a64 @ b64
    assert np.isfinite(actual).all(), f"{label}: outputs not written"
    magnitude = np.abs(a64) @ np.abs(b64)
    relative = (2 * FP16_UNIT_ROUNDOFF + FP16_UNIT_ROUNDOFF ** 2 + 2.0 ** -24
                + (a64.shape[1] + 16 + split_k) * FP32_TRUNCATION)
    absolute = FP16_SUBNORMAL_HALF_SPACING * (np.abs(a64).sum(1, keepdims=True) + np.abs(b64).sum(0, keepdims=True))
    error = np.abs(actual - expected)
    assert (error <= relative * magnitude + absolute).all(), (
        f"{label}: {np.count_nonzero(error > relative * magnitude + absolute)} outputs outside the bound; "
        f"max |err| {error.max():.3e}")


def _split_inputs(split_k, scratch_elements):
    return {"scratch": np.full(split_k * scratch_elements, np.nan, np.float32)}


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_split_linear_q4gsw_matches_float64(vk_device, mode):
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(21)
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), 32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    dispatches = plan_coopmat_linear_q4gsw(M=M, N=N, K=K, group_size=32, out="out", x="x", weights="w", scales="s",
                                           scratch="scratch", split_k=SPLIT, tiling=BM64, **backend)
    assert dispatches[0].groups[2] == SPLIT
    actual = _run(vk_device, dispatches, {"x": x, "w": prepack_weights(flat, K), "s": scales,
                                          **_split_inputs(SPLIT, M * N)}, (M, N))
    deq = dequantize(flat, scales, 32).astype(np.float64)
    _assert_split_close(actual, x.astype(np.float64), deq.T, SPLIT, f"split coopmat_linear_q4gsw {mode}")


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_split_linear_q4gsw_backward_matches_float64(vk_device, mode):
    """d_x [M, 160] = d_out [M, 320] @ deq(W [320, 160]): the reduction (320) runs along W's rows."""
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(22)
    weight_k = 160
    flat, scales = quantize(rng.standard_normal((K, weight_k)).astype(np.float32), 32)
    d_out = (rng.standard_normal((M, K)) * 1e-6).astype(np.float32)  # a gradient: the scale keeps fp16's bits
    dispatches = plan_coopmat_linear_q4gsw_backward(M=M, N=K, K=weight_k, group_size=32, out="out", d_out="g",
                                                    weights="w", scales="s", absmax="absmax", scratch="scratch",
                                                    split_k=SPLIT, tiling=BM64, **backend)
    actual = _run(vk_device, dispatches, {"g": d_out, "w": prepack_weights(flat, weight_k), "s": scales,
                                          **_split_inputs(SPLIT, M * weight_k)}, (M, weight_k))
    scale = 2.0 ** _scale_exponent(d_out)
    deq = dequantize(flat, scales, 32).astype(np.float64)
    _assert_split_close(actual * scale, d_out.astype(np.float64) * scale, deq, SPLIT,
                        f"split coopmat_linear_q4gsw_backward {mode}")


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_split_mm_matches_float64_and_adds_the_addend_after_the_slices(vk_device, mode, b_transposed):
    backend = _gemm_backend(vk_device, mode)
    rng = np.random.default_rng(23 + b_transposed)
    a = (rng.standard_normal((M, K)) * 1e-7).astype(np.float32)  # d_logits-like: far below fp16's normals
    b = rng.standard_normal((K, N)).astype(np.float32)
    d = rng.standard_normal((M, N)).astype(np.float32)
    stored_b = np.ascontiguousarray(b.T) if b_transposed else b
    outputs = []
    for addend in (None, "d"):
        dispatches = plan_coopmat_mm(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax", addend=addend,
                                     b_transposed=b_transposed, scratch="scratch", split_k=SPLIT, tiling=BM64,
                                     **backend)
        outputs.append(_run(vk_device, dispatches, {"a": a, "b": stored_b, "d": d, **_split_inputs(SPLIT, M * N)},
                            (M, N)))
    product, with_addend = outputs
    scale_a, scale_b = 2.0 ** _scale_exponent(a), 2.0 ** _scale_exponent(b)
    _assert_split_close(product * (scale_a * scale_b), a.astype(np.float64) * scale_a,
                        b.astype(np.float64) * scale_b, SPLIT, f"split coopmat_mm {mode}")
    np.testing.assert_array_equal(with_addend.astype(np.float32), product.astype(np.float32) + d)

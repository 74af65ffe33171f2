"""GEMM kernels with an addend (aten.addmm(p, a, b) with beta = alpha = 1, what the gemm_epilogue pass
writes for add(p, mm(a, b))): each must give the bits of the mm's own output followed by an fp32 add.

* matmul.slang: the shared-memory body (GPU tuning), unsplit and split-K (the reduction adds the addend
  after the slices), and the CPU register-tile body.
* coopmat_mm's ADDEND variant (kernels/coopmat.py), run as COOPMAT_EMULATE on devices without tensor
  cores (lavapipe) and for real where the device has them: bit for bit the plain coopmat_mm plus the
  addend, and within the documented fp16-input bound of A @ B (tests/test_kernels_coopmat.py) plus the
  exact sum's own rounding (half an ulp of the result) of the float64 A @ B + D.
Outputs start as NaN, so an element no workgroup writes cannot pass.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.runtime import Buffer, Program
from vktrain.backend.kernel_planning.kernels.gemm_passes import ABSMAX_MAX_PARTIALS
from vktrain.backend.kernel_planning.kernels.coopmat import (
    SUBGROUP_BASIC_BIT,
    coopmat_supported,
    plan_coopmat_mm,
    takes_addend,
)
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import ADDEND_TILINGS, TILING_BY_NAME
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING
from vktrain.serialization.strided_view import StridedView
from vktrain.backend.kernel_planning.kernels.matmul import plan_gemm, split_k_scratch_nbytes
from vktrain.runtime_shaders.build import all_shader_names

FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP32_TRUNCATION = 2.0 ** -23
FP32_HALF_ULP = 2.0 ** -24
FP16_SUBNORMAL_HALF_SPACING = 2.0 ** -25


def _run(device, dispatches, inputs: dict[str, np.ndarray], out_shape, scratch_floats: int = 0):
    inputs = dict(inputs)
    inputs["absmax"] = np.full(2 * ABSMAX_MAX_PARTIALS, 0x7F7F7F7F, np.uint32)  # garbage the GEMM must not read
    if scratch_floats:
        inputs["scratch"] = np.full(scratch_floats, np.nan, np.float32)
    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_shape, np.nan, np.float32), name="out")
    try:
        with Program(device, dispatches, buffers) as program:
            program.replay()
        return buffers["out"].read(np.float32, out_shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _operands(M, N, K, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    d = rng.standard_normal((M, N)).astype(np.float32)
    return a, b, d


def _bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


# ----------------------------------------------------------------------------------- matmul.slang
def _plan_fp32(a, b, d=None, **options):
    views = StridedView.contiguous(a.shape), StridedView.contiguous(b.shape)
    bias = dict(bias="d", bias_view=StridedView.contiguous(d.shape)) if d is not None else {}
    return plan_gemm("out", "a", views[0], "b", views[1], **bias, **options)


@pytest.mark.parametrize("tuning, split_k", [(GPU_TUNING, None), (GPU_TUNING, 4), (CPU_TUNING, None)],
                         ids=["gpu", "gpu-split4", "cpu"])
@pytest.mark.parametrize("M, N, K", [(70, 16, 300), (33, 52, 64)])
def test_fp32_addmm_is_the_mm_followed_by_the_add_bit_for_bit(vk_device, tuning, split_k, M, N, K):
    a, b, d = _operands(M, N, K, seed=M + N + K)
    scratch = split_k_scratch_nbytes(1, M, N, split_k) // 4 if split_k else 0
    options = dict(tuning=tuning, split_k=split_k, scratch="scratch" if split_k else None)
    product = _run(vk_device, _plan_fp32(a, b, **options), {"a": a, "b": b}, (M, N), scratch)
    dispatches = _plan_fp32(a, b, d, **options)
    if split_k:  # the slices carry no bias; the reduction adds the addend after summing them
        assert [x.shader for x in dispatches][1] == "linear_splitk_reduce@HAS_BIAS"
        assert "HAS_BIAS=0" in dispatches[0].shader
    fused = _run(vk_device, dispatches, {"a": a, "b": b, "d": d}, (M, N), scratch)
    assert np.array_equal(_bits(fused), _bits(product + d)), \
        f"{np.count_nonzero(_bits(fused) != _bits(product + d))} of {M * N} outputs differ from product + addend"


def test_split_k_keeps_adding_a_broadcast_or_scaled_bias_in_slice_zero():
    a, b, d = _operands(70, 16, 300, seed=1)
    for bias, beta in ((d[0], 1.0), (d, 0.5)):
        dispatches = plan_gemm("out", "a", StridedView.contiguous(a.shape), "b", StridedView.contiguous(b.shape),
                               bias="d", bias_view=StridedView.contiguous(bias.shape), beta=beta,
                               scratch="scratch", split_k=4)
        assert "HAS_BIAS=1" in dispatches[0].shader and dispatches[1].shader == "linear_splitk_reduce"


# ----------------------------------------------------------------------------------- coopmat_mm ADDEND
def _coopmat_backend(device, mode):
    if mode == "coopmat":
        if not coopmat_supported(device.cooperative_matrix_properties) or device.subgroup_size != 32:
            pytest.skip(f"{device.name} has no 16x16x16 fp16 x fp16 + fp32 cooperative matrices (subgroup size 32)")
        return dict(emulate=False)
    if "shaderFloat16" not in device.features or not device.subgroup_operations & SUBGROUP_BASIC_BIT:
        pytest.skip(f"{device.name} lacks shaderFloat16 or basic subgroup operations in compute shaders")
    return dict(emulate=True, subgroup_size=device.subgroup_size)


def _scale(x):
    largest = float(np.abs(x).max())
    return 1.0 if largest == 0.0 else 2.0 ** (14 - int(np.floor(np.log2(largest))))


def test_addend_plans_name_prebuilt_variants_and_bind_the_addend_last():
    declared = set(all_shader_names())
    for b_transposed in (False, True):
        for M, N in ((300, 260), (4096, 1024)):  # the default tilings of a small and a large output
            *_, mm = plan_coopmat_mm(M=M, N=N, K=64, out="c", a="a", b="b", absmax="m", addend="d",
                                     b_transposed=b_transposed)
            assert mm.shader in declared and mm.shader.endswith("+ADDEND"), mm.shader
            assert [x.buffer for x in mm.bindings] == ["c", "a", "b", "m", "d"]
        for name in ADDEND_TILINGS:
            *_, mm = plan_coopmat_mm(M=300, N=260, K=64, out="c", a="a", b="b", absmax="m", addend="d",
                                     b_transposed=b_transposed, tiling=TILING_BY_NAME[name])
            assert mm.shader in declared and mm.shader.endswith("+ADDEND"), mm.shader
            assert [x.buffer for x in mm.bindings] == ["c", "a", "b", "m", "d"]


def test_only_an_output_shaped_unscaled_addend_goes_to_the_tensor_cores():
    full = StridedView.contiguous((6, 8))
    assert takes_addend(full, (6, 8), 1, 1.0)
    assert not takes_addend(StridedView.contiguous((8,)), (6, 8), 1, 1)           # broadcast
    assert not takes_addend(full, (6, 8), 0.5, 1) and not takes_addend(full, (6, 8), 1, 2)
    assert not takes_addend(StridedView.contiguous((8, 6)).transpose(0, 1), (6, 8), 1, 1)  # strided
    assert not takes_addend(StridedView.contiguous((6, 8), offset=4), (6, 8), 1, 1)


# Edges in M and N (edge blocks add the addend element-wise) and whole 16 x 16 blocks (added to the
# accumulators), both tile heights, both B layouts.
@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "b_transposed"])
@pytest.mark.parametrize("M, N, K, tile_m", [(37, 132, 96, 64), (70, 256, 64, 128)])
def test_coopmat_addend_is_the_product_plus_the_addend_bit_for_bit(vk_device, mode, b_transposed, M, N, K, tile_m):
    tiling = TILING_BY_NAME[f"bm{tile_m}"]
    backend = _coopmat_backend(vk_device, mode)
    a, b, d = _operands(M, N, K, seed=7 * M + N)
    d *= 1e-2  # the addend ~ the product's size, so the sum's rounding is tested
    stored_b = np.ascontiguousarray(b.T) if b_transposed else b
    args = dict(M=M, N=N, K=K, out="out", a="a", b="b", absmax="absmax", b_transposed=b_transposed, tiling=tiling,
                **backend)
    inputs = {"a": a, "b": stored_b}
    product = _run(vk_device, plan_coopmat_mm(**args), inputs, (M, N))
    fused = _run(vk_device, plan_coopmat_mm(**args, addend="d"), {**inputs, "d": d}, (M, N))
    assert np.array_equal(_bits(fused), _bits(product + d)), \
        f"{np.count_nonzero(_bits(fused) != _bits(product + d))} of {M * N} outputs differ from product + addend"
    # Against float64: the fp16-input bound of the scaled product, plus half an ulp for the sum's rounding.
    sa, sb = _scale(a), _scale(b)
    a64, b64 = a.astype(np.float64) * sa, b.astype(np.float64) * sb
    relative = 2 * FP16_UNIT_ROUNDOFF + FP16_UNIT_ROUNDOFF ** 2 + 2.0 ** -24 + (K + 16) * FP32_TRUNCATION
    product_bound = (relative * (np.abs(a64) @ np.abs(b64)) + FP16_SUBNORMAL_HALF_SPACING * (
        np.abs(a64).sum(1, keepdims=True) + np.abs(b64).sum(0, keepdims=True))) / (sa * sb)
    expected = a.astype(np.float64) @ b.astype(np.float64) + d
    bound = product_bound * (1 + FP32_HALF_ULP) + FP32_HALF_ULP * np.abs(expected)
    error = np.abs(fused - expected)
    assert (error <= bound).all(), f"{np.count_nonzero(error > bound)} outputs outside the bound, worst {error.max():.3e}"

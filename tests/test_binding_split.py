"""Dispatches whose bindings exceed the device's max storage binding size, split into ones that fit.

* matmul's C placement (c_offset, c_row_stride): a GEMM writes a window of columns of a wider matrix,
  bit for bit what it writes into a contiguous C (the same products in the same order), and nothing
  outside the window; on every body (shared-memory tiles, VEC4_C, the CPU register tiles, WGSL).
* plan_gemm under a BindingLimit: every binding of every window fits and is aligned; windows of M and N
  (the head's logits over vocabulary windows of W^T, the logits' rows) give the unsplit GEMM's bits;
  windows of K (d_h = d_logits @ W) are within the derived bound gamma_(K + w - 1) * (|A| @ |B|) of the
  float64 product (matmul.py's docstring), on float32 and Q8_0 B.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.runtime.delegate.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies
from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES
from vktrain.runtime.delegate.kernels.layout import BindingLimit, KernelArgumentError, StridedView
from vktrain.runtime.delegate.kernels.matmul import plan_gemm, window_scratch_nbytes
from vktrain.runtime.vk.schedule import BufferBinding

SENTINEL = np.float32(-7.25)  # what the bytes of `out` outside C hold before and after


UNIT_ROUNDOFF = 2.0**-24


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term fp32 sum of products."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def _run_into(device, dispatches, arrays: dict[str, np.ndarray], out_elements: int) -> np.ndarray:
    """Run `dispatches` over `arrays` and an "out" buffer of `out_elements` floats filled with SENTINEL."""
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(a)) for name, a in arrays.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_elements, SENTINEL, np.float32))
    try:
        run_dispatches(device, dispatches, buffers)
        return buffers["out"].read(np.float32, (out_elements,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _gemm_cases(device):
    """(tuning, N, expected variant suffix) for the bodies this device runs."""
    cases = [(GPU_TUNING, 20, "HAS_BIAS=0"), (GPU_TUNING, 24, "HAS_BIAS=0+VEC4_C")]
    if runs_cpu_bodies(device):
        cases.append((CPU_TUNING, 24, "CPU_REGISTER_TILES"))
    return cases


def _check_window_gemm(device) -> None:
    rng = np.random.default_rng(3)
    batch, M, K = 2, 70, 40
    for tuning, N, variant in _gemm_cases(device):
        a = rng.standard_normal((batch, M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        views = ("a", StridedView.contiguous(a.shape), "b", StridedView.contiguous(b.shape))
        contiguous = plan_gemm("out", *views, alpha=0.5, tuning=tuning)
        expected = _run_into(device, contiguous, {"a": a, "b": b}, batch * M * N).reshape(batch, M, N)
        np.testing.assert_allclose(expected, 0.5 * a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
        row_stride, offset = N + 12, 8  # rows of a [batch, M, N + 12] matrix, C from column 8 on
        windowed = plan_gemm("out", *views, alpha=0.5, tuning=tuning, c_offset=offset, c_row_stride=row_stride)
        assert variant in windowed[0].shader, (windowed[0].shader, variant)
        total = offset + batch * M * row_stride
        got = _run_into(device, windowed, {"a": a, "b": b}, total + 4)
        rows = got[offset:offset + batch * M * row_stride].reshape(batch, M, row_stride)
        np.testing.assert_array_equal(rows[..., :N], expected)  # bit for bit: the same sums
        outside = np.concatenate([got[:offset], rows[..., N:].ravel(), got[offset + batch * M * row_stride:]])
        assert (outside == SENTINEL).all(), "the GEMM wrote outside its window"


def test_gemm_writes_a_column_window_of_a_wider_matrix(vk_device):
    _check_window_gemm(vk_device)


def test_wgsl_gemm_writes_a_column_window_of_a_wider_matrix(webgpu_device):
    _check_window_gemm(webgpu_device)


def test_gemm_window_placement_is_checked():
    views = ("a", StridedView.contiguous((4, 8)), "b", StridedView.contiguous((8, 16)))
    with pytest.raises(KernelArgumentError, match="c_row_stride must be an int >= N = 16"):
        plan_gemm("out", *views, c_row_stride=12)
    with pytest.raises(KernelArgumentError, match="c_offset must be an int >= 0"):
        plan_gemm("out", *views, c_offset=-4)
    with pytest.raises(KernelArgumentError, match="split_k=2 needs a contiguous C"):
        plan_gemm("out", *views, c_row_stride=32, scratch="scratch", split_k=2)
    with pytest.raises(KernelArgumentError, match="exceeds 4294967295 elements"):
        plan_gemm("out", *views, c_row_stride=2**31)
    odd = plan_gemm("out", *views, c_offset=2, c_row_stride=32)  # not 16-byte aligned rows: no vec4 stores
    assert "VEC4_C" not in odd[0].shader


LIMIT = BindingLimit(max_bytes=16384, alignment=256)  # W [600, 48] fp32 is 112 KiB, the logits [40, 600] 94 KiB


def _check_bindings(dispatches, limit: BindingLimit) -> None:
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            assert bound.size is not None and bound.size <= limit.max_bytes, (dispatch.name, bound)
            assert bound.offset % limit.alignment == 0, (dispatch.name, bound)


def _q8_0_matrix(rng, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int8 [rows, columns], scales float32 [rows * columns / 32], the float32 matrix they hold)."""
    codes = rng.integers(-127, 128, (rows, columns), dtype=np.int8)
    scales = (rng.random(rows * columns // Q8_0_BLOCK_VALUES) * 0.02).astype(np.float32)
    values = codes.astype(np.float32) * np.repeat(scales, Q8_0_BLOCK_VALUES).reshape(rows, columns)
    return codes, scales, values


@pytest.mark.parametrize("tuning", [GPU_TUNING, CPU_TUNING])
@pytest.mark.parametrize("q8_0", [False, True])
def test_head_gemm_over_vocabulary_windows_is_bit_identical(vk_device, tuning, q8_0):
    """logits [40, 600] = h [40, 48] @ W^T, W [600, 48]: windows of W's rows and of the logits' rows."""
    if tuning == CPU_TUNING and not runs_cpu_bodies(vk_device):
        pytest.skip("no CPU bodies on this device")
    rng = np.random.default_rng(11)
    M, K, N = 40, 48, 600
    h = rng.standard_normal((M, K)).astype(np.float32)
    codes, scales, weight = _q8_0_matrix(rng, N, K)
    b_view = StridedView.contiguous((N, K)).transpose(0, 1)
    arrays = {"a": h, "b": codes if q8_0 else weight, "scales": scales}
    options = dict(b_scales="scales" if q8_0 else None, tuning=tuning)
    whole = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", b_view, **options)
    split = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", b_view, binding_limit=LIMIT, **options)
    assert len(whole) == 1 and len(split) > 10
    _check_bindings(split, LIMIT)
    expected = _run_into(vk_device, whole, arrays, M * N)
    got = _run_into(vk_device, split, arrays, M * N)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got.reshape(M, N), h.astype(np.float64) @ weight.T.astype(np.float64),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q8_0", [False, True])
def test_d_h_gemm_over_reduction_windows_is_within_the_derived_bound(vk_device, q8_0):
    """d_h [40, 48] = d_logits [40, 600] @ W [600, 48]: windows of the reduction added through the bias."""
    rng = np.random.default_rng(12)
    M, K, N = 40, 600, 48
    d_logits = rng.standard_normal((M, K)).astype(np.float32)
    codes, scales, weight = _q8_0_matrix(rng, K, N)
    arrays = {"a": d_logits, "b": codes if q8_0 else weight, "scales": scales,
              "scratch": np.zeros(window_scratch_nbytes(M, N, LIMIT) // 4, np.float32)}
    dispatches = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", StridedView.contiguous((K, N)),
                           b_scales="scales" if q8_0 else None, scratch=BufferBinding("scratch"), binding_limit=LIMIT)
    _check_bindings(dispatches, LIMIT)
    output_windows = sum(1 for d in dispatches if "HAS_BIAS=0" in d.shader)  # each one's first reduction window
    windows_per_output = len(dispatches) // output_windows
    assert output_windows > 1 and windows_per_output > 2 and len(dispatches) % output_windows == 0
    got = _run_into(vk_device, dispatches, arrays, M * N).reshape(M, N)
    exact = d_logits.astype(np.float64) @ weight.astype(np.float64)
    magnitude = np.abs(d_logits.astype(np.float64)) @ np.abs(weight.astype(np.float64))
    assert (np.abs(got - exact) <= gamma(K + windows_per_output - 1) * magnitude).all()

"""Dispatches whose bindings exceed the device's max storage binding size, split into ones that fit.

* matmul's C placement (c_offset, c_row_stride): a GEMM writes a window of columns of a wider matrix,
  bit for bit what it writes into a contiguous C (the same products in the same order), and nothing
  outside the window; on every body (shared-memory tiles, VEC4_C, the CPU register tiles, WGSL).
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.runtime.delegate.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies
from vktrain.runtime.delegate.kernels.layout import KernelArgumentError, StridedView
from vktrain.runtime.delegate.kernels.matmul import plan_gemm

SENTINEL = np.float32(-7.25)  # what the bytes of `out` outside C hold before and after


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

"""A frozen matrix held on the device as Q8_0 (vktrain.quant.q8_0: int8 codes + a float32 scale per 32):
the layout against gguf's own Q8_0 blocks, the embedding gather and the head GEMMs (kernels/q8_0.py)
against float64 references and bit for bit against the float32 kernels reading the dequantized matrix
(same tiles and order: every element code * scale is exactly the float32 value), the backend pass that
selects them (backend/passes/q8_0_weights.py), and a tiny tied Llama whose Q8_0 embedding trains to the
same losses as on the float32-resident route with the device memory that saves."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.quant.q8_0 import GGUF_Q8_0_BLOCK, dequantize_q8_0, q8_0_device_arrays
from vktrain.runtime.delegate.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies
from vktrain.runtime.delegate.kernels.layout import KernelArgumentError, StridedView
from vktrain.runtime.delegate.kernels.matmul import gemm_scratch_nbytes, plan_gemm
from vktrain.runtime.delegate.kernels.q8_0 import plan_embedding_q8_0, plan_linear_q8_0, plan_linear_q8_0_backward

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _gguf_q8_0(shape, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """(gguf's Q8_0 blocks of a random matrix, gguf's dequantization of them): what a GGUF file holds and
    what the importer hands the exporter; one all-zero block and one block of extreme codes."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    values.reshape(-1)[:32] = 0.0
    values.reshape(-1)[32:64] = np.where(np.arange(32) % 2, 1.0, -1.0)  # codes +-127
    quantized = gguf.quants.quantize(values, Q8_0)
    return (np.frombuffer(quantized.tobytes(), GGUF_Q8_0_BLOCK),
            gguf.quants.dequantize(quantized, Q8_0).reshape(shape))


def _bits(array) -> np.ndarray:
    return np.ascontiguousarray(array, np.float32).view(np.uint32)


def test_the_device_layout_holds_ggufs_values_exactly():
    blocks, values = _gguf_q8_0((12, 96), 1)
    codes, scales = q8_0_device_arrays(blocks.tobytes(), 12, 96)
    assert codes.dtype == np.int8 and codes.shape == (12, 96) and scales.dtype == np.float32 and scales.shape == (36,)
    # Flat order: row 0's first 32 codes are block 0's, its next 32 block 1's (the +-127 block).
    np.testing.assert_array_equal(codes[0, 32:64], np.where(np.arange(32) % 2, 127, -127))
    assert scales[0] == 0 and scales[1] == np.float32(np.float16(1 / 127))
    np.testing.assert_array_equal(_bits(dequantize_q8_0(codes, scales)), _bits(values))
    with pytest.raises(ValueError, match=r"\[12, 64\] needs 24 Q8_0 blocks, got 36"):
        q8_0_device_arrays(blocks, 12, 64)


# ----------------------------------------------------------------------------------------- kernels
def _run(device, dispatches, arrays: dict[str, np.ndarray], out_shape) -> np.ndarray:
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(a)) for name, a in arrays.items()}
    buffers["out"] = Buffer(device, max(4, 4 * int(np.prod(out_shape))))
    try:
        run_dispatches(device, dispatches, buffers)
        return buffers["out"].read(np.float32, out_shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _weight(n, k, seed):
    blocks, values = _gguf_q8_0((n, k), seed)
    codes, scales = q8_0_device_arrays(blocks, n, k)
    return codes, scales, values


def test_embedding_q8_0_gathers_the_exact_float32_rows_and_nan_for_bad_indices(vk_device):
    codes, scales, values = _weight(100, 64, 2)  # a vocabulary no workgroup multiple
    indices = np.array([[0, 99, 1, 57], [3, 100, -1, 0], [42, 42, 7, 98]], np.int32)
    dispatches = plan_embedding_q8_0(out="out", codes="codes", codes_shape=codes.shape, scales="scales",
                                     scales_shape=scales.shape, indices="indices", indices_shape=indices.shape,
                                     indices_dtype="int32")
    got = _run(vk_device, dispatches, {"codes": codes, "scales": scales, "indices": indices}, (3, 4, 64))
    valid = (indices >= 0) & (indices < 100)
    np.testing.assert_array_equal(_bits(got[valid]), _bits(values[indices[valid]]))
    assert np.isnan(got[~valid]).all()


def test_embedding_q8_0_refuses_rows_of_partial_words_and_mismatched_scales():
    with pytest.raises(KernelArgumentError, match="K % 4 == 0"):
        plan_embedding_q8_0(out="o", codes="c", codes_shape=(16, 34), scales="s", scales_shape=(17,), indices="i",
                            indices_shape=(3,))
    with pytest.raises(KernelArgumentError, match=r"need scales of shape \[32\], got \[16\]"):
        plan_embedding_q8_0(out="o", codes="c", codes_shape=(16, 64), scales="s", scales_shape=(16,), indices="i",
                            indices_shape=(3,))


def _tunings(device):
    return [GPU_TUNING] + ([CPU_TUNING] if runs_cpu_bodies(device) else [])


# (rows, N, K): vocabularies that fill no tile (100, 77 * 4 = 308), K a multiple of 32 but not of 64; M
# below, at and above the CPU body's row tiles.
HEAD_SHAPES = [(5, 100, 96), (33, 308, 64), (64, 100, 32), (70, 36, 160)]


@pytest.mark.parametrize("rows, n, k", HEAD_SHAPES)
def test_the_head_gemms_equal_the_float32_gemm_of_the_dequantized_matrix_bit_for_bit(vk_device, rows, n, k):
    codes, scales, values = _weight(n, k, rows + n)
    rng = np.random.default_rng(rows)
    x, d_out = rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((rows, n)).astype(np.float32)
    w = StridedView.contiguous((n, k))
    for tuning in _tunings(vk_device):
        forward = plan_linear_q8_0(out="out", x="x", x_shape=x.shape, codes="codes", codes_shape=codes.shape,
                                   scales="scales", scales_shape=scales.shape, tuning=tuning)
        assert forward[0].shader.endswith("+B_Q8_0")
        got = _run(vk_device, forward, {"x": x, "codes": codes, "scales": scales}, (rows, n))
        fp32 = plan_gemm("out", "x", StridedView.contiguous(x.shape), "w", w.transpose(0, 1), tuning=tuning)
        np.testing.assert_array_equal(_bits(got), _bits(_run(vk_device, fp32, {"x": x, "w": values}, (rows, n))))
        reference = x.astype(np.float64) @ values.astype(np.float64).T
        assert np.linalg.norm(got - reference) <= 1e-5 * np.linalg.norm(reference)

        backward = plan_linear_q8_0_backward(out="out", d_out="d", d_out_shape=d_out.shape, codes="codes",
                                             codes_shape=codes.shape, scales="scales", scales_shape=scales.shape,
                                             tuning=tuning)
        got = _run(vk_device, backward, {"d": d_out, "codes": codes, "scales": scales}, (rows, k))
        fp32 = plan_gemm("out", "d", StridedView.contiguous(d_out.shape), "w", w, tuning=tuning)
        np.testing.assert_array_equal(_bits(got), _bits(_run(vk_device, fp32, {"d": d_out, "w": values}, (rows, k))))
        reference = d_out.astype(np.float64) @ values.astype(np.float64)
        assert np.linalg.norm(got - reference) <= 1e-5 * np.linalg.norm(reference)


def test_the_head_backward_splits_a_long_vocabulary_reduction_like_the_float32_gemm(vk_device):
    rows, n, k = 8, 2048, 64  # d_h [8, 64] over a 2048-row vocabulary: few tiles, a long reduction
    codes, scales, values = _weight(n, k, 11)
    d_out = np.random.default_rng(3).standard_normal((rows, n)).astype(np.float32)
    nbytes = gemm_scratch_nbytes(1, rows, k, n, GPU_TUNING)
    assert nbytes > 0
    arrays = {"d": d_out, "codes": codes, "scales": scales, "scratch": np.full(nbytes // 4, np.nan, np.float32)}
    backward = plan_linear_q8_0_backward(out="out", d_out="d", d_out_shape=d_out.shape, codes="codes",
                                         codes_shape=codes.shape, scales="scales", scales_shape=scales.shape,
                                         scratch="scratch")
    assert len(backward) == 2 and backward[1].shader == "linear_splitk_reduce"
    got = _run(vk_device, backward, arrays, (rows, k))
    fp32 = plan_gemm("out", "d", StridedView.contiguous(d_out.shape), "w", StridedView.contiguous((n, k)),
                     scratch="scratch")
    expected = _run(vk_device, fp32, {"d": d_out, "w": values, "scratch": arrays["scratch"]}, (rows, k))
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_the_head_gemms_refuse_inputs_of_the_wrong_width():
    with pytest.raises(KernelArgumentError, match=r"last dim 96 \(codes \[100, 96\]\)"):
        plan_linear_q8_0(out="o", x="x", x_shape=(4, 100), codes="c", codes_shape=(100, 96), scales="s",
                         scales_shape=(300,))
    with pytest.raises(KernelArgumentError, match=r"last dim 100"):
        plan_linear_q8_0_backward(out="o", d_out="d", d_out_shape=(4, 96), codes="c", codes_shape=(100, 96),
                                  scales="s", scales_shape=(300,))

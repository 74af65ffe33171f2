"""A frozen matrix held on the device as Q8_0 (vktrain.quant.q8_0: int8 codes + a float32 scale per 32):
the layout against gguf's own Q8_0 blocks, the embedding gather and the head GEMMs (kernels/q8_0.py)
against float64 references and bit for bit against the float32 kernels reading the dequantized matrix
(same tiles and order: every element code * scale is exactly the float32 value), the backend pass that
selects them (backend/passes/q8_0_weights.py), and a tiny tied Llama whose Q8_0 embedding trains to the
same losses as on the float32-resident route with the device memory that saves."""
from __future__ import annotations

import collections

import gguf
import numpy as np
import pytest

from vktrain.backend import passes
from vktrain.backend.passes.q8_0_weights import EMBEDDING_Q8_0, LINEAR_Q8_0, LINEAR_Q8_0_BACKWARD, hold_q8_0_weights
from vktrain.runtime import Buffer, run_dispatches
from vktrain.serialization.verify import device_buffer_requests
from vktrain.serialization import deserialize_blob, serialize_blob
from vktrain.serialization import graph as vk
from vktrain.quant.q8_0 import GGUF_Q8_0_BLOCK, dequantize_q8_0, q8_0_device_arrays
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies
from vktrain.serialization.strided_view import KernelArgumentError, StridedView
from vktrain.backend.kernel_planning.kernels.matmul import default_gemm_tile, gemm_scratch_nbytes, plan_gemm
from vktrain.backend.kernel_planning.kernels.q8_0 import plan_embedding_q8_0, plan_linear_q8_0, plan_linear_q8_0_backward
from vktrain.backend.kernel_planning import plan_schedule

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
    # The float32 matrix through the same tiles (the default plan of this thin shape would be matmul_thin's,
    # which Q8_0 matrices do not take).
    fp32 = plan_gemm("out", "d", StridedView.contiguous(d_out.shape), "w", StridedView.contiguous((n, k)),
                     scratch="scratch", tile=default_gemm_tile(rows, k))
    expected = _run(vk_device, fp32, {"d": d_out, "w": values, "scratch": arrays["scratch"]}, (rows, k))
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_the_head_gemms_refuse_inputs_of_the_wrong_width():
    with pytest.raises(KernelArgumentError, match=r"last dim 96 \(codes \[100, 96\]\)"):
        plan_linear_q8_0(out="o", x="x", x_shape=(4, 100), codes="c", codes_shape=(100, 96), scales="s",
                         scales_shape=(300,))
    with pytest.raises(KernelArgumentError, match=r"last dim 100"):
        plan_linear_q8_0_backward(out="o", d_out="d", d_out_shape=(4, 96), codes="c", codes_shape=(100, 96),
                                  scales="s", scales_shape=(300,))


# ----------------------------------------------------------------------------------------- the backend pass
def _tied_head_graph(weight: np.ndarray, *, extra_reader: str | None = None) -> vk.VkGraph:
    """embedding(W, ids) -> h; logits = mm(h, permute(W)); d_h = mm(logits, W): a tied head's three reads
    of W [V, D], with `extra_reader` "add" (an elementwise op reads W too) or "output" (W is returned)."""
    graph = vk.VkGraph()
    v, d = weight.shape
    w = graph.add_constant_tensor(weight, name="lm_head.weight")
    ids = graph.add_value(vk.TensorValue(vk.DType.INT64, (4,), name="ids"))
    graph.inputs = [ids]

    def tensor(shape):
        return graph.add_value(vk.TensorValue(vk.DType.FLOAT32, shape))

    h, w_t, logits, d_h = tensor((4, d)), tensor((d, v)), tensor((4, v)), tensor((4, d))
    scalars = [graph.add_value(x) for x in (vk.IntValue(-1), vk.BoolValue(False), vk.BoolValue(False))]
    graph.ops = [vk.OpCall("aten.embedding.default", (w, ids, *scalars), (h,)),
                 vk.OpCall("aten.permute_copy.default", (w, graph.add_value(vk.IntListValue((1, 0)))), (w_t,)),
                 vk.OpCall("aten.mm.default", (h, w_t), (logits,)),
                 vk.OpCall("aten.mm.default", (logits, w), (d_h,))]
    graph.outputs = [logits, d_h]
    if extra_reader == "add":
        doubled = tensor((v, d))
        graph.ops.append(vk.OpCall("aten.add.Tensor", (w, w, graph.add_value(vk.IntValue(1))), (doubled,)))
        graph.outputs.append(doubled)
    elif extra_reader == "output":
        graph.outputs.append(w)
    return graph


def test_the_pass_holds_a_tied_q8_0_embedding_as_codes_and_scales():
    _, _, values = _weight(64, 96, 5)
    graph = _tied_head_graph(values)
    passes.compile_graph(graph)
    assert [op.name for op in graph.ops] == [EMBEDDING_Q8_0, LINEAR_Q8_0, LINEAR_Q8_0_BACKWARD]  # no permute
    codes_id, scales_id = graph.ops[0].args[:2]
    assert all(op.args[1:] == (codes_id, scales_id) for op in graph.ops[1:])
    codes, scales = graph.tensor(codes_id), graph.tensor(scales_id)
    assert (codes.dtype, codes.shape, codes.name) == (vk.DType.INT8, (64, 96), "lm_head.weight.q8_0_codes")
    assert (scales.dtype, scales.shape, scales.name) == (vk.DType.FLOAT32, (192,), "lm_head.weight.q8_0_scales")
    assert graph.constants[scales.constant_id].stored_form == "float16"  # GGUF's scales are float16 numbers
    np.testing.assert_array_equal(
        _bits(dequantize_q8_0(graph.constant_array(codes_id), graph.constant_array(scales_id))), _bits(values))
    # The blob stores what GGUF's blocks take (34 bytes per 32 values), and reads back the same graph.
    assert sum(vk.stored_bytes(c).nbytes for c in graph.constants) == 64 * 96 // 32 * 34
    read = deserialize_blob(serialize_blob(graph))
    assert [op.name for op in read.ops] == [op.name for op in graph.ops]
    np.testing.assert_array_equal(read.constant_array(codes_id), graph.constant_array(codes_id))
    # What the device holds: the memory objects, the indices, codes and scales; no float32 copy of W, and
    # nothing for the dropped transpose's value (no op uses it any more).
    requests = device_buffer_requests(read)
    assert sum(nbytes for _, nbytes in requests) == sum(m.size_bytes for m in read.memory_objects) + 4 * 8 \
        + 64 * 96 + 192 * 4
    assert not [what for what, _ in requests if "[96, 64]" in what]


@pytest.mark.parametrize("case", ["float32_values", "rows_of_partial_blocks", "extra_reader", "returned"])
def test_the_pass_keeps_the_float32_route_for_other_weights_and_readers(case):
    _, _, values = _weight(64, 96, 6)
    if case == "float32_values":
        values = np.random.default_rng(6).standard_normal(values.shape).astype(np.float32)  # not Q8_0
    elif case == "rows_of_partial_blocks":  # Q8_0 in flat order (the file stores it so), but K = 48
        values = values.reshape(128, 48)
    graph = _tied_head_graph(values, extra_reader={"extra_reader": "add", "returned": "output"}.get(case))
    names = [op.name for op in graph.ops]
    passes.compile_graph(graph)
    assert [op.name for op in graph.ops] == names
    assert graph.tensor(graph.ops[0].args[0]).dtype == vk.DType.FLOAT32


# ----------------------------------------------------------------------------------------- end to end
BATCH, SEQ, STEPS = 2, 16, 4


def test_tiny_llama_with_a_tied_q8_0_embedding_trains_as_the_float32_resident_route(vk_device, tmp_path, monkeypatch):
    import torch

    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.ops import adamw_hparams
    from vktrain.runtime.delegate.executor import ExecutorInputError
    from vktrain.serialization.pte import PteFile
    from vktrain.runtime.program.runner import TrainingRunner

    model = build_model("tiny-llama")  # tied head: lm_head.weight is model.embed_tokens.weight
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    vocab, dim = embedding.shape
    with torch.no_grad():  # what the GGUF importer makes of a Q8_0 token_embd.weight
        quantized = gguf.quants.quantize(embedding.detach().numpy(), Q8_0)
        embedding.copy_(torch.from_numpy(gguf.quants.dequantize(quantized, Q8_0).reshape(vocab, dim)))
    program = export_training_step(model, (BATCH, SEQ))
    q8_0 = lower_to_pte(program)
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p is not hold_q8_0_weights))
    float32_resident = lower_to_pte(program)
    monkeypatch.undo()

    histogram = collections.Counter(op.name for op in deserialize_blob(PteFile.from_bytes(q8_0).delegates[0].data).ops)
    assert (histogram[EMBEDDING_Q8_0], histogram[LINEAR_Q8_0], histogram[LINEAR_Q8_0_BACKWARD]) == (1, 1, 1)
    assert histogram["aten.embedding.default"] == 0
    assert abs(len(q8_0) - len(float32_resident)) <= 1024  # the file holds 34 bytes per 32 values either way

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, vocab, (BATCH, SEQ)), rng.integers(0, vocab, (BATCH, SEQ))) for _ in range(STEPS)]
    hparams = adamw_hparams(1e-2).numpy()
    results = []
    for index, data in enumerate((q8_0, float32_resident)):
        path = tmp_path / f"step{index}.pte"
        path.write_bytes(data)
        runner = TrainingRunner.from_pte(path, vk_device, planner=plan_schedule)
        # The gather kernel writes NaN rows for a bad index; the executor refuses one first, on both routes.
        assert runner.executor.index_limits["token_ids"] == vocab
        bad = batches[0][0].copy()
        bad[0, 0] = vocab
        with pytest.raises(ExecutorInputError, match="token_ids"):
            runner.step(bad, batches[0][1], hparams)
        losses = [runner.step(tokens, labels, hparams) for tokens, labels in batches]
        results.append((losses, runner.lora_state(), sum(runner.executor.buffer_bytes.values())))
    (q8_losses, q8_lora, q8_bytes), (fp32_losses, fp32_lora, fp32_bytes) = results
    assert q8_losses == fp32_losses  # exactly: the same products in the same order
    assert q8_losses[-1] < q8_losses[0]
    for name in fp32_lora:
        np.testing.assert_array_equal(q8_lora[name], fp32_lora[name])
    # The device holds int8 codes and a float32 scale per 32 values instead of the float32 matrix.
    assert fp32_bytes - q8_bytes == vocab * dim * 4 - (vocab * dim + vocab * dim // 32 * 4)


def test_a_tiny_gguf_with_a_q8_0_tied_embedding_exports_trains_and_merges_it_exactly(tmp_path, monkeypatch):
    """`vktrain export` of a GGUF file whose tied token_embd is Q8_0 holds it as Q8_0 on the device, the
    step trains, and `vktrain merge` gives back exactly the GGUF's embedding values."""
    from test_model_import import _gguf_round_trip, _hf_model, _write_gguf

    from vktrain import cli
    from vktrain.train.adapters import read_program_graph
    from vktrain.train.merge import merged_state_dict

    hf = _hf_model(tie_word_embeddings=True)
    gguf_path, pte = tmp_path / "tiny.gguf", tmp_path / "step.pte"
    _write_gguf(gguf_path, hf)
    assert cli.main(["export", "--model", str(gguf_path), "--lora-rank", "4", "--batch", "1", "--seq", "16",
                     "--calibration-data", "none", "--out", str(pte)]) == 0
    ops = collections.Counter(op.name for op in read_program_graph(pte).ops)
    assert (ops[EMBEDDING_Q8_0], ops[LINEAR_Q8_0], ops[LINEAR_Q8_0_BACKWARD]) == (1, 1, 1)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, hf.config.vocab_size, 256))
    monkeypatch.setenv("VKTRAIN_VALIDATION", "1")
    assert cli.main(["train", str(pte), "--steps", "2", "--data", str(tmp_path / "tokens.npy"), "--no-progress",
                     "--out-adapters", str(tmp_path / "adapters")]) == 0
    state, _ = merged_state_dict(pte, adapters_dir=tmp_path / "adapters")
    embedding = hf.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(_bits(state["model.embed_tokens.weight"]),
                                  _bits(_gguf_round_trip("model.embed_tokens.weight", embedding)))

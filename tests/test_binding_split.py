"""Dispatches whose bindings exceed the device's max storage binding size, split into ones that fit.

* matmul's C placement (c_offset, c_row_stride): a GEMM writes a window of columns of a wider matrix,
  bit for bit what it writes into a contiguous C (the same products in the same order), and nothing
  outside the window; on every body (shared-memory tiles, VEC4_C, the CPU register tiles, WGSL).
* plan_gemm under a BindingLimit: every binding of every window fits and is aligned; windows of M and N
  (the head's logits over vocabulary windows of W^T, the logits' rows) give the unsplit GEMM's bits;
  windows of K (d_h = d_logits @ W) are within the derived bound gamma_(K + w - 1) * (|A| @ |B|) of the
  float64 product (matmul.py's docstring), on float32 and Q8_0 B.
* The embedding gathers (fp32, Q8_0) and fused_ce under a BindingLimit: windows of whole rows that tile
  the table / the logits once, aligned, each binding within the limit, and outputs (NaN rows of bad
  indices, ignored labels included) equal to the unsplit plan's bit for bit.
* tiny-llama with a 4096-token vocabulary (tied fp32 embedding and logits of 2 MiB each) under a 1 MiB
  max binding size, on both runtimes: the embedding, the head's mm (both forms) and fused_ce are split
  (checked in the schedule: every binding fits), the first loss and the eval loss (forward only: row and
  column windows) equal the unsplit run's bit for bit, and later losses agree within the runtimes'
  parity tolerance 1e-5 (d_h's reduction windows reassociate its sums; bound above).
* mlp-lora's untied q4gsw head (its logits [2, 8, 32768] over 1 MiB) now splits (linear_q4gsw's windows,
  tests/test_q4_windows.py) and trains with the unsplit losses; a head whose one window of K does not fit
  (W [131072, 64]: 2 MiB of words in one 32-column step of K) is refused at load, naming the limit; limits
  below what the kernels split to are refused naming the limit. `vktrain train --max-binding-mib 1`
  trains it; generation under the limit gives the unsplit run's logits bit for bit.
* Llama-3.2-1B's tied 1 GiB head and embedding plan into 8 windows under a browser's 128 MiB (no device).
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from vktrain.runtime import Buffer, run_dispatches
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies
from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit
from vktrain.serialization.strided_view import KernelArgumentError, StridedView
from vktrain.backend.kernel_planning.kernels.cross_entropy import plan_fused_ce
from vktrain.backend.kernel_planning.kernels.embedding import plan_embedding
from vktrain.backend.kernel_planning.kernels.matmul import plan_gemm, window_scratch_nbytes
from vktrain.backend.kernel_planning.kernels.q8_0 import plan_embedding_q8_0
from vktrain.serialization.dispatch import BufferBinding
from vktrain.backend.kernel_planning import plan_schedule

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


def _check_bindings(dispatches, limit: BindingLimit, small: tuple[str, ...] = ()) -> None:
    """Every binding but those of the `small` buffers (bound whole, under the limit) spans at most the limit."""
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            if bound.buffer in small and bound.size is None:
                continue
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


@pytest.mark.parametrize("tuning", [GPU_TUNING, CPU_TUNING])
@pytest.mark.parametrize("q8_0", [False, True])
def test_d_h_gemm_over_reduction_windows_is_within_the_derived_bound(vk_device, q8_0, tuning):
    """d_h [40, 48] = d_logits [40, 600] @ W [600, 48]: windows of the reduction added through the bias."""
    if tuning == CPU_TUNING and not runs_cpu_bodies(vk_device):
        pytest.skip("no CPU bodies on this device")
    rng = np.random.default_rng(12)
    M, K, N = 40, 600, 48
    d_logits = rng.standard_normal((M, K)).astype(np.float32)
    codes, scales, weight = _q8_0_matrix(rng, K, N)
    arrays = {"a": d_logits, "b": codes if q8_0 else weight, "scales": scales,
              "scratch": np.zeros(window_scratch_nbytes(M, N, LIMIT) // 4, np.float32)}
    dispatches = plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", StridedView.contiguous((K, N)),
                           b_scales="scales" if q8_0 else None, scratch=BufferBinding("scratch"), binding_limit=LIMIT,
                           tuning=tuning)
    _check_bindings(dispatches, LIMIT)
    output_windows = sum(1 for d in dispatches if "HAS_BIAS=0" in d.shader)  # each one's first reduction window
    windows_per_output = len(dispatches) // output_windows
    assert output_windows > 1 and windows_per_output > 2 and len(dispatches) % output_windows == 0
    got = _run_into(vk_device, dispatches, arrays, M * N).reshape(M, N)
    exact = d_logits.astype(np.float64) @ weight.astype(np.float64)
    magnitude = np.abs(d_logits.astype(np.float64)) @ np.abs(weight.astype(np.float64))
    assert (np.abs(got - exact) <= gamma(K + windows_per_output - 1) * magnitude).all()


def _row_windows_of(dispatches, binding_index: int, row_bytes: int) -> list[tuple[int, int]]:
    """[first, end) rows each dispatch binds of the table at `binding_index` (offsets relative to 0)."""
    return [(d.bindings[binding_index].offset // row_bytes,
             (d.bindings[binding_index].offset + d.bindings[binding_index].size) // row_bytes) for d in dispatches]


def _assert_tiles(windows: list[tuple[int, int]], rows: int) -> None:
    assert windows[0][0] == 0 and windows[-1][1] == rows and len(windows) > 1
    assert all(end == next_begin for (_, end), (next_begin, _) in zip(windows, windows[1:]))


def test_embedding_gathers_over_windows_of_the_table(vk_device):
    rng = np.random.default_rng(5)
    rows, dim = 1000, 48  # 192000 bytes: 12 windows of 80 rows under 16 KiB (80 rows start 256-aligned)
    weight = rng.standard_normal((rows, dim)).astype(np.float32)
    indices = rng.integers(0, rows, 300).astype(np.int32)
    indices[[3, 77]] = [-1, rows]  # NaN rows
    whole = plan_embedding("out", "weight", weight.shape, "indices", indices.shape)
    split = plan_embedding("out", "weight", weight.shape, "indices", indices.shape, binding_limit=LIMIT)
    _check_bindings(split, LIMIT, small=("out", "indices"))
    _assert_tiles(_row_windows_of(split, 2, 4 * dim), rows)
    arrays = {"weight": weight, "indices": indices}
    expected = _run_into(vk_device, whole, arrays, indices.size * dim)
    got = _run_into(vk_device, split, arrays, indices.size * dim)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got.reshape(-1, dim)[5], weight[indices[5]])
    assert np.isnan(got.reshape(-1, dim)[[3, 77]]).all()


def test_q8_0_embedding_gathers_over_windows_of_whole_blocks(vk_device):
    rng = np.random.default_rng(6)
    rows, dim = 1200, 64  # codes 76800 bytes; windows start every 2048 codes (32 rows): scales aligned too
    codes, scales, values = _q8_0_matrix(rng, rows, dim)
    indices = rng.integers(0, rows, 200).astype(np.int32)
    indices[9] = rows + 5
    kwargs = dict(codes="codes", codes_shape=codes.shape, scales="scales", scales_shape=scales.shape,
                  indices="indices", indices_shape=indices.shape, out="out")
    whole = plan_embedding_q8_0(**kwargs)
    split = plan_embedding_q8_0(**kwargs, binding_limit=LIMIT)
    _check_bindings(split, LIMIT, small=("out", "indices"))
    _assert_tiles(_row_windows_of(split, 2, dim), rows)
    assert [d.bindings[3].offset for d in split] == [d.bindings[2].offset // 8 for d in split]  # scale e / 32
    arrays = {"codes": codes, "scales": scales, "indices": indices}
    expected = _run_into(vk_device, whole, arrays, indices.size * dim)
    got = _run_into(vk_device, split, arrays, indices.size * dim)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got.reshape(-1, dim)[0], values[indices[0]])
    assert np.isnan(got.reshape(-1, dim)[9]).all()


@pytest.mark.parametrize("vocab, in_place", [(400, False), (400, True), (403, False)])
def test_fused_ce_over_windows_of_logits_rows(vk_device, vocab, in_place):
    rng = np.random.default_rng(vocab)
    R = 50  # logits 80 KB: windows of 10 rows (V = 400) under 16 KiB
    logits = (3 * rng.standard_normal((R, vocab))).astype(np.float32)
    labels = rng.integers(0, vocab, R).astype(np.int32)
    labels[[4, 31]] = -100
    dlogits = "logits" if in_place else "dlogits"
    kwargs = dict(R=R, V=vocab, logits="logits", labels="labels", n_valid="n_valid", loss="loss", dlogits=dlogits,
                  row_loss="row_loss")
    whole = plan_fused_ce(**kwargs)
    split = plan_fused_ce(**kwargs, binding_limit=LIMIT)
    _check_bindings(split, LIMIT, small=("labels", "n_valid", "loss", "row_loss"))
    firsts = [struct.unpack_from("<I", d.push_constants, 8)[0] for d in split[:-1]]  # push: R, V, first_row, ...
    _assert_tiles([(first, first + d.groups[0]) for first, d in zip(firsts, split[:-1])], R)
    for first, dispatch in zip(firsts, split[:-1]):  # the window's logits lie inside its binding, from its offset
        skip = struct.unpack_from("<I", dispatch.push_constants, 12)[0]
        assert dispatch.bindings[0].offset + 4 * skip == 4 * first * vocab
        assert dispatch.bindings[0].offset + dispatch.bindings[0].size == 4 * (first + dispatch.groups[0]) * vocab
    results = []
    for dispatches in (whole, split):
        buffers = {"logits": Buffer.from_array(vk_device, logits), "labels": Buffer.from_array(vk_device, labels),
                   "n_valid": Buffer.from_array(vk_device, np.float32([R - 2])),
                   "loss": Buffer(vk_device, 4), "dlogits": Buffer(vk_device, logits.nbytes),
                   "row_loss": Buffer(vk_device, 4 * R)}
        try:
            run_dispatches(vk_device, dispatches, buffers)
            results.append((buffers["loss"].read(np.float32, (1,)), buffers[dlogits].read(np.float32, logits.shape)))
        finally:
            for buffer in buffers.values():
                buffer.destroy()
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    rows_loss = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(R), labels]
    valid = labels >= 0
    np.testing.assert_allclose(results[1][0][0], rows_loss[valid].sum() / valid.sum(), rtol=1e-5)


def test_a_row_over_the_limit_is_refused_naming_the_limit():
    with pytest.raises(KernelArgumentError, match="one row of the logits .* over the device's max storage binding "
                                                  "size of 16384 bytes"):
        plan_fused_ce(R=4, V=8192, logits="l", labels="y", n_valid="n", loss="s", dlogits="d", row_loss="r",
                      binding_limit=LIMIT)
    with pytest.raises(KernelArgumentError, match="rows of the table"):
        plan_embedding("out", "weight", (10, 8192), "indices", (4,), binding_limit=LIMIT)


MIB = 1 << 20
SPLIT_VOCAB, SPLIT_BATCH, SPLIT_SEQ, SPLIT_STEPS = 4096, 2, 64, 3
SPLIT_HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


@pytest.fixture(scope="module")
def big_vocab_program(tmp_path_factory):
    """A 1-layer tiny-llama of vocabulary 4096: embedding [4096, 128] and logits [128, 4096], 2 MiB each."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama", n_layers=1, vocab_size=SPLIT_VOCAB)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    step, evaluation = export_training_and_eval_steps(model, (SPLIT_BATCH, SPLIT_SEQ))
    path = tmp_path_factory.mktemp("pte") / "big_vocab_step.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


def _split_batches():
    """One batch of random ids, SPLIT_STEPS times (so the loss falls), labels the next id."""
    token_ids = torch.randint(0, SPLIT_VOCAB, (SPLIT_BATCH, SPLIT_SEQ), generator=torch.Generator().manual_seed(7))
    for _ in range(SPLIT_STEPS):
        yield token_ids, torch.roll(token_ids, -1, dims=1)


def _train_and_eval(path, device, max_binding_bytes):
    from vktrain.runtime.program.runner import TrainingRunner

    with TrainingRunner.from_pte(path, device, planner=plan_schedule, max_binding_bytes=max_binding_bytes) as runner:
        eval_batch = next(iter(_split_batches()))
        eval_before = runner.evaluate(eval_batch[0].numpy(), eval_batch[1].numpy())
        losses = [runner.step(t.numpy(), l.numpy(), SPLIT_HPARAMS) for t, l in _split_batches()]
        return losses, eval_before, list(runner.executor.dispatches)


def _check_split_training(device, path):
    losses, eval_loss, dispatches = _train_and_eval(path, device, MIB)
    whole_losses, whole_eval, whole_dispatches = _train_and_eval(path, device, None)
    assert len(dispatches) > len(whole_dispatches)
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            assert bound.size <= MIB, (dispatch.name, bound)
    labels = [d.name for d in dispatches]
    for split_op in ("aten.embedding", "aten.mm", "fused_ce"):
        assert sum(split_op in name and ("window" in name or "rows" in name) for name in labels) > 1, split_op
    assert losses[0] == whole_losses[0]  # forward: windows of rows / columns keep every sum's order
    assert eval_loss == whole_eval
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_big_vocabulary_step_trains_split_on_vulkan(vk_device, big_vocab_program):
    _check_split_training(vk_device, big_vocab_program)


def test_big_vocabulary_step_trains_split_on_webgpu(webgpu_device, big_vocab_program):
    _check_split_training(webgpu_device, big_vocab_program)


def test_untied_q4_head_splits_and_a_head_with_no_fitting_window_is_refused(vk_device, tmp_path):
    from _helpers import export_mlp_lora_training_step
    from vktrain.errors import GraphLoweringError
    from vktrain.runtime.program.runner import TrainingRunner

    path = tmp_path / "mlp.pte"
    export_mlp_lora_training_step(path, (2, 8), 32768)  # logits [2, 8, 32768]: 2 MiB out of linear_q4gsw
    token_ids = np.random.default_rng(7).integers(0, 32768, (2, 8))
    labels = np.roll(token_ids, -1, axis=1)
    runs = []
    for limit in (None, MIB):
        with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, max_binding_bytes=limit) as runner:
            names = [d.name for d in runner.executor.dispatches]
            runs.append(([runner.step(token_ids, labels, SPLIT_HPARAMS) for _ in range(2)], names))
    assert runs[0][0] == runs[1][0]  # rows of the logits: each sum whole
    assert any("linear_q4gsw" in n and "window" in n for n in runs[1][1])
    with pytest.raises(GraphLoweringError, match="max_binding_bytes .* must be an int >= 1048576"):
        TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, max_binding_bytes=MIB - 1)
    wide = tmp_path / "wide.pte"
    export_mlp_lora_training_step(wide, (2, 8), 131072)  # head W [131072, 64]: 2 MiB of words per 32-column step
    refusal = (r"vktrain.linear_q4gsw.default.*W \[131072, 64\] \(group size 32\) in windows of 32 columns, one of "
               r"which needs a binding of 2097152 bytes, over the device's max storage binding size of 1048576")
    with pytest.raises(GraphLoweringError, match=refusal):
        TrainingRunner.from_pte(wide, vk_device, planner=plan_schedule, max_binding_bytes=MIB)


def test_train_command_takes_the_limit(vk_device, big_vocab_program, tmp_path):
    import argparse
    import json

    from vktrain.train.command import add_train_arguments, run_train

    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, SPLIT_VOCAB, 4096))
    records = tmp_path / "records.json"
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        [str(big_vocab_program), "--steps", "2", "--no-progress", "--log-every", "0", "--data", str(data),
         "--max-binding-mib", "1", "--json", str(records)])
    assert args.max_binding_mib == 1
    assert run_train(args, vk_device) == 0
    assert [r["step"] for r in json.loads(records.read_text())] == [1, 2]


def test_generation_under_the_limit_gives_the_unsplit_logits(vk_device, tmp_path):
    from vktrain.export.decode import export_generation, lower_generation
    from vktrain.generate.runner import GenerationRunner
    from vktrain.generate.sampling import Sampler
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama", n_layers=1, vocab_size=SPLIT_VOCAB)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path / "generation.pte"
    path.write_bytes(lower_generation(export_generation(model, prefill_length=8, cache_length=32)))
    prompt = [5, 4000, 17, 2048, 3, 99]
    outputs = []
    for limit in (None, MIB):
        with GenerationRunner.from_pte(path, vk_device, max_binding_bytes=limit) as runner:
            result = runner.generate(prompt, 6, Sampler())
            labels = [d.name for d in runner.prefill_method.executor.dispatches]
            outputs.append((result.tokens, runner.prefill(prompt), labels))
    assert outputs[0][0] == outputs[1][0]
    np.testing.assert_array_equal(outputs[0][1], outputs[1][1])
    assert any("window" in name for name in outputs[1][2]) and not any("window" in name for name in outputs[0][2])


def test_llama_3_2_1b_head_plans_fit_a_browsers_128_mib():
    """The shapes of the issue: a 64-token step of Llama-3.2-1B, tied fp32 head/embedding [128256, 2048]
    (1 GiB), logits [64, 128256] (31 MiB), planned for WebGPU's default 128 MiB binding (no device)."""
    limit = BindingLimit(max_bytes=128 * MIB, alignment=256)
    tokens, vocab, dim = 64, 128256, 2048
    weight = StridedView.contiguous((vocab, dim))
    logits = plan_gemm("logits", "h", StridedView.contiguous((tokens, dim)), "W", weight.transpose(0, 1),
                       binding_limit=limit)
    scratch = BufferBinding("scratch", 0, window_scratch_nbytes(tokens, dim, limit))
    d_h = plan_gemm("d_h", "d_logits", StridedView.contiguous((tokens, vocab)), "W", weight, scratch=scratch,
                    binding_limit=limit)
    gather = plan_embedding("x", "W", (vocab, dim), "ids", (tokens,), binding_limit=limit)
    for dispatches, small in ((logits, ("h",)), (d_h, ()), (gather, ("x", "ids"))):
        assert len(dispatches) == 8  # 1 GiB in 8 windows of under 128 MiB
        _check_bindings(dispatches, limit, small)
    covered = sorted((d.bindings[2].offset, d.bindings[2].offset + d.bindings[2].size) for d in logits)
    assert covered[0][0] == 0 and covered[-1][1] == 4 * vocab * dim  # every vocabulary row, once
    assert all(end <= start for (_, end), (start, _) in zip(covered, covered[1:]))
    ce = plan_fused_ce(R=tokens, V=vocab, logits="l", labels="y", n_valid="n", loss="s", dlogits="l", row_loss="r",
                       binding_limit=limit)
    assert len(ce) == 2  # 31 MiB of logits fit whole

"""AdamW and the flat word copies (state updates, adamw's copies into a separate output) over the max storage
binding size: windows of the flat index space (kernels/elementwise_windows.py).

* Geometry: under a BindingLimit every window's bindings of param, exp_avg, exp_avg_sq and grad start at an
  aligned offset, fit the limit, and the windows cover the elements once (no overlap, no gap), for tensors
  at aligned offsets inside larger buffers; a tensor at an unaligned offset is refused naming it.
* The windowed update equals the unsplit one bit for bit on Vulkan and WebGPU (a tail that is not a whole
  vec4 included), writes nothing outside the tensors, and both agree with a float64 AdamW within fp32
  rounding; copy_words under the limit moves the same words as unsplit, each binding within the limit.
* mlp-lora with a 1.25 MiB head lora_B trains at 1 MiB: its AdamW runs in windows, every binding fits, the
  first loss equals the unsplit run's, and on Vulkan the head's tensors and moments after a step too.
* An op that still cannot split (a batched GEMM's output over the limit) is refused naming the dispatch,
  the size and the limit, and listing what splits (adamw and the state updates' copies among them).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vktrain.runtime import Buffer, run_dispatches
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit
from vktrain.backend.kernel_planning.kernels.optimizer import plan_adamw
from vktrain.backend.kernel_planning.op_lowering import copy_words
from vktrain.serialization.dispatch import BufferBinding
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning import plan_schedule

LIMIT = BindingLimit(max_bytes=4096, alignment=256)
NUMEL = 3 * 1024 + 61  # 3 windows of 960 elements (4096 bytes less one alignment) and 253; a 1-element tail
WINDOWS = 4
OFFSETS = {"param": 512, "exp_avg": 0, "exp_avg_sq": 1024, "grad": 256}  # bytes, aligned, inside bigger buffers
PAD = 1024  # bytes of SENTINEL after each tensor
SENTINEL = np.float32(-7.25)
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)  # lr, beta1, beta2, eps, weight_decay
STEP = 3


def _tensors(offsets=OFFSETS) -> dict[str, BufferBinding]:
    return {name: BufferBinding(name, offset, 4 * NUMEL) for name, offset in offsets.items()}


def _plan(limit, offsets=OFFSETS):
    tensors = _tensors(offsets)
    return plan_adamw(numel=NUMEL, **tensors, hparams="hparams", step="step", binding_limit=limit,
                      max_groups=3)


def test_windows_are_aligned_fit_the_limit_and_cover_every_element_once():
    plan = _plan(LIMIT)
    assert len({d.bindings[0].offset for d in plan}) == WINDOWS
    for name_index, (name, offset) in enumerate(OFFSETS.items()):
        covered = np.zeros(NUMEL, np.int32)
        for dispatch in plan:
            bound = dispatch.bindings[name_index]
            assert bound.buffer == name and bound.offset % LIMIT.alignment == 0 and bound.size <= LIMIT.max_bytes
            first, count, _ = np.frombuffer(dispatch.push_constants, np.uint32)[-3:]
            unit = 4 if dispatch.shader == "adamw@VEC4" else 1
            begin = (bound.offset - offset) // 4 + unit * first
            end = (bound.offset - offset) // 4 + unit * count
            assert 0 <= begin < end <= NUMEL and 4 * (end - begin) <= bound.size
            covered[begin:end] += 1
        assert (covered == 1).all(), name
    assert len(_plan(None)) == 2  # unsplit: the vec4 body and the 1-element tail over whole bindings


def test_a_tensor_at_an_unaligned_offset_is_refused_naming_it():
    with pytest.raises(KernelArgumentError, match="grad at an offset aligned to 256 bytes"):
        _plan(LIMIT, {**OFFSETS, "grad": 256 + 16})


def _adamw_reference(param, exp_avg, exp_avg_sq, grad):
    lr, b1, b2, eps, wd = HPARAMS.astype(np.float64)
    p, m, v, g = (x.astype(np.float64) for x in (param, exp_avg, exp_avg_sq, grad))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr / (1 - b1**STEP) * m / (np.sqrt(v) / np.sqrt(1 - b2**STEP) + eps)
    return p, m, v


def _run(device, plan, arrays):
    buffers = {"hparams": Buffer.from_array(device, HPARAMS),
               "step": Buffer.from_array(device, np.array([STEP], np.float32))}
    for name, offset in OFFSETS.items():
        whole = np.full((offset + 4 * NUMEL + PAD) // 4, SENTINEL, np.float32)
        whole[offset // 4:offset // 4 + NUMEL] = arrays[name]
        buffers[name] = Buffer.from_array(device, whole)
    try:
        run_dispatches(device, plan, buffers)
        return {name: buffers[name].read(np.float32, ((offset + 4 * NUMEL + PAD) // 4,))
                for name, offset in OFFSETS.items()}
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _check_update(device):
    rng = np.random.default_rng(5)
    arrays = {"param": rng.standard_normal(NUMEL), "exp_avg": 0.1 * rng.standard_normal(NUMEL),
              "exp_avg_sq": 0.01 * rng.random(NUMEL), "grad": rng.standard_normal(NUMEL)}
    arrays = {name: a.astype(np.float32) for name, a in arrays.items()}
    unsplit = _run(device, _plan(None), arrays)
    windowed = _run(device, _plan(LIMIT), arrays)
    for name, offset in OFFSETS.items():
        np.testing.assert_array_equal(windowed[name], unsplit[name], err_msg=name)
        outside = np.concatenate([windowed[name][:offset // 4], windowed[name][offset // 4 + NUMEL:]])
        assert (outside == SENTINEL).all(), name
    got = [windowed[name][OFFSETS[name] // 4:OFFSETS[name] // 4 + NUMEL] for name in ("param", "exp_avg", "exp_avg_sq")]
    for value, expected in zip(got, _adamw_reference(*(arrays[n] for n in ("param", "exp_avg", "exp_avg_sq", "grad")))):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(got[0], arrays["param"])


def test_windowed_adamw_is_the_unsplit_update_bit_for_bit(vk_device):
    _check_update(vk_device)


def test_wgsl_windowed_adamw_is_the_unsplit_update_bit_for_bit(webgpu_device):
    _check_update(webgpu_device)


def test_copy_words_splits_over_the_limit(vk_device):
    words = np.arange(NUMEL, dtype=np.int32) * 7 - 1000
    out = BufferBinding("out", 512, 4 * NUMEL)
    source = BufferBinding("source", 256, 4 * NUMEL)
    plan = copy_words(out, source, 4 * NUMEL, label="state_update:x", binding_limit=LIMIT)
    assert len(plan) == WINDOWS
    assert all(b.size <= LIMIT.max_bytes and b.offset % LIMIT.alignment == 0 for d in plan for b in d.bindings)
    assert len(copy_words(out, source, 4 * NUMEL, label="state_update:x")) == 1
    source_words = np.zeros(64 + NUMEL + 64, np.int32)
    source_words[64:64 + NUMEL] = words
    buffers = {"source": Buffer.from_array(vk_device, source_words),
               "out": Buffer.from_array(vk_device, np.full(128 + NUMEL + 64, -3, np.int32))}
    try:
        run_dispatches(vk_device, plan, buffers)
        result = buffers["out"].read(np.int32, (128 + NUMEL + 64,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    np.testing.assert_array_equal(result[128:128 + NUMEL], words)
    assert (result[:128] == -3).all() and (result[128 + NUMEL:] == -3).all()


MIB = 1 << 20
BIG_VOCAB = 40960  # the head's LoRA B [40960, 8]: 1.25 MiB of AdamW state per tensor
BATCH = (1, 4)  # d_logits [4, 40960] binds whole, so d_B = d_logits^T @ (x A^T) sums its 4 tokens unsplit
HPARAMS_TRAIN = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


@pytest.fixture(scope="module")
def big_lora_program(tmp_path_factory):
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=BIG_VOCAB, n_layers=1, activation="relu")
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, targets="*", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("pte") / "big_lora_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, BATCH)))
    return path


def _train(path, device, limit):
    """Three steps: their losses, the dispatches, and the state (LoRA tensors, AdamW moments) after the first."""
    from vktrain.runtime.program.runner import TrainingRunner

    token_ids = np.random.default_rng(7).integers(0, BIG_VOCAB, BATCH)
    labels = np.roll(token_ids, -1, axis=1)
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, max_binding_bytes=limit) as runner:
        losses = [runner.step(token_ids, labels, HPARAMS_TRAIN)]
        state = runner.state_dict()
        losses += [runner.step(token_ids, labels, HPARAMS_TRAIN) for _ in range(2)]
        return losses, list(runner.executor.dispatches), state


def _check_training(device, path, head_bits: bool):
    losses, dispatches, state = _train(path, device, MIB)
    whole_losses, whole_dispatches, whole_state = _train(path, device, None)
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            assert bound.size <= MIB, (dispatch.name, bound)
    assert sum("adamw" in d.name and ".window" in d.name for d in dispatches) > 1
    assert not any("adamw" in d.name and ".window" in d.name for d in whole_dispatches)
    assert "model.head.lora_B" in state and state.keys() == whole_state.keys(), sorted(state)
    if head_bits:
        head = [name for name in state if "head" in name]
        for name in head:  # the windowed update of B (its gradient sums 4 tokens, unsplit): bit for bit
            np.testing.assert_array_equal(state[name], whole_state[name], err_msg=name)
        for name in state.keys() - set(head):  # d_h = d_logits @ B sums over windows of the vocabulary
            np.testing.assert_allclose(state[name], whole_state[name], rtol=1e-5, atol=1e-10, err_msg=name)
    # On WebGPU B's gradient already differs in its last bits (upstream of AdamW: the first moment after one
    # step, (1 - beta1) * grad, does), which AdamW's g / sqrt(g^2) amplifies where |g| is near eps; the WGSL
    # update itself is bit for bit (test_wgsl_windowed_adamw_is_the_unsplit_update_bit_for_bit).
    assert losses[0] == whole_losses[0]
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    assert losses[-1] < losses[0]


def test_a_lora_tensor_over_the_limit_trains_bit_identically_on_vulkan(vk_device, big_lora_program):
    _check_training(vk_device, big_lora_program, head_bits=True)


def test_a_lora_tensor_over_the_limit_trains_split_on_webgpu(webgpu_device, big_lora_program):
    _check_training(webgpu_device, big_lora_program, head_bits=False)


class _Gram(nn.Module):
    """A loss through a batched GEMM whose output ([2, 384, 384] fp32: 1.125 MiB) is over 1 MiB."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)

    def forward(self, x):
        h = self.inp(x).view(2, 384, 32)
        return torch.bmm(h, h.transpose(1, 2)).sum() / 1000.0


def test_an_op_that_cannot_split_is_refused_listing_what_splits(vk_device, tmp_path):
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.errors import GraphLoweringError
    from vktrain.runtime.program.runner import TrainingRunner

    torch.manual_seed(0)
    model = _Gram()
    apply_lora(model, LoRAConfig(rank=4, targets="*", group_size=16, seed=0))
    path = tmp_path / "gram.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, example_inputs=(torch.randn(768, 32),))))
    with pytest.raises(GraphLoweringError, match=r"aten\.bmm.* over 1179648 bytes, more than the max storage binding "
                                                 r"size of 1048576 bytes .*copies \(state updates included\) and "
                                                 r"adamw split"):
        TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, max_binding_bytes=MIB)

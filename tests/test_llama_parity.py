"""tiny-llama LoRA training on the Vulkan runner vs PyTorch eager.

The model: the `tiny-llama` preset (2 layers, GQA 4/2 heads, tied embedding / head) with q4gsw bases and
LoRA on q, k, v, o, gate, up and down; the tied lm_head stays a frozen fp32 linear. The whole training step
(forward, fused CE, backward through rms_norm / rope / causal attention / swiglu, AdamW) must lower into
ONE delegate, and 20 steps on the Vulkan runner must follow the eager reference (the same model through
the op library's CPU references, torch.optim.AdamW on the LoRA tensors, the same batches and
hyper-parameters) step by step. The program is exported once per module (the slow part).

Also: the tied embedding is stored once, the train loop runs the program, and (without a device) the
op-lowering table's transformer entries pass the device's limits to the plans, allocate the attention
backward's scratch and refuse malformed ops with a message naming the problem.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.backend.kernel_planning.kernels import attention, norm
from vktrain.errors import GraphLoweringError
from vktrain.backend.kernel_planning.op_lowering import OpContext, TensorArg, lowering_for
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.dispatch import BufferBinding
from vktrain.train.command import add_train_arguments, run_train
from vktrain.serialization import deserialize_blob
from vktrain.serialization import graph as vk

from _helpers import assert_training_matches_reference, eager_float64_and_float32_training, runner_losses
from vktrain.backend.kernel_planning import plan_schedule

BATCH, SEQ = 2, 16
STEPS = 20
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
HPARAMS = np.array([LR, *BETAS, EPS, WEIGHT_DECAY], np.float32)
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_program(tmp_path_factory):
    """(path of the exported training-step .pte, the LoRA model it was exported from)."""
    model = build_model("tiny-llama")
    report = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    assert sorted({path.rsplit(".", 1)[1] for path in report.replaced}) == sorted(ADAPTED)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the head is tied and not adapted
    path = tmp_path_factory.mktemp("pte") / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ))))
    return path, model


def _batches(count: int):
    """Sequences over 16 letters whose label is a fixed function of the current and the previous letter
    (attention must look back to learn it), with about 15% of the positions ignored."""
    generator = torch.Generator().manual_seed(2024)
    first, letters = ord("a"), 16
    for _ in range(count):
        token_ids = first + torch.randint(0, letters, (BATCH, SEQ), generator=generator)
        previous = torch.roll(token_ids, 1, dims=1)
        labels = first + (token_ids - first + 3 * (previous - first)) % letters
        labels[torch.rand((BATCH, SEQ), generator=generator) < 0.15] = -1
        yield token_ids, labels


def test_training_step_is_one_delegate_with_every_transformer_op(llama_program):
    path, model = llama_program
    plan = PteFile.load(path).execution_plan()
    assert [d.id for d in plan.delegates] == ["VktrainVulkanBackend"]
    assert list(plan.operators) == []  # nothing runs outside the delegate
    graph = deserialize_blob(bytes(plan.delegates[0].data))
    names = [op.name for op in graph.ops]
    n_layers = model.config.n_layers
    assert names.count("vktrain.causal_attention.default") == n_layers
    assert names.count("vktrain.causal_attention_backward.default") == n_layers
    assert names.count("vktrain.swiglu.default") == names.count("vktrain.swiglu_backward.default") == n_layers
    assert names.count("vktrain.rope.default") == 4 * n_layers  # q and k, forward and backward
    assert names.count("vktrain.rms_norm.default") == 2 * n_layers + 1
    assert names.count("vktrain.linear_q4gsw.default") == len(ADAPTED) * n_layers
    assert names.count("vktrain.adamw.default") == 2 * len(ADAPTED) * n_layers


def test_tied_embedding_is_stored_once(llama_program):
    """The frozen head shares the embedding's fp32 bytes: the blob holds them once."""
    path, model = llama_program
    payload = bytes(PteFile.load(path).execution_plan().delegates[0].data)
    embedding = model.model.embed_tokens.weight.detach().numpy().astype(np.float32).tobytes()
    assert payload.count(embedding) == 1


def test_twenty_steps_match_eager_pytorch_and_replay_bitwise(vk_device, llama_program):
    path, model = llama_program
    reference = eager_float64_and_float32_training(model, _batches(STEPS), lr=LR, betas=BETAS, eps=EPS,
                                                   weight_decay=WEIGHT_DECAY)
    initial = {"model." + name: param.detach().numpy() for name, param in model.named_parameters()}
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert runner.batch_shape == (BATCH, SEQ) and runner.vocab_size == 256
        losses = runner_losses(runner, _batches(STEPS), HPARAMS)
        lora = runner.lora_state()
        exp_avg = {name: runner.read_state("optimizer.exp_avg." + name) for name in reference.state}
        final_state = runner.state_dict()
        assert runner.read_state("optimizer.step") == np.float32(STEPS)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05  # it trains
    assert sorted(lora) == sorted("model." + name for name in reference.state)
    assert_training_matches_reference(losses, {n: lora["model." + n] for n in reference.state}, exp_avg,
                                      reference, {n: initial["model." + n] for n in reference.state})

    # A second runner (fresh buffers, recorded again) reproduces every bit.
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as second:
        assert runner_losses(second, _batches(STEPS), HPARAMS) == losses
        second_state = second.state_dict()
    assert second_state.keys() == final_state.keys()
    for name in final_state:
        np.testing.assert_array_equal(second_state[name], final_state[name], err_msg=name)


def test_train_command_runs_the_llama_program(vk_device, llama_program, tmp_path):
    """`vktrain train X.pte --steps N` (the train loop the CLI wires) on the built-in corpus."""
    records_path = tmp_path / "records.json"
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        [str(llama_program[0]), "--steps", "4", "--lr", "1e-2", "--no-progress", "--log-every", "0",
         "--json", str(records_path)])
    assert run_train(args, vk_device) == 0
    records = json.loads(records_path.read_text())
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)) and abs(losses[0] - np.log(256)) < 0.5  # starts near uniform over bytes


# ------------------------------------------------------------------------------------------------
# The op-lowering table's transformer entries, without a device
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Limits:
    """The DeviceLimits fields the lowerings read, for a small device."""
    max_compute_shared_memory_size: int = 16384
    max_compute_work_group_invocations: int = 64
    max_compute_work_group_size: tuple[int, int, int] = (64, 64, 64)


def _context(name: str, args: list, outputs: list, limits=None):
    """(OpContext of op `name`, its lowering, the scratch allocations it made: purpose -> nbytes)."""
    op = vk.OpCall(name, tuple(range(len(args))), tuple(range(100, 100 + len(outputs))))
    scratch: dict[str, int] = {}

    def allocate(nbytes: int, purpose: str) -> BufferBinding:
        scratch[purpose] = nbytes
        return BufferBinding(f"scratch.{purpose}", 0, nbytes)

    context = OpContext(0, op, args, outputs, f"0:{name}", allocate, limits)
    return context, lowering_for(op, 0), scratch


_value_ids = itertools.count()


def _tensor(name: str, shape, dtype: str = "float32") -> TensorArg:
    """A tensor living alone in buffer `name` (every tensor here is 4 bytes per element)."""
    nbytes = 4 * int(np.prod(shape, dtype=np.int64))
    return TensorArg(next(_value_ids), BufferBinding(name, 0, max(nbytes, 4)), tuple(shape), dtype)


# Long enough that the default tiling wants 32-row tiles, which do not fit 16 KiB of shared memory.
B_, S_, HQ, HKV, D_ = 1, 2048, 8, 2, 64


def test_attention_lowerings_pass_the_device_limits():
    q, k, v = _tensor("q", (B_, S_, HQ, D_)), _tensor("k", (B_, S_, HKV, D_)), _tensor("v", (B_, S_, HKV, D_))
    out, lse = _tensor("out", q.shape), _tensor("lse", (B_, HQ, S_))
    common = dict(B=B_, S=S_, Hq=HQ, Hkv=HKV, D=D_, q=q.binding, k=k.binding, v=v.binding, out=out.binding,
                  lse=lse.binding, scale=0.25, label="0:vktrain.causal_attention.default")
    context, lowering, _ = _context("vktrain.causal_attention.default", [q, k, v, 0.25, None], [out, lse], _Limits())
    small = attention.plan_causal_attention(**common, shared_memory_bytes=16384, max_workgroup_size=64)
    default = attention.plan_causal_attention(**common)
    assert small != default  # the limits matter at this shape, so the comparison below can fail
    assert lowering.lower(context) == small

    d_out, d_q, d_k, d_v = _tensor("d_out", q.shape), _tensor("d_q", q.shape), _tensor("d_k", k.shape), \
        _tensor("d_v", v.shape)
    context, lowering, scratch = _context("vktrain.causal_attention_backward.default",
                                          [d_out, q, k, v, out, lse, 0.25, None], [d_q, d_k, d_v], _Limits())
    dispatches = lowering.lower(context)
    assert scratch == {"delta": attention.causal_attention_backward_scratch_nbytes(B_, S_, HQ)}
    expected = attention.plan_causal_attention_backward(
        B=B_, S=S_, Hq=HQ, Hkv=HKV, D=D_, d_out=d_out.binding, q=q.binding, k=k.binding, v=v.binding,
        out=out.binding, lse=lse.binding, d_q=d_q.binding, d_k=d_k.binding, d_v=d_v.binding,
        delta=BufferBinding("scratch.delta", 0, scratch["delta"]), scale=0.25, shared_memory_bytes=16384,
        max_workgroup_size=64, label="0:vktrain.causal_attention_backward.default")
    assert dispatches == expected
    assert all(d.local_size[0] <= 64 for d in dispatches)


def test_rms_norm_workgroup_fits_the_device():
    x, weight = _tensor("x", (2, 3, 64)), _tensor("weight", (64,))
    y, rstd = _tensor("y", x.shape), _tensor("rstd", (2, 3, 1))
    context, lowering, _ = _context("vktrain.rms_norm.default", [x, weight, 1e-5], [y, rstd], _Limits())
    (dispatch,) = lowering.lower(context)
    assert dispatch.local_size == (64, 1, 1) and dispatch.groups == (6, 1, 1)
    # Without the device's limits: the 128 invocations every Vulkan device offers (the kernel's own
    # default, 256, is more than that).
    context, lowering, _ = _context("vktrain.rms_norm.default", [x, weight, 1e-5], [y, rstd])
    assert norm.DEFAULT_WORKGROUP_SIZE > 128
    assert lowering.lower(context)[0].local_size == (128, 1, 1)


@pytest.mark.parametrize("name, args, outputs, message", [
    ("vktrain.rope.default", [_tensor("x", (1, 8, 2, 16)), _tensor("cos", (16, 8)), _tensor("sin", (16, 8))],
     [_tensor("o", (1, 8, 2, 16))], r"cos must have shape \[S, D/2\] = \[8, 8\] or \[B, S, D/2\] = \[1, 8, 8\] for x \[B, S, H, D\] = \[1, 8, 2, 16\], got \(16, 8\)"),
    ("vktrain.rope.default", [_tensor("x", (8, 2, 16)), _tensor("cos", (8, 8)), _tensor("sin", (8, 8))],
     [_tensor("o", (8, 2, 16))], r"x must be 4-D \[B, S, H, D\] \(batch, sequence, heads, head dim\), got shape \(8, 2, 16\)"),
    ("vktrain.causal_attention.default",
     [_tensor("q", (1, 8, 4, 16)), _tensor("k", (2, 8, 2, 16)), _tensor("v", (2, 8, 2, 16)), 0.25, None],
     [_tensor("o", (1, 8, 4, 16)), _tensor("l", (1, 4, 8))], r"k and v must have shape \[B, S, Hkv, D\] with B, S, D of q \(1, 8, 4, 16\), got \(2, 8, 2, 16\)"),
    ("vktrain.causal_attention.default",
     [_tensor("q", (1, 8, 3, 16)), _tensor("k", (1, 8, 2, 16)), _tensor("v", (1, 8, 2, 16)), 0.25, None],
     [_tensor("o", (1, 8, 3, 16)), _tensor("l", (1, 3, 8))], r"multiple of the number of kv heads .* got Hq=3 \(q \(1, 8, 3, 16\)\) and Hkv=2"),
    ("vktrain.rms_norm.default", [_tensor("x", (4, 64)), _tensor("w", (32,)), 1e-5],
     [_tensor("y", (4, 64)), _tensor("r", (4, 1))], r"weight must have shape \[D\] = \[64\] to match x \(4, 64\), got \(32,\)"),
    ("vktrain.rms_norm_backward.default",
     [_tensor("dy", (4, 64)), _tensor("x", (4, 64)), _tensor("w", (64,)), _tensor("r", (4,))],
     [_tensor("dx", (4, 64))], r"rstd must have shape \[..., 1\] = \[4, 1\] .* got \(4,\)"),
    ("vktrain.swiglu.default", [_tensor("g", (4, 8)), _tensor("u", (4, 9))], [_tensor("h", (4, 8))],
     r"up must have the shape of gate \(4, 8\), got \(4, 9\)"),
    ("vktrain.swiglu_backward.default", [_tensor("d", (4, 8)), _tensor("g", (4, 8)), _tensor("u", (4, 8))],
     [_tensor("dg", (4, 8)), _tensor("du", (4, 8), "int32")], r"output 1 is int32 \[4, 8\], the op's definition gives float32 \[4, 8\]"),
])
def test_transformer_lowerings_refuse_bad_arguments(name, args, outputs, message):
    context, lowering, _ = _context(name, args, outputs)
    with pytest.raises(GraphLoweringError, match=rf"op 0 \({re.escape(name)}\): .*{message}"):
        lowering.lower(context)


def test_uninitialised_tensors_cost_no_gpu_work():
    out = _tensor("e", (3, 4))
    context, lowering, _ = _context("aten.empty_permuted.default", [(3, 4), (0, 1), "float32", None, None, None],
                                    [out])
    assert lowering.lower(context) == []
    context, lowering, _ = _context("aten.empty_permuted.default", [(3, 4), (1, 0), "float32", None, None, None],
                                    [out])
    with pytest.raises(GraphLoweringError, match=r"physical_layout \(1, 0\) is not the contiguous order"):
        lowering.lower(context)
    context, lowering, _ = _context("aten.empty.memory_format", [(3, 4), None, None, None, None, "channels_last"],
                                    [out])
    with pytest.raises(GraphLoweringError, match="memory_format 'channels_last' is not supported"):
        lowering.lower(context)

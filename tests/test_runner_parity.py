"""TrainingRunner on an exported MLP-LoRA training step (.pte) vs PyTorch eager.

The reference trains the same model (same q4gsw base, same LoRA init) with the op library's CPU
references and torch.optim.AdamW on the LoRA tensors, on the same batches and hyper-parameters.
Also: two runs are bitwise identical, checkpoints restore, out-of-range token ids are refused before the
GPU sees them, the inference program runs through the same executor, unsupported programs are refused
at load, and instructions outside the delegate run on the CPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vktrain.export import example_training_inputs, export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.runtime.delegate.executor import ExecutorInputError
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.interpreter import ProgramInterpreter
from vktrain.runtime.program.runner import TrainingRunner, UnsupportedProgramError

from _helpers import (assert_training_matches_reference, eager_float64_and_float32_training,
                      export_mlp_lora_training_step, runner_losses)
from vktrain.backend.kernel_planning import plan_schedule
from _helpers import planned

BATCH, SEQ, VOCAB = 2, 8, 64
STEPS = 20
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
HPARAMS = np.array([LR, *BETAS, EPS, WEIGHT_DECAY], np.float32)


@pytest.fixture(scope="module")
def step_program(tmp_path_factory):
    """(path of the exported .pte, the LoRA model it was exported from)."""
    path = tmp_path_factory.mktemp("pte") / "mlp_lora_step.pte"
    return path, export_mlp_lora_training_step(path, (BATCH, SEQ), VOCAB)


def _batches(count: int):
    generator = torch.Generator().manual_seed(1234)
    for _ in range(count):
        token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = (3 * token_ids + 1) % VOCAB  # a learnable map, so the loss must fall
        labels[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = -1  # some ignored positions
        yield token_ids, labels


def test_twenty_steps_match_eager_pytorch(vk_device, step_program):
    path, model = step_program
    reference = eager_float64_and_float32_training(model, _batches(STEPS), lr=LR, betas=BETAS, eps=EPS,
                                                   weight_decay=WEIGHT_DECAY)
    initial = {name: param.detach().numpy() for name, param in model.named_parameters()}
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert runner.input_names == ["token_ids", "labels", "hparams", "n_valid"]
        assert runner.batch_shape == (BATCH, SEQ) and runner.vocab_size == VOCAB
        losses = runner_losses(runner, _batches(STEPS), HPARAMS)
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05  # it trains
        lora = runner.lora_state()
        assert sorted(lora) == sorted("model." + name for name in reference.state)
        exp_avg = {name: runner.read_state("optimizer.exp_avg." + name) for name in reference.state}
        assert runner.read_state("optimizer.step") == np.float32(STEPS)
        timings = runner.timings()
        assert timings is None or len(timings) == len(runner.executor.dispatches)
    assert_training_matches_reference(losses, {n: lora["model." + n] for n in reference.state}, exp_avg,
                                      reference, {n: initial[n] for n in reference.state})


def test_two_runs_are_bitwise_identical_and_checkpoints_restore(vk_device, step_program):
    path = step_program[0]
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as first:
        initial = first.state_dict()
        losses_first = runner_losses(first, _batches(STEPS), HPARAMS)
        final_first = first.state_dict()
        # Restoring the initial checkpoint into the same runner reproduces the run exactly.
        first.load_state_dict(initial)
        assert runner_losses(first, _batches(STEPS), HPARAMS) == losses_first
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as second:
        losses_second = runner_losses(second, _batches(STEPS), HPARAMS)
        final_second = second.state_dict()
    assert losses_first == losses_second
    assert final_first.keys() == final_second.keys()
    for name in final_first:
        np.testing.assert_array_equal(final_first[name], final_second[name], err_msg=name)


def test_n_valid_defaults_to_count_of_valid_labels(vk_device, step_program):
    path = step_program[0]
    token_ids, labels = next(_batches(1))
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        initial = runner.state_dict()
        default = runner.step(token_ids.numpy(), labels.numpy(), HPARAMS)
        runner.load_state_dict(initial)
        doubled = runner.step(token_ids.numpy(), labels.numpy(), HPARAMS,
                              n_valid=2 * float((labels >= 0).sum()))
        with pytest.raises(KeyError, match="missing"):
            runner.load_state_dict({})
    np.testing.assert_allclose(doubled, default / 2, rtol=1e-6)


def test_out_of_range_token_is_refused_before_the_step(vk_device, step_program):
    token_ids, labels = next(_batches(1))
    token_ids[1, 3] = VOCAB  # the embedding kernel would read a NaN row; the CPU reference raises
    with TrainingRunner.from_pte(step_program[0], vk_device, planner=plan_schedule) as runner:
        before = runner.state_dict()
        with pytest.raises(ExecutorInputError, match=r"input 'token_ids' holds 64 at \[1, 3\], but it must be a row "
                                                     r"of the 64-row embedding"):
            runner.step(token_ids.numpy(), labels.numpy(), HPARAMS)
        token_ids[1, 3] = -2
        with pytest.raises(ExecutorInputError, match=r"input 'token_ids' holds -2 at \[1, 3\], but it must be a row "
                                                     r"of the 64-row embedding of op 0 \(\[0, 64\)\)"):
            runner.step(token_ids.numpy(), labels.numpy(), HPARAMS)
        with pytest.raises(ExecutorInputError, match="holds int64, got an array of float32"):
            runner.step(token_ids.numpy().astype(np.float32), labels.numpy(), HPARAMS)
        after = runner.state_dict()
    for name in before:  # nothing ran
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_exported_forward_runs_through_interpreter_and_executor(vk_device):
    """The inference program (gelu, biases, non-zero adapters) through ProgramInterpreter + GraphExecutor
    matches the eager model: the executor is not specific to training graphs."""
    from vktrain.export import export_forward
    from vktrain.runtime.delegate.executor import GraphExecutor
    from vktrain.serialization import deserialize_blob

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, activation="gelu", bias=True)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    pte = PteFile.from_bytes(lower_to_pte(export_forward(model, (BATCH, SEQ))))
    plan = pte.execution_plan()
    graph = deserialize_blob(bytes(plan.delegates[0].data))
    token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        interpreter = ProgramInterpreter(pte, plan, lambda index, args: executor.run(*args[:len(graph.inputs)]))
        (logits,) = interpreter.run([token_ids.numpy()])
    with torch.no_grad():
        expected = model(token_ids).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def _cpu_program(module: torch.nn.Module, inputs: tuple) -> bytes:
    from executorch.exir import to_edge

    return to_edge(torch.export.export(module, inputs)).to_executorch().buffer


class _Sine(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x)


class _CastReshapeClone(torch.nn.Module):
    def forward(self, ids):
        return ids.reshape(-1).to(torch.float32).clone()


def test_unsupported_instruction_is_refused_at_load(vk_device):
    pte = PteFile.from_bytes(_cpu_program(_Sine(), (torch.zeros(3),)))
    with pytest.raises(UnsupportedProgramError, match=r"unsupported instruction aten::sin.out"):
        TrainingRunner(pte, vk_device, planner=plan_schedule)


def test_program_without_the_delegate_is_refused(vk_device):
    pte = PteFile.from_bytes(_cpu_program(_CastReshapeClone(), (torch.zeros(2, 3, dtype=torch.int64),)))
    with pytest.raises(UnsupportedProgramError, match="expected exactly one VktrainVulkanBackend delegate"):
        TrainingRunner(pte, vk_device, planner=plan_schedule)


def test_cpu_instructions_run_in_numpy():
    """dtype-converting and cloning copies (what ExecuTorch emits for .to() / .clone()) and memory-planned
    views, interpreted outside any delegate."""
    pte = PteFile.from_bytes(_cpu_program(_CastReshapeClone(), (torch.zeros(2, 3, dtype=torch.int64),)))
    interpreter = ProgramInterpreter(pte, pte.execution_plan())
    ids = np.array([[3, -1, 7], [0, 2**40, 5]], np.int64)
    (result,) = interpreter.run([ids])
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, ids.reshape(-1).astype(np.float32))


def test_example_inputs_match_the_step_signature(vk_device, step_program):
    """The exporter's example inputs run unchanged through the runner (names and dtypes agree)."""
    token_ids, labels, hparams, n_valid = example_training_inputs(BATCH, SEQ, VOCAB)
    with TrainingRunner.from_pte(step_program[0], vk_device, planner=plan_schedule) as runner:
        loss = runner.step(token_ids.numpy(), labels.numpy(), hparams.numpy(), float(n_valid))
    assert np.isfinite(loss) and loss > 0


@pytest.mark.parametrize("activation, fused_op, absent_op", [
    ("gelu", "aten.gelu_backward.default", "aten.erf.default"),
    # SiLU's backward arrives decomposed: 1 - sigmoid is sub(full_like(empty_permuted), sigmoid), which
    # the runtime turns into one rsub (the empty tensor costs no GPU work).
    ("silu", "aten.silu.default", "aten.where.self"),
])
def test_other_activations_train_like_eager(vk_device, tmp_path, activation, fused_op, absent_op):
    """GELU's backward stays one fused op (no aten.erf reaches the GPU); the step follows eager."""
    from vktrain.serialization import deserialize_blob

    model = build_model("mlp-lora", dim=16, hidden=32, vocab_size=VOCAB, n_layers=1, activation=activation)
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets="*", group_size=16, seed=1))
    path = tmp_path / f"{activation}_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ))))
    plan = PteFile.load(path).execution_plan()
    assert list(plan.operators) == []
    names = [op.name for op in deserialize_blob(bytes(plan.delegates[0].data)).ops]
    assert fused_op in names and absent_op not in names
    reference = eager_float64_and_float32_training(model, _batches(STEPS), lr=LR, betas=BETAS, eps=EPS,
                                                   weight_decay=WEIGHT_DECAY)
    initial = {name: param.detach().numpy() for name, param in model.named_parameters()}
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        losses = runner_losses(runner, _batches(STEPS), HPARAMS)
        lora = runner.lora_state()
        exp_avg = {name: runner.read_state("optimizer.exp_avg." + name) for name in reference.state}
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05
    assert_training_matches_reference(losses, {n: lora["model." + n] for n in reference.state}, exp_avg,
                                      reference, {n: initial[n] for n in reference.state})


def test_inspect_planned_memory_is_what_the_executor_allocates(vk_device, step_program):
    """`vktrain inspect`'s planned GPU memory (the blob's memory objects) is exactly what the executor
    allocates for them: the backend planned the final storage, the executor re-sizes nothing."""
    from vktrain.runtime.program.summary import summarize_pte

    path = step_program[0]
    (delegate,) = summarize_pte(path.read_bytes())["delegates"]
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        buffers = dict(runner.executor.buffer_bytes)
    allocated = {key: size for key, size in buffers.items() if key.startswith("mem")}
    assert len(allocated) == delegate["memory"]["memory_objects"] > 0
    assert sum(allocated.values()) == delegate["memory"]["planned_bytes"]
    # The device-memory allocations inspect reports are what the executor's buffers take when sub-allocated
    # (vktrain.runtime.vk.allocator): a few blocks, not one allocation per buffer.
    from vktrain.runtime import count_block_allocations

    assert delegate["memory"]["device_allocations"] == count_block_allocations(buffers.values()) < len(buffers)

"""The whole-program route (vktrain/export/whole_program.py): a program the registry takes whole is
lowered without to_edge, and must give the delegate the standard route (to_edge, partition,
preprocess) gives: the same op chain, the same memory plan, and on the device the same losses and
state, bit for bit (the same kernels run on the same op chain, so nothing may differ); a refused node
sends the program down the standard route."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

import vktrain.export.lower as lower
from vktrain.contract import TRAIN_METHOD, hparams_values
from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.partitioner import VktrainPartitioner
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.blob import deserialize_blob
from vktrain.backend.kernel_planning import plan_schedule

BATCH = (2, 8)
STEPS = 3


@pytest.fixture(scope="module")
def program():
    model = build_model("tiny-llama")  # attention, rope, views, permutes and slices: the ATen view ops
    torch.manual_seed(0)
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    return export_training_step(model, BATCH)


def _standard_route(program) -> bytes:
    edge = lower.to_edge_lowered_methods({TRAIN_METHOD: program}, {TRAIN_METHOD: VktrainPartitioner()})
    return edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(["model.", "optimizer."])])).buffer


def _blob(pte: bytes):
    return deserialize_blob(bytes(PteFile.from_bytes(pte).delegates[0].data))


def _train(pte: bytes, tmp_path, vk_device, name: str):
    path = tmp_path / name
    path.write_bytes(pte)
    rng = np.random.default_rng(7)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        losses = []
        for _ in range(STEPS):
            tokens = rng.integers(0, runner.vocab_size, BATCH)
            losses.append(runner.step(tokens, np.roll(tokens, -1, axis=1), np.float32(hparams_values(1e-2))))
        return np.array(losses), runner.state_dict()


def test_whole_program_route_skips_to_edge_and_equals_the_standard_route(program, tmp_path, vk_device, monkeypatch):
    standard = _standard_route(program)
    with monkeypatch.context() as patch:
        patch.setattr(lower, "to_edge_lowered_methods", lambda *a, **k: pytest.fail("the standard route was taken"))
        whole = lower_to_pte(program)
    plan = PteFile.from_bytes(whole).execution_plan(TRAIN_METHOD)
    assert len(plan.instructions) == 1  # inputs -> one delegate call -> loss

    expected, actual = _blob(standard), _blob(whole)
    assert [op.name for op in actual.ops] == [op.name for op in expected.ops]
    assert actual.memory_objects == expected.memory_objects
    assert len(actual.mutable_state) == len(expected.mutable_state) == len(program.graph_signature.buffers_to_mutate)

    standard_losses, standard_state = _train(standard, tmp_path, vk_device, "standard.pte")
    whole_losses, whole_state = _train(whole, tmp_path, vk_device, "whole.pte")
    np.testing.assert_array_equal(whole_losses, standard_losses)
    assert sorted(whole_state) == sorted(standard_state)
    for name, value in standard_state.items():
        np.testing.assert_array_equal(whole_state[name], value, err_msg=name)


def test_a_refused_node_takes_the_standard_route(program, monkeypatch):
    taken = []
    standard = lower.to_edge_lowered_methods
    monkeypatch.setattr(lower, "to_edge_lowered_methods", lambda *a, **k: taken.append(1) or standard(*a, **k))
    partitioner = VktrainPartitioner(operator_blocklist=["aten.neg.default"])  # rope's rotate-half
    try:
        lower_to_pte(program, partitioner)
    except lower.LoweringError:
        pass  # the step split around the refused node (whether ExecuTorch can keep the state is its business)
    assert taken and [r.op for r in partitioner.refusals] and all(r.op == "aten.neg.default" for r in partitioner.refusals)

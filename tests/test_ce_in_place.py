"""passes/ce_in_place.py: fused_ce's dlogits takes its logits' storage when nothing reads them later. Against the
same program compiled without the pass (lavapipe): the planned memory drops by about one [R, V] tensor, the
fused_ce dispatch runs its IN_PLACE variant, and three training steps give the same losses and state, bit for
bit. The pass leaves the gradient its own storage when the logits are read later (here: a graph output)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vktrain.backend import passes
from vktrain.backend.kernel_planning import plan_schedule
from vktrain.backend.lifetimes import storage_root
from vktrain.backend.passes.ce_in_place import FUSED_CE, write_ce_gradient_in_place
from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.blob import deserialize_blob
from vktrain.serialization.pte import PteFile

VOCAB, SHAPE = 2048, (2, 16)  # logits [32, 2048] fp32: 256 KiB, the step's largest activation
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


@pytest.fixture(scope="module")
def ptes(tmp_path_factory):
    """(with the pass, without it): the same tiny-llama training step."""
    torch.manual_seed(0)
    model = build_model("tiny-llama", dim=64, n_layers=1, hidden=128, vocab_size=VOCAB, max_seq_len=32)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    program = export_training_step(model, SHAPE)
    folder = tmp_path_factory.mktemp("ce_in_place")
    with_pass, without = folder / "with.pte", folder / "without.pte"
    with_pass.write_bytes(lower_to_pte(program))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p is not write_ce_gradient_in_place))
        without.write_bytes(lower_to_pte(program))
    return with_pass, without


def _graph(path):
    pte = PteFile.load(path)
    return deserialize_blob(pte.execution_plan("forward").delegates[0].data, named_data=pte.named_data)


def _fused_ce(graph):
    return next(op for op in graph.ops if op.name == FUSED_CE)


def test_the_gradient_shares_the_logits_storage_and_the_plan_shrinks(ptes, vk_device):
    from vktrain.runtime.device_profiles import profile_of

    with_pass, without = (_graph(p) for p in ptes)
    op = _fused_ce(with_pass)
    assert with_pass.tensor(op.outputs[1]).storage_of == storage_root(with_pass, op.args[0])
    assert storage_root(without, _fused_ce(without).outputs[1]) == _fused_ce(without).outputs[1]
    logits_bytes = with_pass.tensor(op.outputs[1]).stored_nbytes
    planned = [sum(m.size_bytes for m in g.memory_objects) for g in (with_pass, without)]
    assert planned[1] - planned[0] >= logits_bytes // 2, (planned, logits_bytes)
    shaders = {d.shader for d in plan_schedule(with_pass, profile_of(vk_device), state_guard=True).dispatches}
    assert any(s.startswith("fused_ce@") and "IN_PLACE" in s for s in shaders), sorted(shaders)


def test_three_steps_give_the_same_bits_with_and_without_the_pass(ptes, vk_device):
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, VOCAB, SHAPE), rng.integers(0, VOCAB, SHAPE)) for _ in range(3)]
    results = []
    for path in ptes:
        with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
            losses = [runner.step(tokens, labels, HPARAMS) for tokens, labels in batches]
            results.append((losses, runner.state_dict()))
    (losses_a, state_a), (losses_b, state_b) = results
    assert losses_a == losses_b
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)


def test_logits_read_later_keep_the_gradient_its_own_storage(ptes):
    graph = _graph(ptes[1])  # compiled without the pass
    op = _fused_ce(graph)
    root = storage_root(graph, op.args[0])
    read_later = dataclasses.replace(graph, outputs=list(graph.outputs) + [root])
    write_ce_gradient_in_place(read_later)
    assert storage_root(read_later, op.outputs[1]) == op.outputs[1]
    write_ce_gradient_in_place(graph)  # the same graph as it was: the pass applies
    assert storage_root(graph, op.outputs[1]) == root

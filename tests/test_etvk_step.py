"""A small LM whose training step is written with upstream ExecuTorch's et_vk ops (frozen 4-bit base
through et_vk.linear_q4gsw, LoRA tensors, et_vk.fused_ce, the backward by et_vk.linear_q4gsw_backward and
et_vk.linear_dW, the update by et_vk.adamw_step on the module's buffers) exports as ONE step, lowers into
one delegate with no refusal and trains on the Vulkan device with the losses of eager PyTorch running
the same module (the same et_vk ops on CPU).

The reference is the same step in float64 (the et_vk ops' own CPU implementations where they take any
dtype: fused_ce, linear_dW, adamw_step; the 4-bit linears as products with the float64 dequantized
weight), and the bounds are the ones of tests/_helpers.py (why there): the device's run and PyTorch's
own float32 run of the et_vk module must both follow it within LOSS_RTOL per step and DELTA_REL_FROB
for what training did to each LoRA tensor. Then device and eager float32 agree within 2 * LOSS_RTOL.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("executorch.backends.vulkan.custom_ops_lib")

from _etvk_lm import (BIAS_CORRECTIONS, BETAS, EPS, LORA, LR, N_VALID, WEIGHT_DECAY,  # noqa: E402
                      EtvkLoraLM, training_batches, Float64Ops)
from _helpers import DELTA_REL_FROB, LOSS_RTOL, relative_frobenius_error  # noqa: E402
from vktrain.contract import HPARAM_NAMES  # noqa: E402
from vktrain.export.etvk import lower_etvk_program, map_etvk_calls  # noqa: E402
from vktrain.partitioner.etvk_ops import ADAMW_STEP  # noqa: E402
from vktrain.partitioner.op_registry import first_refusal  # noqa: E402
from vktrain.runtime.delegate.executor import GraphExecutor  # noqa: E402
from vktrain.serialization.pte import PteFile  # noqa: E402
from vktrain.runtime.program.summary import summarize_pte  # noqa: E402
from vktrain.serialization.verify import load_delegate_graph  # noqa: E402
from _helpers import planned


def _eager(model: EtvkLoraLM, batches) -> tuple[list[float], dict[str, np.ndarray]]:
    with torch.no_grad():
        losses = [float(model(tokens, labels)) for tokens, labels in batches]
    return losses, model.lora_state()


@pytest.fixture(scope="module")
def exported():
    batches = training_batches()
    return torch.export.export(EtvkLoraLM(), batches[0])


@pytest.fixture(scope="module")
def pte(exported) -> bytes:
    return lower_etvk_program(exported)


def test_the_step_holds_every_et_vk_training_op_and_maps_into_registry_ops_only(exported):
    keys = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    for op in ("linear_q4gsw", "linear_q4gsw_backward", "linear_dW", "fused_ce", "adamw_step"):
        assert f"et_vk.{op}.default" in keys
    mapped = map_etvk_calls(exported)
    assert first_refusal(mapped.program) is None
    assert not any(str(n.target).startswith("et_vk.") for n in mapped.program.graph.nodes)
    # adamw_step's in-place writes became the program's state updates.
    mutated = set(mapped.program.graph_signature.buffers_to_mutate.values())
    assert mutated == {f"{name}_{t}{suffix}" for name in LORA for t in "AB" for suffix in ("", "_m", "_v")}


def test_one_delegate_no_refusal_and_inspect_reports_the_baked_scalars(pte, tmp_path):
    report = summarize_pte(pte)
    assert report["delegate_calls"] == 1 and report["kernel_calls"] == 0 and report["refusals"] == []
    (delegate,) = report["delegates"]
    baked = {entry["op"]: entry["scalars"] for entry in delegate["baked_scalars"]}
    assert baked["et_vk.fused_ce.default"] == {"n_valid": N_VALID}
    assert baked["et_vk.adamw_step.default"] == dict(zip(
        ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction1", "bias_correction2"),
        (LR, *BETAS, EPS, WEIGHT_DECAY, *BIAS_CORRECTIONS)))
    assert sum(entry["op"] == "et_vk.adamw_step.default" for entry in delegate["baked_scalars"]) == 2 * len(LORA)
    path = tmp_path / "etvk_step.pte"
    path.write_bytes(pte)
    text = subprocess.run([sys.executable, "-m", "vktrain.cli", "inspect", str(path)], capture_output=True, text=True,
                          check=True).stdout
    assert "baked scalars" in text and "LR schedule cannot change them" in text
    assert f"n_valid={N_VALID!r}" in text and f"bias_correction2={BIAS_CORRECTIONS[1]!r}" in text


def test_the_adamw_mapping_runs_vktrain_adamw_at_a_step_where_its_bias_corrections_are_one(exported):
    """hparams = [lr sqrt(bc2) / bc1, beta1, beta2, eps sqrt(bc2), wd bc1 / sqrt(bc2)] at t = 2^24."""
    mapped = map_etvk_calls(exported).program
    constants = mapped.constants
    adamw = [n for n in mapped.graph.nodes if n.target is torch.ops.vktrain.adamw.default]
    assert len(adamw) == 2 * len(LORA)
    for node in adamw:
        hparams, step = (constants[mapped.graph_signature.inputs_to_lifted_tensor_constants[a.name]]
                         for a in node.args[4:6])
        bc1, bc2 = BIAS_CORRECTIONS
        expected = dict(zip(HPARAM_NAMES, (LR * np.sqrt(bc2) / bc1, *BETAS, EPS * np.sqrt(bc2),
                                           WEIGHT_DECAY * bc1 / np.sqrt(bc2))))
        np.testing.assert_array_equal(hparams.numpy(), np.float32([expected[name] for name in HPARAM_NAMES]))
        assert float(step) == ADAMW_STEP
        assert 1 - np.float64(np.float32(max(BETAS))) ** ADAMW_STEP == 1.0


def test_ten_steps_on_the_device_follow_eager_pytorch_running_the_same_et_vk_ops(pte, tmp_path, vk_device):
    batches = training_batches()
    initial = EtvkLoraLM().lora_state()
    eager_losses, eager_state = _eager(EtvkLoraLM(), batches)
    exact_losses, exact_state = _eager(EtvkLoraLM(ops=Float64Ops(), dtype=torch.float64), batches)

    path = tmp_path / "etvk_step.pte"
    path.write_bytes(pte)
    program = PteFile.load(path)
    _, graph = load_delegate_graph(program, program.execution_plan("forward"))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        assert [graph.tensor(i).name for i in graph.inputs] == ["token_ids", "labels"]
        losses = [float(executor.run(tokens.numpy(), labels.numpy())[0]) for tokens, labels in batches]
        state = {name: executor.read_state(name) for name in initial}

    assert exact_losses[-1] < 0.6 * exact_losses[0], f"the reference does not learn the batch: {exact_losses}"
    for label, run_losses, run_state in (("vktrain", losses, state), ("torch float32", eager_losses, eager_state)):
        np.testing.assert_allclose(run_losses, exact_losses, rtol=LOSS_RTOL,
                                   err_msg=f"{label}: per-step losses vs the float64 reference")
        errors = {name: relative_frobenius_error(run_state[name] - initial[name], exact_state[name] - initial[name])
                  for name in initial}
        assert max(errors.values()) <= DELTA_REL_FROB, f"{label}: trained deltas vs float64: {json.dumps(errors)}"
    np.testing.assert_allclose(losses, eager_losses, rtol=2 * LOSS_RTOL)

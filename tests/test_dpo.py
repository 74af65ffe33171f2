"""DPO's training step (vktrain/export/dpo.py) on lavapipe against DPO's formula in float64 with
transformers + PEFT: the reference log-probabilities from the same model with its adapters disabled
(PEFT's disable_adapter), the loss -log sigmoid(beta * margin) averaged over the pairs of a step,
torch AdamW. Two pairs per optimizer step (the accumulate method, then the step, each divided by
n_pairs = 2), four steps. Bounds: the trained deltas within tests/_helpers.py's DELTA_REL_FROB (derived
there for float32 through the same ops). The loss is not the well-conditioned token mean LOSS_RTOL bounds:
it is a function of the margin, a difference of four summed log-probabilities (~-90 each here) that nearly
cancel. Each sum carries LOSS_RTOL relative error at most (a cross-entropy sum, as the token loss), so the
margin is off by at most LOSS_RTOL * (|pi_c| + |ref_c| + |pi_r| + |ref_r|), and the loss, whose derivative in
the margin is beta * sigmoid(-z) <= beta, by beta / n_pairs times that per pair: the per-step bound,
computed from the float64 run's log-probabilities. PyTorch's own float32 run meets the same bounds.
The first step's loss is log 2 exactly whatever the pairs (lora_B starts at 0: the policy is the
reference), so the later steps and the deltas carry the comparison; a wrong sign of the margin or a
reference that kept the adapters would move them far outside the bounds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.contract import DPO_INPUTS, TRAIN_METHOD
from vktrain.export import lower_methods_to_pte
from vktrain.export.dpo import example_dpo_inputs, negative_log_sigmoid, with_dpo_loss
from vktrain.export.training import export_accumulating_methods
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model, load
from vktrain.partitioner import VktrainPartitioner
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.train.data import IGNORED_LABEL

from _helpers import DELTA_REL_FROB, LOSS_RTOL, relative_frobenius_error

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_peft_parity import ALPHA, RANK, _hf_checkpoint, peft_lora_state, peft_model  # noqa: E402

SEQ, STEPS, PAIRS, BETA = 16, 4, 2, 0.5
HPARAMS = (1e-2, 0.9, 0.999, 1e-8, 0.01)  # test_peft_parity's


def _pairs():
    """STEPS x PAIRS preference pairs of [1, SEQ] rows: a shared prompt of 4-7 tokens, completions of the
    rest of the row; labels[s] = the token at s + 1 where it is a completion token, else -100."""
    rng = np.random.default_rng(5)
    for _ in range(STEPS * PAIRS):
        prompt = int(rng.integers(4, 8))
        row = {}
        for side in ("chosen", "rejected"):
            ids = np.concatenate([rng.integers(0, 32, prompt) if side == "chosen" else row["chosen_ids"][0, :prompt],
                                  rng.integers(0, 32, SEQ + 1 - prompt)])
            labels = np.where(np.arange(1, SEQ + 1) >= prompt, ids[1:], IGNORED_LABEL)
            row[f"{side}_ids"], row[f"{side}_labels"] = ids[None, :SEQ], labels[None]
        yield row


def _logp(model, ids, labels):
    logits = model(input_ids=torch.from_numpy(ids)).logits[0]
    return -torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels[0]), ignore_index=IGNORED_LABEL,
                                              reduction="sum")


def _reference(directory, vk_model, dtype):
    """DPO over the pairs with transformers + PEFT: per-step losses (summed over the step's pairs, each
    divided by PAIRS) and the trained LoRA tensors."""
    model, peft_layers, optimizer = peft_model(directory, vk_model, dtype)
    pairs, losses, bounds = list(_pairs()), [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        total, bound = 0.0, 0.0
        for pair in pairs[step * PAIRS:(step + 1) * PAIRS]:
            with torch.no_grad(), model.disable_adapter():
                ref = [_logp(model, pair[f"{s}_ids"], pair[f"{s}_labels"]) for s in ("chosen", "rejected")]
            chosen, rejected = (_logp(model, pair[f"{s}_ids"], pair[f"{s}_labels"]) for s in ("chosen", "rejected"))
            margin = (chosen - ref[0]) - (rejected - ref[1])
            loss = -torch.nn.functional.logsigmoid(BETA * margin) / PAIRS
            loss.backward()
            total += loss.item()
            bound += BETA / PAIRS * LOSS_RTOL * float(sum(abs(x) for x in (chosen, rejected, *ref)))
        optimizer.step()
        losses.append(total)
        bounds.append(bound)
    return losses, bounds, peft_lora_state(peft_layers)


@pytest.fixture(scope="module")
def dpo_program(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama_dpo")
    _hf_checkpoint(directory)
    model = load(directory).model
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=32, seed=0, scale_rule="mse"))
    methods = export_accumulating_methods(with_dpo_loss(model, BETA),
                                          example_inputs=example_dpo_inputs(SEQ, model.vocab_size))
    path = directory / "dpo.pte"
    path.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: VktrainPartitioner()}))
    return directory, path, model


def test_negative_log_sigmoid_and_its_gradient():
    """Against torch's logsigmoid in float64: values (log of a sigmoid rounded near 1: an absolute error
    below 2^-52 there; below -80 the asymptote -z, off by < e^-80) and gradients, at 0 too (DPO's first
    step); finite in float32 everywhere."""
    z = torch.tensor([-200.0, -85.0, -30.0, -1.0, 0.0, 1e-3, 2.5, 90.0, 300.0], dtype=torch.float64,
                     requires_grad=True)
    ours, expected = negative_log_sigmoid(z), -torch.nn.functional.logsigmoid(z)
    assert torch.allclose(ours, expected, rtol=1e-14, atol=2 ** -52)
    grad, expected_grad = (torch.autograd.grad(f.sum(), z)[0] for f in (ours, expected))
    assert torch.allclose(grad, expected_grad, rtol=1e-12, atol=1e-30) and grad[4] == -0.5
    assert torch.isfinite(negative_log_sigmoid(z.detach().float())).all()


def test_dpo_steps_match_the_float64_formula_with_transformers_peft(vk_device, dpo_program):
    directory, path, model = dpo_program
    initial = {name: param.detach().double().numpy() for name, param in model.named_parameters()
               if name.endswith(("lora_A", "lora_B"))}
    exact_losses, bounds, exact_state = _reference(directory, model, torch.float64)
    single_losses, _, single_state = _reference(directory, model, torch.float32)
    assert exact_losses[0] == pytest.approx(math.log(2), rel=1e-12)
    # Premise: training moves the loss far beyond the bounds (a step that did not train would stay at log 2).
    assert max(abs(loss - math.log(2)) for loss in exact_losses) > 100 * max(bounds), (exact_losses, bounds)
    hparams = np.array(HPARAMS, np.float32)
    pairs, losses = list(_pairs()), []
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert list(runner.input_specs) == list(DPO_INPUTS)
        for step in range(STEPS):
            batch = [{**pair, "n_pairs": np.float32(PAIRS)} for pair in pairs[step * PAIRS:(step + 1) * PAIRS]]
            loss = sum(runner.accumulate_inputs(inputs) for inputs in batch[:-1])
            losses.append(loss + runner.step_inputs(batch[-1], hparams))
        ours = {name.removeprefix("model."): value for name, value in runner.lora_state().items()}
    assert sorted(ours) == sorted(exact_state)
    for label, run_losses, run_state in (("vktrain", losses, ours), ("torch float32", single_losses, single_state)):
        errors = np.abs(np.array(run_losses) - exact_losses)
        assert (errors <= bounds).all(), f"{label}: DPO losses off by {errors} (bounds {bounds})"
        for name in exact_state:
            error = relative_frobenius_error(run_state[name] - initial[name], exact_state[name] - initial[name])
            assert error <= DELTA_REL_FROB, f"{label}: {name}: trained delta off by {error:.2e} (relative)"


def test_dpo_refuses_what_it_cannot_train():
    base = build_model("tiny-llama", n_layers=1)
    with pytest.raises(ValueError, match="call vktrain.lora.apply_lora first"):
        with_dpo_loss(base)
    apply_lora(base, LoRAConfig(rank=2))
    for beta in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="beta must be a finite number > 0"):
            with_dpo_loss(base, beta)
    dpo = with_dpo_loss(base, 0.2)
    assert dpo.dpo_beta == 0.2 and dpo is not base and not hasattr(base, "dpo_beta")  # a copy

"""SimPO's training step (vktrain/export/simpo.py) and the preference eval (vktrain/train/preference_eval.py)
on lavapipe against SimPO's formula in float64 with transformers + PEFT (tests/test_dpo.py's model, pairs,
optimizer and bounds): the loss -log sigmoid(beta (pi_c / |y_c| - pi_r / |y_r|) - gamma) averaged over the
pairs of a step, no reference model, torch AdamW; two pairs a step (accumulate, then step), four steps.
Bounds: trained deltas within DELTA_REL_FROB; each loss within beta / n_pairs * LOSS_RTOL * (|pi_c| / |y_c| +
|pi_r| / |y_r|) per pair of the float64 one (its derivative in each mean log-probability is at most beta,
each mean carries LOSS_RTOL relative error at most), computed from the float64 run. A loss that used the
sums instead of the means, dropped gamma or kept a reference would be far outside them (the premise check).
Then the trained adapters' held-out eval over the pairs: the mean loss against the float64 one, and the
reward accuracy (beta pi_c / |y_c| > beta pi_r / |y_r|) equal to the float64 model's, pair by pair.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.contract import SIMPO_INPUTS, TRAIN_METHOD
from vktrain.export import lower_methods_to_pte
from vktrain.export.simpo import example_simpo_inputs, with_simpo_loss
from vktrain.export.training import export_accumulating_methods
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model, load
from vktrain.partitioner import VktrainPartitioner
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.train.pairs import PreferencePairs, pair_batches
from vktrain.train.preference_eval import TIE_RTOL, evaluate_pairs

from _helpers import DELTA_REL_FROB, LOSS_RTOL, relative_frobenius_error

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_dpo import HPARAMS, PAIRS, STEPS, _logp, _pairs  # noqa: E402
from test_peft_parity import ALPHA, RANK, _hf_checkpoint, peft_lora_state, peft_model  # noqa: E402

BETA, GAMMA_BETA_RATIO = 2.0, 0.5
GAMMA = BETA * GAMMA_BETA_RATIO


def _means(model, pair):
    """[pi_c / |y_c|, pi_r / |y_r|] of a pair under `model`."""
    return [_logp(model, pair[f"{s}_ids"], pair[f"{s}_labels"]) / float((pair[f"{s}_labels"] >= 0).sum())
            for s in ("chosen", "rejected")]


def _reference(directory, vk_model, dtype):
    """SimPO over the pairs with transformers + PEFT: per-step losses, their bounds, the trained LoRA tensors,
    and the trained model's (mean eval loss, whether each pair's chosen reward beats the rejected one)."""
    model, peft_layers, optimizer = peft_model(directory, vk_model, dtype)
    pairs, losses, bounds = list(_pairs()), [], []
    before = _held_out(model, pairs)
    for step in range(STEPS):
        optimizer.zero_grad()
        total, bound = 0.0, 0.0
        for pair in pairs[step * PAIRS:(step + 1) * PAIRS]:
            chosen, rejected = _means(model, pair)
            loss = -torch.nn.functional.logsigmoid(BETA * (chosen - rejected) - GAMMA) / PAIRS
            loss.backward()
            total += loss.item()
            bound += BETA / PAIRS * LOSS_RTOL * (abs(chosen.item()) + abs(rejected.item()))
        optimizer.step()
        losses.append(total)
        bounds.append(bound)
    return losses, bounds, peft_lora_state(peft_layers), before, _held_out(model, pairs)


def _held_out(model, pairs):
    """The float64 eval of `pairs`: (mean loss, its bound, whether each pair is won, each reward margin)."""
    with torch.no_grad():
        means = [_means(model, pair) for pair in pairs]
    losses = [-torch.nn.functional.logsigmoid(BETA * (c - r) - GAMMA).item() for c, r in means]
    bound = sum(BETA * LOSS_RTOL * (abs(c.item()) + abs(r.item())) for c, r in means) / len(pairs)
    return float(np.mean(losses)), bound, [bool(c > r) for c, r in means], [BETA * (c - r).item() for c, r in means]


@pytest.fixture(scope="module")
def simpo_program(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama_simpo")
    _hf_checkpoint(directory)
    model = load(directory).model
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=32, seed=0, scale_rule="mse"))
    methods = export_accumulating_methods(with_simpo_loss(model, BETA, GAMMA_BETA_RATIO),
                                          example_inputs=example_simpo_inputs(16, model.vocab_size))
    path = directory / "simpo.pte"
    path.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: VktrainPartitioner()}))
    return directory, path, model


def _as_pairs(pairs) -> PreferencePairs:
    return PreferencePairs(*(np.concatenate([pair[f"{side}_{what}"] for pair in pairs])
                             for side in ("chosen", "rejected") for what in ("ids", "labels")), truncated=0)


def test_simpo_steps_and_eval_match_the_float64_formula_with_transformers_peft(vk_device, simpo_program):
    directory, path, model = simpo_program
    initial = {name: param.detach().double().numpy() for name, param in model.named_parameters()
               if name.endswith(("lora_A", "lora_B"))}
    exact_losses, bounds, exact_state, before, after = _reference(directory, model, torch.float64)
    # Premise: training moves the loss far beyond the bounds; before training the base prefers some chosen
    # completions and not others, by margins far beyond the bounds (the accuracy is then exact).
    assert max(exact_losses) - min(exact_losses) > 100 * max(bounds), (exact_losses, bounds)
    assert 0 < sum(before[2]) < len(before[2]) and min(map(abs, before[3])) > 1e3 * before[1], before
    assert min(map(abs, after[3])) > 1e3 * after[1], after
    pairs = list(_pairs())
    hparams = np.array(HPARAMS, np.float32)
    losses = []
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert list(runner.input_specs) == list(SIMPO_INPUTS)
        batches = pair_batches(_as_pairs(pairs), runner.input_specs, "pairs", PAIRS)  # the lengths counted here
        settings = {"objective": "simpo", "beta": BETA, "gamma": GAMMA}
        evaluated = [evaluate_pairs(runner, _as_pairs(pairs), settings)]
        for step in range(STEPS):
            batch = [batches.batch(step * PAIRS + i) for i in range(PAIRS)]
            loss = sum(runner.accumulate_inputs(inputs) for inputs in batch[:-1])
            losses.append(loss + runner.step_inputs(batch[-1], hparams))
        ours = {name.removeprefix("model."): value for name, value in runner.lora_state().items()}
        evaluated.append(evaluate_pairs(runner, _as_pairs(pairs), settings))
    errors = np.abs(np.array(losses) - exact_losses)
    assert (errors <= bounds).all(), f"SimPO losses off by {errors} (bounds {bounds})"
    for name in exact_state:
        error = relative_frobenius_error(ours[name] - initial[name], exact_state[name] - initial[name])
        assert error <= DELTA_REL_FROB, f"{name}: trained delta off by {error:.2e} (relative)"
    # The eval of the initial and of the trained adapters: the loss within the float64 one's bound (10x: after
    # training, the deltas' own error moves the log-probabilities too), the accuracy exact.
    for ours_eval, (exact_eval, eval_bound, exact_wins, _) in zip(evaluated, (before, after)):
        assert abs(ours_eval["loss"] - exact_eval) <= 10 * eval_bound, (ours_eval, exact_eval, eval_bound)
        assert ours_eval["pairs"] == len(pairs) and ours_eval["ties"] == 0
        assert ours_eval["reward_accuracy"] == sum(exact_wins) / len(exact_wins), (ours_eval, exact_wins)


def test_simpo_refuses_what_it_cannot_train():
    base = build_model("tiny-llama", n_layers=1)
    with pytest.raises(ValueError, match="call vktrain.lora.apply_lora first"):
        with_simpo_loss(base)
    apply_lora(base, LoRAConfig(rank=2))
    for beta in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="SimPO's beta must be a finite number > 0"):
            with_simpo_loss(base, beta)
    for ratio in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="gamma_beta_ratio must be a finite number >= 0"):
            with_simpo_loss(base, 2.0, ratio)
    simpo = with_simpo_loss(base, 2.5, 0.4)
    assert (simpo.simpo_beta, simpo.simpo_gamma) == (2.5, 1.0) and not hasattr(base, "simpo_beta")


def test_tie_tolerance_covers_float32_rounding_only():
    """A zero margin's float32 loss is within TIE_RTOL of softplus(gamma); a margin of 1e-4 is not."""
    for gamma in (0.0, 1.0):
        threshold = float(np.log1p(np.exp(gamma)))
        for z, tie in ((-gamma, True), (-gamma + 1e-4, False), (-gamma - 1e-4, False)):
            loss = float(-np.log(1 / (1 + np.exp(-np.float32(z)))).astype(np.float32))
            assert (abs(loss - threshold) <= TIE_RTOL * threshold) == tie, (gamma, z, loss)

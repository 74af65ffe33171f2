"""ORPO's training step (vktrain/export/orpo.py) and its preference eval on lavapipe against ORPO's formula in
float64 with transformers + PEFT (tests/test_dpo.py's model, prompts, optimizer and bounds), as TRL's
ORPOTrainer writes it: log_odds = (lp_c - lp_r) - (log1p(-exp(lp_c)) - log1p(-exp(lp_r))), the loss
-lp_c - lambda logsigmoid(log_odds) averaged over the pairs of a step (lp: the length-normalised log-probability);
two pairs a step (accumulate, then step), four steps.

The completions are the base model's greedy continuations of test_dpo's prompts, with the runner-up token taken
at one position (the likely completion, lp ~ -0.3 to -2: p up to 0.76, where log(1 - p) weighs) or three (the
unlikely one), chosen and rejected in turn: random completions would have p ~ e^-40, where the odds are p and
the log(1 - p) terms vanish. The premise check: dropping those terms moves the losses far outside the bounds.
Bounds: trained deltas within DELTA_REL_FROB; each loss within the float64 one's first-order error, per pair
(1 + lambda / (1 - p_c)) e_c + lambda / (1 - p_r) e_r / n_pairs with e_x = LOSS_RTOL |lp_x| (d log_odds / d lp_x
= 1 / (1 - p_x), sigmoid <= 1). The eval: the mean loss within its bound and the reward accuracy (lambda lp_c >
lambda lp_r, TRL's rewards/accuracies) equal to the float64 model's, pair by pair.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.contract import SIMPO_INPUTS, TRAIN_METHOD
from vktrain.export import lower_methods_to_pte
from vktrain.export.orpo import example_orpo_inputs, log1mexp, orpo_log_odds, with_orpo_loss
from vktrain.export.training import export_accumulating_methods
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model, load
from vktrain.partitioner import VktrainPartitioner
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.train.data import IGNORED_LABEL
from vktrain.train.pairs import pair_batches
from vktrain.train.preference_eval import evaluate_pairs

from _helpers import DELTA_REL_FROB, LOSS_RTOL, relative_frobenius_error

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_dpo import HPARAMS, PAIRS, SEQ, STEPS, _logp, _pairs  # noqa: E402
from test_peft_parity import ALPHA, RANK, _hf_checkpoint, peft_lora_state, peft_model  # noqa: E402
from test_simpo import _as_pairs  # noqa: E402

LAMBDA = 1.0  # TRL's default 0.1 scales the odds-ratio term down, and the premise with it


def _continuation(model, prompt, count: int, runner_up_at: tuple[int, ...]) -> np.ndarray:
    """prompt + `count` greedy tokens under `model`, the second most likely one at positions `runner_up_at`."""
    ids = list(prompt)
    with torch.no_grad():
        for position in range(count):
            order = torch.argsort(model(input_ids=torch.tensor([ids])).logits[0, -1], descending=True)
            ids.append(int(order[1 if position in runner_up_at else 0]))
    return np.array(ids)


def _orpo_pairs(base):
    """test_dpo's prompts with the likely and the unlikely continuation (module docstring), chosen in turn."""
    pairs = []
    for index, pair in enumerate(_pairs()):
        prompt = int((pair["chosen_labels"][0] < 0).sum()) + 1
        likely, unlikely = (_continuation(base, pair["chosen_ids"][0, :prompt], SEQ + 1 - prompt, at)
                            for at in ((0,), (0, 2, 4)))
        row = {}
        for side, ids in zip(("chosen", "rejected"), (likely, unlikely) if index % 2 == 0 else (unlikely, likely)):
            labels = np.where(np.arange(1, SEQ + 1) >= prompt, ids[1:], IGNORED_LABEL)
            row[f"{side}_ids"], row[f"{side}_labels"] = ids[None, :SEQ], labels[None]
        pairs.append(row)
    return pairs


def _means(model, pair):
    """[lp_c, lp_r] of a pair under `model`."""
    return [_logp(model, pair[f"{s}_ids"], pair[f"{s}_labels"]) / float((pair[f"{s}_labels"] >= 0).sum())
            for s in ("chosen", "rejected")]


def _trl_loss(chosen, rejected, odds=True):
    """TRL's ORPO loss of one pair in float64; odds=False drops the log(1 - p) terms (the premise check)."""
    log_odds = (chosen - rejected) - ((torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
                                      if odds else 0.0)
    return -chosen - LAMBDA * torch.nn.functional.logsigmoid(log_odds)


def _bound(chosen, rejected):
    """The float32 error bound of one pair's loss (module docstring)."""
    c, r = chosen.item(), rejected.item()
    return LOSS_RTOL * ((1 + LAMBDA / -math.expm1(c)) * abs(c) + LAMBDA / -math.expm1(r) * abs(r))


def _reference(directory, vk_model, pairs):
    """ORPO over `pairs` with transformers + PEFT in float64: per-step losses, their bounds, the same losses
    without the log(1 - p) terms, the trained LoRA tensors, and the eval before and after training."""
    model, peft_layers, optimizer = peft_model(directory, vk_model, torch.float64)
    losses, bounds, oddless = [], [], []
    before = _held_out(model, pairs)
    for step in range(STEPS):
        optimizer.zero_grad()
        total, bound, without = 0.0, 0.0, 0.0
        for pair in pairs[step * PAIRS:(step + 1) * PAIRS]:
            chosen, rejected = _means(model, pair)
            loss = _trl_loss(chosen, rejected) / PAIRS
            loss.backward()
            total += loss.item()
            bound += _bound(chosen, rejected) / PAIRS
            without += _trl_loss(chosen, rejected, odds=False).item() / PAIRS
        optimizer.step()
        losses.append(total)
        bounds.append(bound)
        oddless.append(without)
    return losses, bounds, oddless, peft_lora_state(peft_layers), before, _held_out(model, pairs)


def _held_out(model, pairs):
    """The float64 eval of `pairs`: (mean loss, its bound, whether each pair is won, each lp_c - lp_r)."""
    with torch.no_grad():
        means = [_means(model, pair) for pair in pairs]
    losses = [_trl_loss(c, r).item() for c, r in means]
    bound = sum(_bound(c, r) for c, r in means) / len(pairs)
    return float(np.mean(losses)), bound, [bool(c > r) for c, r in means], [(c - r).item() for c, r in means]


@pytest.fixture(scope="module")
def orpo_program(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama_orpo")
    _hf_checkpoint(directory)
    model = load(directory).model
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=32, seed=0, scale_rule="mse"))
    methods = export_accumulating_methods(with_orpo_loss(model, LAMBDA),
                                          example_inputs=example_orpo_inputs(SEQ, model.vocab_size))
    path = directory / "orpo.pte"
    path.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: VktrainPartitioner()}))
    return directory, path, model


def test_orpo_steps_and_eval_match_trl_formula_with_transformers_peft(vk_device, orpo_program):
    directory, path, model = orpo_program
    initial = {name: param.detach().double().numpy() for name, param in model.named_parameters()
               if name.endswith(("lora_A", "lora_B"))}
    pairs = _orpo_pairs(peft_model(directory, model, torch.float64)[0])  # lora_B = 0: the base's continuations
    exact_losses, bounds, oddless, exact_state, before, after = _reference(directory, model, pairs)
    # Premise: the log(1 - p) terms and training both move the loss far beyond the bounds; the margins of the
    # eval are far beyond theirs (the accuracy is then exact), half the pairs won before training.
    assert min(abs(a - b) for a, b in zip(exact_losses, oddless)) > 10 * max(bounds), (exact_losses, oddless, bounds)
    assert max(exact_losses) - min(exact_losses) > 100 * max(bounds), (exact_losses, bounds)
    assert sum(before[2]) == len(pairs) // 2 and min(map(abs, before[3] + after[3])) > 1e3 * max(before[1], after[1])
    hparams = np.array(HPARAMS, np.float32)
    losses = []
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert list(runner.input_specs) == list(SIMPO_INPUTS)
        batches = pair_batches(_as_pairs(pairs), runner.input_specs, "pairs", PAIRS)  # the lengths counted here
        settings = {"objective": "orpo", "beta": LAMBDA}
        evaluated = [evaluate_pairs(runner, _as_pairs(pairs), settings)]
        for step in range(STEPS):
            batch = [batches.batch(step * PAIRS + i) for i in range(PAIRS)]
            loss = sum(runner.accumulate_inputs(inputs) for inputs in batch[:-1])
            losses.append(loss + runner.step_inputs(batch[-1], hparams))
        ours = {name.removeprefix("model."): value for name, value in runner.lora_state().items()}
        evaluated.append(evaluate_pairs(runner, _as_pairs(pairs), settings))
    errors = np.abs(np.array(losses) - exact_losses)
    assert (errors <= bounds).all(), f"ORPO losses off by {errors} (bounds {bounds})"
    for name in exact_state:
        error = relative_frobenius_error(ours[name] - initial[name], exact_state[name] - initial[name])
        assert error <= DELTA_REL_FROB, f"{name}: trained delta off by {error:.2e} (relative)"
    for ours_eval, (exact_eval, eval_bound, exact_wins, _) in zip(evaluated, (before, after)):
        assert abs(ours_eval["loss"] - exact_eval) <= 10 * eval_bound, (ours_eval, exact_eval, eval_bound)
        assert ours_eval["pairs"] == len(pairs) and ours_eval["ties"] == 0
        assert ours_eval["reward_accuracy"] == sum(exact_wins) / len(exact_wins), (ours_eval, exact_wins)


def test_log1mexp_and_the_log_odds_are_accurate_where_p_nears_one():
    """The formula the step traces, in float64 eager, against mpmath at 50 digits: log(1 - exp(x)) to float64's
    relative precision for -ln 2 <= x < 0 (where log1p(-exp(x)) loses every digit as x nears 0) and its
    absolute precision below; and the log odds ratio as TRL's, up to p = 1 - 1e-6, where the ceiling keeps
    log(1 - p) finite."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    x = -torch.tensor([1e-300, 1e-12, 1e-6, 0.01, 0.5, math.log(2), 1.0, 30.0, 700.0], dtype=torch.float64)
    expected = torch.tensor([float(mpmath.log(-mpmath.expm1(mpmath.mpf(v)))) for v in x.tolist()],
                            dtype=torch.float64)
    near = x >= -math.log(2)
    torch.testing.assert_close(log1mexp(x[near]), expected[near], rtol=4e-16, atol=0)
    torch.testing.assert_close(log1mexp(x[~near]), expected[~near], rtol=0, atol=4e-16)
    assert (torch.log1p(-torch.exp(x[:2])) - expected[:2]).abs().max() > 0.1  # the textbook formula's loss
    chosen = torch.tensor([-1e-6, -0.05, -0.3, -2.0, -40.0], dtype=torch.float64)
    rejected = torch.tensor([-0.7, -3.0, -0.01, -2.0, -1.0], dtype=torch.float64)
    trl = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    torch.testing.assert_close(orpo_log_odds(chosen, rejected), trl, rtol=1e-9, atol=1e-12)
    certain = orpo_log_odds(torch.tensor(0.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64))
    assert torch.isfinite(certain) and certain.item() == pytest.approx(1.0 - math.log(1e-6) + math.log(-math.expm1(-1)))


def test_orpo_refuses_what_it_cannot_train():
    base = build_model("tiny-llama", n_layers=1)
    with pytest.raises(ValueError, match="call vktrain.lora.apply_lora first"):
        with_orpo_loss(base)
    apply_lora(base, LoRAConfig(rank=2))
    for lambda_ in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"ORPO's lambda \(TRL's beta\) must be a finite number > 0"):
            with_orpo_loss(base, lambda_)
    assert with_orpo_loss(base, 0.25).orpo_lambda == 0.25 and not hasattr(base, "orpo_lambda")

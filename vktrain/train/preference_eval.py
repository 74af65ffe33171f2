"""Held-out evaluation of a preference step (`vktrain eval PREF.pte --data pairs.jsonl`, torch-free):
the mean preference loss over the pairs and the reward accuracy, the fraction of pairs whose chosen
completion's implicit reward beats the rejected one's (TRL's rewards/accuracies).

Each pair goes through the .pte's eval method alone (n_pairs 1), which returns its loss.
DPO's and SimPO's are L = -log sigmoid(z) = softplus(-z), z the objective's logit:
    DPO    z = beta ((pi_c - ref_c) - (pi_r - ref_r)),  rewards beta (pi - ref)         margin = z
    SimPO  z = beta (pi_c / |y_c| - pi_r / |y_r|) - gamma,  rewards beta pi / |y|      margin = z + gamma
so the reward margin (chosen's reward minus rejected's) is z + gamma (gamma 0 for DPO), and L is monotone
in z (the eval method has one output, the loss): a pair is won when the margin is > 0, i.e. when
L < softplus(gamma). The float32 loss carries a few units of rounding in its
last place, so a loss within TIE_RTOL of softplus(gamma) is a tie (no preference either way; DPO's pairs
all tie before training, when the adapters are still the base): counted apart, and not won.
ORPO's loss, -lp_c + lambda softplus(-log_odds) (lp = pi / |y|, rewards lambda lp as TRL's), is not a function
of the margin alone, so each pair also goes through the eval method against itself twice: a completion
paired with itself has log_odds 0, loss L_xx = -lp_x + lambda log 2, so the margin lambda (lp_c - lp_r) is
lambda (L_rr - L_cc), won when L_rr - L_cc > TIE_RTOL max(|L_cc|, |L_rr|) (three calls a pair).
The objective and its beta / gamma are the blob's metadata (contract.METADATA_OBJECTIVE), written by
`vktrain export`.

`vktrain eval PREF.pte --data PAIRS` and `vktrain train PREF.pte --eval-data PAIRS` read the pairs with
held_out_pairs and evaluate them with evaluate_pairs; train records the loss as eval_loss and the reward
accuracy as eval_reward_accuracy (EVAL_REWARD_ACCURACY), which `--keep-best accuracy` compares.
"""
from __future__ import annotations

import json
import math

from vktrain.contract import (CHOSEN_IDS, CHOSEN_LABELS, CHOSEN_LENGTH, METADATA_OBJECTIVE, N_PAIRS, OBJECTIVE_ORPO,
                              OBJECTIVE_SIMPO, PREFERENCE_INPUTS, REJECTED_IDS, REJECTED_LABELS, REJECTED_LENGTH)
from vktrain.train.pairs import PreferencePairs, load_program_pairs, pair_batches
from vktrain.train.train_loop import TrainConfigError

# float32 rounds a loss near softplus(gamma) to 2^-24 relative; its computation (log, sigmoid, a
# subtraction) adds a few such units. Margins this close to 0 are no preference.
TIE_RTOL = 1e-6
EVAL_REWARD_ACCURACY = "eval_reward_accuracy"  # vktrain train's record of the held-out reward accuracy


def objective_settings(metadata: dict, program: str) -> dict:
    """{"objective", "beta"[, "gamma"]} of a preference step, from its blob metadata."""
    text = metadata.get(METADATA_OBJECTIVE)
    if text is None:
        raise TrainConfigError(f"{program} does not record its preference objective (blob metadata "
                               f"{METADATA_OBJECTIVE!r}): export it again with vktrain export --objective "
                               f"dpo|simpo|orpo")
    settings = json.loads(text)
    if settings.get("objective") not in PREFERENCE_INPUTS or not isinstance(settings.get("beta"), (int, float)):
        raise TrainConfigError(f"{program}: blob metadata {METADATA_OBJECTIVE!r} is {text!r}; expected "
                               f'{{"objective": "dpo"|"simpo"|"orpo", "beta": number[, "gamma": number]}}')
    return settings


def held_out_pairs(runner, path, program: str) -> tuple[PreferencePairs, dict]:
    """(the pairs of `path` in the windows of `runner`'s preference step, its objective_settings): what
    evaluate_pairs takes. Bad rows are refused naming the row (vktrain/train/pairs.py)."""
    settings = objective_settings(dict(getattr(getattr(runner, "graph", None), "metadata", {}) or {}), program)
    pairs, _ = load_program_pairs(runner, path, program)
    return pairs, settings


def evaluate_pairs(runner, pairs: PreferencePairs, settings: dict, max_pairs: int | None = None) -> dict:
    """{"loss", "reward_accuracy", "ties", "pairs", "objective"} of `runner`'s current adapters on
    `pairs` (the first `max_pairs`), each through the eval method with n_pairs 1 (module docstring)."""
    method = runner.eval_method()  # refused here when the .pte has none
    batches = pair_batches(pairs, method.input_specs, "pairs", pairs_per_step=1)
    gamma = float(settings.get("gamma", 0.0)) if settings["objective"] == OBJECTIVE_SIMPO else 0.0
    threshold = math.log1p(math.exp(gamma))  # the loss of a zero margin: softplus(gamma)
    count = len(pairs) if max_pairs is None else min(max_pairs, len(pairs))
    losses, won, ties = [], 0, 0
    for position in range(count):
        inputs = batches.batch(position)
        assert float(inputs[N_PAIRS]) == 1.0
        loss = runner.evaluate_inputs(inputs)
        if not math.isfinite(loss):
            raise TrainConfigError(f"the preference loss of pair {position + 1} is {loss} (not finite): the adapters "
                                   f"or the pairs are broken")
        losses.append(loss)
        if settings["objective"] == OBJECTIVE_ORPO:
            margin, scale = _orpo_margin(runner, inputs)
        else:
            margin, scale = threshold - loss, threshold
        if abs(margin) <= TIE_RTOL * scale:
            ties += 1
        elif margin > 0:
            won += 1
    return {"loss": math.fsum(losses) / count, "reward_accuracy": won / count, "ties": ties, "pairs": count,
            "objective": settings["objective"]}


# The inputs of each side of a pair, chosen's then rejected's, position for position.
_SIDES = ((CHOSEN_IDS, CHOSEN_LABELS, CHOSEN_LENGTH), (REJECTED_IDS, REJECTED_LABELS, REJECTED_LENGTH))


def _orpo_margin(runner, inputs: dict) -> tuple[float, float]:
    """(L_rr - L_cc, max(|L_cc|, |L_rr|)) of an ORPO pair: each side's loss against itself (module docstring)."""
    losses = []
    for source in _SIDES:  # the chosen completion in both places, then the rejected one
        paired = dict(inputs)
        for target in _SIDES:
            paired.update({name: inputs[taken] for name, taken in zip(target, source)})
        losses.append(runner.evaluate_inputs(paired))
    chosen, rejected = losses
    return rejected - chosen, max(abs(chosen), abs(rejected))


__all__ = ["EVAL_REWARD_ACCURACY", "TIE_RTOL", "evaluate_pairs", "held_out_pairs", "objective_settings"]

"""Held-out evaluation of a preference step (`vktrain eval DPO_OR_SIMPO.pte --data pairs.jsonl`, torch-free):
the mean preference loss over the pairs and the reward accuracy, the fraction of pairs whose chosen
completion's implicit reward beats the rejected one's (TRL's rewards/accuracies).

Each pair goes through the .pte's eval method alone (n_pairs 1), which returns its loss
L = -log sigmoid(z) = softplus(-z), z the objective's logit:
    DPO    z = beta ((pi_c - ref_c) - (pi_r - ref_r)),  rewards beta (pi - ref)         margin = z
    SimPO  z = beta (pi_c / |y_c| - pi_r / |y_r|) - gamma,  rewards beta pi / |y|      margin = z + gamma
so the reward margin (chosen's reward minus rejected's) is z + gamma (gamma 0 for DPO), and L is monotone
in z (the eval method has one output, the loss): a pair is won when the margin is > 0, i.e. when
L < softplus(gamma). The float32 loss carries a few units of rounding in its
last place, so a loss within TIE_RTOL of softplus(gamma) is a tie (no preference either way; DPO's pairs
all tie before training, when the adapters are still the base): counted apart, and not won. The objective
and its beta / gamma are the blob's metadata (contract.METADATA_OBJECTIVE), written by `vktrain export`.
"""
from __future__ import annotations

import json
import math

from vktrain.contract import METADATA_OBJECTIVE, N_PAIRS, OBJECTIVE_SIMPO, PREFERENCE_INPUTS
from vktrain.train.pairs import PreferencePairs, pair_batches
from vktrain.train.train_loop import TrainConfigError

# float32 rounds a loss near softplus(gamma) to 2^-24 relative; its computation (log, sigmoid, a
# subtraction) adds a few such units. Margins this close to 0 are no preference.
TIE_RTOL = 1e-6


def objective_settings(metadata: dict, program: str) -> dict:
    """{"objective", "beta"[, "gamma"]} of a preference step, from its blob metadata."""
    text = metadata.get(METADATA_OBJECTIVE)
    if text is None:
        raise TrainConfigError(f"{program} does not record its preference objective (blob metadata "
                               f"{METADATA_OBJECTIVE!r}): export it again with vktrain export --objective dpo|simpo")
    settings = json.loads(text)
    if settings.get("objective") not in PREFERENCE_INPUTS or not isinstance(settings.get("beta"), (int, float)):
        raise TrainConfigError(f"{program}: blob metadata {METADATA_OBJECTIVE!r} is {text!r}; expected "
                               f'{{"objective": "dpo"|"simpo", "beta": number[, "gamma": number]}}')
    return settings


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
        if abs(loss - threshold) <= TIE_RTOL * threshold:
            ties += 1
        elif loss < threshold:
            won += 1
    return {"loss": math.fsum(losses) / count, "reward_accuracy": won / count, "ties": ties, "pairs": count,
            "objective": settings["objective"]}


__all__ = ["TIE_RTOL", "evaluate_pairs", "objective_settings"]

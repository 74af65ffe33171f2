"""The ORPO objective's training step (Hong, Lee and Thorne 2024, "ORPO: Monolithic Preference Optimization
without Reference Model"): DPO's machinery (vktrain/export/dpo.py: one pair a call, n_pairs) with SimPO's
inputs (the completions' lengths), supervised fine-tuning on the chosen completion plus an odds-ratio penalty:

    loss = (-lp_c + lambda * -log sigmoid(log_odds)) / n_pairs
    log_odds = log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)) = (lp_c - lp_r) - (log1mexp(lp_c) - log1mexp(lp_r))

lp_x = pi_x / |y_x|: the length-normalised log-probability of completion x (pi_x its targets' summed
log-probability, |y_x| their number), p_x = exp(lp_x); -lp_c is the chosen completion's token-mean NLL, the
SFT term. log1mexp(x) = log(1 - exp(x)) = log(-expm1(x)): expm1 keeps its relative accuracy where p nears 1
(1 - exp(x) would cancel). No reference model: 2 forwards a pair. This is TRL's ORPOTrainer's loss
(policy_nll_loss - beta * logsigmoid(log_odds), its beta being the paper's lambda, default 0.1) for one pair a
step; for N pairs a step, the mean over the pairs of each pair's loss (TRL takes the NLL's token mean over
the N chosen completions together, which weighs longer completions more).

Program inputs (contract.SIMPO_INPUTS): DPO's, then chosen_length and rejected_length float32 [] (|y_c|,
|y_r|); output the loss. lambda is baked (export --beta, TRL's name for it).
"""
from __future__ import annotations

import copy
import math
import types

import torch
from torch import nn

from vktrain.lora import lora_modules

from .dpo import completion_logp, negative_log_sigmoid
from .simpo import example_simpo_inputs

DEFAULT_LAMBDA = 0.1  # TRL's ORPOConfig.beta default

# lp is clamped to at most this before log1mexp: a completion the model predicts with certainty rounds its
# float32 mean log-probability to 0, where log(1 - p) is -inf. Below it (p < 1 - 1e-6) the loss is ORPO's.
_LOG_P_CEILING = -1e-6


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, in ops the backend runs with their backwards: log(-expm1(x)), relatively
    accurate as x nears 0, where log1p(-exp(x)) loses every digit; below x = -ln 2 it is accurate in
    absolute terms (the usual formula switches to log1p(-exp(x)) there, which needs a branch the backend
    lacks: a where), which is what the loss needs, since it adds the value to others of order one."""
    return torch.log(-torch.expm1(x))


def _ceiling(x: torch.Tensor) -> torch.Tensor:
    """min(x, _LOG_P_CEILING) through relu (minimum's backward needs comparisons the backend does not run)."""
    return x - torch.relu(x - _LOG_P_CEILING)  # tensor first: the backend takes no number - tensor


def orpo_log_odds(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """log(odds(p_c) / odds(p_r)) of two length-normalised log-probabilities (module docstring)."""
    return (chosen - rejected) - (log1mexp(_ceiling(chosen)) - log1mexp(_ceiling(rejected)))


def _orpo_loss(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels, n_pairs, chosen_length,
               rejected_length):
    chosen = completion_logp(self, chosen_ids, chosen_labels, chosen_length)  # the mean over the completion
    rejected = completion_logp(self, rejected_ids, rejected_labels, rejected_length)
    return (self.orpo_lambda * negative_log_sigmoid(orpo_log_odds(chosen, rejected)) - chosen) / n_pairs


def check_orpo_settings(lambda_: float) -> None:
    """ValueError naming the setting unless lambda is finite and > 0."""
    if not (isinstance(lambda_, (int, float)) and math.isfinite(lambda_) and lambda_ > 0):
        raise ValueError(f"ORPO's lambda (TRL's beta) must be a finite number > 0, got {lambda_!r}")


def with_orpo_loss(model: nn.Module, lambda_: float = DEFAULT_LAMBDA) -> nn.Module:
    """A copy of a token model (LoRA adapters inserted) whose `loss` is ORPO's (module docstring)."""
    check_orpo_settings(lambda_)
    if not lora_modules(model):
        raise ValueError("ORPO trains LoRA adapters: call vktrain.lora.apply_lora first")
    model = copy.deepcopy(model)
    model.orpo_lambda = float(lambda_)
    model.loss = types.MethodType(_orpo_loss, model)
    return model


example_orpo_inputs = example_simpo_inputs  # the same inputs (contract.PREFERENCE_INPUTS)

__all__ = ["DEFAULT_LAMBDA", "check_orpo_settings", "example_orpo_inputs", "log1mexp", "orpo_log_odds",
           "with_orpo_loss"]

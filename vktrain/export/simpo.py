"""The SimPO objective's training step (Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with
a Reference-Free Reward"): DPO's machinery (vktrain/export/dpo.py: one pair a call, n_pairs), with the
length-normalised log-probability as the implicit reward and no reference model:

    loss = softplus(-(beta * (pi_c / |y_c| - pi_r / |y_r|) - gamma)) / n_pairs,   gamma = beta * gamma_beta_ratio

pi_x: the summed log-probability of completion x's targets (labels >= 0) under the adapted model, |y_x|
their number. No frozen-base pass: 2 forwards a pair (DPO: 4). The defaults are the paper's reference
implementation's (princeton-nlp/SimPO: beta 2.0, gamma_beta_ratio 0.5).

Program inputs (contract.SIMPO_INPUTS): DPO's, then chosen_length and rejected_length float32 [] (|y_c|, |y_r|:
the caller counts the targets, as it counts n_valid for the token loss); output the loss. beta and gamma
are baked (export --beta, --gamma-beta-ratio).
"""
from __future__ import annotations

import copy
import math
import types

import torch
from torch import nn

from vktrain.lora import lora_modules

from .dpo import completion_logp, example_dpo_inputs, negative_log_sigmoid

DEFAULT_BETA = 2.0
DEFAULT_GAMMA_BETA_RATIO = 0.5


def _simpo_loss(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels, n_pairs, chosen_length,
                rejected_length):
    chosen = completion_logp(self, chosen_ids, chosen_labels, chosen_length)  # the mean over the completion
    rejected = completion_logp(self, rejected_ids, rejected_labels, rejected_length)
    return negative_log_sigmoid(self.simpo_beta * (chosen - rejected) - self.simpo_gamma) / n_pairs


def check_simpo_settings(beta: float, gamma_beta_ratio: float) -> None:
    """ValueError naming the setting unless beta is finite and > 0 and gamma_beta_ratio finite and >= 0."""
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"SimPO's beta must be a finite number > 0, got {beta!r}")
    if not (isinstance(gamma_beta_ratio, (int, float)) and math.isfinite(gamma_beta_ratio) and gamma_beta_ratio >= 0):
        raise ValueError(f"SimPO's gamma_beta_ratio must be a finite number >= 0, got {gamma_beta_ratio!r}")


def with_simpo_loss(model: nn.Module, beta: float = DEFAULT_BETA,
                    gamma_beta_ratio: float = DEFAULT_GAMMA_BETA_RATIO) -> nn.Module:
    """A copy of a token model (LoRA adapters inserted) whose `loss` is SimPO's (module docstring)."""
    check_simpo_settings(beta, gamma_beta_ratio)
    if not lora_modules(model):
        raise ValueError("SimPO trains LoRA adapters: call vktrain.lora.apply_lora first")
    model = copy.deepcopy(model)
    model.simpo_beta, model.simpo_gamma = float(beta), float(beta) * float(gamma_beta_ratio)
    model.loss = types.MethodType(_simpo_loss, model)
    return model


def example_simpo_inputs(seq_len: int, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """contract.SIMPO_INPUTS' example tensors: DPO's, then lengths of S (any positive value traces alike)."""
    length = torch.full((), float(seq_len), dtype=torch.float32)
    return (*example_dpo_inputs(seq_len, vocab_size), length, length.clone())


__all__ = ["DEFAULT_BETA", "DEFAULT_GAMMA_BETA_RATIO", "check_simpo_settings", "example_simpo_inputs",
           "with_simpo_loss"]

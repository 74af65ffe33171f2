"""The DPO objective's training step: one preference pair a call, reference log-probabilities from the
frozen base (the adapters bypassed) in the same step.

    loss = softplus(-beta * ((pi_c - ref_c) - (pi_r - ref_r))) / n_pairs  (= -log sigmoid(...) / n_pairs)

pi_x / ref_x: the summed log-probability of completion x's target tokens (labels >= 0: the completion, not
the prompt; vktrain/train/pairs.py builds them) under the adapted model / under the base alone. The step
takes one pair (token ids and labels [1, S] per side) and n_pairs, the number of pairs of the optimizer
step: N pairs are N calls, the first N - 1 accumulating their gradients (the .pte's accumulate method),
each divided by N, so the update is DPO's mean over the N pairs. One pair per call because a per-sequence
sum needs the rows apart, and the backend has no backward for slicing a batch (select_scatter); fused_ce
over one row's tokens with n_valid 1 is the row's summed negative log-probability, its backward the
gradient the step needs.

Program inputs (contract.DPO_INPUTS, the loss's parameters): chosen_ids, chosen_labels, rejected_ids, rejected_labels int64 [1, S],
n_pairs float32 [], then hparams; output the loss. beta is baked (export --beta).
"""
from __future__ import annotations

import copy
import math
import types

import torch
from torch import nn

from vktrain.lora import lora_modules

DEFAULT_BETA = 0.1


def completion_logp(model: nn.Module, token_ids: torch.Tensor, labels: torch.Tensor,
                    divisor: torch.Tensor | None = None) -> torch.Tensor:
    """The summed log-probability [] of the targets (labels >= 0) of one row [1, S] under `model`, divided
    by `divisor` (float32 [], e.g. the number of targets: the mean) when given."""
    logits = model.forward(token_ids)
    if divisor is None:
        divisor = torch.ones((), dtype=torch.float32)
    loss, _ = torch.ops.vktrain.fused_ce(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), divisor)
    return -loss


# Below it, sigmoid(z) nears fp32's underflow; there -log sigmoid(z) = -z to within e^z.
_LINEAR_BELOW = -80.0


def negative_log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(z), in ops the backend runs with their backwards (torch's softplus decomposes to log1p,
    which it does not): -log(sigmoid(z)) down to z = -80, continued as its asymptote -z below (the clamp is
    relu's, so its one kink is at -80, not at 0 where DPO starts: a |z| formulation would give a zero
    gradient there)."""
    clamped = torch.relu(z - _LINEAR_BELOW) + _LINEAR_BELOW
    return -torch.log(torch.sigmoid(clamped)) + (clamped - z)


def _dpo_loss(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels, n_pairs):
    adapters = list(lora_modules(self).values())
    for adapter in adapters:  # the frozen base: the reference model
        adapter.adapter_enabled = False
    try:
        ref_chosen = completion_logp(self, chosen_ids, chosen_labels)
        ref_rejected = completion_logp(self, rejected_ids, rejected_labels)
    finally:
        for adapter in adapters:
            adapter.adapter_enabled = True
    margin = (completion_logp(self, chosen_ids, chosen_labels) - ref_chosen) - \
        (completion_logp(self, rejected_ids, rejected_labels) - ref_rejected)
    return negative_log_sigmoid(self.dpo_beta * margin) / n_pairs


def with_dpo_loss(model: nn.Module, beta: float = DEFAULT_BETA) -> nn.Module:
    """A copy of a token model (LoRA adapters inserted) whose `loss` is DPO's (module docstring)."""
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"DPO's beta must be a finite number > 0, got {beta!r}")
    if not lora_modules(model):
        raise ValueError("DPO trains LoRA adapters over a frozen base (the reference): call vktrain.lora.apply_lora "
                         "first")
    model = copy.deepcopy(model)
    model.dpo_beta = float(beta)
    model.loss = types.MethodType(_dpo_loss, model)
    return model


def example_dpo_inputs(seq_len: int, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """contract.DPO_INPUTS' example tensors (the loss's parameters, in that order): one pair of [1, S]
    rows, n_pairs 1."""
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab_size, (1, seq_len), generator=generator) for _ in range(4)]
    return ids[0], ids[1], ids[2], ids[3], torch.ones((), dtype=torch.float32)


__all__ = ["DEFAULT_BETA", "completion_logp", "example_dpo_inputs", "negative_log_sigmoid",
           "with_dpo_loss"]

"""vktrain's training ops (torch.library namespace `vktrain`). Importing this package registers them all.

Schemas (docs/CONTRACTS.md; each also has an `.out` overload for ExecuTorch):
    linear_q4gsw(Tensor x, Tensor weights, Tensor scales, int group_size, Tensor? bias=None) -> Tensor
    linear_q4gsw_backward(Tensor d_out, Tensor weights, Tensor scales, int group_size) -> Tensor
    linear_dW(Tensor d_out, Tensor x) -> Tensor
    lora_linear_q4gsw(Tensor x, Tensor lora_A, Tensor lora_B, float scaling, Tensor base_x, Tensor weights,
                      Tensor scales, int group_size, Tensor? bias=None) -> Tensor
    lora_linear_q4gsw_backward(Tensor d_out, Tensor x, Tensor lora_A, Tensor lora_B, float scaling,
                               Tensor weights, Tensor scales, int group_size)
        -> (Tensor d_x, Tensor d_lora_A, Tensor d_lora_B, Tensor d_base_x)
    q4gsw_requant(Tensor latent, Tensor scales, int group_size) -> Tensor
    fused_ce(Tensor logits, Tensor labels, Tensor n_valid) -> (Tensor loss, Tensor dlogits)
    adamw(Tensor param, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, Tensor hparams, Tensor step)
        -> (Tensor param, Tensor exp_avg, Tensor exp_avg_sq)

The schemas, argument dtypes and shape rules are the torch-free op definitions (vktrain/opdefs); this
package registers each from its definition plus a CPU reference (vktrain/ops/_library.py `define_op`).

Transformer ops (Llama family, vktrain/ops/transformer.py; listed in TRANSFORMER_OP_NAMES):
    rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)
    rms_norm_backward(Tensor d_y, Tensor x, Tensor weight, Tensor rstd) -> Tensor
    rope(Tensor x, Tensor cos, Tensor sin) -> Tensor
    causal_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? positions=None) -> (Tensor out, Tensor lse)
    causal_attention_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale,
                              Tensor? positions=None) -> (Tensor d_q, Tensor d_k, Tensor d_v)
    swiglu(Tensor gate, Tensor up) -> Tensor
    swiglu_backward(Tensor d_h, Tensor gate, Tensor up) -> (Tensor d_gate, Tensor d_up)

The functions below are thin wrappers over torch.ops.vktrain.<op>, so they trace and export as the op.
"""
from __future__ import annotations

import torch

from vktrain import contract

from . import (cross_entropy, decode, gemm, linear, lora_linear, optimizer, q8_0,  # noqa: F401  (registers the ops)
               transformer)
from ._library import NAMESPACE
from .linear import dequantize_q4gsw, quantize_q4gsw

OP_NAMES = ("linear_q4gsw", "linear_q4gsw_backward", "linear_dW", "q4gsw_requant", "fused_ce", "adamw")
TRANSFORMER_OP_NAMES = ("rms_norm", "rms_norm_backward", "rope", "causal_attention", "causal_attention_backward",
                        "swiglu", "swiglu_backward")


def linear_q4gsw(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ deq(W).T (+ bias) -> [..., N]; differentiable in x and bias."""
    return torch.ops.vktrain.linear_q4gsw(x, weights, scales, group_size, bias)


def linear_q4gsw_backward(d_out: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """d_out[..., N] @ deq(W) -> d_x [..., K]."""
    return torch.ops.vktrain.linear_q4gsw_backward(d_out, weights, scales, group_size)


def linear_dW(d_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d_out.reshape(-1, N).T @ x.reshape(-1, K) -> dense dW [N, K]."""
    return torch.ops.vktrain.linear_dW(d_out, x)


def q4gsw_requant(latent: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Re-quantize a float latent [N, K] on fixed scales [G, N] -> flat uint8 weights [N, Kp/2]."""
    return torch.ops.vktrain.q4gsw_requant(latent, scales, group_size)


def fused_ce(logits: torch.Tensor, labels: torch.Tensor,
             n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [], dlogits [R, V]) of cross-entropy summed over rows with label >= 0, divided by n_valid."""
    return torch.ops.vktrain.fused_ce(logits, labels, n_valid)


def adamw(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
          hparams: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW update; returns new (param, exp_avg, exp_avg_sq) and leaves the inputs untouched."""
    return torch.ops.vktrain.adamw(param, exp_avg, exp_avg_sq, grad, hparams, step)


_DEFAULTS = contract.ADAMW_DEFAULTS


def adamw_hparams(lr: float, beta1: float = _DEFAULTS["beta1"], beta2: float = _DEFAULTS["beta2"],
                  eps: float = _DEFAULTS["eps"], weight_decay: float = _DEFAULTS["weight_decay"]) -> torch.Tensor:
    """The float32 hparams tensor adamw takes (vktrain.contract.HPARAM_NAMES; defaults are
    torch.optim.AdamW's, contract.ADAMW_DEFAULTS)."""
    return torch.tensor(contract.hparams_values(lr, beta1, beta2, eps, weight_decay), dtype=torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd [..., 1]) with rstd = 1/sqrt(mean(x^2, last dim) + eps), y = x * rstd * weight;
    differentiable in x only (the weight must not require grad)."""
    return torch.ops.vktrain.rms_norm(x, weight, eps)


def rms_norm_backward(d_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> torch.Tensor:
    """d_x of rms_norm, from its saved rstd."""
    return torch.ops.vktrain.rms_norm_backward(d_y, x, weight, rstd)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, S, H, D] with tables cos/sin [S, D/2] (or [B, S, D/2], per token), pairing
    (i, i + D/2) ("rotate half")."""
    return torch.ops.vktrain.rope(x, cos, sin)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, Hq, D], lse [B, Hq, S]) of causal softmax(scale * q k^T) v; k/v [B, S, Hkv, D] (GQA).
    `positions` [B, S] (packed documents): each token's position in its document; query i then sees
    keys i - positions[i] .. i only."""
    return torch.ops.vktrain.causal_attention(q, k, v, scale, positions)


def causal_attention_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, scale: float,
                              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_q, d_k, d_v) of causal_attention, rebuilding the probabilities from lse (flash-attention style)."""
    return torch.ops.vktrain.causal_attention_backward(d_out, q, k, v, out, lse, scale, positions)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return torch.ops.vktrain.swiglu(gate, up)


def swiglu_backward(d_h: torch.Tensor, gate: torch.Tensor,
                    up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of swiglu."""
    return torch.ops.vktrain.swiglu_backward(d_h, gate, up)


__all__ = [
    "NAMESPACE", "OP_NAMES", "TRANSFORMER_OP_NAMES", "adamw", "adamw_hparams", "dequantize_q4gsw", "fused_ce",
    "linear_dW", "linear_q4gsw", "linear_q4gsw_backward", "q4gsw_requant", "quantize_q4gsw",
    "causal_attention", "causal_attention_backward", "rms_norm", "rms_norm_backward", "rope", "swiglu",
    "swiglu_backward",
]

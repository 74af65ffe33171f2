"""Fused transformer ops of the Llama family (docs/CONTRACTS.md, "Transformer ops").

    rms_norm(x[..., D], weight[D], eps) -> (y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps) [..., 1])
    rms_norm_backward(d_y, x, weight, rstd) -> d_x
    rope(x[B, S, H, D], cos[S, D/2] or [B, S, D/2], sin alike) -> "rotate half" rotation of the pairs (i, i + D/2)
    causal_attention(q[B, S, Hq, D], k[B, S, Hkv, D], v[B, S, Hkv, D], scale, positions[B, S] or None)
        -> (out[B, S, Hq, D], lse[B, Hq, S])
    causal_attention_backward(d_out, q, k, v, out, lse, scale, positions) -> (d_q, d_k, d_v)

Packed documents: with `positions` (each token's position in its document, 0 at a document's first
token), query i attends to keys j with i - positions[i] <= j <= i only, its own document's past.
    swiglu(gate, up) -> silu(gate) * up
    swiglu_backward(d_h, gate, up) -> (d_gate, d_up)

Each forward op differentiates through its own backward op, so a joint graph from
`_export_forward_backward` holds one backward node per forward node (rope's backward is rope itself with
-sin). The CPU references here define the ops; they may materialise the [B, H, S, S] attention scores,
GPU kernels may not. Norm weights and the rotary tables are frozen: autograd refuses them when they
require grad instead of silently dropping their gradient. Schemas and shape rules are the op definitions
(vktrain/opdefs/vktrain_ops.py); `define_op` derives the `.out` and fake kernels from them.
"""
from __future__ import annotations

import torch

from ._library import define_op


# ---- rms_norm ----------------------------------------------------------------------------------------

def _rms_norm_cpu(x, weight, eps):
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    y = x * rstd * weight
    return y.contiguous(), rstd.contiguous()


define_op("rms_norm", _rms_norm_cpu)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    if weight.requires_grad:
        raise RuntimeError(
            "vktrain.rms_norm has no gradient for its weight (norm weights are frozen in LoRA training), but "
            "weight requires grad; freeze it first (weight.requires_grad_(False))")
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_autograd_backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.vktrain.rms_norm_backward(grad_y, x, weight, rstd)
    return grad_x, None, None


torch.library.register_autograd(
    "vktrain::rms_norm", _rms_norm_autograd_backward, setup_context=_rms_norm_setup_context)


# ---- rms_norm_backward -------------------------------------------------------------------------------

def _rms_norm_backward_cpu(d_y, x, weight, rstd):
    # y = x * r * w with r = (mean(x^2) + eps)^-1/2 and dr/dx_j = -r^3 x_j / D, so with g = d_y * w:
    # d_x = r * (g - x * r^2 * mean(g * x)).
    g = d_y * weight
    d_x = rstd * (g - x * rstd.square() * (g * x).mean(dim=-1, keepdim=True))
    return d_x.contiguous()


define_op("rms_norm_backward", _rms_norm_backward_cpu)


# ---- rope --------------------------------------------------------------------------------------------

def _rope_cpu(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # [S, D/2] -> [S, 1, D/2]: one angle per position and frequency, shared by every batch row and head
    # ([B, S, D/2] -> [B, S, 1, D/2]: per token).
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


define_op("rope", _rope_cpu)


def _rope_setup_context(ctx, inputs, output):
    _, cos, sin = inputs
    if cos.requires_grad or sin.requires_grad:
        raise RuntimeError(
            "vktrain.rope has no gradient for its cos/sin tables (they are fixed functions of the positions), "
            "but cos or sin requires grad; pass them detached")
    ctx.save_for_backward(cos, sin)


def _rope_autograd_backward(ctx, grad_y):
    # The rotation by angle a is orthogonal; its transpose is the rotation by -a: cos stays, sin flips.
    cos, sin = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.vktrain.rope(grad_y, cos, torch.neg(sin))
    return grad_x, None, None


torch.library.register_autograd("vktrain::rope", _rope_autograd_backward, setup_context=_rope_setup_context)


# ---- causal_attention --------------------------------------------------------------------------------

def _heads_first(x, repeats):
    """[B, S, H, D] -> [B, H * repeats, S, D], each head repeated `repeats` times in a row (GQA's mapping
    query head h -> kv head h // repeats)."""
    x = x.permute(0, 2, 1, 3)
    return x.repeat_interleave(repeats, dim=1) if repeats > 1 else x


def hidden_keys(seq_len, positions=None, device=None):
    """bool [S, S] (or [B, 1, S, S] with positions [B, S]): True where query i may not see key j, i.e.
    j > i, or (packed documents) j < i - positions[i], before the query's document starts."""
    index = torch.arange(seq_len, device=device)
    future = index[None, :] > index[:, None]
    if positions is None:
        return future
    start = index[None, :] - positions.to(device=device, dtype=index.dtype)  # [B, S]: each query's first key
    return (future[None] | (index[None, None, :] < start[:, :, None]))[:, None]


def _masked_scores(q_heads_first, k_heads_first, scale, positions=None):
    """scale * q k^T [B, Hq, S, S] with -inf where the key is hidden from the query (hidden_keys)."""
    scores = scale * torch.matmul(q_heads_first, k_heads_first.transpose(-1, -2))
    return scores.masked_fill(hidden_keys(scores.shape[-1], positions, scores.device), float("-inf"))


def _causal_attention_cpu(q, k, v, scale, positions=None):
    group = q.shape[2] // k.shape[2]
    scores = _masked_scores(_heads_first(q, 1), _heads_first(k, group), scale, positions)
    lse = torch.logsumexp(scores, dim=-1)  # the diagonal is never masked, so lse is finite
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, _heads_first(v, group))  # [B, Hq, S, D]
    return out.permute(0, 2, 1, 3).contiguous(), lse.contiguous()


define_op("causal_attention", _causal_attention_cpu)


def _causal_attention_setup_context(ctx, inputs, output):
    q, k, v, scale, positions = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, positions)
    ctx.scale = scale


def _causal_attention_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, positions = ctx.saved_tensors
    d_q, d_k, d_v = torch.ops.vktrain.causal_attention_backward(grad_out, q, k, v, out, lse, ctx.scale, positions)
    needs = ctx.needs_input_grad
    return (d_q if needs[0] else None), (d_k if needs[1] else None), (d_v if needs[2] else None), None, None


torch.library.register_autograd(
    "vktrain::causal_attention", _causal_attention_autograd_backward,
    setup_context=_causal_attention_setup_context)


# ---- causal_attention_backward -----------------------------------------------------------------------

def _sum_query_groups(grad_heads_first, kv_heads):
    """[B, Hq, S, D] -> [B, S, Hkv, D]: each kv head's gradient is the sum over the query heads reading it."""
    batch, q_heads, seq_len, head_dim = grad_heads_first.shape
    grouped = grad_heads_first.reshape(batch, kv_heads, q_heads // kv_heads, seq_len, head_dim).sum(dim=2)
    return grouped.permute(0, 2, 1, 3).contiguous()


def _causal_attention_backward_cpu(d_out, q, k, v, out, lse, scale, positions=None):
    q_heads, kv_heads = q.shape[2], k.shape[2]
    group = q_heads // kv_heads
    q_h, k_h, v_h = _heads_first(q, 1), _heads_first(k, group), _heads_first(v, group)
    d_out_h, out_h = _heads_first(d_out, 1), _heads_first(out, 1)
    # Flash-attention backward: the probabilities are rebuilt from lse rather than stored, and
    # softmax's Jacobian is applied through delta = rowsum(d_out * out) = rowsum(P * dP).
    probs = torch.exp(_masked_scores(q_h, k_h, scale, positions) - lse[..., None])
    d_v_h = torch.matmul(probs.transpose(-1, -2), d_out_h)
    d_probs = torch.matmul(d_out_h, v_h.transpose(-1, -2))
    delta = (d_out_h * out_h).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - delta)
    d_q_h = scale * torch.matmul(d_scores, k_h)
    d_k_h = scale * torch.matmul(d_scores.transpose(-1, -2), q_h)
    d_q = d_q_h.permute(0, 2, 1, 3).contiguous()
    return d_q, _sum_query_groups(d_k_h, kv_heads), _sum_query_groups(d_v_h, kv_heads)


define_op("causal_attention_backward", _causal_attention_backward_cpu)


# ---- swiglu ------------------------------------------------------------------------------------------

def _swiglu_cpu(gate, up):
    return (torch.nn.functional.silu(gate) * up).contiguous()


define_op("swiglu", _swiglu_cpu)


def _swiglu_setup_context(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _swiglu_autograd_backward(ctx, grad_h):
    gate, up = ctx.saved_tensors
    d_gate, d_up = torch.ops.vktrain.swiglu_backward(grad_h, gate, up)
    needs = ctx.needs_input_grad
    return (d_gate if needs[0] else None), (d_up if needs[1] else None)


torch.library.register_autograd("vktrain::swiglu", _swiglu_autograd_backward, setup_context=_swiglu_setup_context)


# ---- swiglu_backward ---------------------------------------------------------------------------------

def _swiglu_backward_cpu(d_h, gate, up):
    sig = torch.sigmoid(gate)
    # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))
    d_up = d_h * gate * sig
    return d_gate.contiguous(), d_up.contiguous()


define_op("swiglu_backward", _swiglu_backward_cpu)

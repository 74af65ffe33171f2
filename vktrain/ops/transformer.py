"""Fused transformer ops of the Llama family (docs/CONTRACTS.md, "Transformer ops").

    rms_norm(x[..., D], weight[D], eps) -> (y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps) [..., 1])
    rms_norm_backward(d_y, x, weight, rstd) -> d_x
    rope(x[B, S, H, D], cos[S, D/2], sin[S, D/2]) -> "rotate half" rotation of the pairs (i, i + D/2)
    causal_attention(q[B, S, Hq, D], k[B, S, Hkv, D], v[B, S, Hkv, D], scale) -> (out[B, S, Hq, D], lse[B, Hq, S])
    causal_attention_backward(d_out, q, k, v, out, lse, scale) -> (d_q, d_k, d_v)
    swiglu(gate, up) -> silu(gate) * up
    swiglu_backward(d_h, gate, up) -> (d_gate, d_up)

Each forward op differentiates through its own backward op, so a joint graph from
`_export_forward_backward` holds one backward node per forward node (rope's backward is rope itself with
-sin). The CPU references here define the ops; they may materialise the [B, H, S, S] attention scores,
GPU kernels may not. Norm weights and the rotary tables are frozen: autograd refuses them when they
require grad instead of silently dropping their gradient.
"""
from __future__ import annotations

import math

import torch

from ._library import check_out_like, define_op_pair, write_out
from ._validation import FLOAT_DTYPES, check_dtype, check_ndim, check_same_dtype


def _check_same_shape(tensor, name, reference, reference_name):
    if tuple(tensor.shape) != tuple(reference.shape):
        raise ValueError(
            f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(tensor.shape)}")


def _check_float_arg(value, name, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float ({what}), got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite ({what}), got {value}")


# ---- rms_norm ----------------------------------------------------------------------------------------

def _check_rms_norm(x, weight, eps):
    check_dtype(x, "x", FLOAT_DTYPES)
    check_dtype(weight, "weight", FLOAT_DTYPES)
    check_same_dtype(weight, "weight", x, "x")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim [..., D] (normalised over the last), got shape {tuple(x.shape)}")
    check_ndim(weight, "weight", 1, f"[D] = [{x.shape[-1]}] (one gain per feature of x's last dim)")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape [D] = [{x.shape[-1]}] to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    _check_float_arg(eps, "eps", "added to mean(x^2) before the square root")
    if eps < 0:
        raise ValueError(f"eps must be >= 0 (added to mean(x^2) before the square root), got {eps}")


def _rms_norm_cpu(x, weight, eps):
    _check_rms_norm(x, weight, eps)
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    y = x * rstd * weight
    return y.contiguous(), rstd.contiguous()


def _rms_norm_fake(x, weight, eps):
    _check_rms_norm(x, weight, eps)
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], 1))


def _rms_norm_out_cpu(x, weight, eps, *, y_out, rstd_out):
    y, rstd = _rms_norm_cpu(x, weight, eps)
    return write_out(y_out, y, "y_out"), write_out(rstd_out, rstd, "rstd_out")


def _rms_norm_out_fake(x, weight, eps, *, y_out, rstd_out):
    y, rstd = _rms_norm_fake(x, weight, eps)
    return check_out_like(y_out, y, "y_out"), check_out_like(rstd_out, rstd, "rstd_out")


define_op_pair(
    "rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)",
    "rms_norm.out(Tensor x, Tensor weight, float eps, *, Tensor(a!) y_out, Tensor(b!) rstd_out) "
    "-> (Tensor(a!), Tensor(b!))",
    _rms_norm_cpu, _rms_norm_out_cpu, _rms_norm_fake, _rms_norm_out_fake,
)


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

def _check_rms_norm_backward(d_y, x, weight, rstd):
    _check_rms_norm(x, weight, 0.0)
    check_dtype(d_y, "d_y", FLOAT_DTYPES)
    check_same_dtype(d_y, "d_y", x, "x")
    _check_same_shape(d_y, "d_y", x, "x")
    check_dtype(rstd, "rstd", FLOAT_DTYPES)
    check_same_dtype(rstd, "rstd", x, "x")
    expected = (*x.shape[:-1], 1)
    if tuple(rstd.shape) != tuple(expected):
        raise ValueError(
            f"rstd must have shape [..., 1] = {list(expected)} (rms_norm's second output for x "
            f"{tuple(x.shape)}), got {tuple(rstd.shape)}")


def _rms_norm_backward_cpu(d_y, x, weight, rstd):
    _check_rms_norm_backward(d_y, x, weight, rstd)
    # y = x * r * w with r = (mean(x^2) + eps)^-1/2 and dr/dx_j = -r^3 x_j / D, so with g = d_y * w:
    # d_x = r * (g - x * r^2 * mean(g * x)).
    g = d_y * weight
    d_x = rstd * (g - x * rstd.square() * (g * x).mean(dim=-1, keepdim=True))
    return d_x.contiguous()


def _rms_norm_backward_fake(d_y, x, weight, rstd):
    _check_rms_norm_backward(d_y, x, weight, rstd)
    return x.new_empty(x.shape)


def _rms_norm_backward_out_cpu(d_y, x, weight, rstd, *, out):
    return write_out(out, _rms_norm_backward_cpu(d_y, x, weight, rstd), "out")


def _rms_norm_backward_out_fake(d_y, x, weight, rstd, *, out):
    return check_out_like(out, _rms_norm_backward_fake(d_y, x, weight, rstd), "out")


define_op_pair(
    "rms_norm_backward(Tensor d_y, Tensor x, Tensor weight, Tensor rstd) -> Tensor",
    "rms_norm_backward.out(Tensor d_y, Tensor x, Tensor weight, Tensor rstd, *, Tensor(a!) out) -> Tensor(a!)",
    _rms_norm_backward_cpu, _rms_norm_backward_out_cpu, _rms_norm_backward_fake, _rms_norm_backward_out_fake,
)


# ---- rope --------------------------------------------------------------------------------------------

def _check_rope(x, cos, sin):
    check_dtype(x, "x", FLOAT_DTYPES)
    check_ndim(x, "x", 4, "[B, S, H, D] (batch, sequence, heads, head dim)")
    _, seq_len, _, head_dim = x.shape
    if head_dim % 2 != 0:
        raise ValueError(f"x's head dim D must be even (rope rotates the pairs (i, i + D/2)), got D={head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_dtype(table, name, FLOAT_DTYPES)
        check_same_dtype(table, name, x, "x")
        if tuple(table.shape) != (seq_len, head_dim // 2):
            raise ValueError(
                f"{name} must have shape [S, D/2] = [{seq_len}, {head_dim // 2}] for x [B, S, H, D] = "
                f"{list(x.shape)}, got {tuple(table.shape)}")


def _rope_cpu(x, cos, sin):
    _check_rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # [S, D/2] -> [S, 1, D/2]: one angle per position and frequency, shared by every batch row and head.
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_fake(x, cos, sin):
    _check_rope(x, cos, sin)
    return x.new_empty(x.shape)


def _rope_out_cpu(x, cos, sin, *, out):
    return write_out(out, _rope_cpu(x, cos, sin), "out")


def _rope_out_fake(x, cos, sin, *, out):
    return check_out_like(out, _rope_fake(x, cos, sin), "out")


define_op_pair(
    "rope(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "rope.out(Tensor x, Tensor cos, Tensor sin, *, Tensor(a!) out) -> Tensor(a!)",
    _rope_cpu, _rope_out_cpu, _rope_fake, _rope_out_fake,
)


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

def _check_causal_attention(q, k, v, scale):
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_dtype(tensor, name, FLOAT_DTYPES)
        heads = "Hq" if name == "q" else "Hkv"
        check_ndim(tensor, name, 4, f"[B, S, {heads}, D] (batch, sequence, heads, head dim)")
    check_same_dtype(k, "k", q, "q")
    check_same_dtype(v, "v", q, "q")
    _check_same_shape(v, "v", k, "k")
    batch, seq_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k and v must have shape [B, S, Hkv, D] with B, S, D of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of kv heads (grouped-query attention), "
            f"got Hq={q_heads} (q {tuple(q.shape)}) and Hkv={kv_heads} (k {tuple(k.shape)})")
    _check_float_arg(scale, "scale", "the factor applied to q k^T, usually 1/sqrt(D)")
    return batch, seq_len, q_heads, kv_heads


def _heads_first(x, repeats):
    """[B, S, H, D] -> [B, H * repeats, S, D], each head repeated `repeats` times in a row (GQA's mapping
    query head h -> kv head h // repeats)."""
    x = x.permute(0, 2, 1, 3)
    return x.repeat_interleave(repeats, dim=1) if repeats > 1 else x


def _masked_scores(q_heads_first, k_heads_first, scale):
    """scale * q k^T [B, Hq, S, S] with -inf above the diagonal (key position > query position)."""
    scores = scale * torch.matmul(q_heads_first, k_heads_first.transpose(-1, -2))
    seq_len = scores.shape[-1]
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=scores.device).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf"))


def _causal_attention_cpu(q, k, v, scale):
    _, _, q_heads, kv_heads = _check_causal_attention(q, k, v, scale)
    group = q_heads // kv_heads
    scores = _masked_scores(_heads_first(q, 1), _heads_first(k, group), scale)
    lse = torch.logsumexp(scores, dim=-1)  # the diagonal is never masked, so lse is finite
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, _heads_first(v, group))  # [B, Hq, S, D]
    return out.permute(0, 2, 1, 3).contiguous(), lse.contiguous()


def _causal_attention_fake(q, k, v, scale):
    batch, seq_len, q_heads, _ = _check_causal_attention(q, k, v, scale)
    return q.new_empty(q.shape), q.new_empty((batch, q_heads, seq_len))


def _causal_attention_out_cpu(q, k, v, scale, *, out_out, lse_out):
    out, lse = _causal_attention_cpu(q, k, v, scale)
    return write_out(out_out, out, "out_out"), write_out(lse_out, lse, "lse_out")


def _causal_attention_out_fake(q, k, v, scale, *, out_out, lse_out):
    out, lse = _causal_attention_fake(q, k, v, scale)
    return check_out_like(out_out, out, "out_out"), check_out_like(lse_out, lse, "lse_out")


define_op_pair(
    "causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor out, Tensor lse)",
    "causal_attention.out(Tensor q, Tensor k, Tensor v, float scale, *, Tensor(a!) out_out, Tensor(b!) lse_out) "
    "-> (Tensor(a!), Tensor(b!))",
    _causal_attention_cpu, _causal_attention_out_cpu, _causal_attention_fake, _causal_attention_out_fake,
)


def _causal_attention_setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _causal_attention_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    d_q, d_k, d_v = torch.ops.vktrain.causal_attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
    needs = ctx.needs_input_grad
    return (d_q if needs[0] else None), (d_k if needs[1] else None), (d_v if needs[2] else None), None


torch.library.register_autograd(
    "vktrain::causal_attention", _causal_attention_autograd_backward,
    setup_context=_causal_attention_setup_context)


# ---- causal_attention_backward -----------------------------------------------------------------------

def _check_causal_attention_backward(d_out, q, k, v, out, lse, scale):
    batch, seq_len, q_heads, kv_heads = _check_causal_attention(q, k, v, scale)
    for name, tensor in (("d_out", d_out), ("out", out)):
        check_dtype(tensor, name, FLOAT_DTYPES)
        check_same_dtype(tensor, name, q, "q")
        _check_same_shape(tensor, name, q, "q")
    check_dtype(lse, "lse", FLOAT_DTYPES)
    check_same_dtype(lse, "lse", q, "q")
    if tuple(lse.shape) != (batch, q_heads, seq_len):
        raise ValueError(
            f"lse must have shape [B, Hq, S] = {[batch, q_heads, seq_len]} (causal_attention's second output "
            f"for q {tuple(q.shape)}), got {tuple(lse.shape)}")
    return batch, seq_len, q_heads, kv_heads


def _sum_query_groups(grad_heads_first, kv_heads):
    """[B, Hq, S, D] -> [B, S, Hkv, D]: each kv head's gradient is the sum over the query heads reading it."""
    batch, q_heads, seq_len, head_dim = grad_heads_first.shape
    grouped = grad_heads_first.reshape(batch, kv_heads, q_heads // kv_heads, seq_len, head_dim).sum(dim=2)
    return grouped.permute(0, 2, 1, 3).contiguous()


def _causal_attention_backward_cpu(d_out, q, k, v, out, lse, scale):
    _, _, q_heads, kv_heads = _check_causal_attention_backward(d_out, q, k, v, out, lse, scale)
    group = q_heads // kv_heads
    q_h, k_h, v_h = _heads_first(q, 1), _heads_first(k, group), _heads_first(v, group)
    d_out_h, out_h = _heads_first(d_out, 1), _heads_first(out, 1)
    # Flash-attention backward: the probabilities are rebuilt from lse rather than stored, and
    # softmax's Jacobian is applied through delta = rowsum(d_out * out) = rowsum(P * dP).
    probs = torch.exp(_masked_scores(q_h, k_h, scale) - lse[..., None])
    d_v_h = torch.matmul(probs.transpose(-1, -2), d_out_h)
    d_probs = torch.matmul(d_out_h, v_h.transpose(-1, -2))
    delta = (d_out_h * out_h).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - delta)
    d_q_h = scale * torch.matmul(d_scores, k_h)
    d_k_h = scale * torch.matmul(d_scores.transpose(-1, -2), q_h)
    d_q = d_q_h.permute(0, 2, 1, 3).contiguous()
    return d_q, _sum_query_groups(d_k_h, kv_heads), _sum_query_groups(d_v_h, kv_heads)


def _causal_attention_backward_fake(d_out, q, k, v, out, lse, scale):
    _check_causal_attention_backward(d_out, q, k, v, out, lse, scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _causal_attention_backward_out_cpu(d_out, q, k, v, out, lse, scale, *, d_q_out, d_k_out, d_v_out):
    d_q, d_k, d_v = _causal_attention_backward_cpu(d_out, q, k, v, out, lse, scale)
    return (write_out(d_q_out, d_q, "d_q_out"), write_out(d_k_out, d_k, "d_k_out"),
            write_out(d_v_out, d_v, "d_v_out"))


def _causal_attention_backward_out_fake(d_out, q, k, v, out, lse, scale, *, d_q_out, d_k_out, d_v_out):
    d_q, d_k, d_v = _causal_attention_backward_fake(d_out, q, k, v, out, lse, scale)
    return (check_out_like(d_q_out, d_q, "d_q_out"), check_out_like(d_k_out, d_k, "d_k_out"),
            check_out_like(d_v_out, d_v, "d_v_out"))


define_op_pair(
    "causal_attention_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale) "
    "-> (Tensor d_q, Tensor d_k, Tensor d_v)",
    "causal_attention_backward.out(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "float scale, *, Tensor(a!) d_q_out, Tensor(b!) d_k_out, Tensor(c!) d_v_out) "
    "-> (Tensor(a!), Tensor(b!), Tensor(c!))",
    _causal_attention_backward_cpu, _causal_attention_backward_out_cpu,
    _causal_attention_backward_fake, _causal_attention_backward_out_fake,
)


# ---- swiglu ------------------------------------------------------------------------------------------

def _check_swiglu(gate, up):
    check_dtype(gate, "gate", FLOAT_DTYPES)
    check_dtype(up, "up", FLOAT_DTYPES)
    check_same_dtype(up, "up", gate, "gate")
    _check_same_shape(up, "up", gate, "gate")


def _swiglu_cpu(gate, up):
    _check_swiglu(gate, up)
    return (torch.nn.functional.silu(gate) * up).contiguous()


def _swiglu_fake(gate, up):
    _check_swiglu(gate, up)
    return gate.new_empty(gate.shape)


def _swiglu_out_cpu(gate, up, *, out):
    return write_out(out, _swiglu_cpu(gate, up), "out")


def _swiglu_out_fake(gate, up, *, out):
    return check_out_like(out, _swiglu_fake(gate, up), "out")


define_op_pair(
    "swiglu(Tensor gate, Tensor up) -> Tensor",
    "swiglu.out(Tensor gate, Tensor up, *, Tensor(a!) out) -> Tensor(a!)",
    _swiglu_cpu, _swiglu_out_cpu, _swiglu_fake, _swiglu_out_fake,
)


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

def _check_swiglu_backward(d_h, gate, up):
    _check_swiglu(gate, up)
    check_dtype(d_h, "d_h", FLOAT_DTYPES)
    check_same_dtype(d_h, "d_h", gate, "gate")
    _check_same_shape(d_h, "d_h", gate, "gate")


def _swiglu_backward_cpu(d_h, gate, up):
    _check_swiglu_backward(d_h, gate, up)
    sig = torch.sigmoid(gate)
    # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))
    d_up = d_h * gate * sig
    return d_gate.contiguous(), d_up.contiguous()


def _swiglu_backward_fake(d_h, gate, up):
    _check_swiglu_backward(d_h, gate, up)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _swiglu_backward_out_cpu(d_h, gate, up, *, d_gate_out, d_up_out):
    d_gate, d_up = _swiglu_backward_cpu(d_h, gate, up)
    return write_out(d_gate_out, d_gate, "d_gate_out"), write_out(d_up_out, d_up, "d_up_out")


def _swiglu_backward_out_fake(d_h, gate, up, *, d_gate_out, d_up_out):
    d_gate, d_up = _swiglu_backward_fake(d_h, gate, up)
    return check_out_like(d_gate_out, d_gate, "d_gate_out"), check_out_like(d_up_out, d_up, "d_up_out")


define_op_pair(
    "swiglu_backward(Tensor d_h, Tensor gate, Tensor up) -> (Tensor d_gate, Tensor d_up)",
    "swiglu_backward.out(Tensor d_h, Tensor gate, Tensor up, *, Tensor(a!) d_gate_out, Tensor(b!) d_up_out) "
    "-> (Tensor(a!), Tensor(b!))",
    _swiglu_backward_cpu, _swiglu_backward_out_cpu, _swiglu_backward_fake, _swiglu_backward_out_fake,
)

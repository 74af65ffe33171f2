"""Linear ops through a q4gsw weight, the dense weight gradient, and straight-through re-quantization.

    linear_q4gsw(x[..., K], weights, scales, group_size, bias?) -> x @ deq(W).T (+ bias)   [..., N]
    linear_q4gsw_backward(d_out[..., N], weights, scales, group_size) -> d_out @ deq(W)   [..., K]
    linear_dW(d_out[..., N], x[..., K]) -> d_out.reshape(-1, N).T @ x.reshape(-1, K)       [N, K]
    q4gsw_requant(latent[N, K], scales, group_size) -> flat uint8 codes [N, Kp/2], usable as `weights`

deq(W) is formed once, in float32, exactly as vktrain.quant.dequantize defines it (q * scale), and the
matmul then runs in x's dtype. Autograd: linear_q4gsw differentiates x (through linear_q4gsw_backward)
and bias only; the quantized weight is frozen.
"""
from __future__ import annotations

import torch

from vktrain import quant

from vktrain.opdefs.vktrain_ops import q4gsw_weight_dims

from ._library import define_op, tensor_meta


def dequantize_q4gsw(weights: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """deq(W) float32 [N, K] from flat uint8 codes [N, Kp/2] and scales [G, N]."""
    q4gsw_weight_dims(tensor_meta(weights), tensor_meta(scales), group_size)
    deq = quant.dequantize(weights.detach().cpu().numpy(), scales.detach().cpu().numpy(), group_size)
    return torch.from_numpy(deq)


def quantize_q4gsw(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight [N, K] -> (flat uint8 weights [N, Kp/2], float32 scales [G, N])."""
    flat, scales = quant.quantize(weight.detach().cpu().to(torch.float32).numpy(), group_size)
    return torch.from_numpy(flat), torch.from_numpy(scales)


# ---- linear_q4gsw ---------------------------------------------------------------------------------

def _linear_q4gsw_cpu(x, weights, scales, group_size, bias=None):
    deq = dequantize_q4gsw(weights, scales, group_size).to(x.dtype)
    y = torch.matmul(x, deq.T)
    if bias is not None:
        y = y + bias
    return y


define_op("linear_q4gsw", _linear_q4gsw_cpu)


def _linear_q4gsw_setup_context(ctx, inputs, output):
    _, weights, scales, group_size, bias = inputs
    ctx.save_for_backward(weights, scales)
    ctx.group_size = group_size
    ctx.num_out_features = scales.shape[1]


def _linear_q4gsw_autograd_backward(ctx, grad_out):
    weights, scales = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.vktrain.linear_q4gsw_backward(grad_out, weights, scales, ctx.group_size)
    # The dispatcher drops arguments equal to their default, so without a bias there are only 4 entries.
    if len(ctx.needs_input_grad) > 4 and ctx.needs_input_grad[4]:
        grad_bias = grad_out.reshape(-1, ctx.num_out_features).sum(dim=0)
    # weights (uint8 codes), scales and group_size are frozen / non-differentiable.
    return grad_x, None, None, None, grad_bias


torch.library.register_autograd(
    "vktrain::linear_q4gsw", _linear_q4gsw_autograd_backward, setup_context=_linear_q4gsw_setup_context)


# ---- linear_q4gsw_backward ------------------------------------------------------------------------

def _linear_q4gsw_backward_cpu(d_out, weights, scales, group_size):
    deq = dequantize_q4gsw(weights, scales, group_size).to(d_out.dtype)
    return torch.matmul(d_out, deq)


define_op("linear_q4gsw_backward", _linear_q4gsw_backward_cpu)


def _linear_q4gsw_backward_setup_context(ctx, inputs, output):
    _, weights, scales, group_size = inputs
    ctx.save_for_backward(weights, scales)
    ctx.group_size = group_size


def _linear_q4gsw_backward_autograd_backward(ctx, grad_d_x):
    # d_x = d_out @ deq(W) is linear in d_out, so its adjoint is the forward op (double backward).
    weights, scales = ctx.saved_tensors
    grad_d_out = None
    if ctx.needs_input_grad[0]:
        grad_d_out = torch.ops.vktrain.linear_q4gsw(grad_d_x, weights, scales, ctx.group_size)
    return grad_d_out, None, None, None


torch.library.register_autograd(
    "vktrain::linear_q4gsw_backward", _linear_q4gsw_backward_autograd_backward,
    setup_context=_linear_q4gsw_backward_setup_context)


# ---- linear_dW -------------------------------------------------------------------------------------

def _linear_dW_cpu(d_out, x):
    N, K = d_out.shape[-1], x.shape[-1]
    return d_out.reshape(-1, N).T @ x.reshape(-1, K)


define_op("linear_dW", _linear_dW_cpu)


def _linear_dW_setup_context(ctx, inputs, output):
    d_out, x = inputs
    ctx.save_for_backward(d_out, x)


def _linear_dW_autograd_backward(ctx, grad_dW):
    # dW = D.T @ X with D, X the row-flattened inputs: dL/dD = X @ G.T, dL/dX = D @ G.
    d_out, x = ctx.saved_tensors
    N, K = grad_dW.shape
    grad_d_out = grad_x = None
    if ctx.needs_input_grad[0]:
        grad_d_out = (x.reshape(-1, K) @ grad_dW.T).reshape(d_out.shape)
    if ctx.needs_input_grad[1]:
        grad_x = (d_out.reshape(-1, N) @ grad_dW).reshape(x.shape)
    return grad_d_out, grad_x


torch.library.register_autograd(
    "vktrain::linear_dW", _linear_dW_autograd_backward, setup_context=_linear_dW_setup_context)


# ---- q4gsw_requant ---------------------------------------------------------------------------------

def _q4gsw_requant_cpu(latent, scales, group_size):
    # NaN has no code; +-inf is well defined (clamped), so only NaN is refused.
    if torch.isnan(latent).any():
        raise ValueError("latent contains NaN; cannot re-quantize it to 4-bit codes")
    if torch.isnan(scales).any():
        raise ValueError("scales contain NaN; cannot re-quantize with them")
    codes = quant.requant(latent.detach().numpy(), scales.detach().numpy(), group_size)
    return torch.from_numpy(quant.pack_flat(codes))


define_op("q4gsw_requant", _q4gsw_requant_cpu)

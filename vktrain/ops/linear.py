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

from ._library import check_out_like, define_op_pair, write_out
from ._validation import FLOAT_DTYPES, check_dtype, check_last_dim, check_ndim, check_q4gsw_weights, check_same_dtype


def dequantize_q4gsw(weights: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """deq(W) float32 [N, K] from flat uint8 codes [N, Kp/2] and scales [G, N]."""
    check_q4gsw_weights(weights, scales, group_size)
    deq = quant.dequantize(weights.detach().cpu().numpy(), scales.detach().cpu().numpy(), group_size)
    return torch.from_numpy(deq)


def quantize_q4gsw(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight [N, K] -> (flat uint8 weights [N, Kp/2], float32 scales [G, N])."""
    flat, scales = quant.quantize(weight.detach().cpu().to(torch.float32).numpy(), group_size)
    return torch.from_numpy(flat), torch.from_numpy(scales)


# ---- linear_q4gsw ---------------------------------------------------------------------------------

def _check_linear_q4gsw(x, weights, scales, group_size, bias):
    N, K = check_q4gsw_weights(weights, scales, group_size)
    check_dtype(x, "x", FLOAT_DTYPES)
    check_last_dim(x, "x", K, "K = in features = G * group_size")
    if bias is not None:
        check_dtype(bias, "bias", FLOAT_DTYPES)
        check_same_dtype(bias, "bias", x, "x")
        check_ndim(bias, "bias", 1, f"[N] = [{N}]")
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape [N] = [{N}], got {tuple(bias.shape)}")
    return N, K


def _linear_q4gsw_cpu(x, weights, scales, group_size, bias=None):
    _check_linear_q4gsw(x, weights, scales, group_size, bias)
    deq = dequantize_q4gsw(weights, scales, group_size).to(x.dtype)
    y = torch.matmul(x, deq.T)
    if bias is not None:
        y = y + bias
    return y


def _linear_q4gsw_fake(x, weights, scales, group_size, bias=None):
    N, _ = _check_linear_q4gsw(x, weights, scales, group_size, bias)
    return x.new_empty((*x.shape[:-1], N))


def _linear_q4gsw_out_cpu(x, weights, scales, group_size, bias=None, *, out):
    return write_out(out, _linear_q4gsw_cpu(x, weights, scales, group_size, bias), "out")


def _linear_q4gsw_out_fake(x, weights, scales, group_size, bias=None, *, out):
    return check_out_like(out, _linear_q4gsw_fake(x, weights, scales, group_size, bias), "out")


define_op_pair(
    "linear_q4gsw(Tensor x, Tensor weights, Tensor scales, int group_size, Tensor? bias=None) -> Tensor",
    "linear_q4gsw.out(Tensor x, Tensor weights, Tensor scales, int group_size, Tensor? bias=None, *, "
    "Tensor(a!) out) -> Tensor(a!)",
    _linear_q4gsw_cpu, _linear_q4gsw_out_cpu, _linear_q4gsw_fake, _linear_q4gsw_out_fake,
)


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

def _check_linear_q4gsw_backward(d_out, weights, scales, group_size):
    N, K = check_q4gsw_weights(weights, scales, group_size)
    check_dtype(d_out, "d_out", FLOAT_DTYPES)
    check_last_dim(d_out, "d_out", N, "N = out features")
    return N, K


def _linear_q4gsw_backward_cpu(d_out, weights, scales, group_size):
    _check_linear_q4gsw_backward(d_out, weights, scales, group_size)
    deq = dequantize_q4gsw(weights, scales, group_size).to(d_out.dtype)
    return torch.matmul(d_out, deq)


def _linear_q4gsw_backward_fake(d_out, weights, scales, group_size):
    _, K = _check_linear_q4gsw_backward(d_out, weights, scales, group_size)
    return d_out.new_empty((*d_out.shape[:-1], K))


def _linear_q4gsw_backward_out_cpu(d_out, weights, scales, group_size, *, out):
    return write_out(out, _linear_q4gsw_backward_cpu(d_out, weights, scales, group_size), "out")


def _linear_q4gsw_backward_out_fake(d_out, weights, scales, group_size, *, out):
    return check_out_like(out, _linear_q4gsw_backward_fake(d_out, weights, scales, group_size), "out")


define_op_pair(
    "linear_q4gsw_backward(Tensor d_out, Tensor weights, Tensor scales, int group_size) -> Tensor",
    "linear_q4gsw_backward.out(Tensor d_out, Tensor weights, Tensor scales, int group_size, *, "
    "Tensor(a!) out) -> Tensor(a!)",
    _linear_q4gsw_backward_cpu, _linear_q4gsw_backward_out_cpu,
    _linear_q4gsw_backward_fake, _linear_q4gsw_backward_out_fake,
)


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

def _check_linear_dW(d_out, x):
    check_dtype(d_out, "d_out", FLOAT_DTYPES)
    check_dtype(x, "x", FLOAT_DTYPES)
    check_same_dtype(x, "x", d_out, "d_out")
    if d_out.dim() < 1 or x.dim() < 1:
        raise ValueError(
            f"d_out [..., N] and x [..., K] must have at least 1 dim, got {tuple(d_out.shape)} and {tuple(x.shape)}")
    if tuple(d_out.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"d_out {tuple(d_out.shape)} and x {tuple(x.shape)} must share their leading (row) dims: "
            f"expected d_out [..., N] and x [..., K] with the same ...")
    return d_out.shape[-1], x.shape[-1]


def _linear_dW_cpu(d_out, x):
    N, K = _check_linear_dW(d_out, x)
    return d_out.reshape(-1, N).T @ x.reshape(-1, K)


def _linear_dW_fake(d_out, x):
    N, K = _check_linear_dW(d_out, x)
    return d_out.new_empty((N, K))


def _linear_dW_out_cpu(d_out, x, *, out):
    return write_out(out, _linear_dW_cpu(d_out, x), "out")


def _linear_dW_out_fake(d_out, x, *, out):
    return check_out_like(out, _linear_dW_fake(d_out, x), "out")


define_op_pair(
    "linear_dW(Tensor d_out, Tensor x) -> Tensor",
    "linear_dW.out(Tensor d_out, Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
    _linear_dW_cpu, _linear_dW_out_cpu, _linear_dW_fake, _linear_dW_out_fake,
)


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

def _check_q4gsw_requant(latent, scales, group_size):
    check_dtype(latent, "latent", (torch.float32,))
    check_dtype(scales, "scales", (torch.float32,))
    check_ndim(latent, "latent", 2, "[N, K] (the float latent weight)")
    check_ndim(scales, "scales", 2, "[G, N] (one scale per group and output feature)")
    N, K = latent.shape
    quant.check_q4gsw_shapes(N, K, group_size)
    expected_scales = (K // group_size, N)
    if tuple(scales.shape) != expected_scales:
        raise ValueError(
            f"scales must have shape [G, N] = {list(expected_scales)} for latent [N, K] = [{N}, {K}] and "
            f"group_size={group_size}, got {tuple(scales.shape)}")
    return N, K


def _q4gsw_requant_cpu(latent, scales, group_size):
    _check_q4gsw_requant(latent, scales, group_size)
    # NaN has no code; +-inf is well defined (clamped), so only NaN is refused.
    if torch.isnan(latent).any():
        raise ValueError("latent contains NaN; cannot re-quantize it to 4-bit codes")
    if torch.isnan(scales).any():
        raise ValueError("scales contain NaN; cannot re-quantize with them")
    codes = quant.requant(latent.detach().numpy(), scales.detach().numpy(), group_size)
    return torch.from_numpy(quant.pack_flat(codes))


def _q4gsw_requant_fake(latent, scales, group_size):
    N, K = _check_q4gsw_requant(latent, scales, group_size)
    return latent.new_empty((N, quant.padded_k(K) // 2), dtype=torch.uint8)


def _q4gsw_requant_out_cpu(latent, scales, group_size, *, out):
    return write_out(out, _q4gsw_requant_cpu(latent, scales, group_size), "out")


def _q4gsw_requant_out_fake(latent, scales, group_size, *, out):
    return check_out_like(out, _q4gsw_requant_fake(latent, scales, group_size), "out")


define_op_pair(
    "q4gsw_requant(Tensor latent, Tensor scales, int group_size) -> Tensor",
    "q4gsw_requant.out(Tensor latent, Tensor scales, int group_size, *, Tensor(a!) out) -> Tensor(a!)",
    _q4gsw_requant_cpu, _q4gsw_requant_out_cpu, _q4gsw_requant_fake, _q4gsw_requant_out_fake,
)

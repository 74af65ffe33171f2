"""A LoRA linear through a q4gsw base as ONE op, and its backward as one op.

    lora_linear_q4gsw(x, lora_A, lora_B, scaling, base_x, weights, scales, group_size, bias?)
        = linear_q4gsw(base_x, weights, scales, group_size, bias) + scaling * (x @ lora_A.T) @ lora_B.T
    lora_linear_q4gsw_backward(d_out, x, lora_A, lora_B, scaling, weights, scales, group_size)
        -> (d_x, d_lora_A, d_lora_B, d_base_x)

Why one op: an exported training step traces ~25 nodes per LoRA linear when the adapter is written out in
ATen (views, transposes, two matmuls, a scale, an add, and their backward), which makes torch.export and
the joint-graph trace of a 30-layer model cost most of a minute; as one op it is 2 nodes. The backend's
lora_linear pass (vktrain/backend/passes/lora_linear.py) writes both back as the ATen chain the unfused
module traces to, so the delegate's op chain, memory plan and numerics are those of the unfused module.

`x` (the adapter's input) and `base_x` (the base linear's) are the same tensor in LoRAQ4Linear (PEFT's
adapter input differs only under dropout). As two arguments, autograd adds the adapter's and the base's
input gradients into x's gradient one after the other, adapter first, as it does for the unfused module,
so the sums, and with them the rounding, are the unfused module's too.
"""
from __future__ import annotations

import torch

from ._library import define_op
from .linear import _linear_q4gsw_backward_cpu, _linear_q4gsw_cpu


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _lora_linear_q4gsw_cpu(x, lora_A, lora_B, scaling, base_x, weights, scales, group_size, bias=None):
    base = _linear_q4gsw_cpu(base_x, weights, scales, group_size, bias)
    return base + ((x @ lora_A.T) * scaling) @ lora_B.T


define_op("lora_linear_q4gsw", _lora_linear_q4gsw_cpu)


def _lora_linear_q4gsw_backward_cpu(d_out, x, lora_A, lora_B, scaling, weights, scales, group_size):
    hidden = (x @ lora_A.T) * scaling                       # [..., r], the adapter's scaled bottleneck
    d_lora_B = _flat_rows(d_out).T @ _flat_rows(hidden)      # [N, r]
    d_hidden = (d_out @ lora_B) * scaling                   # [..., r]
    d_lora_A = _flat_rows(d_hidden).T @ _flat_rows(x)        # [r, K]
    d_x = d_hidden @ lora_A                                 # [..., K]
    d_base_x = _linear_q4gsw_backward_cpu(d_out, weights, scales, group_size)
    return d_x.contiguous(), d_lora_A, d_lora_B, d_base_x.contiguous()


define_op("lora_linear_q4gsw_backward", _lora_linear_q4gsw_backward_cpu)


def _setup_context(ctx, inputs, output):
    x, lora_A, lora_B, scaling, _, weights, scales, group_size, *_ = inputs
    ctx.save_for_backward(x, lora_A, lora_B, weights, scales)
    ctx.scaling = scaling
    ctx.group_size = group_size
    ctx.num_out_features = scales.shape[1]


def _autograd_backward(ctx, grad_out):
    x, lora_A, lora_B, weights, scales = ctx.saved_tensors
    d_x, d_lora_A, d_lora_B, d_base_x = torch.ops.vktrain.lora_linear_q4gsw_backward(
        grad_out, x, lora_A, lora_B, ctx.scaling, weights, scales, ctx.group_size)
    needs = ctx.needs_input_grad
    grad_bias = None
    # The dispatcher drops arguments equal to their default, so without a bias there are only 8 entries.
    if len(needs) > 8 and needs[8]:
        grad_bias = _flat_rows(grad_out).sum(dim=0)
    # scaling, weights (uint8 codes), scales and group_size are frozen / non-differentiable.
    return (d_x if needs[0] else None, d_lora_A if needs[1] else None, d_lora_B if needs[2] else None, None,
            d_base_x if needs[4] else None, None, None, None, grad_bias)


torch.library.register_autograd("vktrain::lora_linear_q4gsw", _autograd_backward, setup_context=_setup_context)

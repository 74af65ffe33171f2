"""adamw: one torch.optim.AdamW update (amsgrad=False, maximize=False), functional.

    p  = p * (1 - lr * wd)                       decoupled weight decay, applied first
    m  = b1 * m + (1 - b1) * g
    v  = b2 * v + (1 - b2) * g * g
    p  = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

hparams = float32 [lr, b1, b2, eps, wd] and step = float32 t (after increment, 1 on the first update)
are runtime tensors, so a learning-rate schedule needs no re-export. Scalar factors are formed in float64
from those float32 values, as torch.optim.AdamW forms them from Python floats; the elementwise update
follows AdamW's order of operations in the parameter's dtype.
"""
from __future__ import annotations

import math

import torch

from ._library import define_op


def _read_hparams(hparams, step):
    lr, beta1, beta2, eps, weight_decay = (float(v) for v in hparams.tolist())  # vktrain.contract.HPARAM_NAMES order
    t = float(step)
    problems = []
    if not (math.isfinite(lr) and lr >= 0):
        problems.append(f"lr={lr} must be finite and >= 0")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{name}={beta} must lie in [0, 1)")
    if not (math.isfinite(eps) and eps >= 0):
        problems.append(f"eps={eps} must be finite and >= 0")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        problems.append(f"weight_decay={weight_decay} must be finite and >= 0")
    if not (math.isfinite(t) and t >= 1 and t == int(t)):
        problems.append(f"step={t} must be a whole number >= 1 (t after increment; bias corrections are 1 - beta^t)")
    if problems:
        raise ValueError("invalid adamw hyper-parameters: " + "; ".join(problems))
    return lr, beta1, beta2, eps, weight_decay, t


def _adamw_cpu(param, exp_avg, exp_avg_sq, grad, hparams, step):
    lr, beta1, beta2, eps, weight_decay, t = _read_hparams(hparams, step)
    new_param = param * (1 - lr * weight_decay)
    new_exp_avg = exp_avg * beta1 + grad * (1 - beta1)
    new_exp_avg_sq = exp_avg_sq * beta2 + grad * grad * (1 - beta2)
    bias_correction1 = 1 - beta1 ** t
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** t)
    step_size = lr / bias_correction1
    denom = new_exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    new_param = new_param - step_size * (new_exp_avg / denom)
    return new_param, new_exp_avg, new_exp_avg_sq


define_op("adamw", _adamw_cpu)


def _adamw_setup_context(ctx, inputs, output):
    # An optimizer step is not part of the differentiated computation: called on a Parameter (which
    # requires grad) it must return plain tensors, not extend the autograd graph through the update.
    ctx.mark_non_differentiable(*output)


def _adamw_autograd_backward(ctx, *grads):
    raise RuntimeError("vktrain::adamw is an optimizer update and has no gradient")


torch.library.register_autograd("vktrain::adamw", _adamw_autograd_backward, setup_context=_adamw_setup_context)

"""fused_ce: cross-entropy loss and its logits gradient in one op.

    loss    = sum_{r: labels[r] >= 0} (logsumexp(logits[r]) - logits[r, labels[r]]) / n_valid
    dlogits = (softmax(logits[r]) - onehot(labels[r])) / n_valid   on those rows, 0 on rows with label < 0

The forward already produces the gradient, so autograd's backward is just grad_loss * dlogits: the
training graph never materialises a separate softmax backward. n_valid is a runtime float32 scalar so
a changing number of valid labels needs no re-export.
"""
from __future__ import annotations

import torch

from ._library import define_op


def _check_fused_ce_values(labels, n_valid, vocab):
    too_large = (labels >= vocab).nonzero()
    if too_large.numel():
        row = int(too_large[0, 0])
        raise ValueError(f"labels must be < V={vocab} (or < 0 to ignore a row), got labels[{row}]={int(labels[row])}")
    divisor = float(n_valid)
    if not divisor > 0 or divisor == float("inf"):
        raise ValueError(f"n_valid must be a finite number > 0 (the count the loss is averaged over), got {divisor}")


def _fused_ce_cpu(logits, labels, n_valid):
    vocab = logits.shape[1]
    _check_fused_ce_values(labels, n_valid, vocab)
    valid = labels >= 0
    # Ignored rows gather class 0 and are masked afterwards, so any negative label is accepted.
    safe_labels = torch.where(valid, labels, 0).to(torch.int64)[:, None]
    # log_softmax/softmax subtract the row max, so logits ~1e4 neither overflow nor lose the loss to
    # cancellation (the loss never forms logsumexp - logit from two huge numbers).
    log_probs = torch.log_softmax(logits, dim=-1)
    row_loss = torch.where(valid, -log_probs.gather(1, safe_labels)[:, 0], 0.0)
    divisor = n_valid.to(logits.dtype)
    # Accumulate the row losses in float64: R can be large and the sum is one scalar.
    loss = (row_loss.sum(dtype=torch.float64) / n_valid.to(torch.float64)).to(logits.dtype)
    dlogits = torch.softmax(logits, dim=-1)
    dlogits.scatter_add_(1, safe_labels, torch.full_like(safe_labels, -1, dtype=logits.dtype))
    dlogits = torch.where(valid[:, None], dlogits / divisor, 0.0)
    return loss, dlogits


define_op("fused_ce", _fused_ce_cpu)


def _fused_ce_setup_context(ctx, inputs, output):
    _, dlogits = output
    ctx.save_for_backward(dlogits)
    # dlogits is already a gradient; differentiating through it is not supported.
    ctx.mark_non_differentiable(dlogits)


def _fused_ce_autograd_backward(ctx, grad_loss, grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    grad_logits = grad_loss * dlogits if ctx.needs_input_grad[0] else None
    return grad_logits, None, None


torch.library.register_autograd(
    "vktrain::fused_ce", _fused_ce_autograd_backward, setup_context=_fused_ce_setup_context)

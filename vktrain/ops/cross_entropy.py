"""fused_ce: cross-entropy loss and its logits gradient in one op.

    loss    = sum_{r: labels[r] >= 0} (logsumexp(logits[r]) - logits[r, labels[r]]) / n_valid
    dlogits = (softmax(logits[r]) - onehot(labels[r])) / n_valid   on those rows, 0 on rows with label < 0

The forward already produces the gradient, so autograd's backward is just grad_loss * dlogits: the
training graph never materialises a separate softmax backward. n_valid is a runtime float32 scalar so
a changing number of valid labels needs no re-export.
"""
from __future__ import annotations

import torch

from ._library import check_out_like, define_op_pair, write_out
from ._validation import FLOAT_DTYPES, LABEL_DTYPES, check_dtype, check_ndim


def _check_fused_ce(logits, labels, n_valid):
    check_dtype(logits, "logits", FLOAT_DTYPES)
    check_dtype(labels, "labels", LABEL_DTYPES)
    check_dtype(n_valid, "n_valid", (torch.float32,))
    check_ndim(logits, "logits", 2, "[R, V] (rows, vocabulary)")
    check_ndim(labels, "labels", 1, "[R] (one class index per row, < 0 = ignored)")
    check_ndim(n_valid, "n_valid", 0, "[] (a float32 scalar tensor: the loss divisor)")
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"logits must have at least one class (V >= 1), got shape {tuple(logits.shape)}")
    if labels.shape[0] != rows:
        raise ValueError(f"labels must have shape [R] = [{rows}] to match logits {tuple(logits.shape)}, "
                         f"got {tuple(labels.shape)}")
    return rows, vocab


def _check_fused_ce_values(labels, n_valid, vocab):
    too_large = (labels >= vocab).nonzero()
    if too_large.numel():
        row = int(too_large[0, 0])
        raise ValueError(f"labels must be < V={vocab} (or < 0 to ignore a row), got labels[{row}]={int(labels[row])}")
    divisor = float(n_valid)
    if not divisor > 0 or divisor == float("inf"):
        raise ValueError(f"n_valid must be a finite number > 0 (the count the loss is averaged over), got {divisor}")


def _fused_ce_cpu(logits, labels, n_valid):
    _, vocab = _check_fused_ce(logits, labels, n_valid)
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


def _fused_ce_fake(logits, labels, n_valid):
    _check_fused_ce(logits, labels, n_valid)
    return logits.new_empty(()), torch.empty_like(logits)


def _fused_ce_out_cpu(logits, labels, n_valid, *, loss_out, dlogits_out):
    loss, dlogits = _fused_ce_cpu(logits, labels, n_valid)
    return write_out(loss_out, loss, "loss_out"), write_out(dlogits_out, dlogits, "dlogits_out")


def _fused_ce_out_fake(logits, labels, n_valid, *, loss_out, dlogits_out):
    loss, dlogits = _fused_ce_fake(logits, labels, n_valid)
    return check_out_like(loss_out, loss, "loss_out"), check_out_like(dlogits_out, dlogits, "dlogits_out")


define_op_pair(
    "fused_ce(Tensor logits, Tensor labels, Tensor n_valid) -> (Tensor loss, Tensor dlogits)",
    "fused_ce.out(Tensor logits, Tensor labels, Tensor n_valid, *, Tensor(a!) loss_out, "
    "Tensor(b!) dlogits_out) -> (Tensor(a!), Tensor(b!))",
    _fused_ce_cpu, _fused_ce_out_cpu, _fused_ce_fake, _fused_ce_out_fake,
)


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

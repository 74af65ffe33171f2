"""CPU references of the Q8_0 weight ops (definitions: vktrain/opdefs/q8_0_ops.py): W [N, K] = codes * scales
per block of 32 flat elements (vktrain.quant.q8_0). Frozen weights: no autograd. The backend writes these
ops into the delegate graph; the references exist so that every definition has a torch op (and for tests)."""
from __future__ import annotations

import torch

from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES

from ._library import define_op


def _dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    blocks = codes.reshape(-1, Q8_0_BLOCK_VALUES).to(scales.dtype)
    return (scales.reshape(-1, 1) * blocks).reshape(codes.shape)


def _embedding_q8_0_cpu(codes, scales, indices):
    return _dequantize(codes, scales)[indices].contiguous()


def _linear_q8_0_cpu(x, codes, scales):
    return (x @ _dequantize(codes, scales).T).contiguous()


def _linear_q8_0_backward_cpu(d_out, codes, scales):
    return (d_out @ _dequantize(codes, scales)).contiguous()


define_op("embedding_q8_0", _embedding_q8_0_cpu)
define_op("linear_q8_0", _linear_q8_0_cpu)
define_op("linear_q8_0_backward", _linear_q8_0_backward_cpu)

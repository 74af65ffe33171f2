"""LoRAQ4Linear: a frozen 4-bit (q4gsw) base linear plus a trainable low-rank adapter.

y = linear_q4gsw(x, W, s, group_size, bias) + scaling * (x @ lora_A.T) @ lora_B.T, scaling = alpha / rank,
computed by the one op vktrain.lora_linear_q4gsw (vktrain/ops/lora_linear.py).
The base weight is quantized once with vktrain.quant (the one source of truth for the layout) and kept as
buffers: it is never trained, and as buffers it lowers into the delegate as a constant.

Weights that arrive already in q4gsw form (a GGUF Q4_0 tensor: symmetric, one scale per 32 weights) are
not re-quantized: the importer attaches a Q4GSWWeight to the float nn.Linear as the attribute
PREQUANTIZED_ATTR (its weight holding the exact dequantized values), and from_linear takes those codes
and scales as they are when the group size matches and the float weight still equals their dequantization.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)

from vktrain.quant import check_q4gsw_shapes, dequantize, quantize


PREQUANTIZED_ATTR = "q4gsw_prequantized"


@dataclass(frozen=True)
class Q4GSWWeight:
    """A weight given in q4gsw form: flat uint8 [N, Kp/2] and float32 scales [G, N] (vktrain.quant layouts)."""
    flat: np.ndarray
    scales: np.ndarray
    group_size: int


def _prequantized_base(linear: nn.Linear, weight: np.ndarray, group_size: int) -> Q4GSWWeight | None:
    """The linear's attached Q4GSWWeight when it can be used as the base unchanged, else None (with a warning
    when one is attached but cannot be used: the float weight is quantized instead)."""
    given = getattr(linear, PREQUANTIZED_ATTR, None)
    if given is None:
        return None
    if given.group_size != group_size:
        warnings.warn(f"LoRA: the layer's weight came as q4gsw codes at group size {given.group_size}; "
                      f"re-quantizing it at group size {group_size} (lossy)", stacklevel=3)
        return None
    deq = dequantize(given.flat, given.scales, given.group_size, weight.shape[1])
    if not np.array_equal(deq, weight):
        warnings.warn("LoRA: the layer's weight was changed after its q4gsw codes were attached; quantizing the "
                      "current float weight instead", stacklevel=3)
        return None
    return given


class LoRAQ4Linear(nn.Module):
    """Frozen q4gsw base weight + trainable LoRA factors lora_A [r, K], lora_B [N, r]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weights: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        rank: int,
        alpha: float,
        bias: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        check_q4gsw_shapes(out_features, in_features, group_size)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank}")
        expected_w = (out_features, (in_features + 7) // 8 * 4)
        if weights.dtype != torch.uint8 or tuple(weights.shape) != expected_w:
            raise ValueError(
                f"weights must be uint8 {list(expected_w)} (flat q4gsw layout), got {weights.dtype} {list(weights.shape)}")
        expected_s = (in_features // group_size, out_features)
        if scales.dtype != torch.float32 or tuple(scales.shape) != expected_s:
            raise ValueError(f"scales must be float32 [G, N] = {list(expected_s)}, got {scales.dtype} {list(scales.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must have shape [{out_features}], got {list(bias.shape)}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.register_buffer("weights", weights.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        # False = base layer only (export_forward(with_adapters=False)); read at trace time.
        self.adapter_enabled = True
        # PEFT's default: A like nn.Linear's weight init (kaiming-uniform, a=sqrt(5)), B = 0 so the
        # adapted model starts exactly at the base model.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, group_size: int,
                    generator: torch.Generator | None = None, scale_rule: str = "absmax",
                    importance: np.ndarray | None = None) -> "LoRAQ4Linear":
        """Quantize `linear.weight` to q4gsw (vktrain.quant.quantize with `scale_rule`) and wrap it with
        a fresh adapter; a Q4GSWWeight attached as PREQUANTIZED_ATTR (module docstring) is used as it is instead.
        `importance` [in_features]: calibration weights of the "mse" rule (vktrain.quant.quantize)."""
        weight = linear.weight.detach().to(torch.float32).cpu().numpy()
        given = _prequantized_base(linear, weight, group_size)
        flat, scales = ((given.flat, given.scales) if given is not None
                        else quantize(weight, group_size, scale_rule, importance))
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.in_features, linear.out_features, torch.from_numpy(flat), torch.from_numpy(scales),
                   group_size, rank, alpha, bias, generator)

    def dequantized_weight(self) -> torch.Tensor:
        """deq(W) [N, K] float32, via vktrain.quant (for references and merging)."""
        return torch.from_numpy(dequantize(self.weights.cpu().numpy(), self.scales.cpu().numpy(), self.group_size,
                                           self.in_features).astype(np.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return torch.ops.vktrain.linear_q4gsw(x, self.weights, self.scales, self.group_size, self.bias)
        # One op (two nodes with its backward) instead of ~25 traced ATen nodes: vktrain/ops/lora_linear.py.
        return torch.ops.vktrain.lora_linear_q4gsw(x, self.lora_A, self.lora_B, self.scaling, x, self.weights,
                                                   self.scales, self.group_size, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"rank={self.rank}, alpha={self.alpha:g}, bias={self.bias is not None}")

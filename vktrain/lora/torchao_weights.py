"""torchao's int4 weight-only linears as q4gsw, codes and scales kept as they are (lossless).

`torchao.quantization.quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4,
granularity=PerGroup(g)))` (the upstream ExecuTorch Vulkan recipe) turns each nn.Linear's weight into an
IntxUnpackedToInt8Tensor: int8 codes `qdata` [N, K] in [-8, 7], float `scale` [N, K/g] and `zero_point`
[N, K/g], dequantized as (qdata - zero_point) * scale. Its default mapping is symmetric (zero_point = 0,
scale = absmax / 7.5 per group), which is exactly q4gsw: q = qdata, scales = scale.T (vktrain.quant
layouts), group size g. An asymmetric weight (a nonzero zero point) has no q4gsw form and is refused.

Two users: `apply_lora` wraps such a linear in a LoRAQ4Linear over these codes, and every export (the
training step, its eval method, the inference forward, the generation program: they all trace
vktrain.export.training.traceable_copy) turns the ones left without an adapter into Q4GSWLinear (a frozen
linear_q4gsw): what torchao's dequantize_affine + linear computes, fused, and the one form torch's joint
(forward + backward) tracing takes (aot_export refuses tensor-subclass parameters; a forward-only trace
would dequantize into a dense float matmul whose int8 casts stay outside the delegate). Nothing here imports torchao: a torchao weight is
recognised by its type's module and name.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)
from vktrain.errors import VktrainError
from vktrain.quant import QMAX, QMIN, check_q4gsw_shapes, pack_flat

from .layers import Q4GSWWeight

TORCHAO_INT4_TENSOR = "IntxUnpackedToInt8Tensor"  # torchao 0.18's IntxWeightOnlyConfig weight type


class TorchaoWeightError(VktrainError, ValueError):
    """A torchao-quantized weight with no lossless q4gsw form (not symmetric int4 per group)."""


def is_torchao_weight(weight: torch.Tensor) -> bool:
    """True for a torchao quantized-tensor subclass (any of them; q4gsw takes only TORCHAO_INT4_TENSOR)."""
    return type(weight).__module__.split(".")[0] == "torchao"


def torchao_q4gsw(linear: nn.Module, path: str) -> Q4GSWWeight | None:
    """The q4gsw form of `linear`'s torchao int4 weight (its codes and scales as they are), None when the
    weight is not torchao's; TorchaoWeightError (naming the layer at `path`) when it has no q4gsw form."""
    weight = getattr(linear, "weight", None)
    if weight is None or not is_torchao_weight(weight):
        return None
    where = f"layer '{path}': torchao weight {type(weight).__name__}"
    if type(weight).__name__ != TORCHAO_INT4_TENSOR:
        raise TorchaoWeightError(f"{where}; q4gsw takes {TORCHAO_INT4_TENSOR} (IntxWeightOnlyConfig) only")
    if weight.target_dtype != torch.int4 or weight.activation_quantization is not None:
        raise TorchaoWeightError(f"{where} holds {weight.target_dtype} codes with activation quantization "
                                 f"{weight.activation_quantization}; expected int4 weight-only")
    N, K = weight.qdata.shape
    block = tuple(weight.block_size)
    if len(block) != 2 or block[0] != 1 or K % block[1]:
        raise TorchaoWeightError(f"{where} has block size {list(block)}; expected per-group [1, group size] "
                                 f"(PerGroup granularity) dividing K={K}")
    group_size = block[1]
    if torch.any(weight.zero_point != 0):
        raise TorchaoWeightError(f"{where} is asymmetric (nonzero zero points); q4gsw is symmetric: quantize "
                                 f"with MappingType.SYMMETRIC (IntxWeightOnlyConfig's default)")
    codes = weight.qdata.numpy()
    if codes.min() < QMIN or codes.max() > QMAX:
        raise TorchaoWeightError(f"{where} has codes in [{codes.min()}, {codes.max()}]; expected [{QMIN}, {QMAX}]")
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise TorchaoWeightError(f"{where}: {exc}") from None
    scales = weight.scale.to(torch.float32).numpy()  # float16 / bfloat16 scales widen exactly
    if scales.shape != (N, K // group_size):
        raise TorchaoWeightError(f"{where} has scales of shape {list(scales.shape)}; expected [{N}, {K // group_size}]")
    return Q4GSWWeight(pack_flat(codes), np.ascontiguousarray(scales.T), group_size)


class Q4GSWLinear(nn.Module):
    """A frozen q4gsw linear: y = linear_q4gsw(x, weights, scales, group_size, bias), all buffers."""

    def __init__(self, base: Q4GSWWeight, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = base.flat.shape[0]
        self.group_size = base.group_size
        self.register_buffer("weights", torch.from_numpy(base.flat))
        self.register_buffer("scales", torch.from_numpy(base.scales))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vktrain.linear_q4gsw(x, self.weights, self.scales, self.group_size, self.bias)


def replace_torchao_linears(model: nn.Module) -> list[str]:
    """Replace every nn.Linear of `model` holding a torchao int4 weight with a Q4GSWLinear over its codes,
    in place; return their paths. A torchao weight anywhere else is refused (no form the step can trace)."""
    replaced = []
    for path, module in list(model.named_modules()):
        base = torchao_q4gsw(module, path) if isinstance(module, nn.Linear) else None
        if base is None:
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, Q4GSWLinear(base, module.in_features, module.bias))
        replaced.append(path)
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if is_torchao_weight(tensor)]
    if left:
        raise TorchaoWeightError(f"torchao-quantized tensors outside an nn.Linear: {left}; only linear weights "
                                 f"(IntxWeightOnlyConfig int4) lower to q4gsw")
    return replaced

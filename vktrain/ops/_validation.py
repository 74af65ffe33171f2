"""Input checks shared by the CPU and fake kernels, so export-time tracing refuses exactly what eager
execution refuses. Shape/value problems raise ValueError, dtype problems TypeError; every message names
the argument, what it got and what was expected."""
from __future__ import annotations

import torch

from vktrain.quant import check_q4gsw_shapes, padded_k

# The CPU references also accept float64 activations so autograd can be checked with gradcheck in double
# precision; GPU kernels and the exporter use float32 only.
FLOAT_DTYPES = (torch.float32, torch.float64)
LABEL_DTYPES = (torch.int64, torch.int32)


def check_dtype(tensor: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in allowed:
        expected = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {expected}, got {tensor.dtype}")


def check_ndim(tensor: torch.Tensor, name: str, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")


def check_same_dtype(tensor: torch.Tensor, name: str, reference: torch.Tensor, reference_name: str) -> None:
    if tensor.dtype != reference.dtype:
        raise TypeError(
            f"{name} has dtype {tensor.dtype} but {reference_name} has {reference.dtype}; they must match")


def check_last_dim(tensor: torch.Tensor, name: str, size: int, what: str) -> None:
    if tensor.dim() < 1 or tensor.shape[-1] != size:
        raise ValueError(
            f"{name} must have shape [..., {size}] (last dim = {what}), got {tuple(tensor.shape)}")


def check_q4gsw_weights(weights: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """Validate a flat q4gsw weight and its scales; returns (N, K) with K = G * group_size."""
    check_dtype(weights, "weights", (torch.uint8,))
    check_dtype(scales, "scales", (torch.float32,))
    check_ndim(weights, "weights", 2, "[N, Kp/2] (flat q4gsw codes, two per byte)")
    check_ndim(scales, "scales", 2, "[G, N] (one scale per group and output feature)")
    check_group_size(group_size)
    num_groups, N = scales.shape
    if num_groups == 0:
        raise ValueError(f"scales must have at least one group (shape [G, N] with G >= 1), got {tuple(scales.shape)}")
    K = num_groups * group_size
    check_q4gsw_shapes(N, K, group_size)
    expected = (N, padded_k(K) // 2)
    if tuple(weights.shape) != expected:
        raise ValueError(
            f"weights shape {tuple(weights.shape)} does not match scales {tuple(scales.shape)} with "
            f"group_size={group_size}: expected flat uint8 [N, Kp/2] = {list(expected)} "
            f"(N={N}, K=G*group_size={K}, Kp={padded_k(K)})")
    return N, K


def check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0 or group_size % 4 != 0:
        raise ValueError(f"group_size={group_size} must be a positive multiple of 4")

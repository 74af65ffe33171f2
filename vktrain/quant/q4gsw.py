"""q4gsw: 4-bit group-symmetric weights, and the flat uint8 layout the ops take.

Notation (w4x8.md): weight W[N, K], groups of `group_size` along K, G = K / group_size,
q[n, k] in [-8, 7], code c = q + 8, W ~= q * scales[k // group_size, n]. Scales are [G, N] (N contiguous).

Scale rule: scale = absmax(group) / 7. The symmetric grid then covers [-absmax, +absmax] with no
clipping; absmax/8 would use code 0 (q = -8) but clip the positive extreme by a full step, and weight
distributions are symmetric, so the one unused level costs less than the clipping error.
"""
from __future__ import annotations

import numpy as np

QMIN = -8
QMAX = 7
CODE_ZERO = 8  # code of q = 0; also the padding code


def padded_k(K: int) -> int:
    """K rounded up to a multiple of 8: one little-endian uint32 word holds 8 codes of a row."""
    return (K + 7) // 8 * 8


def num_groups(K: int, group_size: int) -> int:
    return K // group_size


def check_q4gsw_shapes(N: int, K: int, group_size: int) -> None:
    """Refuse shapes the layouts cannot represent, naming what is wrong and what was expected."""
    problems = []
    if group_size <= 0 or group_size % 4 != 0:
        problems.append(f"group_size={group_size} must be a positive multiple of 4")
    elif K % group_size != 0:
        problems.append(f"K={K} must be a multiple of group_size={group_size}")
    if N % 4 != 0:
        problems.append(f"N={N} (out features) must be a multiple of 4")
    if K % 4 != 0:
        problems.append(f"K={K} (in features) must be a multiple of 4")
    if problems:
        raise ValueError("unsupported q4gsw shape: " + "; ".join(problems))


def requant(latent: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """q = clamp(round_half_to_even(latent / s), -8, 7), q = 0 where s == 0. Returns int8 [N, K]."""
    latent = np.asarray(latent, dtype=np.float32)
    N, K = latent.shape
    check_q4gsw_shapes(N, K, group_size)
    scales = np.asarray(scales, dtype=np.float32)
    if scales.shape != (K // group_size, N):
        raise ValueError(f"scales shape {scales.shape} != expected [G, N] = {(K // group_size, N)}")
    s = np.repeat(scales.T, group_size, axis=1)  # [N, K]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(latent / s)  # np.rint rounds half to even
    q = np.where(s == 0, 0.0, q)
    return np.clip(q, QMIN, QMAX).astype(np.int8)


def quantize(weight: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight [N, K] -> (flat uint8 [N, Kp/2], scales float32 [G, N])."""
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {weight.shape}")
    N, K = weight.shape
    check_q4gsw_shapes(N, K, group_size)
    G = K // group_size
    absmax = np.abs(weight.reshape(N, G, group_size)).max(axis=2)  # [N, G]
    scales = (absmax / QMAX).T.astype(np.float32).copy()  # [G, N]
    return pack_flat(requant(weight, scales, group_size)), scales


def pack_flat(q: np.ndarray) -> np.ndarray:
    """int q [N, K] in [-8, 7] -> flat uint8 [N, Kp/2]; even k in the low nibble; padding code 8."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {q.shape}")
    if q.size and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError(f"q values must lie in [{QMIN}, {QMAX}], got [{q.min()}, {q.max()}]")
    N, K = q.shape
    codes = np.full((N, padded_k(K)), CODE_ZERO, dtype=np.uint8)
    codes[:, :K] = (q.astype(np.int16) + CODE_ZERO).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_flat(flat: np.ndarray, K: int) -> np.ndarray:
    """flat uint8 [N, Kp/2] -> int8 q [N, K]."""
    flat = np.asarray(flat)
    if flat.dtype != np.uint8 or flat.ndim != 2 or flat.shape[1] != padded_k(K) // 2:
        raise ValueError(
            f"flat weights must be uint8 [N, Kp/2] = [N, {padded_k(K) // 2}] for K={K}, "
            f"got {flat.dtype} {flat.shape}")
    codes = np.empty((flat.shape[0], padded_k(K)), dtype=np.int8)
    codes[:, 0::2] = flat & 0xF
    codes[:, 1::2] = flat >> 4
    return codes[:, :K] - CODE_ZERO


def dequantize(flat: np.ndarray, scales: np.ndarray, group_size: int, K: int | None = None) -> np.ndarray:
    """deq(W)[n, k] = q[n, k] * scales[k // group_size, n]  -> float32 [N, K].

    K defaults to scales.shape[0] * group_size (groups cover K exactly)."""
    scales = np.asarray(scales, dtype=np.float32)
    if K is None:
        K = scales.shape[0] * group_size
    q = unpack_flat(flat, K)
    N = q.shape[0]
    check_q4gsw_shapes(N, K, group_size)
    if scales.shape != (K // group_size, N):
        raise ValueError(f"scales shape {scales.shape} != expected [G, N] = {(K // group_size, N)}")
    return q.astype(np.float32) * np.repeat(scales.T, group_size, axis=1)

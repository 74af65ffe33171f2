"""W_4X8: the prepacked layout the GPU kernels read (bit-compatible with upstream ExecuTorch Vulkan).

One 16-byte block per (k4, n8) at block index k4*N8 + n8; word j, byte t holds k = 4*k4 + t for the
row pair n = 8*n8 + 2j (low nibble) and 8*n8 + 2j + 1 (high nibble). Rows n >= N hold code 8.
"""
from __future__ import annotations

import numpy as np

from .q4gsw import CODE_ZERO, padded_k


def _dims(N: int, K: int) -> tuple[int, int]:
    Kp = padded_k(K)
    if N % 4 != 0:
        raise ValueError(f"W_4X8 needs N % 4 == 0, got N={N}")
    N4 = N // 4
    return Kp // 4, (N4 + 1) // 2  # K4, N8


def w4x8_num_words(N: int, K: int) -> int:
    K4, N8 = _dims(N, K)
    return K4 * N8 * 4


def _flat_codes(flat: np.ndarray) -> np.ndarray:
    """flat uint8 [N, Kp/2] -> codes uint8 [N, Kp] (including padding codes)."""
    codes = np.empty((flat.shape[0], flat.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = flat & 0xF
    codes[:, 1::2] = flat >> 4
    return codes


def pack_w4x8(flat: np.ndarray, K: int) -> np.ndarray:
    """flat uint8 [N, Kp/2] -> uint32 [K4 * N8 * 4]."""
    flat = np.asarray(flat)
    N = flat.shape[0]
    if flat.dtype != np.uint8 or flat.ndim != 2 or flat.shape[1] != padded_k(K) // 2:
        raise ValueError(f"flat weights must be uint8 [N, {padded_k(K) // 2}] for K={K}, got {flat.dtype} {flat.shape}")
    K4, N8 = _dims(N, K)
    codes = np.full((N8 * 8, K4 * 4), CODE_ZERO, dtype=np.uint32)  # rows n >= N stay code 8
    codes[:N] = _flat_codes(flat)
    # codes[n8*8 + 2j + h, k4*4 + t] -> [k4, n8, j, t, h]
    c = codes.reshape(N8, 4, 2, K4, 4).transpose(3, 0, 1, 4, 2)
    bytes_ = c[..., 0] | (c[..., 1] << 4)  # [K4, N8, j, t]
    words = (bytes_[..., 0] | (bytes_[..., 1] << 8) | (bytes_[..., 2] << 16) | (bytes_[..., 3] << 24))
    return np.ascontiguousarray(words.reshape(-1)).astype(np.uint32)


def unpack_w4x8(words: np.ndarray, N: int, K: int) -> np.ndarray:
    """uint32 [K4 * N8 * 4] -> flat uint8 [N, Kp/2]."""
    K4, N8 = _dims(N, K)
    words = np.asarray(words, dtype=np.uint32)
    if words.shape != (K4 * N8 * 4,):
        raise ValueError(f"W_4X8 buffer must hold {K4 * N8 * 4} uint32 words for N={N}, K={K}, got {words.shape}")
    w = words.reshape(K4, N8, 4)
    t = np.arange(4, dtype=np.uint32)
    bytes_ = (w[..., None] >> (8 * t)) & 0xFF  # [K4, N8, j, t]
    c = np.stack([bytes_ & 0xF, bytes_ >> 4], axis=-1)  # [K4, N8, j, t, h]
    codes = c.transpose(1, 2, 4, 0, 3).reshape(N8 * 8, K4 * 4)[:N].astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def decode_w4x8_element(words: np.ndarray, scales: np.ndarray, n: int, k: int, N: int, group_size: int) -> float:
    """Decode one weight the way a kernel addresses it (w4x8.md, 'Decoding one element')."""
    N8 = (N // 4 + 1) // 2
    k4, t, n4, ni = k >> 2, k & 3, n >> 2, n & 3
    n8 = n4 >> 1
    j = 2 * (n4 & 1) + (ni >> 1)
    code = (int(words[4 * (k4 * N8 + n8) + j]) >> (8 * t + 4 * (ni & 1))) & 0xF
    return float((code - CODE_ZERO) * scales[k // group_size, n])

"""Q8_0 on the device: a frozen float32 matrix whose values are GGUF Q8_0 blocks (SmolLM2's token
embedding, read again by its tied head), held as int8 codes and float32 scales (docs/spec/q8_0.md).

GGUF's Q8_0 (what the blob stores, serialization/narrow_constant.py): per 32 consecutive values in flat
order, a little-endian float16 scale d then 32 int8 codes q; value = float32(d) * q. Its 34-byte blocks
are not 4-byte aligned, so the device holds the same numbers in two arrays:
- codes: int8 [N, K], the codes in flat (row-major) order, four to a little-endian 32-bit word;
- scales: float32 [N * K / 32], one per block of 32 flat elements, in block order.
Element e (flat index n * K + k) is float(codes[e]) * scales[e // 32]: exactly the float32 value, since
an 8-bit code times an 11-bit float16 mantissa is exact in float32.
"""
from __future__ import annotations

import numpy as np

Q8_0_BLOCK_VALUES = 32
# The names of a Q8_0 matrix W's two device tensors: W's name plus these (the backend pass names them,
# readers of a program's weights such as `vktrain merge` find W by them).
Q8_0_CODES_SUFFIX, Q8_0_SCALES_SUFFIX = ".q8_0_codes", ".q8_0_scales"
# GGUF's Q8_0 block: 34 bytes, packed.
GGUF_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("q", "i1", (Q8_0_BLOCK_VALUES,))])


def q8_0_num_scales(N: int, K: int) -> int:
    """Scales of an [N, K] Q8_0 matrix: one per 32 flat elements (N * K must be a multiple of 32)."""
    if N < 0 or K < 0 or (N * K) % Q8_0_BLOCK_VALUES:
        raise ValueError(f"a Q8_0 matrix has a multiple of {Q8_0_BLOCK_VALUES} elements, got [{N}, {K}]")
    return N * K // Q8_0_BLOCK_VALUES


def q8_0_device_arrays(blocks: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 blocks (GGUF_Q8_0_BLOCK records, or their bytes) of an [N, K] matrix -> (codes int8 [N, K],
    scales float32 [N * K / 32]), the device layout."""
    if not (isinstance(blocks, np.ndarray) and blocks.dtype == GGUF_Q8_0_BLOCK):
        blocks = np.frombuffer(blocks, GGUF_Q8_0_BLOCK)
    if len(blocks) != q8_0_num_scales(N, K):
        raise ValueError(f"[{N}, {K}] needs {q8_0_num_scales(N, K)} Q8_0 blocks, got {len(blocks)}")
    codes = np.ascontiguousarray(blocks["q"]).reshape(N, K)
    return codes, blocks["d"].astype(np.float32)


def dequantize_q8_0(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 values of device-layout codes int8 [N, K] and scales float32 [N * K / 32]."""
    codes = np.asarray(codes)
    if codes.dtype != np.int8 or codes.ndim != 2:
        raise ValueError(f"Q8_0 codes are int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    scales = np.asarray(scales, np.float32).reshape(-1)
    if scales.size != q8_0_num_scales(*codes.shape):
        raise ValueError(f"codes {list(codes.shape)} need {q8_0_num_scales(*codes.shape)} scales, got {scales.size}")
    blocks = codes.reshape(-1, Q8_0_BLOCK_VALUES).astype(np.float32)
    return (scales[:, None] * blocks).reshape(codes.shape)

"""Definitions of the KV-cache ops of generation (prefill + decode with a cache; vktrain/export/decode.py).

Positions are a runtime input, `input_pos` int [L]: row l of a call is the token at position
input_pos[l]. Caches are [B, C, Hkv, D] (C = cache length), new rows [B, L, Hkv, D].

    kv_cache_update(cache, new, input_pos) -> cache with cache[:, input_pos[l]] = new[:, l]
        (input_pos entries distinct and in [0, C))
    cached_attention(q [B, L, Hq, D], k_cache, v_cache, input_pos, scale) -> out [B, L, Hq, D]
        query l attends to the cache rows 0 .. input_pos[l] (causal by position; GQA as causal_attention)
"""
from __future__ import annotations

import numpy as np

from vktrain.errors import VktrainError
from vktrain.opdefs.core import Call, OpDef, Refusal, TensorMeta, rank, same_dtype, same_shape
from vktrain.opdefs.schema import Schema

NAMESPACE = "vktrain"
_FLOAT = ("float32", "float64")
_INDEX = ("int64", "int32")
_CACHE_LAYOUT = "[B, C, Hkv, D] (batch, cache length, kv heads, head dim)"


class CachePositionError(VktrainError, ValueError):
    """A position outside the KV cache, or two rows of one call at the same position."""


def check_cache_positions(input_pos, cache_length: int, what: str = "input_pos") -> None:
    """The value rule of both ops (the shapes are the definitions'): every position in [0, cache_length),
    no position twice. Checked by the CPU references and by the generator before a program runs (a GPU
    kernel cannot raise)."""
    positions = np.asarray(input_pos)
    if positions.size == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= cache_length:
        raise CachePositionError(f"{what} holds positions in [{low}, {high}]; the KV cache holds positions "
                                 f"0 .. {cache_length - 1} (cache length {cache_length})")
    if np.unique(positions).size != positions.size:
        raise CachePositionError(f"{what} holds a position twice ({positions.tolist()}); each row needs its own")


def _positions(call: Call, rows: int, rows_of: str) -> None:
    positions = rank(call, "input_pos", 1, "[L] (the position of each row)")
    if positions.shape[0] != rows:
        raise Refusal(f"input_pos must have one position per row of {rows_of} (L = {rows}), got shape "
                      f"{positions.shape}")


def _kv_cache_update(call: Call) -> tuple[TensorMeta, ...]:
    cache = rank(call, "cache", 4, _CACHE_LAYOUT)
    new = rank(call, "new", 4, "[B, L, Hkv, D] (batch, new rows, kv heads, head dim)")
    same_dtype(call, "new", "cache")
    batch, length, heads, head_dim = cache.shape
    if (new.shape[0], new.shape[2], new.shape[3]) != (batch, heads, head_dim) or new.shape[1] > length:
        raise Refusal(f"new must have shape [B, L, Hkv, D] with B, Hkv, D of cache {cache.shape} and L <= the cache "
                      f"length {length}, got {new.shape}")
    _positions(call, new.shape[1], "new")
    return (cache,)


def _cached_attention(call: Call) -> tuple[TensorMeta, ...]:
    q = rank(call, "q", 4, "[B, L, Hq, D] (batch, query rows, heads, head dim)")
    k_cache = rank(call, "k_cache", 4, _CACHE_LAYOUT)
    rank(call, "v_cache", 4, _CACHE_LAYOUT)
    same_dtype(call, "k_cache", "q")
    same_dtype(call, "v_cache", "q")
    same_shape(call, "v_cache", "k_cache")
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if (k_cache.shape[0], k_cache.shape[3]) != (batch, head_dim):
        raise Refusal(f"k_cache / v_cache must have shape [B, C, Hkv, D] with B and D of q {q.shape}, "
                      f"got {k_cache.shape}")
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise Refusal(f"the number of query heads must be a multiple of the number of kv heads (grouped-query "
                      f"attention), got Hq={q_heads} (q {q.shape}) and Hkv={kv_heads} (k_cache {k_cache.shape})")
    _positions(call, q.shape[1], "q")
    call.real("scale", "the factor applied to q k^T, usually 1/sqrt(D)")
    return (q,)


def _define(schema: str, shape_function, **arg_dtypes: tuple[str, ...]) -> OpDef:
    return OpDef(Schema.parse(NAMESPACE, schema), shape_function, arg_dtypes)


DECODE_OPS = (
    _define("kv_cache_update(Tensor cache, Tensor new, Tensor input_pos) -> Tensor", _kv_cache_update,
            cache=_FLOAT, new=_FLOAT, input_pos=_INDEX),
    _define("cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale) -> Tensor",
            _cached_attention, q=_FLOAT, k_cache=_FLOAT, v_cache=_FLOAT, input_pos=_INDEX),
)

__all__ = ["CachePositionError", "DECODE_OPS", "check_cache_positions"]

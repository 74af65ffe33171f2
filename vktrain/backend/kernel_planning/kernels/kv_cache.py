"""The KV-cache family of generation: kv_cache_update and cached_attention (vktrain/opdefs/decode_ops.py).

kv_cache_update: two dispatches of kv_cache_update.slang, the cache copied into the output, then the
new rows scattered to their positions (the barrier between them comes from the buffers' hazards).
cached_attention: one work group per (batch, query row, query head), cached_attention.slang.
Positions are int32 on the GPU (int64 index tensors are stored as int32); the host checks them
against the cache length before a program runs (check_cache_positions), kernels skip what lies outside.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, check_shape
from vktrain.backend.kernel_planning.kernels.layout import binding, check_dtype, elementwise_groups
from vktrain.backend.kernel_planning.kernels.registry import register_kernel
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import pack_push

_POSITION_DTYPES = ("int32", "int64")
# cached_attention.slang: TILE threads per work group, each owning at most MAX_DIMS_PER_THREAD output dims.
ATTENTION_TILE = 64
ATTENTION_MAX_HEAD_DIM = ATTENTION_TILE * 4


def _rank4(shape: Sequence[int], what: str) -> tuple[int, int, int, int]:
    shape = check_shape(shape, what)
    if len(shape) != 4:
        raise KernelArgumentError(f"{what} must be 4-D [B, rows, H, D], got shape {list(shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise KernelArgumentError(f"{what} has {math.prod(shape)} elements; the kernels index with 32 bits "
                                  f"(at most {MAX_ELEMENTS})")
    return shape


@register_kernel("vktrain.kv_cache_update.default")
def plan_kv_cache_update(*, cache: Any, cache_shape: Sequence[int], new: Any, new_shape: Sequence[int],
                         input_pos: Any, input_pos_shape: Sequence[int], out: Any, cache_dtype: Any = "float32",
                         new_dtype: Any = "float32", input_pos_dtype: Any = "int32",
                         label: str = "kv_cache_update") -> list[Dispatch]:
    """out = cache with out[:, input_pos[l]] = new[:, l]. cache/out [B, C, Hkv, D], new [B, L, Hkv, D]."""
    check_dtype(cache_dtype, f"{label} cache")
    check_dtype(new_dtype, f"{label} new")
    check_dtype(input_pos_dtype, f"{label} input_pos", _POSITION_DTYPES)
    batch, length, heads, head_dim = _rank4(cache_shape, f"{label} cache")
    new_shape = _rank4(new_shape, f"{label} new")
    rows = new_shape[1]
    if tuple(input_pos_shape) != (rows,) or (new_shape[0], new_shape[2], new_shape[3]) != (batch, heads, head_dim):
        raise KernelArgumentError(f"{label}: new {list(new_shape)} / input_pos {list(input_pos_shape)} do not fit "
                                  f"cache {list(cache_shape)} (expected new [B, L, Hkv, D], input_pos [L])")
    cache_numel, new_numel = math.prod(cache_shape), math.prod(new_shape)
    copy = Dispatch("kv_cache_update", elementwise_groups(cache_numel),
                    bindings=(binding(out, "w"), binding(cache, "r")), push_constants=pack_push(cache_numel),
                    label=f"{label}.copy")
    if new_numel == 0:
        return [copy]
    scatter = Dispatch("kv_cache_update@SCATTER", elementwise_groups(new_numel),
                       bindings=(binding(out, "w"), binding(new, "r"), binding(input_pos, "r")),
                       push_constants=pack_push(new_numel, rows, heads * head_dim, length), label=f"{label}.scatter")
    return [copy, scatter]


@register_kernel("vktrain.cached_attention.default")
def plan_cached_attention(*, q: Any, q_shape: Sequence[int], k_cache: Any, k_cache_shape: Sequence[int],
                          v_cache: Any, v_cache_shape: Sequence[int], input_pos: Any,
                          input_pos_shape: Sequence[int], scale: float, out: Any, q_dtype: Any = "float32",
                          k_cache_dtype: Any = "float32", v_cache_dtype: Any = "float32",
                          input_pos_dtype: Any = "int32", label: str = "cached_attention") -> list[Dispatch]:
    """out [B, L, Hq, D]: query l over the cache rows 0 .. input_pos[l] (GQA)."""
    for name, dtype in (("q", q_dtype), ("k_cache", k_cache_dtype), ("v_cache", v_cache_dtype)):
        check_dtype(dtype, f"{label} {name}")
    check_dtype(input_pos_dtype, f"{label} input_pos", _POSITION_DTYPES)
    batch, rows, q_heads, head_dim = _rank4(q_shape, f"{label} q")
    cache_shape = _rank4(k_cache_shape, f"{label} k_cache")
    if tuple(v_cache_shape) != cache_shape:
        raise KernelArgumentError(f"{label}: v_cache {list(v_cache_shape)} differs from k_cache {list(cache_shape)}")
    cache_batch, length, kv_heads, cache_dim = cache_shape
    if (cache_batch, cache_dim) != (batch, head_dim) or q_heads % kv_heads or tuple(input_pos_shape) != (rows,):
        raise KernelArgumentError(f"{label}: q {list(q_shape)}, caches {list(cache_shape)}, input_pos "
                                  f"{list(input_pos_shape)} do not fit (expected q [B, L, Hq, D], caches "
                                  f"[B, C, Hkv, D] with Hq % Hkv == 0, input_pos [L])")
    if head_dim > ATTENTION_MAX_HEAD_DIM:
        raise KernelArgumentError(f"{label}: head dim D={head_dim} is over the kernel's {ATTENTION_MAX_HEAD_DIM}")
    if not math.isfinite(scale):
        raise KernelArgumentError(f"{label}: scale must be finite, got {scale}")
    groups = batch * rows * q_heads
    if groups == 0:
        return []
    return [Dispatch("cached_attention", groups,
                     bindings=(binding(q, "r"), binding(k_cache, "r"), binding(v_cache, "r"), binding(input_pos, "r"),
                               binding(out, "w")),
                     push_constants=pack_push(rows, q_heads, kv_heads, head_dim, length, float(scale)), label=label)]

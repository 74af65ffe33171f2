"""CPU references of the KV-cache ops (definitions: vktrain/opdefs/decode_ops.py). Inference only: no autograd."""
from __future__ import annotations

import torch

from vktrain.opdefs.decode_ops import check_cache_positions

from ._library import define_op


def _kv_cache_update_cpu(cache, new, input_pos):
    check_cache_positions(input_pos.numpy(), cache.shape[1])
    updated = cache.clone()
    updated[:, input_pos] = new
    return updated


define_op("kv_cache_update", _kv_cache_update_cpu)


def _cached_attention_cpu(q, k_cache, v_cache, input_pos, scale):
    check_cache_positions(input_pos.numpy(), k_cache.shape[1])
    group = q.shape[2] // k_cache.shape[2]
    q_heads_first = q.permute(0, 2, 1, 3)  # [B, Hq, L, D]
    k_heads_first = k_cache.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, Hq, C, D]
    v_heads_first = v_cache.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = scale * torch.matmul(q_heads_first, k_heads_first.transpose(-1, -2))  # [B, Hq, L, C]
    cache_positions = torch.arange(k_cache.shape[1])
    later = cache_positions[None, :] > input_pos[:, None]  # [L, C]: rows a query at input_pos[l] must not see
    probs = torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1)
    return torch.matmul(probs, v_heads_first).permute(0, 2, 1, 3).contiguous()


define_op("cached_attention", _cached_attention_cpu)

"""Generation: the KV-cache ops (kv_cache_update, cached_attention), the prefill + decode program and
`vktrain generate`, against independent references.

Tolerances (fp32 GPU kernels against float64 references):
* kv_cache_update moves 32-bit words: bit-exact.
* cached_attention: each output is a softmax-weighted sum over at most C keys of D-long fp32 dot
  products, as causal_attention (tests/test_kernels_transformer.py): norm-relative error 1e-6.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain)
from vktrain.opdefs.decode_ops import CachePositionError
from vktrain.runtime import Buffer, Program
from vktrain.runtime.delegate.kernels import kv_cache

OPS = torch.ops.vktrain


def _run(device, plan, inputs, outputs):
    """Run `plan` once with `inputs` {key: array} uploaded as they are and `outputs` {key: shape}
    allocated as fp32 (poisoned with NaN first). Returns {key: array}."""
    buffers = {}
    try:
        for key, array in inputs.items():
            buffers[key] = Buffer.from_array(device, np.ascontiguousarray(array), name=key)
        for key, shape in outputs.items():
            buffers[key] = Buffer(device, 4 * max(1, math.prod(shape)), name=key)
            buffers[key].write(np.full(math.prod(shape), np.nan, np.float32))
        with Program(device, plan, buffers) as program:
            program.replay()
            return {key: buffers[key].read(np.float32, shape) for key, shape in outputs.items()}
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _attention_reference(q, k_cache, v_cache, positions, scale):
    """Float64 softmax attention written out per query row: row l over the cache rows 0 .. positions[l]."""
    batch, rows, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        for l, position in enumerate(positions):
            for h in range(q_heads):
                keys = k_cache[b, :position + 1, h // group].astype(np.float64)
                scores = scale * keys @ q[b, l, h].astype(np.float64)
                weights = np.exp(scores - scores.max())
                out[b, l, h] = weights @ v_cache[b, :position + 1, h // group] / weights.sum()
    return out


def _norm_rel(got, ref):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("B,C,H,D,positions", [(1, 16, 2, 8, [0]), (1, 16, 2, 8, [5, 6, 7]),
                                               (2, 10, 3, 4, [9, 0, 4]), (1, 8, 1, 16, list(range(8)))])
def test_kv_cache_update_kernel_is_the_reference_bit_for_bit(vk_device, B, C, H, D, positions):
    rng = np.random.default_rng(C + len(positions))
    cache = rng.standard_normal((B, C, H, D)).astype(np.float32)
    new = rng.standard_normal((B, len(positions), H, D)).astype(np.float32)
    pos = np.asarray(positions, np.int32)
    plan = kv_cache.plan_kv_cache_update(cache="cache", cache_shape=cache.shape, new="new", new_shape=new.shape,
                                         input_pos="pos", input_pos_shape=pos.shape, out="out")
    got = _run(vk_device, plan, {"cache": cache, "new": new, "pos": pos}, {"out": cache.shape})["out"]
    expected = cache.copy()
    for l, p in enumerate(positions):  # written out, independent of the op library
        expected[:, p] = new[:, l]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, OPS.kv_cache_update(torch.from_numpy(cache), torch.from_numpy(new),
                                                           torch.from_numpy(pos.astype(np.int64))).numpy())


@pytest.mark.parametrize("B,L,Hq,Hkv,C,D,positions", [
    (1, 1, 4, 2, 16, 8, [0]), (1, 1, 4, 2, 200, 32, [150]),  # decode: several 64-key tiles
    (1, 5, 4, 4, 32, 16, [3, 4, 5, 6, 7]),  # a chunk at an offset
    (2, 3, 6, 2, 70, 72, [69, 0, 64]),  # GQA 3:1, D over one thread's share, ragged tiles
])
def test_cached_attention_kernel_matches_float64_softmax(vk_device, B, L, Hq, Hkv, C, D, positions):
    rng = np.random.default_rng(C + D)
    q = rng.standard_normal((B, L, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, C, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, C, Hkv, D)).astype(np.float32)
    pos = np.asarray(positions, np.int32)
    scale = 1 / math.sqrt(D)
    plan = kv_cache.plan_cached_attention(q="q", q_shape=q.shape, k_cache="k", k_cache_shape=k.shape, v_cache="v",
                                          v_cache_shape=v.shape, input_pos="pos", input_pos_shape=pos.shape,
                                          scale=scale, out="out")
    got = _run(vk_device, plan, {"q": q, "k": k, "v": v, "pos": pos}, {"out": q.shape})["out"]
    reference = _attention_reference(q, k, v, positions, scale)
    assert np.isfinite(got).all()
    assert _norm_rel(got, reference) <= 1e-6
    cpu = OPS.cached_attention(*(torch.from_numpy(a).double() for a in (q, k, v)),
                               torch.from_numpy(pos.astype(np.int64)), scale).numpy()
    assert _norm_rel(cpu, reference) <= 1e-12


def test_cached_attention_over_a_full_prefix_is_causal_attention():
    """The cache read from position 0 with positions 0..S-1 is causal attention over S tokens."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    k_cache = torch.zeros(1, 9, 2, 8, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(6)
    k_cache = OPS.kv_cache_update(k_cache, k, positions)
    v_cache = OPS.kv_cache_update(v_cache, v, positions)
    expected, _ = OPS.causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(OPS.cached_attention(q, k_cache, v_cache, positions, 0.3), expected,
                               rtol=1e-12, atol=1e-12)


def test_positions_outside_the_cache_are_refused():
    cache, new = torch.zeros(1, 4, 1, 8), torch.ones(1, 2, 1, 8)
    with pytest.raises(CachePositionError, match=r"positions in \[3, 4\]; the KV cache holds positions 0 .. 3"):
        OPS.kv_cache_update(cache, new, torch.tensor([3, 4]))
    with pytest.raises(CachePositionError, match="a position twice"):
        OPS.kv_cache_update(cache, new, torch.tensor([1, 1]))
    with pytest.raises(CachePositionError, match=r"positions in \[-1, -1\]"):
        OPS.cached_attention(torch.zeros(1, 1, 1, 8), cache, cache, torch.tensor([-1]), 1.0)

"""GPU kernels of the linear family (vktrain/backend/kernel_planning/kernels/linear.py) on the Vulkan device.

Each kernel is checked against two references: the op library's CPU definition
(torch.ops.vktrain.*, fp32) and an independent float64 formula through vktrain.quant.dequantize.

Tolerance. Every output is a dot product of length L (L = K forward, N backward, M for dW) of terms
a_l * w_l. In fp32 with any summation order (tiles, trees, FMA or not), the rounding error is at most
gamma_{L+2} * sum_l |a_l * w_l| with gamma_n ~= n * 2^-24 (Higham, "Accuracy and Stability of Numerical
Algorithms", 3.1; the +2 covers the rounding of deq = q * scale and of the factored-out scale of the
GEMV path). The checks use exactly that bound, element by element, against the float64 reference:
an element-wise relative error would be ill-conditioned where outputs cancel to ~0, while this bound
stays tight (for L <= 300 it is <= 2e-5 of the term magnitudes, and any layout or indexing error moves
an output by O(one term)). Against the fp32 op library both sides err, so the bound doubles.
Outputs start as NaN, so an element a kernel fails to write cannot pass.

Layout decoding is also checked bit-exactly: with an identity activation every output is a single
product q * scale, so the GPU must reproduce deq(W) exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import vktrain.ops  # noqa: E402,F401  (registers torch.ops.vktrain.*)
from vktrain.quant import dequantize, pack_flat, quantize  # noqa: E402
from vktrain.runtime import Buffer, Program  # noqa: E402
from vktrain.backend.kernel_planning.kernels import KERNELS, get_kernel, register_kernel  # noqa: E402
from vktrain.backend.kernel_planning.kernels.gemm_tuning import (  # noqa: E402
    CPU_TUNING,
    GPU_TUNING,
    GemmTuningError,
    runs_cpu_bodies,
    select_gemm_tuning,
)
from vktrain.backend.kernel_planning.kernels.linear_tiles import MIN_SPLIT_SLICE  # noqa: E402
from vktrain.backend.kernel_planning.kernels.linear import (  # noqa: E402
    CPU_LANES,
    CPU_ROWS,
    GEMV_MAX_M,
    GEMV_MAX_ROWS,
    GemmTiles,
    GemvTiles,
    plan_linear_dw,
    plan_linear_q4gsw,
    plan_linear_q4gsw_backward,
    plan_scratch_nbytes,
    prepack_weights,
    split_k_scratch_nbytes,
    weights_nbytes,
)

UNIT_ROUNDOFF = 2.0 ** -24
SMALL_GEMM = GemmTiles(threads_x=4, threads_y=4, bk=8)  # 32 x 32 tiles: many tiles on small shapes


# ----------------------------------------------------------------------------------- helpers
def _q4gsw(rng, N, K, group_size, zero_groups=()):
    """Random q4gsw weight: (flat uint8 [N, Kp/2], scales float32 [G, N], deq float64 [N, K])."""
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    for g in zero_groups:
        scales[g % scales.shape[0], :] = 0.0
    return flat, scales, dequantize(flat, scales, group_size).astype(np.float64)


def _run(device, dispatches, inputs, out_shape, max_group_count=None, scratch_nbytes=0):
    """Upload `inputs` (key -> array), run the dispatches, return the "out" buffer as float32. The
    output and the split-K scratch ("scratch") start as NaN: an element nobody writes cannot pass."""
    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_shape, np.nan, dtype=np.float32), name="out")
    if scratch_nbytes:
        buffers["scratch"] = Buffer.from_array(device, np.full(scratch_nbytes // 4, np.nan, np.float32))
    try:
        with Program(device, dispatches, buffers, max_group_count=max_group_count) as program:
            program.replay()
        return buffers["out"].read(np.float32, out_shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _assert_dot_close(actual, a64, b64, expected64, length, label, factor=1.0, addend=0.0):
    """|actual - expected| <= factor * gamma_{length+2} * (|a| @ |b| + |addend|) element-wise (module
    docstring); `addend` is a bias added to the dot products (its addition rounds too)."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected64.shape, f"{label}: shape {actual.shape} != {expected64.shape}"
    assert np.isfinite(actual).all(), f"{label}: {np.count_nonzero(~np.isfinite(actual))} non-finite outputs"
    magnitude = np.abs(a64) @ np.abs(b64) + np.abs(addend)
    bound = factor * (length + 2) * UNIT_ROUNDOFF * magnitude
    excess = np.abs(actual - expected64) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"{label}: element {worst} = {actual[worst]!r}, expected {expected64[worst]!r} "
        f"(error {abs(actual[worst] - expected64[worst]):.3e} > bound {bound[worst]:.3e})")


def _forward(device, rng, M, N, K, group_size, *, bias=False, tiles=None, zero_groups=(), lead=None,
             max_group_count=None, split_k=None, scratch_nbytes=0, tuning=GPU_TUNING):
    flat, scales, deq = _q4gsw(rng, N, K, group_size, zero_groups)
    x = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    inputs = {"x": x, "w": prepack_weights(flat, K), "s": scales}
    if bias:
        inputs["b"] = b
    plan = plan_linear_q4gsw(M=M, N=N, K=K, group_size=group_size, out="out", x="x", weights="w",
                             scales="s", bias="b" if bias else None, tiles=tiles, split_k=split_k,
                             scratch="scratch" if scratch_nbytes else None, tuning=tuning)
    y = _run(device, plan, inputs, (M, N), max_group_count, scratch_nbytes)

    x64 = x.astype(np.float64)
    b64 = b.astype(np.float64) if bias else 0.0
    expected = x64 @ deq.T + b64
    label = f"linear_q4gsw M={M} N={N} K={K} gs={group_size} via {plan[0].shader}"
    _assert_dot_close(y, x64, deq.T, expected, K, label, addend=b64)

    x_t = torch.from_numpy(x if lead is None else x.reshape(*lead, K))
    op = torch.ops.vktrain.linear_q4gsw(x_t, torch.from_numpy(flat), torch.from_numpy(scales), group_size,
                                        None if b is None else torch.from_numpy(b))
    assert tuple(op.shape) == tuple(x_t.shape[:-1]) + (N,)
    _assert_dot_close(y, x64, deq.T, op.reshape(M, N).double().numpy(), K, label + " vs op library", 2.0, b64)
    return plan


def _backward(device, rng, M, N, K, group_size, *, tiles=None, zero_groups=(), lead=None, max_group_count=None,
              split_k=None, scratch_nbytes=0, tuning=GPU_TUNING):
    flat, scales, deq = _q4gsw(rng, N, K, group_size, zero_groups)
    d_out = rng.standard_normal((M, N)).astype(np.float32)
    plan = plan_linear_q4gsw_backward(M=M, N=N, K=K, group_size=group_size, out="out", d_out="d",
                                      weights="w", scales="s", tiles=tiles, split_k=split_k,
                                      scratch="scratch" if scratch_nbytes else None, tuning=tuning)
    dx = _run(device, plan, {"d": d_out, "w": prepack_weights(flat, K), "s": scales}, (M, K), max_group_count,
              scratch_nbytes)

    d64 = d_out.astype(np.float64)
    label = f"linear_q4gsw_backward M={M} N={N} K={K} gs={group_size} via {plan[0].shader}"
    _assert_dot_close(dx, d64, deq, d64 @ deq, N, label)
    d_t = torch.from_numpy(d_out if lead is None else d_out.reshape(*lead, N))
    op = torch.ops.vktrain.linear_q4gsw_backward(d_t, torch.from_numpy(flat), torch.from_numpy(scales), group_size)
    assert tuple(op.shape) == tuple(d_t.shape[:-1]) + (K,)
    _assert_dot_close(dx, d64, deq, op.reshape(M, K).double().numpy(), N, label + " vs op library", 2.0)
    return plan


def _dw(device, rng, M, N, K, *, tiles=None, lead=None, max_group_count=None, split_k=None, scratch_nbytes=0):
    d_out = rng.standard_normal((M, N)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    plan = plan_linear_dw(M=M, N=N, K=K, out="out", d_out="d", x="x", tiles=tiles, split_k=split_k,
                          scratch="scratch" if scratch_nbytes else None)
    dw = _run(device, plan, {"d": d_out, "x": x}, (N, K), max_group_count, scratch_nbytes)

    d64, x64 = d_out.astype(np.float64), x.astype(np.float64)
    label = f"linear_dW M={M} N={N} K={K}"
    _assert_dot_close(dw, d64.T, x64, d64.T @ x64, M, label)
    d_t, x_t = torch.from_numpy(d_out), torch.from_numpy(x)
    if lead is not None:
        d_t, x_t = d_t.reshape(*lead, N), x_t.reshape(*lead, K)
    op = torch.ops.vktrain.linear_dW(d_t, x_t)
    _assert_dot_close(dw, d64.T, x64, op.double().numpy(), M, label + " vs op library", 2.0)
    return plan


# ----------------------------------------------------------------------------------- layout
def _spec_pattern_weights(N, K):
    """w4x8.md's test pattern q[n, k] = ((3n + 5k) mod 16) - 8 with distinct power-of-two scales per
    (group, n), so a wrong code, nibble or scale index changes the exact result."""
    n, k = np.meshgrid(np.arange(N), np.arange(K), indexing="ij")
    q = ((3 * n + 5 * k) % 16) - 8
    group_size = 4
    scales = np.ldexp(1.0, (np.arange(K // group_size)[:, None] + 2 * np.arange(N)[None, :]) % 7 - 3)
    return pack_flat(q), scales.astype(np.float32), group_size


@pytest.mark.parametrize("N,K", [(8, 8), (12, 4), (16, 24), (20, 36)])
@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_identity_activation_reproduces_deq_exactly(vk_device, N, K, path):
    flat, scales, gs = _spec_pattern_weights(N, K)
    deq = dequantize(flat, scales, gs)  # float32, exact products of small ints and powers of two
    w = prepack_weights(flat, K)
    # Forward: x = identity [K, K] -> y[m, n] = deq[n, m]; backward: d_out = identity [N, N] ->
    # dx[m, k] = deq[m, k]. The GEMV kernels then run many row groups of 4 (forced: M > GEMV_MAX_M).
    fwd_tiles = GemvTiles(wg_x=2, wg_y=4, rows=4) if path == "gemv" else SMALL_GEMM
    plan = plan_linear_q4gsw(M=K, N=N, K=K, group_size=gs, out="out", x="x", weights="w", scales="s",
                             tiles=fwd_tiles)
    y = _run(vk_device, plan, {"x": np.eye(K, dtype=np.float32), "w": w, "s": scales}, (K, N))
    np.testing.assert_array_equal(y, deq.T, err_msg=f"forward via {plan[0].shader}")
    bwd_tiles = GemvTiles(wg_x=4, wg_y=2, rows=4) if path == "gemv" else SMALL_GEMM
    plan = plan_linear_q4gsw_backward(M=N, N=N, K=K, group_size=gs, out="out", d_out="d", weights="w",
                                      scales="s", tiles=bwd_tiles)
    dx = _run(vk_device, plan, {"d": np.eye(N, dtype=np.float32), "w": w, "s": scales}, (N, K))
    np.testing.assert_array_equal(dx, deq, err_msg=f"backward via {plan[0].shader}")


# ----------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("M,N,K,gs,bias", [
    (1, 8, 8, 8, True),      # GEMV, one block, bias
    (1, 12, 20, 4, False),   # GEMV, odd N4 (N % 8 == 4), K % 8 == 4, five groups
    (3, 36, 96, 32, True),   # GEMV with 3 rows, three groups
    (4, 260, 64, 16, False),  # GEMV, several workgroups along N, odd N4
    (7, 36, 40, 8, True),    # GEMV, two row groups (4 + 3 rows)
])
def test_linear_q4gsw_gemv(vk_device, M, N, K, gs, bias):
    plan = _forward(vk_device, np.random.default_rng(M * 1000 + N), M, N, K, gs, bias=bias)
    assert plan[0].shader.startswith("linear_q4gsw_gemv")


@pytest.mark.parametrize("M,N,K,gs,bias,tiles", [
    (70, 100, 132, 4, True, None),         # default tiles: partial tiles, odd N4, K % 8 == 4, 33 groups
    (37, 68, 72, 24, False, SMALL_GEMM),    # 2 x 3 tiles, all partial, three groups of 24
    (65, 32, 40, 8, True, GemmTiles(8, 4, 16)),  # non-square threads, BK=16 with K % BK != 0
    (9, 8, 8, 8, False, None),              # smallest GEMM (M just above the GEMV limit)
])
def test_linear_q4gsw_gemm(vk_device, M, N, K, gs, bias, tiles):
    plan = _forward(vk_device, np.random.default_rng(M * 1000 + N), M, N, K, gs, bias=bias, tiles=tiles)
    assert plan[0].shader.startswith("linear_q4gsw") and "gemv" not in plan[0].shader


@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_linear_q4gsw_zero_scales(vk_device, path):
    # Groups 0 and 2 of 3 have zero scales: those k contribute exactly nothing.
    M = 3 if path == "gemv" else 20
    _forward(vk_device, np.random.default_rng(7), M, 44, 48, 16, bias=True, zero_groups=(0, 2),
             tiles=SMALL_GEMM if path == "gemm" else None)


def test_linear_q4gsw_all_zero_scales_give_bias_exactly(vk_device):
    rng = np.random.default_rng(8)
    N, K, gs = 12, 16, 8
    flat, scales, _ = _q4gsw(rng, N, K, gs, zero_groups=(0, 1))
    b = rng.standard_normal(N).astype(np.float32)
    for M in (2, 9):
        x = rng.standard_normal((M, K)).astype(np.float32)
        plan = plan_linear_q4gsw(M=M, N=N, K=K, group_size=gs, out="out", x="x", weights="w", scales="s",
                                 bias="b")
        y = _run(vk_device, plan, {"x": x, "w": prepack_weights(flat, K), "s": scales, "b": b}, (M, N))
        np.testing.assert_array_equal(y, np.broadcast_to(b, (M, N)), err_msg=plan[0].shader)


@pytest.mark.parametrize("lead", [(2, 3), (3, 1, 2)])
def test_linear_q4gsw_leading_batch(vk_device, lead):
    M = int(np.prod(lead))
    _forward(vk_device, np.random.default_rng(M), M, 20, 24, 8, bias=True, lead=lead)


@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_linear_q4gsw_split_group_grid(vk_device, path):
    """Grids cut into several dispatches (group-count limit) give the same result."""
    tiles = SMALL_GEMM if path == "gemm" else GemvTiles(wg_x=2, wg_y=8, rows=2)
    _forward(vk_device, np.random.default_rng(11), 7, 72, 40, 8, bias=True, tiles=tiles, max_group_count=2)


@pytest.mark.parametrize("seed", range(4))
def test_linear_q4gsw_random_shapes(vk_device, seed):
    rng = np.random.default_rng(100 + seed)
    gs = 4 * int(rng.integers(1, 9))
    K = gs * int(rng.integers(1, 6))
    M = int(rng.integers(1, 90))
    N = 4 * int(rng.integers(1, 40))
    tiles = [None, SMALL_GEMM, GemmTiles(8, 4, 8)][seed % 3] if M > GEMV_MAX_M else None
    _forward(vk_device, rng, M, N, K, gs, bias=bool(seed % 2), tiles=tiles)


# ----------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("M,N,K,gs,tiles", [
    (1, 12, 20, 4, None),                  # GEMV: odd N4, K % 8 == 4
    (2, 72, 96, 32, None),                 # GEMV: 3 groups, N8 = 9 blocks over the slices
    (3, 260, 16, 16, GemvTiles(8, 2, 3)),  # GEMV: several workgroups along K, odd N4
    (70, 100, 132, 4, None),               # GEMM default tiles: partial tiles, odd N4, K % 8 == 4
    (37, 68, 72, 24, SMALL_GEMM),          # GEMM: N % BK != 0 and odd N4 inside the reduction
    (9, 36, 44, 4, GemmTiles(4, 8, 16)),   # GEMM: BK=16 reduction with a half block at the end
])
def test_linear_q4gsw_backward(vk_device, M, N, K, gs, tiles):
    plan = _backward(vk_device, np.random.default_rng(M * 1000 + N + 1), M, N, K, gs, tiles=tiles)
    assert ("gemv" in plan[0].shader) == (M <= GEMV_MAX_M)


@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_linear_q4gsw_backward_zero_scales_and_split_grid(vk_device, path):
    M = 3 if path == "gemv" else 33
    tiles = SMALL_GEMM if path == "gemm" else GemvTiles(wg_x=4, wg_y=2, rows=2)
    _backward(vk_device, np.random.default_rng(12), M, 44, 48, 16, zero_groups=(1,), tiles=tiles,
              max_group_count=2)


def test_linear_q4gsw_backward_leading_batch(vk_device):
    _backward(vk_device, np.random.default_rng(13), 6, 28, 24, 8, lead=(2, 3))


@pytest.mark.parametrize("seed", range(3))
def test_linear_q4gsw_backward_random_shapes(vk_device, seed):
    rng = np.random.default_rng(200 + seed)
    gs = 4 * int(rng.integers(1, 9))
    K = gs * int(rng.integers(1, 6))
    M = int(rng.integers(1, 90))
    N = 4 * int(rng.integers(1, 40))
    _backward(vk_device, rng, M, N, K, gs, tiles=SMALL_GEMM if seed == 1 and M > GEMV_MAX_M else None)


# ----------------------------------------------------------------------------------- dW
@pytest.mark.parametrize("M,N,K,tiles", [
    (1, 12, 20, None),           # one row: outer product
    (37, 100, 132, None),        # default tiles, partial tiles, reduction M % BK != 0
    (300, 36, 44, SMALL_GEMM),   # long reduction, 2 x 2 partial tiles
    (17, 64, 8, GemmTiles(8, 4, 16)),
])
def test_linear_dw(vk_device, M, N, K, tiles):
    _dw(vk_device, np.random.default_rng(M + N + K), M, N, K, tiles=tiles)


def test_linear_dw_leading_batch_and_split_grid(vk_device):
    _dw(vk_device, np.random.default_rng(14), 10, 72, 40, tiles=SMALL_GEMM, lead=(2, 5), max_group_count=2)


# ----------------------------------------------------------------------------------- split-K
def test_linear_q4gsw_split_k_with_bias(vk_device):
    # K=72 in 3 slices of BK=8 steps: slices of 24, 24, 24; partial tiles; the reduce adds the bias.
    M, N, K = 37, 68, 72
    plan = _forward(vk_device, np.random.default_rng(21), M, N, K, 8, bias=True, tiles=SMALL_GEMM, split_k=3,
                    scratch_nbytes=split_k_scratch_nbytes(M, N, 3))
    assert [d.shader for d in plan] == ["linear_q4gsw", "linear_splitk_reduce@HAS_BIAS"]
    assert plan[0].groups[2] == 3


def test_linear_q4gsw_backward_split_k_with_empty_slice(vk_device):
    # N=40 over 4 slices of whole BK=16 steps: 16, 16, 8, and an empty one that must write zeros.
    M, N, K = 9, 40, 44
    _backward(vk_device, np.random.default_rng(22), M, N, K, 4, tiles=GemmTiles(4, 4, 16), split_k=4,
              scratch_nbytes=split_k_scratch_nbytes(M, K, 4))


def test_linear_dw_automatic_split_k_for_thin_output(vk_device):
    # A LoRA-like dW: an [8, 16] output (one tile) reduced over M=1200 rows: the default plan splits
    # once given scratch, and the result is the same as unsplit.
    M, N, K = 1200, 8, 16
    scratch = plan_scratch_nbytes("linear_dW", M=M, N=N, K=K)
    assert scratch == split_k_scratch_nbytes(N, K, M // MIN_SPLIT_SLICE)
    plan = _dw(vk_device, np.random.default_rng(23), M, N, K, scratch_nbytes=scratch, max_group_count=2)
    assert [d.shader for d in plan] == ["linear_dw", "linear_splitk_reduce"]
    assert plan[0].groups[2] == M // MIN_SPLIT_SLICE


def test_split_k_needs_scratch_and_a_gemm():
    with pytest.raises(ValueError, match=r"split_k=2 needs a scratch buffer of split_k_scratch_nbytes\(8, 8, 2\)"):
        plan_linear_dw(M=64, N=8, K=8, out=0, d_out=1, x=2, split_k=2)
    with pytest.raises(ValueError, match="GEMV path .* has no split_k"):
        plan_linear_q4gsw(M=1, N=8, K=8, group_size=8, out=0, x=1, weights=2, scales=3, tiles=GemvTiles(),
                          split_k=2, scratch=4)
    with pytest.raises(ValueError, match="split_k must be an int >= 1"):
        plan_linear_q4gsw(M=8, N=8, K=8, group_size=8, out=0, x=1, weights=2, scales=3, split_k=0, scratch=4)
    # Large outputs never split; GEMV-sized M needs no scratch.
    assert plan_scratch_nbytes("linear_q4gsw", M=2048, N=8192, K=2048) == 0
    assert plan_scratch_nbytes("linear_q4gsw", M=1, N=8192, K=2048) == 0
    assert plan_scratch_nbytes("linear_q4gsw", M=512, N=2048, K=2048) == split_k_scratch_nbytes(512, 2048, 4)


# ----------------------------------------------------------------------------------- plans
def test_registry_holds_the_linear_plans():
    assert KERNELS["vktrain.linear_q4gsw.default"] is plan_linear_q4gsw
    assert KERNELS["vktrain.linear_q4gsw_backward.default"] is plan_linear_q4gsw_backward
    assert KERNELS["vktrain.linear_dW.default"] is plan_linear_dw
    assert get_kernel("vktrain.linear_dW.default") is plan_linear_dw
    with pytest.raises(KeyError, match="no kernel registered for op 'no_such_op'"):
        get_kernel("no_such_op")
    with pytest.raises(ValueError, match="already registered"):
        register_kernel("vktrain.linear_dW.default")(lambda **kwargs: [])
    with pytest.raises(ValueError, match="must be an op key '<namespace>.<name>.<overload>', got 'linear_dW'"):
        register_kernel("linear_dW")(lambda **kwargs: [])
    assert KERNELS["vktrain.linear_dW.default"] is plan_linear_dw


def test_plan_covers_the_output_and_picks_the_path():
    gemv = plan_linear_q4gsw(M=GEMV_MAX_M, N=2048, K=2048, group_size=32, out=0, x=1, weights=2, scales=3)
    gemm = plan_linear_q4gsw(M=GEMV_MAX_M + 1, N=2048, K=2048, group_size=32, out=0, x=1, weights=2,
                             scales=3, bias=4)
    assert [d.shader for d in gemv + gemm] == ["linear_q4gsw_gemv", "linear_q4gsw@HAS_BIAS"]
    (d,) = gemm
    bm, bn = 8 * d.local_size[1], 8 * d.local_size[0]
    assert d.groups[0] * bn >= 2048 > (d.groups[0] - 1) * bn
    assert d.groups[1] * bm >= GEMV_MAX_M + 1 > (d.groups[1] - 1) * bm
    assert [b.access for b in d.bindings] == ["w", "r", "r", "r", "r"]
    # M, N, K, group size, then the contiguous GemmPlacement: a_offset, a_row_stride = K, c_offset, c_row_stride = N,
    # w_offset, s_offset
    assert d.push_constants == np.array([GEMV_MAX_M + 1, 2048, 2048, 32, 0, 2048, 0, 2048, 0, 0], "<u4").tobytes()
    (g,) = gemv
    assert dict(g.spec_constants) == {3: GEMV_MAX_ROWS, 4: 32}  # rows per workgroup, group size
    assert g.groups[1] * GEMV_MAX_ROWS >= GEMV_MAX_M
    assert g.push_constants == np.array([GEMV_MAX_M, 2048, 2048], "<u4").tobytes()
    (b,) = plan_linear_q4gsw_backward(M=1, N=2048, K=2052, group_size=4, out=0, d_out=1, weights=2, scales=3)
    assert b.shader == "linear_q4gsw_gemv@BACKWARD"
    assert b.groups[0] * b.local_size[1] >= 2052 // 4  # output k4 columns
    assert weights_nbytes(12, 20) == 4 * 6 * 2 * 4  # K4 = 24/4, N8 = 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(M=4, N=10, K=8, group_size=4), "N=10 .* multiple of 4"),
    (dict(M=4, N=8, K=6, group_size=2), "group_size=2"),
    (dict(M=4, N=8, K=12, group_size=8), "K=12 must be a multiple of group_size=8"),
    (dict(M=0, N=8, K=8, group_size=8), "M must be an int >= 1"),
])
def test_plans_refuse_bad_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_linear_q4gsw(**kwargs, out=0, x=1, weights=2, scales=3)
    with pytest.raises(ValueError, match=message):
        plan_linear_q4gsw_backward(**kwargs, out=0, d_out=1, weights=2, scales=3)


def test_plans_refuse_bad_tiles_and_dw_shapes():
    with pytest.raises(ValueError, match="bk must be a positive multiple of 8"):
        GemmTiles(16, 16, 12)
    with pytest.raises(ValueError, match="wg_y must be a power of two"):
        GemvTiles(4, 48, 1)
    with pytest.raises(ValueError, match="shared memory"):
        plan_linear_dw(M=4, N=8, K=8, out=0, d_out=1, x=2, tiles=GemmTiles(32, 32, 64))
    with pytest.raises(ValueError, match="linear_dW: unsupported shape: K=6 must be a multiple of 4"):
        plan_linear_dw(M=4, N=8, K=6, out=0, d_out=1, x=2)
    with pytest.raises(ValueError, match="must be GemmTiles"):
        plan_linear_dw(M=4, N=8, K=8, out=0, d_out=1, x=2, tiles=GemvTiles())


@pytest.mark.parametrize("shared_memory_bytes", [16384, 32768])
def test_default_plans_fit_the_shared_memory_budget(shared_memory_bytes):
    # 16 KiB is the Vulkan minimum; the defaults must fit it without the caller choosing tiles.
    for M in (1, 3, 4, 7, 8, 9, 64, 512, 2048):
        for N, K in ((8, 8), (2048, 2048), (8192, 2048), (2052, 2052)):
            common = dict(M=M, N=N, K=K, out=0, shared_memory_bytes=shared_memory_bytes, scratch=9)
            for plan in (plan_linear_q4gsw(**common, group_size=4, x=1, weights=2, scales=3),
                         plan_linear_q4gsw_backward(**common, group_size=4, d_out=1, weights=2, scales=3),
                         plan_linear_dw(**common, d_out=1, x=2)):
                assert plan and all(d.local_size[0] * d.local_size[1] <= 256 for d in plan)


# ----------------------------------------------------------------------------------- CPU tuning
@pytest.fixture
def cpu_bodies(vk_device):
    """The device, when it can run the register-tile bodies of CPU_TUNING (lavapipe can)."""
    if not runs_cpu_bodies(vk_device):
        pytest.skip(f"{vk_device.name} cannot run the CPU bodies ({CPU_LANES}-lane subgroups, shuffles, int64)")
    return vk_device


# M = 1 .. 9 spans the GEMV thresholds and one row tile (CPU_ROWS); N, K not multiples of the 4 * CPU_LANES
# columns of a workgroup; N % 8 == 4 (a half-filled last W_4X8 block); group sizes below, at and above the
# CPU_LANES k4 steps of one chunk (12: a partial chunk per group).
CPU_FORWARD_CASES = [(M, 20, 48, 12, M % 2 == 1) for M in range(1, 10)] + [
    (64, 100, 96, 32, False), (17, 36, 64, 4, True), (13, 1540, 40, 8, False), (CPU_ROWS + 1, 12, 192, 64, True)]


@pytest.mark.parametrize("M,N,K,gs,bias", CPU_FORWARD_CASES)
def test_linear_q4gsw_cpu_tuning(cpu_bodies, M, N, K, gs, bias):
    plan = _forward(cpu_bodies, np.random.default_rng(M * 1000 + N), M, N, K, gs, bias=bias, tuning=CPU_TUNING)
    assert [d.shader for d in plan] == ["linear_q4gsw@CPU_REGISTER_TILES" + ("+HAS_BIAS" if bias else "")]
    assert plan[0].groups == (-(-N // (4 * CPU_LANES)), -(-M // CPU_ROWS), 1)


# The d_x body needs group_size % (4 * CPU_LANES) == 0; K (its columns) not a multiple of 32 is then
# impossible, so partial workgroups come from K / 4 quads vs lanes only through M, N and padded blocks.
CPU_BACKWARD_CASES = [(M, 20, 64, 32) for M in range(1, 10)] + [
    (64, 100, 96, 32), (17, 12, 128, 64), (9, 1540, 32, 32), (CPU_ROWS + 1, 36, 256, 128)]


@pytest.mark.parametrize("M,N,K,gs", CPU_BACKWARD_CASES)
def test_linear_q4gsw_backward_cpu_tuning(cpu_bodies, M, N, K, gs):
    plan = _backward(cpu_bodies, np.random.default_rng(M * 1000 + N), M, N, K, gs, tuning=CPU_TUNING)
    assert [d.shader for d in plan] == ["linear_q4gsw_backward@CPU_REGISTER_TILES"]


def test_cpu_tuning_zero_scales_leading_batch_and_split_grid(cpu_bodies):
    rng = np.random.default_rng(7)
    _forward(cpu_bodies, rng, 6, 24, 96, 32, zero_groups=(1,), lead=(2, 3), max_group_count=1, tuning=CPU_TUNING)
    _backward(cpu_bodies, rng, 10, 44, 64, 32, zero_groups=(0,), max_group_count=1, tuning=CPU_TUNING)


def test_cpu_tuning_keeps_the_tiled_kernels_where_its_bodies_do_not_apply():
    common = dict(M=64, N=64, K=64, out="out", weights="w", scales="s", tuning=CPU_TUNING)
    forward = dict(common, x="x")
    backward = dict(common, d_out="d")
    # Forced tiles or split-K pick a kernel whatever the tuning.
    assert plan_linear_q4gsw(**forward, group_size=32, tiles=SMALL_GEMM)[0].shader == "linear_q4gsw"
    assert plan_linear_q4gsw(**forward, group_size=32, tiles=GemvTiles(4, 4, 1))[0].shader == "linear_q4gsw_gemv"
    split = plan_linear_q4gsw_backward(**backward, group_size=32, split_k=2, scratch="scratch")
    assert [d.shader for d in split] == ["linear_q4gsw_backward", "linear_splitk_reduce"]
    # d_x needs every workgroup's columns in one group; with group 16 it keeps the tiled body.
    assert plan_linear_q4gsw_backward(**backward, group_size=16)[0].shader == "linear_q4gsw_backward"
    assert plan_linear_q4gsw(**forward, group_size=16)[0].shader == "linear_q4gsw@CPU_REGISTER_TILES"
    # dW has no CPU body; the CPU bodies never split, so they need no scratch.
    assert plan_linear_dw(M=64, N=64, K=64, out="out", d_out="d", x="x", tuning=CPU_TUNING)[0].shader == "linear_dw"
    for op in ("linear_q4gsw", "linear_q4gsw_backward"):
        assert plan_scratch_nbytes(op, M=512, N=2048, K=2048, group_size=32, tuning=CPU_TUNING) == 0
        assert plan_scratch_nbytes(op, M=512, N=2048, K=2048, group_size=32) > 0
    # Without the group size the d_x body cannot be promised: the scratch is sized for the tiled one.
    assert plan_scratch_nbytes("linear_q4gsw_backward", M=512, N=2048, K=2048, tuning=CPU_TUNING) > 0
    with pytest.raises(GemmTuningError, match="tuning must be one of gpu, cpu, got 'fast'"):
        plan_linear_q4gsw(**dict(forward, tuning="fast"), group_size=32)


def test_gpu_tuning_is_the_default_and_unchanged():
    kwargs = dict(M=64, N=576, K=576, group_size=32, out="out", x="x", weights="w", scales="s", scratch="scratch")
    default = plan_linear_q4gsw(**kwargs)
    assert default == plan_linear_q4gsw(**kwargs, tuning=GPU_TUNING)
    assert [d.shader for d in default] == ["linear_q4gsw", "linear_splitk_reduce"]


def _fake_device(device_type, subgroup_size=8, subgroup_operations=0xBF, features=frozenset({"shaderInt64"})):
    from types import SimpleNamespace
    return SimpleNamespace(name=f"test-{device_type}", device_type=device_type, subgroup_size=subgroup_size,
                           subgroup_operations=subgroup_operations, features=features)


def test_select_gemm_tuning_by_device_type_and_environment():
    assert select_gemm_tuning(_fake_device("cpu"), environ={}) == CPU_TUNING
    for device_type in ("discrete_gpu", "integrated_gpu", "virtual_gpu", "other"):
        assert select_gemm_tuning(_fake_device(device_type), environ={}) == GPU_TUNING
    # A CPU implementation whose subgroups the bodies cannot use keeps the GPU tuning (SwiftShader: 4 lanes).
    assert select_gemm_tuning(_fake_device("cpu", subgroup_size=4), environ={}) == GPU_TUNING
    assert select_gemm_tuning(_fake_device("cpu", subgroup_operations=0x0F), environ={}) == GPU_TUNING
    assert select_gemm_tuning(_fake_device("cpu", features=frozenset()), environ={}) == GPU_TUNING
    assert select_gemm_tuning(_fake_device("cpu"), environ={"VKTRAIN_GEMM_TUNING": "gpu"}) == GPU_TUNING
    assert select_gemm_tuning(_fake_device("discrete_gpu"), environ={"VKTRAIN_GEMM_TUNING": " CPU "}) == CPU_TUNING
    with pytest.raises(GemmTuningError, match="VKTRAIN_GEMM_TUNING must be one of gpu, cpu, got 'fast'"):
        select_gemm_tuning(_fake_device("cpu"), environ={"VKTRAIN_GEMM_TUNING": "fast"})
    with pytest.raises(GemmTuningError, match="test-cpu cannot run the CPU bodies: .* it has 4 lanes"):
        select_gemm_tuning(_fake_device("cpu", subgroup_size=4), environ={"VKTRAIN_GEMM_TUNING": "cpu"})


def test_bench_script_quick_run(tmp_path, vk_device):
    """scripts/bench_kernels.py --quick produces timings and agrees with PyTorch (one kernel, 1 replay)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", script)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--kernels", "linear_dW,linear_q4gsw", "--replays", "1", "--warmup", "0",
                       "--torch-device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["kernel"] for r in results} == {"linear_dW", "linear_q4gsw"}
    for record in results:
        assert record["vk_ms"] > 0 and record["torch_ms"] > 0 and record["vk_gflops"] > 0
        assert record["error_vs_torch"] < 1e-5, record

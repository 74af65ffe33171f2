"""vktrain.quant against the spec's test vectors (w4x8.md) and independent float64 formulas."""
import numpy as np
import pytest

from vktrain import quant


def spec_q(N, K):
    """The spec's test pattern q[n, k] = ((3n + 5k) mod 16) - 8."""
    n = np.arange(N)[:, None]
    k = np.arange(K)[None, :]
    return ((3 * n + 5 * k) % 16) - 8


def words(*hex_words):
    return [int(w, 16) for w in hex_words]


SPEC_VECTORS = [
    # (N, K, flat row 0, {(k4, n8): 4 words})
    (8, 8, "50 fa 94 3e", {
        (0, 0): words("2fda8530", "8530eb96", "eb9641fc", "41fca752"),
        (1, 0): words("631ec974", "c9742fda", "2fda8530", "8530eb96"),
    }),
    (12, 4, "50 fa 88 88", {
        (0, 0): words("2fda8530", "8530eb96", "eb9641fc", "41fca752"),
        (0, 1): words("a7520db8", "0db8631e", "88888888", "88888888"),
        (1, 0): words("88888888", "88888888", "88888888", "88888888"),
        (1, 1): words("88888888", "88888888", "88888888", "88888888"),
    }),
    (16, 24, "50 fa 94 3e d8 72 1c b6 50 fa 94 3e", {
        (0, 0): words("2fda8530", "8530eb96", "eb9641fc", "41fca752"),
        (0, 1): words("a7520db8", "0db8631e", "631ec974", "c9742fda"),
        (5, 1): words("eb9641fc", "41fca752", "a7520db8", "0db8631e"),
    }),
]


@pytest.mark.parametrize("N,K,row0,blocks", SPEC_VECTORS)
def test_spec_vectors(N, K, row0, blocks):
    flat = quant.pack_flat(spec_q(N, K))
    assert flat[0].tobytes() == bytes.fromhex(row0.replace(" ", ""))
    packed = quant.pack_w4x8(flat, K)
    N8 = (N // 4 + 1) // 2
    assert packed.shape == (quant.w4x8_num_words(N, K),)
    for (k4, n8), expected in blocks.items():
        block = 4 * (k4 * N8 + n8)
        assert [int(w) for w in packed[block:block + 4]] == expected, (k4, n8)


@pytest.mark.parametrize("N,K", [(4, 4), (8, 8), (12, 4), (12, 20), (16, 24), (20, 36), (64, 128)])
def test_round_trips_and_decode_formula(N, K):
    rng = np.random.default_rng(N * 1000 + K)
    q = rng.integers(-8, 8, size=(N, K))
    flat = quant.pack_flat(q)
    assert flat.shape == (N, quant.padded_k(K) // 2)
    np.testing.assert_array_equal(quant.unpack_flat(flat, K), q)
    packed = quant.pack_w4x8(flat, K)
    np.testing.assert_array_equal(quant.unpack_w4x8(packed, N, K), flat)
    # Padding nibbles (k >= K) are code 8 in both layouts.
    if quant.padded_k(K) != K:
        codes_hi = flat[:, -1] >> 4
        assert (codes_hi == 8).all()
    gs = 4
    scales = rng.uniform(0.5, 2.0, size=(K // gs, N)).astype(np.float32)
    deq = quant.dequantize(flat, scales, gs)
    for n, k in [(0, 0), (N - 1, K - 1), (N // 2, K // 3), (N - 1, 0), (1 % N, K - 1)]:
        assert quant.decode_w4x8_element(packed, scales, n, k, N, gs) == deq[n, k]
        # float64 product is exact for a 4-bit code; one rounding to float32 must give the kernel value
        assert deq[n, k] == np.float32(np.float64(q[n, k]) * np.float64(scales[k // gs, n]))


def test_w4x8_rows_past_n_hold_code_8():
    N, K = 12, 16  # N4 = 3 is odd: the upper half of the last block column is padding
    packed = quant.pack_w4x8(quant.pack_flat(np.zeros((N, K), dtype=np.int64) - 8), K)
    blocks = packed.reshape(K // 4, 2, 4)
    assert (blocks[:, 1, 2:] == 0x88888888).all()
    assert (blocks[:, 1, :2] == 0).all()  # real rows hold code 0 (q = -8)


def test_quantize_matches_float64_rule():
    rng = np.random.default_rng(0)
    N, K, gs = 12, 64, 16
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[3, 16:32] = 0.0  # a zero group -> zero scale -> code 8
    flat, scales = quant.quantize(w, gs)
    assert scales.shape == (K // gs, N) and scales.dtype == np.float32
    w64 = w.astype(np.float64).reshape(N, K // gs, gs)
    s64 = np.abs(w64).max(axis=2) / 7.0
    np.testing.assert_allclose(scales, s64.T, rtol=1e-6)
    q = quant.unpack_flat(flat, K).reshape(N, K // gs, gs)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.clip(np.rint(w64 / s64.astype(np.float32)[..., None]), -8, 7)
    expected = np.where(s64[..., None] == 0, 0, expected)
    np.testing.assert_array_equal(q, expected)
    assert scales[1, 3] == 0 and (q[3, 1] == 0).all()
    # Error bound of the symmetric grid: half a step per element.
    err = np.abs(quant.dequantize(flat, scales, gs) - w).reshape(N, K // gs, gs)
    assert (err <= scales.T[..., None] / 2 + 1e-6).all()


def test_requant_rounds_half_to_even_and_clamps():
    scales = np.ones((1, 4), dtype=np.float32)
    latent = np.array([[0.5, 1.5, 2.5, -0.5], [-1.5, 7.5, -8.5, 100.0],
                       [6.5, -7.5, 3.49, -3.51], [0, 0, 0, 0]], dtype=np.float32)
    q = quant.requant(latent, scales, 4)
    np.testing.assert_array_equal(q, [[0, 2, 2, 0], [-2, 7, -8, 7], [6, -8, 3, -4], [0, 0, 0, 0]])


def test_requant_of_dequantized_returns_the_same_codes():
    rng = np.random.default_rng(1)
    N, K, gs = 20, 40, 8
    flat, scales = quant.quantize(rng.standard_normal((N, K)), gs)
    q_again = quant.requant(quant.dequantize(flat, scales, gs), scales, gs)
    np.testing.assert_array_equal(quant.pack_flat(q_again), flat)


@pytest.mark.parametrize("N,K,gs,match", [
    (6, 8, 4, "N=6"), (8, 6, 2, "group_size=2"), (8, 12, 8, "K=12 must be a multiple of group_size=8"),
    (8, 10, 5, "group_size=5"),
])
def test_bad_shapes_are_refused_with_reason(N, K, gs, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(np.zeros((N, K), dtype=np.float32), gs)


def test_bad_layout_inputs_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        quant.unpack_flat(np.zeros((4, 4), dtype=np.int32), 8)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        quant.pack_flat(np.full((4, 8), 8))
    with pytest.raises(ValueError, match="words"):
        quant.unpack_w4x8(np.zeros(3, dtype=np.uint32), 8, 8)
    with pytest.raises(ValueError, match="scales shape"):
        quant.dequantize(np.zeros((8, 4), dtype=np.uint8), np.zeros((3, 8), dtype=np.float32), 4, K=8)


def _group_sse(w, flat, scales, gs):
    N, K = w.shape
    err = (quant.dequantize(flat, scales, gs).astype(np.float64) - w.astype(np.float64)) ** 2
    return err.reshape(N, K // gs, gs).sum(axis=2)  # [N, G]


@pytest.mark.parametrize("dist", ["gaussian", "student_t3"])
def test_mse_rule_beats_absmax_and_nears_a_dense_search(dist):
    rng = np.random.default_rng(5)
    N, K, gs = 64, 256, 32
    w = (rng.standard_normal((N, K)) if dist == "gaussian" else rng.standard_t(3, (N, K))).astype(np.float32)
    w[5, :gs] = 0.0  # a zero group stays exactly zero
    flat, scales = quant.quantize(w, gs, "mse")
    # The layout's rule holds for the chosen scales: codes are requant(w, s).
    np.testing.assert_array_equal(quant.unpack_flat(flat, K), quant.requant(w, scales, gs))
    assert scales[0, 5] == 0 and (quant.unpack_flat(flat, K)[5, :gs] == 0).all()
    sse = _group_sse(w, flat, scales, gs)
    sse_absmax = _group_sse(w, *quant.quantize(w, gs, "absmax"), gs)
    # d = 7 is among the candidates (absmax/7 with the sign flipped, the same error up to rounding).
    assert (sse <= sse_absmax * (1 + 1e-5) + 1e-12).all()
    assert sse.sum() < 0.8 * sse_absmax.sum()  # the docstring reports 0.70-0.76 on such matrices
    # Independent float64 reference: the best of 4001 scales of either sign, each with nearest-level codes.
    groups = w.astype(np.float64).reshape(N, K // gs, gs)
    absmax = np.abs(groups).max(axis=2, keepdims=True)
    best = np.full(sse.shape, np.inf)
    for s in np.concatenate([np.linspace(1 / 10, 1 / 6, 2000), -np.linspace(1 / 10, 1 / 6, 2001)]):
        scale = absmax * s
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scale == 0, 0, np.clip(np.rint(groups / scale), -8, 7))
        best = np.minimum(best, ((groups - q * scale) ** 2).sum(axis=2))
    assert sse.sum() <= 1.02 * best.sum()  # within 2% of the dense search overall


def test_unknown_scale_rule_is_refused():
    with pytest.raises(ValueError, match="unknown q4gsw scale rule 'l1'; rules: absmax, mse"):
        quant.quantize(np.zeros((4, 8), dtype=np.float32), 4, "l1")


def _weighted_group_sse(w, flat, scales, gs, importance):
    N, K = w.shape
    err = (quant.dequantize(flat, scales, gs).astype(np.float64) - w.astype(np.float64)) ** 2 * importance
    return err.reshape(N, K // gs, gs).sum(axis=2)


def test_importance_weighted_mse_lowers_the_output_weighted_error():
    rng = np.random.default_rng(11)
    N, K, gs = 64, 256, 32
    w = rng.standard_normal((N, K)).astype(np.float32)
    importance = np.exp(2.0 * rng.standard_normal(K)).astype(np.float32)  # heavy-tailed, as real activations
    flat, scales = quant.quantize(w, gs, "mse", importance)
    np.testing.assert_array_equal(quant.unpack_flat(flat, K), quant.requant(w, scales, gs))  # layout rule holds
    weighted = _weighted_group_sse(w, flat, scales, gs, importance)
    plain = _weighted_group_sse(w, *quant.quantize(w, gs, "mse"), gs, importance)
    assert weighted.sum() < 0.9 * plain.sum()
    # Independent float64 reference: per group, the best of 4001 scales under the same weighted error.
    groups = w.astype(np.float64).reshape(N, K // gs, gs)
    a = importance.astype(np.float64).reshape(1, K // gs, gs)
    absmax = np.abs(groups).max(axis=2, keepdims=True)
    best = np.full(weighted.shape, np.inf)
    for s in np.concatenate([np.linspace(1 / 10, 1 / 6, 2000), -np.linspace(1 / 10, 1 / 6, 2001)]):
        scale = absmax * s
        q = np.clip(np.rint(groups / scale), -8, 7)
        best = np.minimum(best, (((groups - q * scale) ** 2) * a).sum(axis=2))
    assert weighted.sum() <= 1.05 * best.sum()


def test_importance_is_a_relative_weight():
    """Scaling every importance by one factor leaves the weighted objective's minimiser alone, and a
    uniform importance is the plain squared error (its search range differs: within 2% of the plain rule)."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    importance = np.exp(rng.standard_normal(128)).astype(np.float32)
    flat, scales = quant.quantize(w, 32, "mse", importance)
    scaled_flat, scaled_scales = quant.quantize(w, 32, "mse", importance * np.float32(64.0))  # exact in float32
    np.testing.assert_array_equal(scaled_flat, flat)
    np.testing.assert_array_equal(scaled_scales, scales)
    uniform = _group_sse(w, *quant.quantize(w, 32, "mse", np.full(128, 3.5, np.float32)), 32).sum()
    plain = _group_sse(w, *quant.quantize(w, 32, "mse"), 32).sum()
    assert abs(uniform - plain) <= 0.02 * plain


@pytest.mark.parametrize("importance, rule, match", [
    (np.ones(7), "mse", r"one value per input column, shape \(8,\)"),
    (-np.ones(8), "mse", "finite and >= 0"),
    (np.full(8, np.nan), "mse", "finite and >= 0"),
    (np.ones(8), "absmax", "'mse' scale rule only"),
])
def test_bad_importance_is_refused(importance, rule, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(np.ones((4, 8), dtype=np.float32), 4, rule, importance)

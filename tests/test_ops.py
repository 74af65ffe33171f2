"""vktrain.ops CPU references against independent float64 formulas, torch eager and torch.optim.

Weights are decoded for the references with vktrain.quant.unpack_flat (codes) and the deq formula
q[n, k] * scales[k // group_size, n] written here in float64; nothing here calls the op's own dequantizer.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import vktrain.ops as ops
from vktrain import quant


# ---- helpers -------------------------------------------------------------------------------------

def random_q4gsw(N, K, group_size, seed, zero_scale_groups=()):
    """Random codes over the whole range [-8, 7] and random positive scales; listed groups get scale 0."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(N, K))
    scales = rng.uniform(0.01, 0.2, size=(K // group_size, N)).astype(np.float32)
    for g in zero_scale_groups:
        scales[g, :] = 0.0
    return torch.from_numpy(quant.pack_flat(q)), torch.from_numpy(scales)


def deq_float64(weights, scales, group_size):
    """deq(W) [N, K] in float64, straight from the spec formula."""
    G, N = scales.shape
    K = G * group_size
    q = quant.unpack_flat(weights.numpy(), K).astype(np.float64)
    s = scales.numpy().astype(np.float64)
    k = np.arange(K)
    return q * s[k // group_size, :].T


def ce_float64(logits, labels, n_valid):
    """(loss, dlogits) in float64 from the definition, row by row."""
    z = logits.detach().numpy().astype(np.float64)
    R, V = z.shape
    loss = 0.0
    dlogits = np.zeros_like(z)
    for r in range(R):
        label = int(labels[r])
        if label < 0:
            continue
        m = z[r].max()
        sum_exp = np.exp(z[r] - m).sum()
        loss += m + math.log(sum_exp) - z[r, label]
        dlogits[r] = np.exp(z[r] - m) / sum_exp
        dlogits[r, label] -= 1.0
    return loss / n_valid, dlogits / n_valid


def assert_close_rel(actual, expected, rtol, what):
    """Max abs error relative to the reference's largest magnitude (robust where entries cancel to ~0)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
    err = np.abs(actual - expected).max(initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


# (N, K, group_size, leading dims of x, zero-scale groups)
LINEAR_CASES = [
    (8, 32, 8, (5,), ()),
    (12, 20, 4, (2, 3), (1,)),        # N % 8 == 4, K % 8 == 4 (padding nibbles), 5 groups, a zero group
    (4, 36, 12, (7,), ()),            # K % 8 == 4 with 3 groups of 12
    (20, 64, 16, (), (0, 3)),         # 1-D x, two zero-scale groups
    (36, 132, 44, (3, 2, 2), (2,)),   # 3 leading dims
    (64, 256, 32, (9,), ()),
]


# ---- linear_q4gsw --------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K,group_size,lead,zero_groups", LINEAR_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_q4gsw_matches_float64(N, K, group_size, lead, zero_groups, with_bias):
    weights, scales = random_q4gsw(N, K, group_size, seed=N + K, zero_scale_groups=zero_groups)
    gen = torch.Generator().manual_seed(K)
    x = torch.randn(*lead, K, generator=gen)
    bias = torch.randn(N, generator=gen) if with_bias else None
    y = ops.linear_q4gsw(x, weights, scales, group_size, bias)
    assert y.dtype == torch.float32 and y.shape == (*lead, N)
    expected = x.double().numpy() @ deq_float64(weights, scales, group_size).T
    if with_bias:
        expected = expected + bias.double().numpy()
    assert_close_rel(y, expected, 1e-5, "linear_q4gsw")


def test_linear_q4gsw_zero_scale_group_contributes_nothing():
    N, K, gs = 8, 24, 8
    weights, scales = random_q4gsw(N, K, gs, seed=3, zero_scale_groups=(1,))
    x = torch.zeros(2, K)
    x[:, gs:2 * gs] = 1e6  # only the zero-scale group sees input
    y = ops.linear_q4gsw(x, weights, scales, gs)
    assert torch.equal(y, torch.zeros(2, N))


def test_linear_q4gsw_float64_input_is_computed_in_float64():
    weights, scales = random_q4gsw(12, 20, 4, seed=5)
    x = torch.randn(3, 20, dtype=torch.float64)
    y = ops.linear_q4gsw(x, weights, scales, 4)
    assert y.dtype == torch.float64
    # deq(W) is formed in float32 (q * s rounds once) and the product then runs in float64.
    assert_close_rel(y, x.numpy() @ deq_float64(weights, scales, 4).T, 1e-6, "float64 linear_q4gsw")


@pytest.mark.parametrize("N,K,group_size,lead,zero_groups", LINEAR_CASES)
def test_linear_q4gsw_backward_matches_float64(N, K, group_size, lead, zero_groups):
    weights, scales = random_q4gsw(N, K, group_size, seed=2 * N + K, zero_scale_groups=zero_groups)
    d_out = torch.randn(*lead, N, generator=torch.Generator().manual_seed(N))
    d_x = ops.linear_q4gsw_backward(d_out, weights, scales, group_size)
    assert d_x.dtype == torch.float32 and d_x.shape == (*lead, K)
    expected = d_out.double().numpy() @ deq_float64(weights, scales, group_size)
    assert_close_rel(d_x, expected, 1e-5, "linear_q4gsw_backward")


def test_linear_q4gsw_gradcheck_x_and_bias():
    weights, scales = random_q4gsw(12, 20, 4, seed=11, zero_scale_groups=(2,))
    x = torch.randn(2, 3, 20, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: ops.linear_q4gsw(x, weights, scales, 4, b), (x, bias))
    # Double backward: the adjoint of linear_q4gsw_backward is linear_q4gsw.
    assert torch.autograd.gradgradcheck(lambda x, b: ops.linear_q4gsw(x, weights, scales, 4, b), (x, bias))


def test_linear_q4gsw_autograd_equals_float64_formula():
    N, K, gs = 20, 36, 12
    weights, scales = random_q4gsw(N, K, gs, seed=13)
    x = torch.randn(4, 5, K, requires_grad=True)
    bias = torch.randn(N, requires_grad=True)
    d_out = torch.randn(4, 5, N)
    ops.linear_q4gsw(x, weights, scales, gs, bias).backward(d_out)
    assert_close_rel(x.grad, d_out.double().numpy() @ deq_float64(weights, scales, gs), 1e-5, "grad x")
    assert_close_rel(bias.grad, d_out.double().sum(dim=(0, 1)).numpy(), 1e-5, "grad bias")


def test_linear_q4gsw_weights_get_no_gradient():
    weights, scales = random_q4gsw(8, 16, 8, seed=1)
    scales.requires_grad_(True)
    x = torch.randn(3, 16, requires_grad=True)
    ops.linear_q4gsw(x, weights, scales, 8).sum().backward()
    assert x.grad is not None
    assert scales.grad is None


# ---- linear_dW -----------------------------------------------------------------------------------

@pytest.mark.parametrize("lead,N,K", [((7,), 12, 20), ((2, 3), 8, 36), ((), 4, 4), ((0,), 8, 12)])
def test_linear_dW_matches_float64(lead, N, K):
    gen = torch.Generator().manual_seed(N * K)
    d_out = torch.randn(*lead, N, generator=gen)
    x = torch.randn(*lead, K, generator=gen)
    dW = ops.linear_dW(d_out, x)
    assert dW.dtype == torch.float32 and dW.shape == (N, K)
    expected = np.einsum("rn,rk->nk", d_out.double().reshape(-1, N).numpy(), x.double().reshape(-1, K).numpy())
    if expected.size and np.abs(expected).max() > 0:
        assert_close_rel(dW, expected, 1e-5, "linear_dW")
    else:
        assert torch.equal(dW, torch.zeros(N, K))


def test_linear_dW_gradcheck():
    d_out = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.linear_dW, (d_out, x))


# ---- q4gsw_requant -------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K,group_size", [(8, 32, 8), (12, 20, 4), (4, 36, 12), (36, 132, 44)])
def test_requant_then_forward_equals_quantize_then_forward(N, K, group_size):
    gen = torch.Generator().manual_seed(N + 7 * K)
    latent = torch.randn(N, K, generator=gen)
    flat_ref, scales = ops.quantize_q4gsw(latent, group_size)
    codes = ops.q4gsw_requant(latent, scales, group_size)
    assert codes.dtype == torch.uint8 and codes.shape == (N, quant.padded_k(K) // 2)
    x = torch.randn(3, K, generator=gen)
    y = ops.linear_q4gsw(x, codes, scales, group_size)
    # Reference: quantize with vktrain.quant, decode in float64, multiply in float64.
    assert_close_rel(y, x.double().numpy() @ deq_float64(flat_ref, scales, group_size).T, 1e-5, "requant forward")
    assert torch.equal(codes, flat_ref)


@pytest.mark.parametrize("N,K,group_size", [(8, 32, 8), (12, 20, 4), (20, 36, 12)])
def test_requant_of_dequantized_weight_returns_same_codes(N, K, group_size):
    weights, scales = random_q4gsw(N, K, group_size, seed=N * K, zero_scale_groups=(0,))
    latent = torch.from_numpy(deq_float64(weights, scales, group_size).astype(np.float32))
    codes = ops.q4gsw_requant(latent, scales, group_size)
    q_in = quant.unpack_flat(weights.numpy(), K)
    # A zero-scale group dequantizes to 0 whatever its code, and re-quantizes to q = 0 (code 8).
    zero_scale = np.repeat(scales.numpy().T == 0, group_size, axis=1)
    np.testing.assert_array_equal(quant.unpack_flat(codes.numpy(), K), np.where(zero_scale, 0, q_in))
    if K % 8:
        assert np.all(codes.numpy()[:, -1] >> 4 == quant.CODE_ZERO), "padding nibbles must hold code 8"


def test_requant_rounds_half_to_even_and_clamps():
    # scale 0.5 makes latent / scale exact, so the ties are real ties.
    ratios = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, 7.5, -7.5, -8.5, 100.0, -100.0, 3.49, -3.51, 0.0, 7.0])
    latent = torch.from_numpy((ratios * 0.5).astype(np.float32)).reshape(4, 4)
    scales = torch.full((1, 4), 0.5)
    codes = ops.q4gsw_requant(latent, scales, 4)
    expected = np.clip(np.round(ratios), -8, 7).reshape(4, 4)  # np.round is half-to-even
    np.testing.assert_array_equal(quant.unpack_flat(codes.numpy(), 4), expected)
    assert expected.ravel()[:3].tolist() == [0, 2, 2]  # the ties really exercised round-half-even


def test_requant_zero_scale_gives_code_8_even_for_infinite_latent():
    latent = torch.tensor([[1.0, -np.inf, np.inf, 3.0]] * 4)
    codes = ops.q4gsw_requant(latent, torch.zeros(1, 4), 4)
    assert torch.all(codes == 0x88)


# ---- fused_ce ------------------------------------------------------------------------------------

CE_CASES = [
    # (R, V, labels spec, logit scale)
    (6, 5000, "masked", 3.0),      # V far above any workgroup size
    (5, 17, "all_valid", 1.0),
    (4, 1, "all_valid", 1.0),      # a single class: loss 0, gradient 0
    (8, 300, "masked", 1e4),       # huge logits: must not overflow
    (3, 64, "all_masked", 1.0),
]


def make_labels(R, V, spec, gen):
    labels = torch.randint(0, V, (R,), generator=gen)
    if spec == "masked":
        labels[::3] = -100
        labels[1] = -1  # any negative label is ignored, not only -100
    elif spec == "all_masked":
        labels[:] = -100
    return labels


@pytest.mark.parametrize("R,V,spec,scale", CE_CASES)
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_fused_ce_matches_float64(R, V, spec, scale, label_dtype):
    gen = torch.Generator().manual_seed(R * V)
    logits = torch.randn(R, V, generator=gen) * scale
    labels = make_labels(R, V, spec, gen).to(label_dtype)
    n_valid = torch.tensor(max(int((labels >= 0).sum()), 1), dtype=torch.float32)
    loss, dlogits = ops.fused_ce(logits, labels, n_valid)
    assert loss.shape == () and loss.dtype == torch.float32
    assert dlogits.shape == (R, V) and dlogits.dtype == torch.float32
    assert torch.isfinite(loss) and torch.isfinite(dlogits).all()
    ref_loss, ref_dlogits = ce_float64(logits, labels, float(n_valid))
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(abs(ref_loss), 1.0)
    assert np.abs(dlogits.double().numpy() - ref_dlogits).max() <= 1e-6
    masked = labels < 0
    assert torch.all(dlogits[masked] == 0)


def test_fused_ce_equals_torch_cross_entropy_and_its_gradient():
    gen = torch.Generator().manual_seed(0)
    R, V = 10, 333
    logits = torch.randn(R, V, generator=gen) * 4
    labels = torch.randint(0, V, (R,), generator=gen)
    labels[[2, 7]] = -100
    # n_valid deliberately differs from this batch's count, as with gradient accumulation.
    n_valid = torch.tensor(11.0)
    mine = logits.clone().requires_grad_(True)
    loss, dlogits = ops.fused_ce(mine, labels, n_valid)
    theirs = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(theirs, labels, ignore_index=-100, reduction="sum") / n_valid
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mine.grad, 2.5 * dlogits, rtol=0, atol=0)
    assert not dlogits.requires_grad


def test_fused_ce_gradcheck_float64():
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, -100, 0, 8, 5])
    n_valid = torch.tensor(4.0)
    assert torch.autograd.gradcheck(lambda z: ops.fused_ce(z, labels, n_valid)[0], (logits,))


def test_fused_ce_huge_logits_loss_is_exact():
    # Row 0: two equal maxima at 1e4 -> loss log(2); row 1: target far below the max -> loss ~ 2e4.
    logits = torch.full((2, 4), -1e4)
    logits[0, 1] = logits[0, 2] = 1e4
    logits[1, 3] = 1e4
    labels = torch.tensor([1, 0])
    loss, dlogits = ops.fused_ce(logits, labels, torch.tensor(2.0))
    assert math.isclose(float(loss), (math.log(2) + 2e4) / 2, rel_tol=1e-6)
    expected = torch.tensor([[0, -0.5, 0.5, 0], [-1, 0, 0, 1]]) / 2
    torch.testing.assert_close(dlogits, expected, rtol=0, atol=1e-7)


# ---- adamw ---------------------------------------------------------------------------------------

def f32(value):
    """The float32 value a runtime hparams tensor carries, as a Python float."""
    return float(np.float32(value))


def test_adamw_ten_steps_equal_torch_optim():
    lr, betas, eps, weight_decay = 3e-3, (0.9, 0.999), 1e-8, 0.1
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(7, 13, generator=gen)
    grads = [torch.randn(7, 13, generator=gen) * (0.1 + i) for i in range(10)]

    reference = torch.nn.Parameter(init.clone())
    # torch.optim gets the float32 values the hparams tensor really carries: that is the same optimizer.
    optimizer = torch.optim.AdamW([reference], lr=f32(lr), betas=(f32(betas[0]), f32(betas[1])),
                                  eps=f32(eps), weight_decay=f32(weight_decay))
    hparams = ops.adamw_hparams(lr, betas[0], betas[1], eps, weight_decay)
    param, exp_avg, exp_avg_sq = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    for t, grad in enumerate(grads, start=1):
        reference.grad = grad.clone()
        optimizer.step()
        param, exp_avg, exp_avg_sq = ops.adamw(param, exp_avg, exp_avg_sq, grad, hparams,
                                               torch.tensor(float(t)))
        state = optimizer.state[reference]
        torch.testing.assert_close(param, reference.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-6, atol=0)
        # m = b1*m + (1-b1)*g (spec) vs torch's lerp round differently; where they cancel to ~0 the
        # elementwise ratio is meaningless, so exp_avg is compared relative to its magnitude.
        assert_close_rel(exp_avg, state["exp_avg"], 1e-6, f"exp_avg at step {t}")
    assert not torch.equal(param, init)


def test_adamw_single_step_matches_float64_formula_and_is_functional():
    gen = torch.Generator().manual_seed(1)
    param, exp_avg, grad = (torch.randn(50, generator=gen) for _ in range(3))
    exp_avg_sq = torch.rand(50, generator=gen)
    inputs = [t.clone() for t in (param, exp_avg, exp_avg_sq, grad)]
    hparams = ops.adamw_hparams(1e-2, 0.8, 0.99, 1e-6, 0.05)
    lr, b1, b2, eps, wd = (float(v) for v in hparams.double())
    t = 4
    new_param, new_m, new_v = ops.adamw(param, exp_avg, exp_avg_sq, grad, hparams, torch.tensor(float(t)))
    p, m, v, g = (x.double().numpy() for x in (param, exp_avg, exp_avg_sq, grad))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    assert_close_rel(new_param, p, 1e-6, "param")
    assert_close_rel(new_m, m, 1e-6, "exp_avg")
    assert_close_rel(new_v, v, 1e-6, "exp_avg_sq")
    for before, after in zip(inputs, (param, exp_avg, exp_avg_sq, grad)):
        assert torch.equal(before, after), "adamw must not mutate its inputs"


def test_adamw_and_requant_do_not_extend_the_autograd_graph():
    param = torch.nn.Parameter(torch.randn(8, 16))
    outputs = ops.adamw(param, torch.zeros(8, 16), torch.zeros(8, 16), torch.randn(8, 16), ops.adamw_hparams(1e-3),
                        torch.tensor(1.0))
    assert [t.requires_grad for t in outputs] == [False, False, False]
    _, scales = ops.quantize_q4gsw(param, 8)
    codes = ops.q4gsw_requant(param, scales, 8)
    assert not codes.requires_grad and codes.grad_fn is None


# ---- .out overloads --------------------------------------------------------------------------------

def test_out_overloads_write_into_out_and_match_functional():
    weights, scales = random_q4gsw(12, 20, 4, seed=21)
    x = torch.randn(3, 20)
    bias = torch.randn(12)
    out = torch.empty(3, 12)
    returned = torch.ops.vktrain.linear_q4gsw.out(x, weights, scales, 4, bias, out=out)
    assert returned is out
    assert torch.equal(out, ops.linear_q4gsw(x, weights, scales, 4, bias))

    d_out = torch.randn(3, 12)
    out = torch.empty(3, 20)
    torch.ops.vktrain.linear_q4gsw_backward.out(d_out, weights, scales, 4, out=out)
    assert torch.equal(out, ops.linear_q4gsw_backward(d_out, weights, scales, 4))

    out = torch.empty(12, 20)
    torch.ops.vktrain.linear_dW.out(d_out, x, out=out)
    assert torch.equal(out, ops.linear_dW(d_out, x))

    latent = torch.randn(12, 20)
    out = torch.empty(12, 12, dtype=torch.uint8)
    torch.ops.vktrain.q4gsw_requant.out(latent, scales, 4, out=out)
    assert torch.equal(out, ops.q4gsw_requant(latent, scales, 4))

    logits, labels, n_valid = torch.randn(4, 9), torch.tensor([1, -100, 8, 0]), torch.tensor(3.0)
    loss_out, dlogits_out = torch.empty(()), torch.empty(4, 9)
    returned = torch.ops.vktrain.fused_ce.out(logits, labels, n_valid, loss_out=loss_out, dlogits_out=dlogits_out)
    assert returned[0] is loss_out and returned[1] is dlogits_out
    loss, dlogits = ops.fused_ce(logits, labels, n_valid)
    assert torch.equal(loss_out, loss) and torch.equal(dlogits_out, dlogits)


def test_adamw_out_may_alias_its_inputs():
    gen = torch.Generator().manual_seed(2)
    param, exp_avg, grad = (torch.randn(10, generator=gen) for _ in range(3))
    exp_avg_sq = torch.rand(10, generator=gen)
    hparams, step = ops.adamw_hparams(1e-2), torch.tensor(3.0)
    expected = ops.adamw(param, exp_avg, exp_avg_sq, grad, hparams, step)
    torch.ops.vktrain.adamw.out(param, exp_avg, exp_avg_sq, grad, hparams, step,
                                param_out=param, exp_avg_out=exp_avg, exp_avg_sq_out=exp_avg_sq)
    for got, want in zip((param, exp_avg, exp_avg_sq), expected):
        assert torch.equal(got, want)


def test_out_overload_refuses_wrong_dtype():
    with pytest.raises(TypeError, match="out tensor 'out' has dtype torch.float64, expected torch.float32"):
        torch.ops.vktrain.linear_dW.out(torch.randn(2, 4), torch.randn(2, 4),
                                        out=torch.empty(4, 4, dtype=torch.float64))


# ---- fake kernels and registration -----------------------------------------------------------------

def example_calls():
    weights, scales = random_q4gsw(12, 20, 4, seed=0)
    return {
        "linear_q4gsw": (torch.randn(2, 3, 20), weights, scales, 4, torch.randn(12)),
        "linear_q4gsw_backward": (torch.randn(2, 3, 12), weights, scales, 4),
        "linear_dW": (torch.randn(2, 3, 12), torch.randn(2, 3, 20)),
        "q4gsw_requant": (torch.randn(12, 20), scales, 4),
        "fused_ce": (torch.randn(4, 9), torch.tensor([1, -100, 8, 0]), torch.tensor(3.0)),
        "adamw": (torch.randn(5), torch.randn(5), torch.rand(5), torch.randn(5), ops.adamw_hparams(1e-3),
                  torch.tensor(2.0)),
    }


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_fake_kernel_matches_eager_metadata(name):
    args = example_calls()[name]
    op = getattr(torch.ops.vktrain, name).default
    eager = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    eager, fake = (r if isinstance(r, tuple) else (r,) for r in (eager, fake))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in eager]


def test_multi_output_out_overloads_trace_under_fake_tensors():
    with FakeTensorMode() as mode:
        logits, labels, n_valid = (mode.from_tensor(t) for t in example_calls()["fused_ce"][:3])
        loss_out, dlogits_out = torch.empty(()), torch.empty(4, 9)
        returned = torch.ops.vktrain.fused_ce.out(logits, labels, n_valid, loss_out=loss_out, dlogits_out=dlogits_out)
        assert returned[0] is loss_out and returned[1] is dlogits_out
        args = [mode.from_tensor(t) for t in example_calls()["adamw"]]
        outs = [torch.empty(5) for _ in range(3)]
        returned = torch.ops.vktrain.adamw.out(*args, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2])
        assert all(r is o for r, o in zip(returned, outs))
        with pytest.raises(ValueError, match=r"out tensor 'dlogits_out' is torch.float32 \(4, 8\), expected"):
            torch.ops.vktrain.fused_ce.out(logits, labels, n_valid, loss_out=loss_out, dlogits_out=torch.empty(4, 8))


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_opcheck(name):
    """torch.library.opcheck: schema vs. behaviour, autograd registration, fake kernels, AOT autograd."""
    torch.library.opcheck(getattr(torch.ops.vktrain, name).default, example_calls()[name],
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


# ---- validation ----------------------------------------------------------------------------------

W12, S12 = random_q4gsw(12, 20, 4, seed=9)  # N=12, K=20, group_size=4


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12.to(torch.int8), S12, 4), TypeError,
     "weights must have dtype uint8, got int8"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12, S12.double(), 4), TypeError,
     "scales must have dtype float32"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20).half(), W12, S12, 4), TypeError,
     "x must have dtype float32 or float64, got float16"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 24), W12, S12, 4), ValueError,
     r"x must have shape \[..., 20\]"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12[:8], S12, 4), ValueError,
     r"weights shape \(8, 12\) does not match .* expected flat uint8 \[N, Kp/2\] = \[12, 12\]"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12.reshape(-1), S12, 4), ValueError,
     r"weights must be 2-D \[N, Kp/2\]"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12, S12.T.contiguous(), 4), ValueError,
     "N=5 \\(out features\\) must be a multiple of 4"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 30), torch.zeros(12, 16, dtype=torch.uint8), torch.ones(5, 12), 6),
     ValueError, "group_size=6 must be a positive multiple of 4"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), torch.zeros(6, 12, dtype=torch.uint8), torch.ones(5, 6), 4),
     ValueError, "N=6 \\(out features\\) must be a multiple of 4"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12, S12, 4, torch.randn(13)), ValueError,
     r"bias must have shape \[N\] = \[12\]"),
    (lambda: ops.linear_q4gsw(torch.randn(3, 20), W12, S12, 4, torch.randn(12).double()), TypeError,
     "bias has dtype float64 but x has float32"),
    (lambda: ops.linear_q4gsw_backward(torch.randn(3, 8), W12, S12, 4), ValueError,
     r"d_out must have shape \[..., 12\]"),
    (lambda: ops.linear_dW(torch.randn(3, 8), torch.randn(4, 12)), ValueError,
     "must share their leading"),
    (lambda: ops.linear_dW(torch.randn(3, 8), torch.randn(3, 12).double()), TypeError,
     "x has dtype float64 but d_out has float32"),
    (lambda: ops.q4gsw_requant(torch.randn(8, 20), torch.ones(2, 8), 8), ValueError,
     "K=20 must be a multiple of group_size=8"),
    (lambda: ops.q4gsw_requant(torch.randn(8, 18), torch.ones(9, 8), 2), ValueError,
     "group_size=2 must be a positive multiple of 4; K=18 \\(in features\\) must be a multiple of 4"),
    (lambda: ops.q4gsw_requant(torch.randn(8, 16), torch.ones(2, 4), 8), ValueError,
     r"scales must have shape \[G, N\] = \[2, 8\]"),
    (lambda: ops.q4gsw_requant(torch.full((4, 4), float("nan")), torch.ones(1, 4), 4), ValueError,
     "latent contains NaN"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.zeros(4), torch.tensor(3.0)), TypeError,
     "labels must have dtype int64 or int32, got float32"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.zeros(5, dtype=torch.long), torch.tensor(3.0)), ValueError,
     r"labels must have shape \[R\] = \[4\]"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.tensor([0, 9, 1, 2]), torch.tensor(3.0)), ValueError,
     r"labels must be < V=9 .* got labels\[1\]=9"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.zeros(4, dtype=torch.long), torch.tensor([3.0])), ValueError,
     r"n_valid must be 0-D"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.zeros(4, dtype=torch.long), torch.tensor(3)), TypeError,
     "n_valid must have dtype float32, got int64"),
    (lambda: ops.fused_ce(torch.randn(4, 9), torch.zeros(4, dtype=torch.long), torch.tensor(0.0)), ValueError,
     "n_valid must be a finite number > 0"),
    (lambda: ops.fused_ce(torch.randn(36), torch.zeros(4, dtype=torch.long), torch.tensor(1.0)), ValueError,
     r"logits must be 2-D \[R, V\]"),
    (lambda: ops.adamw(*example_calls()["adamw"][:4], torch.ones(4), torch.tensor(1.0)), ValueError,
     r"hparams must have shape \[5\] = \[lr, beta1, beta2, eps, weight_decay\]"),
    (lambda: ops.adamw(*example_calls()["adamw"][:5], torch.tensor(0.0)), ValueError,
     "step=0.0 must be a whole number >= 1"),
    (lambda: ops.adamw(*example_calls()["adamw"][:5], torch.tensor(1)), TypeError,
     "step must have dtype float32, got int64"),
    (lambda: ops.adamw(*example_calls()["adamw"][:4], ops.adamw_hparams(1e-3, beta1=1.0),
                       torch.tensor(1.0)), ValueError, r"beta1=1.0 must lie in \[0, 1\)"),
    (lambda: ops.adamw(torch.randn(5), torch.randn(5), torch.rand(6), torch.randn(5), ops.adamw_hparams(1e-3),
                       torch.tensor(1.0)), ValueError, r"exp_avg_sq must match param \(float32 \(5,\)\)"),
])
def test_bad_input_raises_naming_the_problem(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_validation_also_runs_at_trace_time():
    """The fake kernels refuse the same shapes, so a bad model fails at export, not on the GPU."""
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 24))
        weights, scales = mode.from_tensor(W12), mode.from_tensor(S12)
        with pytest.raises(ValueError, match=r"x must have shape \[..., 20\]"):
            torch.ops.vktrain.linear_q4gsw(x, weights, scales, 4)

"""vktrain's transformer ops (rms_norm, rope, causal_attention, swiglu and their backward ops) against
independent float64 references: numpy formulas written out here (attention as an explicit per-row masked
softmax, rope as a complex-number rotation), float64 torch autograd through plain formulas for the
backward ops, gradcheck of the registered autograd, and torch.export / ExecuTorch lowering."""
import math

import numpy as np
import pytest
import torch
from executorch.exir import to_edge
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.experimental import _export_forward_backward

import vktrain.ops as ops


def generator(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=generator(seed), dtype=torch.float64) * scale).to(dtype)


def rope_tables(seq_len, head_dim, theta=10000.0, dtype=torch.float32):
    """cos/sin [S, D/2] of the angles position * theta^(-2i/D), formed in float64."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return torch.from_numpy(np.cos(angles)).to(dtype), torch.from_numpy(np.sin(angles)).to(dtype)


def assert_close_rel(actual, expected, rtol, what):
    """Max abs error relative to the reference's largest magnitude."""
    actual = np.asarray(torch.as_tensor(actual).detach(), dtype=np.float64)
    expected = np.asarray(torch.as_tensor(expected).detach(), dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
    err = np.abs(actual - expected).max(initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


# ---- float64 references (numpy, straight from the definitions) ------------------------------------

def rms_norm_float64(x, weight, eps):
    x = x.numpy().astype(np.float64)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x * rstd * weight.numpy().astype(np.float64), rstd


def rope_complex(x, cos, sin):
    """Pairs (i, i + D/2) as complex numbers x_i + 1j x_{i+D/2}, multiplied by exp(1j * angle)."""
    x = x.numpy().astype(np.float64)
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    rotation = (cos.numpy().astype(np.float64) + 1j * sin.numpy().astype(np.float64))[None, :, None, :]
    rotated = z * rotation
    return np.concatenate([rotated.real, rotated.imag], axis=-1)


def attention_float64(q, k, v, scale):
    """Explicit loops: query (b, i, h) attends keys j <= i of kv head h // (Hq / Hkv)."""
    q, k, v = (t.numpy().astype(np.float64) for t in (q, k, v))
    batch, seq_len, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    out = np.zeros_like(q)
    lse = np.zeros((batch, q_heads, seq_len))
    for b in range(batch):
        for h in range(q_heads):
            kv = h // group
            for i in range(seq_len):
                scores = np.array([scale * q[b, i, h] @ k[b, j, kv] for j in range(i + 1)])
                m = scores.max()
                weights = np.exp(scores - m)
                lse[b, h, i] = m + math.log(weights.sum())
                out[b, i, h] = (weights / weights.sum()) @ v[b, : i + 1, kv]
    return out, lse


def swiglu_float64(gate, up):
    g = gate.numpy().astype(np.float64)
    return g / (1 + np.exp(-g)) * up.numpy().astype(np.float64)


# Plain float64 torch formulas, differentiated by torch autograd: the references for the backward ops.

def rms_norm_autograd_ref(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention_autograd_ref(q, k, v, scale):
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    seq_len = q.shape[1]
    mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def swiglu_autograd_ref(gate, up):
    return gate * torch.sigmoid(gate) * up


# ---- rms_norm ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,eps,scale", [
    ((2, 5, 16), 1e-5, 1.0),
    ((7,), 1e-6, 1.0),                # 1-D x
    ((3, 2, 4, 12), 0.0, 1.0),        # eps = 0
    ((4, 64), 1e-5, 1e3),             # large activations: rstd is scale invariant
    ((4, 32), 1e-2, 1e-3),            # eps dominates mean(x^2)
])
def test_rms_norm_matches_float64_formula(shape, eps, scale):
    x = randn(*shape, seed=1, scale=scale)
    weight = randn(shape[-1], seed=2)
    y, rstd = ops.rms_norm(x, weight, eps)
    y_ref, rstd_ref = rms_norm_float64(x, weight, eps)
    assert y.dtype == rstd.dtype == torch.float32
    assert rstd.shape == (*shape[:-1], 1)
    assert_close_rel(y, y_ref, 2e-6, "y")
    assert_close_rel(rstd, rstd_ref, 2e-6, "rstd")


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
def test_rms_norm_backward_matches_autograd_of_the_formula(dtype, rtol):
    x = randn(3, 4, 24, seed=3, dtype=torch.float64)
    weight = randn(24, seed=4, dtype=torch.float64)
    d_y = randn(3, 4, 24, seed=5, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    rms_norm_autograd_ref(x_ref, weight, 1e-5).backward(d_y)
    _, rstd = ops.rms_norm(x.to(dtype), weight.to(dtype), 1e-5)
    d_x = ops.rms_norm_backward(d_y.to(dtype), x.to(dtype), weight.to(dtype), rstd)
    assert d_x.dtype == dtype
    assert_close_rel(d_x, x_ref.grad, rtol, "d_x")


def test_rms_norm_refuses_a_weight_that_requires_grad():
    x = randn(2, 8, seed=6).requires_grad_(True)
    weight = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no gradient for its weight .* freeze it first"):
        ops.rms_norm(x, weight, 1e-5)
    # Without grad mode nothing is differentiated, so the same call is fine.
    with torch.no_grad():
        y, _ = ops.rms_norm(x, weight, 1e-5)
    assert_close_rel(y, rms_norm_float64(x.detach(), weight.detach(), 1e-5)[0], 2e-6, "y under no_grad")


# ---- rope ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,theta", [((2, 6, 3, 8), 10000.0), ((1, 33, 2, 16), 500000.0), ((3, 1, 1, 2), 10.0)])
def test_rope_matches_complex_rotation(shape, theta):
    x = randn(*shape, seed=7)
    cos, sin = rope_tables(shape[1], shape[3], theta)
    y = ops.rope(x, cos, sin)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close_rel(y, rope_complex(x, cos, sin), 1e-6, "rope(x)")


def test_rope_with_negated_sin_inverts_the_rotation_and_is_the_autograd_backward():
    x = randn(2, 5, 4, 8, seed=8, dtype=torch.float64)
    cos, sin = rope_tables(5, 8, dtype=torch.float64)
    y = ops.rope(x, cos, sin)
    assert_close_rel(ops.rope(y, cos, -sin), x, 1e-14, "rope(rope(x, cos, sin), cos, -sin)")
    # The adjoint of a rotation is its inverse: d_x = rotate(d_y, -angle), i.e. multiply by the conjugate.
    d_y = randn(2, 5, 4, 8, seed=9, dtype=torch.float64)
    x_req = x.clone().requires_grad_(True)
    ops.rope(x_req, cos, sin).backward(d_y)
    assert_close_rel(x_req.grad, rope_complex(d_y, cos, -sin), 1e-14, "d_x")


def test_rope_refuses_tables_that_require_grad():
    x = randn(1, 3, 2, 4, seed=10).requires_grad_(True)
    cos, sin = rope_tables(3, 4)
    with pytest.raises(RuntimeError, match="no gradient for its cos/sin tables"):
        ops.rope(x, cos, sin.requires_grad_(True))


# ---- causal_attention ---------------------------------------------------------------------------------

# (B, S, Hq, Hkv, D)
ATTENTION_CASES = [
    (2, 7, 2, 2, 8),     # multi-head
    (1, 9, 4, 2, 16),    # grouped-query
    (2, 5, 6, 1, 4),     # multi-query
    (1, 1, 2, 1, 8),     # a single position
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_causal_attention_matches_explicit_masked_softmax(case):
    batch, seq_len, q_heads, kv_heads, head_dim = case
    q = randn(batch, seq_len, q_heads, head_dim, seed=11)
    k = randn(batch, seq_len, kv_heads, head_dim, seed=12)
    v = randn(batch, seq_len, kv_heads, head_dim, seed=13)
    scale = 1 / math.sqrt(head_dim)
    out, lse = ops.causal_attention(q, k, v, scale)
    out_ref, lse_ref = attention_float64(q, k, v, scale)
    assert out.shape == (batch, seq_len, q_heads, head_dim) and lse.shape == (batch, q_heads, seq_len)
    assert_close_rel(out, out_ref, 5e-6, "out")
    assert_close_rel(lse, lse_ref, 5e-6, "lse")


def test_causal_attention_is_stable_for_large_scores():
    # Scores ~1e3 overflow exp() without max subtraction.
    q = randn(1, 6, 2, 8, seed=14, scale=30.0)
    k = randn(1, 6, 1, 8, seed=15, scale=30.0)
    v = randn(1, 6, 1, 8, seed=16)
    out, lse = ops.causal_attention(q, k, v, 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    out_ref, lse_ref = attention_float64(q, k, v, 1.0)
    assert_close_rel(out, out_ref, 1e-5, "out")
    assert_close_rel(lse, lse_ref, 1e-5, "lse")


@pytest.mark.parametrize("case", ATTENTION_CASES[:3])
def test_causal_attention_backward_matches_autograd_of_the_formula(case):
    batch, seq_len, q_heads, kv_heads, head_dim = case
    q = randn(batch, seq_len, q_heads, head_dim, seed=17, dtype=torch.float64)
    k = randn(batch, seq_len, kv_heads, head_dim, seed=18, dtype=torch.float64)
    v = randn(batch, seq_len, kv_heads, head_dim, seed=19, dtype=torch.float64)
    d_out = randn(batch, seq_len, q_heads, head_dim, seed=20, dtype=torch.float64)
    scale = 0.7
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention_autograd_ref(*leaves, scale).backward(d_out)
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        q32, k32, v32, d32 = (t.to(dtype) for t in (q, k, v, d_out))
        out, lse = ops.causal_attention(q32, k32, v32, scale)
        grads = ops.causal_attention_backward(d32, q32, k32, v32, out, lse, scale)
        for name, got, leaf in zip(("d_q", "d_k", "d_v"), grads, leaves):
            assert got.dtype == dtype and got.shape == leaf.shape
            assert_close_rel(got, leaf.grad, rtol, f"{name} ({dtype})")


# ---- swiglu -------------------------------------------------------------------------------------------

def test_swiglu_and_backward_match_float64_formulas():
    gate = randn(3, 5, 24, seed=21, scale=4.0)
    up = randn(3, 5, 24, seed=22)
    assert_close_rel(ops.swiglu(gate, up), swiglu_float64(gate, up), 2e-6, "swiglu")
    d_h = randn(3, 5, 24, seed=23, dtype=torch.float64)
    leaves = [t.double().requires_grad_(True) for t in (gate, up)]
    swiglu_autograd_ref(*leaves).backward(d_h)
    d_gate, d_up = ops.swiglu_backward(d_h.float(), gate, up)
    assert_close_rel(d_gate, leaves[0].grad, 5e-6, "d_gate")
    assert_close_rel(d_up, leaves[1].grad, 5e-6, "d_up")


# ---- gradcheck (float64) of the registered autograd ----------------------------------------------------

def test_gradcheck_rms_norm():
    x = randn(2, 3, 6, seed=24, dtype=torch.float64).requires_grad_(True)
    weight = randn(6, seed=25, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: ops.rms_norm(t, weight, 1e-3)[0], (x,))


def test_gradcheck_rope():
    x = randn(2, 4, 2, 6, seed=26, dtype=torch.float64).requires_grad_(True)
    cos, sin = rope_tables(4, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: ops.rope(t, cos, sin), (x,))


def test_gradcheck_causal_attention_gqa():
    q = randn(1, 5, 4, 3, seed=27, dtype=torch.float64).requires_grad_(True)
    k = randn(1, 5, 2, 3, seed=28, dtype=torch.float64).requires_grad_(True)
    v = randn(1, 5, 2, 3, seed=29, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, c: ops.causal_attention(a, b, c, 0.8)[0], (q, k, v))


def test_gradcheck_causal_attention_with_documents():
    """Packed documents: the registered autograd (through causal_attention_backward with the positions)
    is the float64 finite-difference gradient, and no gradient crosses a document boundary."""
    q, k, v = (randn(2, 7, heads, 4, seed=60 + heads, dtype=torch.float64).requires_grad_() for heads in (4, 2, 2))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])
    assert torch.autograd.gradcheck(lambda a, b, c: ops.causal_attention(a, b, c, 0.8, positions)[0], (q, k, v))
    out, _ = ops.causal_attention(q, k, v, 0.8, positions)
    d_k, d_v = torch.autograd.grad(out[0, :3].sum(), (k, v))  # the first document's outputs of row 0
    assert d_k[0, 3:].abs().max() == 0 and d_v[0, 3:].abs().max() == 0 and d_v[0, :3].abs().max() > 0
    assert d_v[1].abs().max() == 0


def test_causal_attention_refuses_positions_of_another_shape():
    q, k, v = randn(2, 3, 4, 8, seed=34), randn(2, 3, 2, 8, seed=35), randn(2, 3, 2, 8, seed=36)
    with pytest.raises(Exception, match=r"positions must have shape \[B, S\] = \[2, 3\]"):
        ops.causal_attention(q, k, v, 0.5, torch.zeros(3, 2, dtype=torch.int64))


def test_gradcheck_swiglu():
    gate = randn(3, 7, seed=30, dtype=torch.float64, scale=3.0).requires_grad_(True)
    up = randn(3, 7, seed=31, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(ops.swiglu, (gate, up))


# ---- fake kernels, .out overloads, opcheck ---------------------------------------------------------------

def example_calls():
    x = randn(2, 3, 8, seed=32)
    weight = randn(8, seed=33)
    _, rstd = ops.rms_norm(x, weight, 1e-5)
    cos, sin = rope_tables(3, 8)
    q, k, v = randn(2, 3, 4, 8, seed=34), randn(2, 3, 2, 8, seed=35), randn(2, 3, 2, 8, seed=36)
    out, lse = ops.causal_attention(q, k, v, 0.5)
    gate, up = randn(2, 3, 12, seed=37), randn(2, 3, 12, seed=38)
    return {
        "rms_norm": (x, weight, 1e-5),
        "rms_norm_backward": (randn(2, 3, 8, seed=39), x, weight, rstd),
        "rope": (q, cos, sin),
        "causal_attention": (q, k, v, 0.5),
        "causal_attention_backward": (randn(2, 3, 4, 8, seed=40), q, k, v, out, lse, 0.5),
        "swiglu": (gate, up),
        "swiglu_backward": (randn(2, 3, 12, seed=41), gate, up),
    }


@pytest.mark.parametrize("name", ops.TRANSFORMER_OP_NAMES)
def test_out_overload_writes_what_the_functional_op_returns(name):
    args = example_calls()[name]
    functional = getattr(torch.ops.vktrain, name).default(*args)
    functional = functional if isinstance(functional, tuple) else (functional,)
    schema = getattr(torch.ops.vktrain, name).out._schema
    out_names = [a.name for a in schema.arguments if a.kwarg_only]
    # Wrong-sized outs are resized (aten's out= convention); the returned tensors are the outs themselves.
    outs = {n: torch.empty(0) for n in out_names}
    returned = getattr(torch.ops.vktrain, name).out(*args, **outs)
    returned = returned if isinstance(returned, tuple) else (returned,)
    assert len(returned) == len(functional) == len(out_names)
    for n, r, f in zip(out_names, returned, functional):
        assert r is outs[n]
        assert torch.equal(r, f), f"{name}.out {n}"
    with pytest.raises(TypeError, match=f"out tensor '{out_names[0]}' has dtype torch.float64"):
        getattr(torch.ops.vktrain, name).out(*args, **{n: torch.empty(0, dtype=torch.float64) for n in out_names})


@pytest.mark.parametrize("name", ops.TRANSFORMER_OP_NAMES)
def test_fake_kernel_matches_eager_metadata(name):
    args = example_calls()[name]
    op = getattr(torch.ops.vktrain, name).default
    eager = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    eager, fake = (r if isinstance(r, tuple) else (r,) for r in (eager, fake))
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in eager]


@pytest.mark.parametrize("name", ops.TRANSFORMER_OP_NAMES)
def test_opcheck(name):
    """torch.library.opcheck: schema vs. behaviour, autograd registration, fake kernels, AOT autograd."""
    args = example_calls()[name]
    if name in ("rms_norm", "rope", "causal_attention", "swiglu"):
        # Inputs that require grad exercise the registered autograd (frozen weight / tables stay frozen).
        frozen = {"rms_norm": {1}, "rope": {1, 2}}.get(name, set())
        args = tuple(a.clone().requires_grad_(i not in frozen) if isinstance(a, torch.Tensor) else a
                     for i, a in enumerate(args))
    torch.library.opcheck(getattr(torch.ops.vktrain, name).default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


# ---- validation ----------------------------------------------------------------------------------------

X = randn(2, 3, 8, seed=42)
Q, K, V = randn(2, 3, 4, 8, seed=43), randn(2, 3, 2, 8, seed=44), randn(2, 3, 2, 8, seed=45)
COS, SIN = rope_tables(3, 8)


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.rms_norm(X.half(), torch.ones(8).half(), 1e-5), TypeError,
     "x must have dtype float32 or float64, got float16"),
    (lambda: ops.rms_norm(X, torch.ones(7), 1e-5), ValueError, r"weight must have shape \[D\] = \[8\]"),
    (lambda: ops.rms_norm(X, torch.ones(8).double(), 1e-5), TypeError,
     "weight has dtype float64 but x has float32"),
    (lambda: ops.rms_norm(X, torch.ones(8), -1.0), ValueError, "eps must be >= 0"),
    (lambda: ops.rms_norm(X, torch.ones(8), float("nan")), ValueError, "eps must be finite"),
    (lambda: ops.rms_norm_backward(X, X, torch.ones(8), torch.ones(2, 3)), ValueError,
     r"rstd must have shape \[..., 1\] = \[2, 3, 1\]"),
    (lambda: ops.rms_norm_backward(X[:1], X, torch.ones(8), torch.ones(2, 3, 1)), ValueError,
     r"d_y must have the shape of x \(2, 3, 8\), got \(1, 3, 8\)"),
    (lambda: ops.rope(X, COS, SIN), ValueError, r"x must be 4-D \[B, S, H, D\]"),
    (lambda: ops.rope(randn(1, 3, 2, 7, seed=0), COS, SIN), ValueError, "head dim D must be even"),
    (lambda: ops.rope(Q, COS[:2], SIN), ValueError, r"cos must have shape \[S, D/2\] = \[3, 4\]"),
    (lambda: ops.rope(Q, COS, SIN.double()), TypeError, "sin has dtype float64 but x has float32"),
    (lambda: ops.causal_attention(Q, randn(2, 3, 3, 8, seed=0), randn(2, 3, 3, 8, seed=0), 0.5), ValueError,
     "multiple of the number of kv heads .* Hq=4 .* Hkv=3"),
    (lambda: ops.causal_attention(Q, K[:, :2], V[:, :2], 0.5), ValueError,
     r"k and v must have shape \[B, S, Hkv, D\] with B, S, D of q"),
    (lambda: ops.causal_attention(Q, K, V[..., :4], 0.5), ValueError, "v must have the shape of k"),
    (lambda: ops.causal_attention(Q, K.double(), V, 0.5), TypeError, "k has dtype float64 but q has"),
    (lambda: ops.causal_attention(Q, K, V, float("inf")), ValueError, "scale must be finite"),
    (lambda: ops.causal_attention(Q[0], K[0], V[0], 0.5), ValueError, r"q must be 4-D \[B, S, Hq, D\]"),
    (lambda: ops.causal_attention_backward(Q, Q, K, V, Q, torch.zeros(2, 3, 4), 0.5), ValueError,
     r"lse must have shape \[B, Hq, S\] = \[2, 4, 3\]"),
    (lambda: ops.causal_attention_backward(Q[..., :4], Q, K, V, Q, torch.zeros(2, 4, 3), 0.5), ValueError,
     "d_out must have the shape of q"),
    (lambda: ops.swiglu(X, X[..., :4]), ValueError, r"up must have the shape of gate \(2, 3, 8\)"),
    (lambda: ops.swiglu(X.to(torch.int32), X), TypeError, "gate must have dtype"),
    (lambda: ops.swiglu_backward(X.double(), X, X), TypeError, "d_h has dtype float64 but gate has"),
])
def test_bad_inputs_are_refused_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---- export ----------------------------------------------------------------------------------------------

class Block(torch.nn.Module):
    """A pre-norm attention + SwiGLU block made of the fused ops only (no projections)."""

    def __init__(self, seq_len, q_heads, kv_heads, head_dim):
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.register_buffer("norm_weight", randn(q_heads * head_dim, seed=46))
        cos, sin = rope_tables(seq_len, head_dim)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, k, v):
        batch, seq_len, _ = x.shape
        h, _ = ops.rms_norm(x, self.norm_weight, 1e-5)
        q = ops.rope(h.view(batch, seq_len, self.q_heads, self.head_dim), self.cos, self.sin)
        attn, _ = ops.causal_attention(q, ops.rope(k, self.cos, self.sin), v, self.head_dim ** -0.5)
        attn = attn.reshape(batch, seq_len, -1)
        return (ops.swiglu(attn, h) * x).sum()


def test_fused_ops_export_as_single_nodes_and_the_joint_graph_uses_their_backward_ops():
    block = Block(seq_len=6, q_heads=4, kv_heads=2, head_dim=8)
    inputs = (randn(2, 6, 32, seed=47).requires_grad_(True), randn(2, 6, 2, 8, seed=48).requires_grad_(True),
              randn(2, 6, 2, 8, seed=49).requires_grad_(True))
    ep = torch.export.export(block, tuple(t.detach() for t in inputs))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    vk = [t for t in targets if "vktrain" in str(t)]
    assert vk == [torch.ops.vktrain.rms_norm.default, torch.ops.vktrain.rope.default, torch.ops.vktrain.rope.default,
                  torch.ops.vktrain.causal_attention.default, torch.ops.vktrain.swiglu.default]
    # Attention stays one node: no softmax, no [B, H, S, S] matmul.
    assert not any("softmax" in str(t) or "bmm" in str(t) or "matmul" in str(t) for t in targets)

    # Joint graph w.r.t. the three inputs: export as a loss module with them as trainable parameters.
    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            self.x, self.k, self.v = (torch.nn.Parameter(t.detach().clone()) for t in inputs)

        def forward(self):
            return (self.block(self.x, self.k, self.v),)

    loss_module = Loss()
    joint = _export_forward_backward(torch.export.export(loss_module, ()))
    joint_targets = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    for op in ("rms_norm_backward", "causal_attention_backward", "swiglu_backward"):
        assert joint_targets.count(getattr(torch.ops.vktrain, op).default) == 1, op
    # Forward rope twice, backward rope twice (with neg(sin)).
    assert joint_targets.count(torch.ops.vktrain.rope.default) == 4
    assert not any("softmax" in str(t) or "bmm" in str(t) for t in joint_targets)

    # The joint graph computes eager autograd's gradients.
    block(*inputs).backward()
    params = dict(loss_module.named_parameters())
    buffers = dict(loss_module.named_buffers())
    flat = [params.get(s.target, buffers.get(s.target)) for s in joint.graph_signature.input_specs]
    results = dict(zip((s.target or "loss" for s in joint.graph_signature.output_specs), joint.graph_module(*flat)))
    for name, leaf in zip(("x", "k", "v"), inputs):
        torch.testing.assert_close(results[name], leaf.grad, msg=f"gradient of {name}")

    lowered = to_edge(joint).to_executorch()
    lowered_targets = {n.target for n in lowered.exported_program().graph.nodes if "vktrain" in str(n.target)}
    assert lowered_targets == {getattr(torch.ops.vktrain, n).out for n in
                               ("rms_norm", "rms_norm_backward", "rope", "causal_attention",
                                "causal_attention_backward", "swiglu", "swiglu_backward")}

"""GPU kernels of the transformer ops (rms_norm, rope, causal_attention, swiglu, and their backwards) on
lavapipe, against the op library's CPU references (torch.ops.vktrain, vktrain/ops/transformer.py) run in
float64 on the same fp32 inputs, plus float64 formulas written here (attention by explicit softmax and
autograd, rms_norm by autograd) that do not depend on the op library.

Tolerances and why (fp32 kernels against float64 references):
* rms_norm: a length-dim fp32 sum (relative error ~ log2(dim) ulp with the tree), one inversesqrt
  (Vulkan allows 2 ulp) and two multiplies: y and rstd within 2e-6 relative to the largest entry.
  The backward adds a second length-dim sum and subtracts two terms that can cancel (completely when
  dim = 1): its error is bounded by 1e-5 of the larger term's magnitude, not of d_x's.
* rope: two products and a sum per element, exact to a few ulp of the larger product: 1e-6 of the
  largest entry.
* swiglu: exp (Vulkan: 3 + 2|x| ulp, |x| <= ~12 here -> ~3e-6 relative), a division and products:
  1e-5 relative per element where the reference is not tiny, plus 1e-6 of the largest entry for the
  entries near 0 (silu's zero crossing).
* attention: norm-relative ||gpu - ref|| / ||ref||. Each output is a softmax-weighted sum over up to S
  keys of D-long fp32 dot products (measured ~1e-7 to 4e-7 on these shapes): 1e-6 for out, lse and
  d_v. d_q and d_k subtract nearly equal terms (dS = P * (dP - delta); with S = 1 they are exactly 0),
  so their error is measured against the norm the gradient would have without cancellation
  (gradient_term_magnitudes), also 1e-6. Scores of magnitude ~100 (the large-score test): a score
  carries an absolute rounding error of ~|s| ulp(1) ~ 1e-5, which exp(s - m) turns into a relative error
  of the probabilities of that size, hence 1e-5 there (the running max keeps exp from overflowing).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain)
from vktrain.runtime import Buffer, Program
from vktrain.backend.kernel_planning.kernels import attention, norm, rotary, swiglu
from vktrain.backend.kernel_planning.kernels.attention import AttentionTiles
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.registry import KERNELS

OPS = torch.ops.vktrain


# ---- helpers -------------------------------------------------------------------------------------

def run_plan(device, plan, inputs, outputs, *, replays=1, max_group_count=None):
    """Run `plan` once (or `replays` times) with `inputs` {key: array} uploaded and `outputs`
    {key: shape} allocated as fp32; every output is poisoned with NaN before each replay so an element
    a kernel fails to write is caught. Returns {key: array}, or a list of them with replays > 1."""
    buffers = {}
    try:
        for key, array in inputs.items():  # integer arrays (document positions) as int32, the rest fp32
            dtype = np.int32 if np.asarray(array).dtype.kind in "iu" else np.float32
            buffers[key] = Buffer.from_array(device, np.ascontiguousarray(array, dtype=dtype), name=key)
        for key, shape in outputs.items():
            buffers[key] = Buffer(device, 4 * max(1, math.prod(shape)), name=key)
        results = []
        with Program(device, plan, buffers, max_group_count=max_group_count) as program:
            for _ in range(replays):
                for key, shape in outputs.items():
                    buffers[key].write(np.full(math.prod(shape), np.nan, np.float32))
                program.replay()
                results.append({key: buffers[key].read(np.float32, shape) for key, shape in outputs.items()})
        return results if replays > 1 else results[0]
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def f64(array):
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def max_rel_error(actual, expected):
    """Max abs error relative to the reference's largest magnitude."""
    expected = np.asarray(expected, dtype=np.float64)
    return np.abs(np.asarray(actual, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30)


def norm_rel_error(actual, expected):
    expected = np.asarray(expected, dtype=np.float64)
    return np.linalg.norm(np.asarray(actual, np.float64) - expected) / max(np.linalg.norm(expected), 1e-30)


def assert_finite_and_shaped(actual, expected, what):
    assert actual.shape == tuple(expected.shape), f"{what}: shape {actual.shape} != {tuple(expected.shape)}"
    assert np.isfinite(actual).all(), f"{what}: non-finite values (an element left unwritten?)"


def test_plans_are_registered():
    assert KERNELS["vktrain.rms_norm.default"] is norm.plan_rms_norm
    assert KERNELS["vktrain.rms_norm_backward.default"] is norm.plan_rms_norm_backward
    assert KERNELS["vktrain.rope.default"] is rotary.plan_rope
    assert KERNELS["vktrain.causal_attention.default"] is attention.plan_causal_attention
    assert KERNELS["vktrain.causal_attention_backward.default"] is attention.plan_causal_attention_backward
    assert KERNELS["vktrain.swiglu.default"] is swiglu.plan_swiglu
    assert KERNELS["vktrain.swiglu_backward.default"] is swiglu.plan_swiglu_backward


# ---- rms_norm ------------------------------------------------------------------------------------

def rms_norm_gpu(device, x, weight, eps, d_y=None, *, vec4=None, workgroup_size=norm.DEFAULT_WORKGROUP_SIZE,
                 max_group_count=None):
    """(y, rstd[..., 1]) from the forward kernel, and d_x from the backward kernel when d_y is given (fed
    with the GPU's own rstd, as in a training step)."""
    dim = x.shape[-1]
    rows = x.size // dim
    plan = norm.plan_rms_norm(rows=rows, dim=dim, x="x", weight="w", y="y", rstd="rstd", eps=eps, vec4=vec4,
                              workgroup_size=workgroup_size)
    use_vec4 = dim % 4 == 0 if vec4 is None else vec4
    assert plan[0].shader == ("rms_norm@VEC4" if use_vec4 else "rms_norm")
    inputs = {"x": x, "w": weight}
    outputs = {"y": x.shape, "rstd": (*x.shape[:-1], 1)}
    if d_y is not None:
        plan += norm.plan_rms_norm_backward(rows=rows, dim=dim, d_y="d_y", x="x", weight="w", rstd="rstd",
                                            d_x="d_x", vec4=vec4, workgroup_size=workgroup_size)
        inputs["d_y"] = d_y
        outputs["d_x"] = x.shape
    return run_plan(device, plan, inputs, outputs, max_group_count=max_group_count)


def assert_rms_backward_close(actual, expected, x, weight, d_y, rstd):
    """d_x = a - b with a = rstd * w * d_y and b = x * rstd^3 * mean(x w d_y): fp32 rounding is relative
    to the larger of the two terms, which can cancel almost exactly (dim = 1: d_x ~ eps / |x|^3)."""
    x, weight, d_y, rstd = f64(x), f64(weight), f64(d_y), torch.as_tensor(rstd, dtype=torch.float64)
    term_a = rstd * weight * d_y
    term_b = x * rstd**3 * (x * weight * d_y).mean(-1, keepdim=True)
    scale = float(torch.maximum(term_a.abs(), term_b.abs()).max())
    err = np.abs(actual - np.asarray(expected, np.float64)).max() / scale
    assert err <= 1e-5, f"d_x: error {err:.3e} of the terms' magnitude > 1e-5"


# (leading shape, dim, workgroup size, vec4 kernel): dim below, equal to, above and far above the
# workgroup (several elements per thread, a ragged last stride), in floats and in vec4s; 1-element rows.
# dim % 4 == 0 takes the vec4 kernel unless forced to scalar.
RMS_SHAPES = [((2, 3), 64, 256, None), ((5,), 256, 256, False), ((5,), 256, 64, None), ((2, 2, 3), 1000, 128, None),
              ((3,), 2048, 256, None), ((3,), 2048, 256, False), ((4,), 1, 32, None), ((7,), 33, 32, None)]


@pytest.mark.parametrize("lead,dim,workgroup_size,vec4", RMS_SHAPES)
def test_rms_norm_forward_and_backward(vk_device, lead, dim, workgroup_size, vec4):
    rng = np.random.default_rng(dim * 31 + len(lead))
    x = (rng.standard_normal((*lead, dim)) * 3 + 0.5).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    d_y = rng.standard_normal((*lead, dim)).astype(np.float32)
    eps = 1e-5
    got = rms_norm_gpu(vk_device, x, weight, eps, d_y, vec4=vec4, workgroup_size=workgroup_size)

    ref_y, ref_rstd = OPS.rms_norm(f64(x), f64(weight), eps)
    ref_dx = OPS.rms_norm_backward(f64(d_y), f64(x), f64(weight), ref_rstd)
    # Independent of the op library: autograd through the definition.
    x_leaf = f64(x).requires_grad_()
    y_def = x_leaf * torch.rsqrt(x_leaf.square().mean(-1, keepdim=True) + eps) * f64(weight)
    (dx_def,) = torch.autograd.grad(y_def, x_leaf, f64(d_y))
    for name, ref in (("y", ref_y), ("rstd", ref_rstd), ("d_x", ref_dx)):
        assert_finite_and_shaped(got[name], ref, name)
    assert max_rel_error(got["y"], ref_y) <= 2e-6
    assert max_rel_error(got["rstd"], ref_rstd) <= 2e-6
    assert_rms_backward_close(got["d_x"], ref_dx, x, weight, d_y, ref_rstd)
    assert_rms_backward_close(got["d_x"], dx_def, x, weight, d_y, ref_rstd)
    assert max_rel_error(got["y"], y_def.detach()) <= 2e-6


def test_rms_norm_eps_dominates_zero_rows_and_split_dispatch(vk_device):
    """A zero row gives rstd = 1/sqrt(eps) and y = 0 (no NaN); 70 rows over a group limit of 16
    exercise the split-dispatch group offsets."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((70, 48)).astype(np.float32)
    x[3] = 0.0
    weight = rng.standard_normal(48).astype(np.float32)
    d_y = rng.standard_normal((70, 48)).astype(np.float32)
    got = rms_norm_gpu(vk_device, x, weight, 1e-3, d_y, max_group_count=16)
    ref_y, ref_rstd = OPS.rms_norm(f64(x), f64(weight), 1e-3)
    ref_dx = OPS.rms_norm_backward(f64(d_y), f64(x), f64(weight), ref_rstd)
    assert got["rstd"][3, 0] == pytest.approx(1 / math.sqrt(1e-3), rel=2e-6)
    assert np.all(got["y"][3] == 0.0)
    assert max_rel_error(got["y"], ref_y) <= 2e-6
    assert max_rel_error(got["rstd"], ref_rstd) <= 2e-6
    assert_rms_backward_close(got["d_x"], ref_dx, x, weight, d_y, ref_rstd)


def test_rms_norm_plan_refuses_bad_arguments():
    with pytest.raises(KernelArgumentError, match="power of two"):
        norm.plan_rms_norm(rows=2, dim=8, x="x", weight="w", y="y", rstd="r", eps=1e-5, workgroup_size=96)
    with pytest.raises(KernelArgumentError, match="eps"):
        norm.plan_rms_norm(rows=2, dim=8, x="x", weight="w", y="y", rstd="r", eps=-1.0)
    with pytest.raises(KernelArgumentError, match=r"dim % 4 == 0 .*got dim=6"):
        norm.plan_rms_norm(rows=2, dim=6, x="x", weight="w", y="y", rstd="r", eps=1e-5, vec4=True)
    with pytest.raises(KernelArgumentError, match="dim must be an int >= 1"):
        norm.plan_rms_norm_backward(rows=2, dim=0, d_y="g", x="x", weight="w", rstd="r", d_x="d")


# ---- rope ----------------------------------------------------------------------------------------

def rope_tables(S, D, base=10000.0):
    inv_freq = 1.0 / base ** (np.arange(0, D // 2, dtype=np.float64) * 2 / D)
    angles = np.arange(S, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("B,S,H,D", [(2, 5, 3, 16), (1, 1, 2, 64), (1, 7, 1, 128), (2, 3, 2, 8)])
def test_rope_forward_and_backward(vk_device, B, S, H, D):
    rng = np.random.default_rng(B * 100 + S * 10 + D)
    x = rng.standard_normal((B, S, H, D)).astype(np.float32)
    d_y = rng.standard_normal((B, S, H, D)).astype(np.float32)
    cos, sin = rope_tables(S, D)
    forward = rotary.plan_rope(B=B, S=S, H=H, D=D, x="x", cos="cos", sin="sin", out="y")
    backward = rotary.plan_rope(B=B, S=S, H=H, D=D, x="d_y", cos="cos", sin="sin", out="d_x", negate_sin=True)
    got = run_plan(vk_device, forward + backward, {"x": x, "d_y": d_y, "cos": cos, "sin": sin},
                   {"y": x.shape, "d_x": x.shape})

    ref_y = OPS.rope(f64(x), f64(cos), f64(sin))
    # The backward is the vector-Jacobian product of the forward (autograd of the float64 definition,
    # not the contract's rope(d_y, cos, -sin) identity the kernel relies on).
    x_leaf = f64(x).requires_grad_()
    x1, x2 = x_leaf[..., : D // 2], x_leaf[..., D // 2:]
    c, s = f64(cos)[None, :, None, :], f64(sin)[None, :, None, :]
    y_def = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    (dx_def,) = torch.autograd.grad(y_def, x_leaf, f64(d_y))
    assert_finite_and_shaped(got["y"], ref_y, "y")
    assert_finite_and_shaped(got["d_x"], dx_def, "d_x")
    assert max_rel_error(got["y"], ref_y) <= 1e-6
    assert max_rel_error(got["y"], y_def.detach()) <= 1e-6
    assert max_rel_error(got["d_x"], dx_def) <= 1e-6
    assert max_rel_error(got["d_x"], OPS.rope(f64(d_y), f64(cos), -f64(sin))) <= 1e-6


def test_rope_split_dispatch(vk_device):
    B, S, H, D = 1, 40, 4, 64  # 1280 quads over 64-thread groups: 20 groups, split by 8
    rng = np.random.default_rng(9)
    x = rng.standard_normal((B, S, H, D)).astype(np.float32)
    cos, sin = rope_tables(S, D)
    plan = rotary.plan_rope(B=B, S=S, H=H, D=D, x="x", cos="cos", sin="sin", out="y")
    got = run_plan(vk_device, plan, {"x": x, "cos": cos, "sin": sin}, {"y": x.shape}, max_group_count=8)
    assert max_rel_error(got["y"], OPS.rope(f64(x), f64(cos), f64(sin))) <= 1e-6


def test_rope_plan_refuses_bad_head_dim():
    with pytest.raises(KernelArgumentError, match=r"D=12 .*D % 8 == 0"):
        rotary.plan_rope(B=1, S=2, H=1, D=12, x="x", cos="c", sin="s", out="y")
    with pytest.raises(KernelArgumentError, match="negate_sin must be a bool"):
        rotary.plan_rope(B=1, S=2, H=1, D=16, x="x", cos="c", sin="s", out="y", negate_sin=1)


# ---- swiglu --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,vec4", [((3, 5, 64), None), ((7, 3), None), ((1,), None), ((4, 32), False),
                                        ((2, 300), None)])
def test_swiglu_forward_and_backward(vk_device, shape, vec4):
    rng = np.random.default_rng(sum(shape))
    gate = (rng.standard_normal(shape) * 3).astype(np.float32)
    gate.flat[0] = -100.0  # exp(100) overflows fp32: sigmoid must come out 0, not NaN
    if gate.size > 1:
        gate.flat[1] = 60.0
    up = rng.standard_normal(shape).astype(np.float32)
    d_h = rng.standard_normal(shape).astype(np.float32)
    numel = gate.size
    plan = (swiglu.plan_swiglu(gate="gate", gate_shape=shape, up="up", up_shape=shape, out="h", vec4=vec4)
            + swiglu.plan_swiglu_backward(d_h="d_h", d_h_shape=shape, gate="gate", gate_shape=shape, up="up",
                                          up_shape=shape, d_gate="d_gate", d_up="d_up", vec4=vec4))
    assert plan[0].shader == ("swiglu@VEC4" if (vec4 is None and numel % 4 == 0) else "swiglu")
    got = run_plan(vk_device, plan, {"gate": gate, "up": up, "d_h": d_h},
                   {"h": shape, "d_gate": shape, "d_up": shape})
    ref_h = OPS.swiglu(f64(gate), f64(up))
    ref_dgate, ref_dup = OPS.swiglu_backward(f64(d_h), f64(gate), f64(up))
    # Independent of the op library: autograd of silu(gate) * up.
    g_leaf, u_leaf = f64(gate).requires_grad_(), f64(up).requires_grad_()
    h_def = torch.nn.functional.silu(g_leaf) * u_leaf
    dgate_def, dup_def = torch.autograd.grad(h_def, (g_leaf, u_leaf), f64(d_h))
    for name, ref, independent in (("h", ref_h, h_def.detach()), ("d_gate", ref_dgate, dgate_def),
                                   ("d_up", ref_dup, dup_def)):
        actual = got[name]
        assert_finite_and_shaped(actual, ref, name)
        for expected in (ref.numpy(), independent.numpy()):
            # FLT_MIN: Vulkan may flush fp32 denormals (silu(-100) ~ -4e-42) to zero.
            bound = 1e-5 * np.abs(expected) + 1e-6 * np.abs(expected).max() + np.finfo(np.float32).tiny
            worst = np.abs(actual - expected) - bound
            assert worst.max() <= 0, f"{name}: error exceeds the bound by {worst.max():.3e}"


def test_swiglu_split_dispatch(vk_device):
    rng = np.random.default_rng(3)
    gate, up = rng.standard_normal((2, 2, 1, 1000)).astype(np.float32)  # 500 vec4s: 4 groups, split by 1
    plan = swiglu.plan_swiglu(gate="gate", gate_shape=gate.shape, up="up", up_shape=up.shape, out="h")
    got = run_plan(vk_device, plan, {"gate": gate, "up": up}, {"h": gate.shape}, max_group_count=1)
    assert max_rel_error(got["h"], OPS.swiglu(f64(gate), f64(up))) <= 1e-5


def test_swiglu_plan_refuses_what_it_cannot_run():
    with pytest.raises(KernelArgumentError, match=r"numel % 4 == 0, got numel=7"):
        swiglu.plan_swiglu(gate="g", gate_shape=(7,), up="u", up_shape=(7,), out="h", vec4=True)
    with pytest.raises(KernelArgumentError, match=r"every operand must have the shape of d_h \[2, 4\], got \{'up': \[2, 5\]\}"):
        swiglu.plan_swiglu_backward(d_h="d", d_h_shape=(2, 4), gate="g", gate_shape=(2, 4), up="u", up_shape=(2, 5),
                                    d_gate="a", d_up="b")
    with pytest.raises(KernelArgumentError, match="swiglu up has dtype float64; this kernel supports float32"):
        swiglu.plan_swiglu(gate="g", gate_shape=(4,), up="u", up_shape=(4,), up_dtype="float64", out="h")
    assert swiglu.plan_swiglu(gate="g", gate_shape=(0, 3), up="u", up_shape=(0, 3), out="h") == []


# ---- causal attention ----------------------------------------------------------------------------

def attention_gpu(device, q, k, v, scale, d_out=None, *, tiles=None, dq_tiles=None, dkv_tiles=None,
                  replays=1, max_group_count=None, positions=None):
    """(out, lse) from the forward kernel and, with d_out, (d_q, d_k, d_v) from the backward kernels fed
    with the GPU's own out and lse (as in a training step); `positions` int [B, S]: packed documents."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    documents = {} if positions is None else {"positions": "positions"}
    plan = attention.plan_causal_attention(**dims, q="q", k="k", v="v", out="out", lse="lse", scale=scale,
                                           tiles=tiles, **documents)
    inputs = {"q": q, "k": k, "v": v, **({} if positions is None else {"positions": positions})}
    outputs = {"out": q.shape, "lse": (B, Hq, S)}
    if d_out is not None:
        plan += attention.plan_causal_attention_backward(
            **dims, d_out="d_out", q="q", k="k", v="v", out="out", lse="lse", d_q="d_q", d_k="d_k", d_v="d_v",
            delta="delta", scale=scale, dq_tiles=dq_tiles, dkv_tiles=dkv_tiles, **documents)
        inputs["d_out"] = d_out
        outputs.update(d_q=q.shape, d_k=k.shape, d_v=v.shape,
                       delta=(attention.causal_attention_backward_scratch_nbytes(B, S, Hq) // 4,))
    return run_plan(device, plan, inputs, outputs, replays=replays, max_group_count=max_group_count)


def attention_definition(q, k, v, scale):
    """float64 causal attention by explicit masked softmax (independent of the op library), returning
    (out [B, S, Hq, D], lse [B, Hq, S]) as differentiable tensors of the given leaves."""
    group = q.shape[2] // k.shape[2]
    qh = q.permute(0, 2, 1, 3)                                          # [B, Hq, S, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)          # query head h -> kv head h // group
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = scale * qh @ kh.transpose(-1, -2)
    S = q.shape[1]
    future = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vh
    return out.permute(0, 2, 1, 3), lse


def attention_inputs(B, S, Hq, Hkv, D, seed, magnitude=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, S, Hq, D)) * magnitude).astype(np.float32)
    k = (rng.standard_normal((B, S, Hkv, D)) * magnitude).astype(np.float32)
    v = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    d_out = rng.standard_normal((B, S, Hq, D)).astype(np.float32)
    return q, k, v, d_out


def gradient_term_magnitudes(q, k, v, d_out, scale):
    """||scale * |dS| @ |k|||, ||scale * |dS|^T @ |q|||, the norms d_q and d_k would have if no term
    cancelled, with |dS| taken as P * (|dP| + |delta|): the scale of fp32 rounding in the
    backward. d_q and d_k can cancel completely (S = 1: the softmax over one key has zero gradient,
    so d_q = d_k = 0 exactly while the terms are O(1)); d_v = P^T d_out has no such subtraction."""
    group = q.shape[2] // k.shape[2]
    qh = f64(q).permute(0, 2, 1, 3)
    kh = f64(k).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vh = f64(v).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    doh = f64(d_out).permute(0, 2, 1, 3)
    S = q.shape[1]
    scores = (scale * qh @ kh.transpose(-1, -2)).masked_fill(
        torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1), -math.inf)
    p = torch.softmax(scores, dim=-1)
    delta = (doh * (p @ vh)).sum(-1, keepdim=True)
    ds_magnitude = p * ((doh @ vh.transpose(-1, -2)).abs() + delta.abs())
    return (float((scale * ds_magnitude @ kh.abs()).norm()),
            float((scale * ds_magnitude.transpose(-1, -2) @ qh.abs()).norm()))


def check_attention(got, q, k, v, d_out, scale, *, fwd_tol, bwd_tol):
    ref_out, ref_lse = OPS.causal_attention(f64(q), f64(k), f64(v), scale)
    # The GPU backward consumed the GPU's own out and lse; the reference consumes exact ones, so the
    # comparison covers forward and backward errors together, as training sees them.
    ref_dq, ref_dk, ref_dv = OPS.causal_attention_backward(f64(d_out), f64(q), f64(k), f64(v), ref_out, ref_lse,
                                                           scale)
    dq_scale, dk_scale = gradient_term_magnitudes(q, k, v, d_out, scale)
    for name, ref, tol, scale_norm in (
            ("out", ref_out, fwd_tol, None), ("lse", ref_lse, fwd_tol, None), ("d_q", ref_dq, bwd_tol, dq_scale),
            ("d_k", ref_dk, bwd_tol, dk_scale), ("d_v", ref_dv, bwd_tol, None)):
        assert_finite_and_shaped(got[name], ref, name)
        denominator = scale_norm if scale_norm is not None else float(ref.norm())
        err = np.linalg.norm(got[name] - ref.numpy()) / denominator
        assert err <= tol, f"{name}: norm-relative error {err:.3e} > {tol:.1e}"
    return ref_out, ref_lse, ref_dq, ref_dk, ref_dv


# (B, S, Hq, Hkv, D, forward tiles, dq tiles, dkv tiles): S = 1; S not a multiple of any tile, with
# several key/query tiles per workgroup and row tiles != column tiles; GQA 4/2 and 4/1; MHA; B = 2;
# every supported head dim; default tiles (None) and explicit small ones that make short sequences
# span many tiles.
ATTENTION_CASES = [
    (1, 1, 2, 2, 16, None, None, None),
    (2, 19, 4, 2, 16, AttentionTiles(8, 8, 4), AttentionTiles(8, 4, 4), AttentionTiles(4, 8, 4)),
    (1, 37, 4, 1, 64, AttentionTiles(16, 8, 4), AttentionTiles(4, 16, 4), AttentionTiles(16, 8, 4)),
    (2, 13, 2, 1, 32, None, None, None),
    (1, 21, 2, 2, 128, AttentionTiles(8, 8, 8), None, AttentionTiles(8, 8, 8)),
    (1, 24, 4, 4, 64, AttentionTiles(8, 16, 4), AttentionTiles(8, 8, 4), AttentionTiles(8, 8, 4)),
]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,tiles,dq_tiles,dkv_tiles", ATTENTION_CASES)
def test_causal_attention_forward_and_backward(vk_device, B, S, Hq, Hkv, D, tiles, dq_tiles, dkv_tiles):
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=B * 1000 + S * 10 + Hq + D)
    scale = 1 / math.sqrt(D)
    got = attention_gpu(vk_device, q, k, v, scale, d_out, tiles=tiles, dq_tiles=dq_tiles, dkv_tiles=dkv_tiles)
    ref_out, ref_lse, *_ = check_attention(got, q, k, v, d_out, scale, fwd_tol=1e-6, bwd_tol=1e-6)
    # delta = rowsum(d_out * out) [B, Hq, S], the backward's only scratch.
    ref_delta = (f64(d_out) * ref_out).sum(-1).permute(0, 2, 1).reshape(-1)
    assert norm_rel_error(got["delta"], ref_delta) <= 1e-5


def test_causal_attention_matches_the_definition(vk_device):
    """The same comparison against explicit softmax + autograd in float64 (not the op library)."""
    B, S, Hq, Hkv, D = 1, 11, 4, 2, 32
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=77)
    scale = 0.3
    got = attention_gpu(vk_device, q, k, v, scale, d_out, tiles=AttentionTiles(4, 4, 4),
                        dq_tiles=AttentionTiles(4, 4, 4), dkv_tiles=AttentionTiles(4, 4, 4))
    leaves = [f64(a).requires_grad_() for a in (q, k, v)]
    out, lse = attention_definition(*leaves, scale)
    grads = torch.autograd.grad(out, leaves, f64(d_out))
    # Relative to the gradients' own norms here (row 0 of d_q is an exact cancellation, but S = 11 rows
    # keep ||d_q|| and ||d_k|| at about a quarter of their terms' magnitude): 2e-6.
    for name, ref, tol in (("out", out, 1e-6), ("lse", lse, 1e-6), ("d_q", grads[0], 2e-6),
                           ("d_k", grads[1], 2e-6), ("d_v", grads[2], 1e-6)):
        ref = ref.detach()
        assert_finite_and_shaped(got[name], ref, name)
        assert norm_rel_error(got[name], ref) <= tol, name


def test_causal_attention_large_scores_stay_finite(vk_device):
    """Scores up to ~1e2: without the running max exp would overflow fp32 (e^89); the online rescaling
    and lse-based recomputation must keep everything finite and accurate."""
    B, S, Hq, Hkv, D = 1, 30, 2, 1, 16
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=8, magnitude=4.0)
    scale = 1.0
    got = attention_gpu(vk_device, q, k, v, scale, d_out, tiles=AttentionTiles(8, 8, 4),
                        dq_tiles=AttentionTiles(8, 8, 4), dkv_tiles=AttentionTiles(8, 8, 4))
    ref_out, ref_lse = OPS.causal_attention(f64(q), f64(k), f64(v), scale)
    assert np.abs(ref_lse.numpy()).max() > 90, "test premise: scores beyond exp's fp32 range"
    check_attention(got, q, k, v, d_out, scale, fwd_tol=1e-5, bwd_tol=1e-5)


def test_causal_attention_backward_is_deterministic_and_splits(vk_device):
    """Two replays give bitwise-equal gradients (no atomics), and a group-count limit of 2 splits every
    grid axis (3 tiles x 4 heads x 2 batches) through the push-constant group offsets."""
    B, S, Hq, Hkv, D = 2, 23, 4, 2, 16
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=21)
    scale = 0.25
    tiles = AttentionTiles(8, 8, 4)
    runs = attention_gpu(vk_device, q, k, v, scale, d_out, tiles=tiles, dq_tiles=tiles, dkv_tiles=tiles,
                         replays=2, max_group_count=2)
    for name in ("out", "lse", "d_q", "d_k", "d_v"):
        assert np.array_equal(runs[0][name], runs[1][name]), f"{name} differs between replays"
    check_attention(runs[0], q, k, v, d_out, scale, fwd_tol=1e-6, bwd_tol=1e-6)


def test_attention_default_tiles_fit_device_limits(vk_device):
    limits = vk_device.limits
    for D in attention.SUPPORTED_HEAD_DIMS:
        for kernel in ("forward", "backward_dq", "backward_dkv"):
            for shared in (16384, 32768, 49152):
                for S in (None, 1, 100, 4096):
                    tiles = attention.default_tiles(kernel, D, S=S, heads_times_batch=8, shared_memory_bytes=shared)
                    assert attention.shared_memory_nbytes(kernel, tiles, D) <= shared
                    assert tiles.workgroup_size <= attention.DEFAULT_MAX_WORKGROUP_SIZE
                    assert (D // 4) % tiles.threads_per_row == 0 and tiles.cols % tiles.threads_per_row == 0
            tiles = attention.default_tiles(kernel, D, shared_memory_bytes=limits.max_compute_shared_memory_size)
            assert tiles.workgroup_size <= limits.max_compute_work_group_invocations


def test_attention_default_tiles_trade_tile_height_for_parallelism():
    """Llama-3.2-1B shapes (Hq=32, Hkv=8, D=64, 48 KiB): the forward keeps 32-query tiles (2048 or more
    workgroups); DKV over 8 kv heads at S=512 would offer only 128 workgroups with 32-key tiles, so it
    takes 16 (256 workgroups); at S=2048 32 rows already give 512. Short sequences get the most
    workgroups among tiles of at least 32 threads."""
    def rows(kernel, S, heads):
        return attention.default_tiles(kernel, 64, S=S, heads_times_batch=heads, shared_memory_bytes=49152).rows

    assert rows("forward", 512, 32) == 32
    assert rows("backward_dkv", 512, 8) == 16
    assert rows("backward_dkv", 2048, 8) == 32
    short = attention.default_tiles("backward_dkv", 64, S=40, heads_times_batch=2, shared_memory_bytes=49152)
    assert short.workgroup_size >= 32 and short.rows == 8
    # Without a sequence length: the largest that fits.
    assert attention.default_tiles("forward", 64, shared_memory_bytes=49152) == AttentionTiles(32, 32, 4)


def test_attention_plans_refuse_unsupported_problems():
    base = dict(B=1, S=8, Hq=4, Hkv=2, D=64, q="q", k="k", v="v", out="o", lse="l", scale=0.125)
    with pytest.raises(KernelArgumentError, match=r"head dim D=48 is not supported.*\(16, 32, 64, 128\)"):
        attention.plan_causal_attention(**{**base, "D": 48})
    with pytest.raises(KernelArgumentError, match=r"Hq=4 .* Hkv=3"):
        attention.plan_causal_attention(**{**base, "Hkv": 3})
    with pytest.raises(KernelArgumentError, match="S must be an int >= 1"):
        attention.plan_causal_attention(**{**base, "S": 0})
    with pytest.raises(KernelArgumentError, match="scale must be a finite float"):
        attention.plan_causal_attention(**{**base, "scale": math.inf})
    with pytest.raises(KernelArgumentError, match="shared memory"):
        attention.plan_causal_attention(**base, tiles=AttentionTiles(32, 32, 4), shared_memory_bytes=16384)
    with pytest.raises(KernelArgumentError, match="must divide"):
        attention.plan_causal_attention(**base, tiles=AttentionTiles(8, 6, 4))
    with pytest.raises(KernelArgumentError, match="workgroup limit"):
        attention.plan_causal_attention(**base, tiles=AttentionTiles(64, 8, 4))
    backward = dict(base, d_out="g", d_q="a", d_k="b", d_v="c", delta="t")
    with pytest.raises(KernelArgumentError, match="backward_dkv tiles"):
        attention.plan_causal_attention_backward(**backward, dkv_tiles=AttentionTiles(8, 8, 3))


# ---- packed documents: causal attention within each document, per-token rope tables ---------------------

def document_positions(lengths_per_row):
    """int32 [B, S] positions of rows packed with documents of the given lengths (each row's sum is S)."""
    return np.array([np.concatenate([np.arange(n) for n in lengths]) for lengths in lengths_per_row], np.int32)


def per_document_definition(q, k, v, d_out, scale, lengths_per_row):
    """float64 (out, lse, d_q, d_k, d_v) of packed rows computed one document at a time with the plain causal
    definition (attention_definition on each document's slice alone, autograd): what a packed batch must
    equal, independent of the masks' formula."""
    results = {name: np.zeros(shape) for name, shape in (("out", q.shape), ("d_q", q.shape), ("d_k", k.shape),
                                                         ("d_v", v.shape))}
    results["lse"] = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            leaves = [f64(a[b:b + 1, part]).requires_grad_() for a in (q, k, v)]
            out, lse = attention_definition(*leaves, scale)
            grads = torch.autograd.grad(out, leaves, f64(d_out[b:b + 1, part]))
            results["out"][b, part], results["lse"][b, :, part] = out[0].detach(), lse[0].detach()
            for name, grad in zip(("d_q", "d_k", "d_v"), grads):
                results[name][b, part] = grad[0]
            start += n
    return results


# (B, S, Hq, Hkv, D, documents per row, tiles): documents crossing tile boundaries, one-token documents,
# a document as long as the row, rows of different layouts; tiles small enough that whole key tiles are
# skipped (forward, DQ) and query tiles cut short (DKV).
DOCUMENT_CASES = [
    (2, 19, 4, 2, 16, [[5, 1, 9, 4], [19]], AttentionTiles(4, 4, 4)),
    (1, 37, 4, 1, 64, [[1, 1, 12, 8, 15]], AttentionTiles(8, 8, 4)),
    (2, 24, 2, 2, 32, [[8, 8, 8], [3, 17, 1, 3]], None),
]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,lengths,tiles", DOCUMENT_CASES)
def test_document_masked_attention_equals_each_document_alone(vk_device, B, S, Hq, Hkv, D, lengths, tiles):
    """With positions, every document of a packed row gets the outputs and gradients it has alone (float64
    definition per document), and no gradient flows between documents (d_k / d_v of a document's keys
    come from its own queries only). Tolerances as the causal cases' (module docstring)."""
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=S * 7 + D)
    scale = 1 / math.sqrt(D)
    positions = document_positions(lengths)
    got = attention_gpu(vk_device, q, k, v, scale, d_out, tiles=tiles, dq_tiles=tiles, dkv_tiles=tiles,
                        positions=positions)
    ref = per_document_definition(q, k, v, d_out, scale, lengths)
    # The op library's CPU reference with the same positions agrees with the per-document definition.
    ref_out, ref_lse = OPS.causal_attention(f64(q), f64(k), f64(v), scale, torch.from_numpy(positions))
    assert norm_rel_error(ref_out, ref["out"]) <= 1e-12 and norm_rel_error(ref_lse, ref["lse"]) <= 1e-12
    for name in ("out", "lse", "d_q", "d_k", "d_v"):
        assert_finite_and_shaped(got[name], torch.from_numpy(ref[name]), name)
        # 2e-6: the gradients' own norms, as test_causal_attention_matches_the_definition (one-token
        # documents have d_q = d_k = 0 exactly: an exact cancellation, absolute error ~1e-7 there).
        assert norm_rel_error(got[name], ref[name]) <= (1e-6 if name in ("out", "lse", "d_v") else 2e-6), name
    # Not the plain causal result: the masks change something (the test would pass vacuously otherwise).
    plain, _ = OPS.causal_attention(f64(q), f64(k), f64(v), scale)
    if any(len(row) > 1 for row in lengths):
        assert norm_rel_error(got["out"], plain) > 1e-3


def test_document_positions_of_one_document_give_the_causal_result(vk_device):
    """positions 0..S-1 (each row one document) hide nothing: the DOCUMENTS kernels give the plain
    kernels' bits."""
    B, S, Hq, Hkv, D = 2, 21, 4, 2, 16
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=5)
    tiles = AttentionTiles(8, 8, 4)
    plain = attention_gpu(vk_device, q, k, v, 0.25, d_out, tiles=tiles, dq_tiles=tiles, dkv_tiles=tiles)
    packed = attention_gpu(vk_device, q, k, v, 0.25, d_out, tiles=tiles, dq_tiles=tiles, dkv_tiles=tiles,
                           positions=document_positions([[S], [S]]))
    for name in ("out", "lse", "d_q", "d_k", "d_v"):
        np.testing.assert_array_equal(packed[name], plain[name], err_msg=name)


def test_rope_per_token_tables(vk_device):
    """cos/sin [B, S, D/2] (each token's own angles: positions restarting at each document) rotate token
    (b, s) by row b * S + s of the tables, forward and backward (float64 definition)."""
    B, S, H, D = 2, 11, 3, 16
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, S, H, D)).astype(np.float32)
    positions = document_positions([[4, 7], [11]])
    table_cos, table_sin = rope_tables(S, D)
    cos, sin = table_cos[positions], table_sin[positions]  # [B, S, D/2]
    forward = rotary.plan_rope(B=B, S=S, H=H, D=D, x="x", cos="cos", sin="sin", out="y", per_token=True)
    backward = rotary.plan_rope(B=B, S=S, H=H, D=D, x="y", cos="cos", sin="sin", out="x_back", negate_sin=True,
                                per_token=True)
    got = run_plan(vk_device, forward + backward, {"x": x, "cos": cos, "sin": sin}, {"y": x.shape, "x_back": x.shape})
    c, s = f64(cos)[:, :, None, :], f64(sin)[:, :, None, :]
    x1, x2 = f64(x)[..., : D // 2], f64(x)[..., D // 2:]
    y_def = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert max_rel_error(got["y"], y_def) <= 1e-6
    assert max_rel_error(got["y"], OPS.rope(f64(x), f64(cos), f64(sin))) <= 1e-6
    assert max_rel_error(got["x_back"], x) <= 2e-6  # the inverse rotation gives x back

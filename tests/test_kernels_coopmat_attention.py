"""Flash attention on tensor cores (vktrain/backend/kernel_planning/kernels/coopmat_attention.py): plans, routing,
and the kernels against float64 element by element within a bound derived from their fp16 rounding.

Modes as tests/test_kernels_coopmat.py: "coopmat" on a device with 16x16x16 fp16 x fp16 + fp32
cooperative matrices (skipped elsewhere, with the reason), "emulated" (COOPMAT_EMULATE: the same
shaders with the matrix operations done by plain arithmetic and the same rounding) on lavapipe.

The bound (u = 2^-11 fp16 unit roundoff, t = 2^-23 an fp32 sum's worst step (tensor cores may truncate),
h = 2^-25 half of fp16's subnormal spacing, gamma_n = (n + 16) t for an fp32 sum of n terms):
* scores: s_ij = scale * sum_d fp16(q_id) fp16(k_jd) in fp32, so
  |ds_ij| <= scale ((2u + u^2 + gamma_D) sum_d |q_id k_jd| + h (sum_d |q_id| + |k_jd|)); E_i is its max
  over the row. exp in fp32 (Vulkan: 3 + 2|x| ulp, x = s - m, |x| <= X_i = max_j |s_ij - lse_i| + 1):
  eta_i = (3 + 2 X_i + 8) t with a few roundings of the statistics. P_ij = exp(s_ij - lse_i) (backward) or
  p_j / l (forward) has a relative error rho_i = exp(2 E_i + 2 eta_i + gamma_S) - 1 (the score, and the
  row's normaliser, which is a sum of such terms).
* forward: out_id = sum_j fp16(P_ij) fp16(v_jd) in fp32:
  |dout| <= ((1 + rho)(1 + u)^2 (1 + gamma_S) - 1) sum_j P_ij |v_jd| + h (sum_j |v_jd| + 1) + t |out|;
  |dlse| <= E + eta + gamma_S + 4 t (|lse| + 1).
* backward: d_out is staged times 2^e_do (its max in [2^14, 2^15)), so its fp16 rounding is relative u
  above max |d_out| 2^-29 and absolute h 2^-e_do below; dP_ij = d_out_i . v_j:
  |ddP| <= (2u + u^2 + gamma_D) sum_d |dO_id v_jd| + h (2^-e_do sum_d |v_jd| + sum_d |dO_id|);
  delta_i from the kernel's own out: |ddelta| <= sum_d |dO_id| |dout_id| + gamma_D sum_d |dO_id out_id|;
  dS_ij = P_ij (dP_ij - delta_i) in fp32, then rounded to fp16 times 2^e_ds:
  |ddS| <= rho P |dP - delta| + (1 + rho) P (|ddP| + |ddelta|) + 3 t P (|dP| + |delta|), then
  (1 + u) on top plus h 2^-e_ds; fp16(P) for d_v: (1 + rho)(1 + u) - 1 relative plus h.
  d_q = scale sum_j dS_ij fp16(k_jd), d_k = scale sum_{heads, i} dS_ij fp16(q_id), d_v = sum_{heads, i}
  fp16(P_ij) fp16(dO_id): the propagated |ddS| (|dP|) times |k| (|q|, |dO|), plus u and gamma_n times the
  absolute sums, plus h times the sum of |dS| (or P) for the fp16 subnormals of k, q (dO: 2^-e_do h).
The bound is worst case (every rounding the same way, the largest score error of a row for all of it):
at D = 64 ~1.4% of the absolute sums sum_j P_ij |v_jd| it bounds, dominated by 2 E_i ~ 4u scale
sum_d |q_id k_jd| (asserted below 2%). A wrong key, mask, tile or scale moves an output by a whole term,
P_ij |v_j| ~ 1 / (i + 1) of that sum for query i, or more (a skipped rescale, a lost tile), so the check
can fail; outputs start as NaN, so an element no workgroup writes fails (the measured errors are ~3e-4
of the norms). Scaling d_out is checked with gradients of 1e-7: unscaled,
their fp16 rounding alone would exceed the bound (asserted on the same data).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vktrain.contract import PRECISION_FP16_TC, PRECISION_FP32, PRECISIONS
from vktrain.backend.kernel_planning.kernels import coopmat_attention
from vktrain.backend.kernel_planning.kernels.coopmat import FP32_ROUTE, SUBGROUP_BASIC_BIT, coopmat_supported, select_gemm_route
from vktrain.backend.kernel_planning.kernels.coopmat_attention import (
    ROW_BLOCK_CHOICES,
    backward_absmax_scratch_nbytes,
    default_row_blocks,
    plan_coopmat_causal_attention,
    plan_coopmat_causal_attention_backward,
    shared_memory_nbytes,
    takes_tensor_cores,
)
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.runtime.vk.coopmat import CooperativeMatrixShape
from vktrain.runtime_shaders.build import all_shader_names

from test_kernels_transformer import OPS, attention_inputs, f64, run_plan
from vktrain.backend.kernel_planning import plan_schedule

U = 2.0 ** -11
T = 2.0 ** -23
H = 2.0 ** -25
H200_SHARED_MEMORY = 49152


def _gamma(n: int) -> float:
    return (n + 16) * T


def _fake_device(properties=(), subgroup_size=32):
    """What select_gemm_route reads of a Device: a fake capability set."""
    return SimpleNamespace(name="fake GPU", cooperative_matrix_properties=properties, subgroup_size=subgroup_size,
                           features=frozenset({"shaderFloat16"}), subgroup_operations=SUBGROUP_BASIC_BIT)


FP16_16x16x16 = CooperativeMatrixShape(16, 16, 16, "float16", "float16", "float32", "float32", False, "subgroup")


# ----------------------------------------------------------------------------------- no device needed
def test_route_takes_the_tensor_cores_for_attention_exactly_where_the_device_lists_them():
    problem = dict(B=4, S=512, Hq=32, Hkv=8, D=64, shared_memory_bytes=H200_SHARED_MEMORY)
    tensor_cores = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _fake_device((FP16_16x16x16,)))
    assert tensor_cores.tensor_cores and not tensor_cores.emulate
    assert takes_tensor_cores(tensor_cores, **problem, backward=False)
    assert takes_tensor_cores(tensor_cores, **problem, backward=True)
    bf16_only = CooperativeMatrixShape(16, 16, 16, "bfloat16", "bfloat16", "float32", "float32", False, "subgroup")
    for route in (select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _fake_device((bf16_only,))),
                  select_gemm_route(PRECISION_FP32, PRECISIONS, _fake_device((FP16_16x16x16,))), FP32_ROUTE):
        assert not takes_tensor_cores(route, **problem, backward=False), route
        assert not takes_tensor_cores(route, **problem, backward=True), route
    # D = 128 and a device with too little shared memory keep the fp32 kernels.
    assert not takes_tensor_cores(tensor_cores, **{**problem, "D": 128}, backward=False)
    assert not takes_tensor_cores(tensor_cores, **{**problem, "shared_memory_bytes": 16384}, backward=True)


def test_emulated_route_keeps_the_fp32_kernels_past_lavapipes_loop_budget():
    emulated = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _fake_device(subgroup_size=8), emulate=True)
    small = dict(B=1, S=96, Hq=4, Hkv=1, D=64, shared_memory_bytes=32768)
    assert takes_tensor_cores(emulated, **small, backward=True)
    assert not takes_tensor_cores(emulated, **{**small, "S": 4096}, backward=True)
    with pytest.raises(KernelArgumentError, match="loop iterations per invocation at S=4096"):
        plan_coopmat_causal_attention_backward(**{**small, "S": 4096}, **_names(backward=True), scale=0.125,
                                               emulate=True, subgroup_size=8)


def _names(backward: bool) -> dict:
    names = dict(q="q", k="k", v="v", out="out", lse="lse")
    if backward:
        names.update(d_out="d_out", d_q="d_q", d_k="d_k", d_v="d_v", delta="delta", absmax="absmax")
    return names


def test_default_plans_at_llama_shapes_name_prebuilt_variants_and_cover_the_sequence():
    prebuilt = set(all_shader_names())
    for B, S in ((1, 512), (4, 512), (1, 2048), (1, 37)):
        dims = dict(B=B, S=S, Hq=32, Hkv=8, D=64)
        forward = plan_coopmat_causal_attention(**dims, **_names(False), scale=0.125,
                                                shared_memory_bytes=H200_SHARED_MEMORY)
        backward = plan_coopmat_causal_attention_backward(**dims, **_names(True), scale=0.125,
                                                          shared_memory_bytes=H200_SHARED_MEMORY)
        assert [d.shader.split("@")[0] for d in backward] == [
            "attention_bwd_delta", "coopmat_absmax", "coopmat_attention_bwd", "coopmat_attention_bwd"]
        for dispatch in forward + backward[2:]:
            assert dispatch.shader in prebuilt, dispatch.shader
            rows = 16 * int(dispatch.shader.split("ROW_BLOCKS=")[1].split("+")[0])
            heads = 8 if "DKV" in dispatch.shader else 32
            assert dispatch.groups == (math.ceil(S / rows), heads, B), (dispatch.shader, dispatch.groups)


def test_row_blocks_prefer_tall_tiles_where_the_shared_memory_holds_them():
    for kernel in coopmat_attention.KERNELS:
        assert default_row_blocks(kernel, 64, shared_memory_bytes=H200_SHARED_MEMORY) == 4, kernel
        assert shared_memory_nbytes(kernel, 64, max(ROW_BLOCK_CHOICES)) <= H200_SHARED_MEMORY, kernel
    # lavapipe's 32 KiB hold only the 2-block tiles at D = 64, all 4-block ones at D = 16.
    assert shared_memory_nbytes("forward", 64, 4) > 32768 >= shared_memory_nbytes("forward", 64, 2)
    assert default_row_blocks("forward", 64, shared_memory_bytes=32768) == 2
    assert max(shared_memory_nbytes(kernel, 16, 4) for kernel in coopmat_attention.KERNELS) <= 32768
    assert default_row_blocks("backward_dkv", 64, shared_memory_bytes=16384) is None


def test_plans_refuse_what_the_kernels_cannot_run_by_name():
    base = dict(B=1, S=8, Hq=2, Hkv=1, D=64, **_names(False), scale=0.125, shared_memory_bytes=H200_SHARED_MEMORY)
    with pytest.raises(KernelArgumentError, match=r"head dim D=128 \(the tensor-core kernels take D in \(16, 32, 64\)\)"):
        plan_coopmat_causal_attention(**{**base, "D": 128})
    with pytest.raises(KernelArgumentError, match="Hq=2 query heads is not a multiple of Hkv=3"):
        plan_coopmat_causal_attention(**{**base, "Hkv": 3})
    with pytest.raises(KernelArgumentError, match="forward tiles need .* bytes of shared memory, the device has 16384"):
        plan_coopmat_causal_attention(**{**base, "shared_memory_bytes": 16384})
    with pytest.raises(KernelArgumentError, match="row_blocks must be one of"):
        plan_coopmat_causal_attention(**base, row_blocks=3)
    with pytest.raises(KernelArgumentError, match="subgroup_size must be a power of two"):
        plan_coopmat_causal_attention(**base, subgroup_size=24)


# ----------------------------------------------------------------------------------- the bound
def _scale_exponent(largest: float) -> int:
    """The kernels' operand-scale exponent (coopmat_scale.slangh scale_exponent)."""
    if largest == 0.0 or not math.isfinite(largest):
        return 0
    return max(-60, min(60, 14 - math.floor(math.log2(largest))))


def _heads_first(x, group=1):
    """[B, S, H, D] float64 -> [B, H * group, S, D] (kv heads repeated for their query heads)."""
    return f64(x).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)


def _to_kv_heads(x, group):
    """[B, Hq, S, D] summed over the query heads of each kv head -> [B, S, Hkv, D]."""
    B, Hq, S, D = x.shape
    return x.reshape(B, Hq // group, group, S, D).sum(2).permute(0, 2, 1, 3)


def fp16_attention_bounds(q, k, v, d_out, scale):
    """(reference, bound, magnitude) of the outputs, float64 numpy in the kernels' layouts (module
    docstring); the backward's bound covers the forward's error in the out it reads for delta."""
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    qh, kh, vh, doh = _heads_first(q), _heads_first(k, group), _heads_first(v, group), _heads_first(d_out)
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    scores = scale * qh @ kh.transpose(-1, -2)
    lse = torch.logsumexp(scores.masked_fill(~causal, -math.inf), dim=-1)
    P = torch.exp(scores - lse[..., None]).masked_fill(~causal, 0.0)
    out = P @ vh
    score_error = scale * ((2 * U + U * U + _gamma(D)) * (qh.abs() @ kh.abs().transpose(-1, -2))
                           + H * (qh.abs().sum(-1)[..., :, None] + kh.abs().sum(-1)[..., None, :]))
    E = score_error.masked_fill(~causal, 0.0).amax(-1)
    X = (scores - lse[..., None]).abs().masked_fill(~causal, 0.0).amax(-1) + 1
    eta = (11 + 2 * X) * T
    rho = (torch.exp(2 * E + 2 * eta + _gamma(S)) - 1)[..., None]
    out_bound = ((1 + rho) * (1 + U) ** 2 * (1 + _gamma(S)) - 1) * (P @ vh.abs()) \
        + H * (causal.to(torch.float64) @ vh.abs() + 1) + T * out.abs()
    lse_bound = E + eta + _gamma(S) + 4 * T * (lse.abs() + 1)

    e_do = _scale_exponent(float(np.abs(d_out).max()))
    e_ds = max(-120, min(120, e_do + _scale_exponent(float(np.abs(v).max())) - 16 - int(math.log2(D))))
    dP = doh @ vh.transpose(-1, -2)
    delta = (doh * out).sum(-1, keepdim=True)
    dS = P * (dP - delta)
    dP_error = (2 * U + U * U + _gamma(D)) * (doh.abs() @ vh.abs().transpose(-1, -2)) + H * (
        2.0 ** -e_do * vh.abs().sum(-1)[..., None, :] + doh.abs().sum(-1)[..., :, None])
    delta_error = (doh.abs() * out_bound).sum(-1, keepdim=True) \
        + _gamma(D) * (doh * out).abs().sum(-1, keepdim=True)
    dS_error = (rho * P * (dP - delta).abs() + (1 + rho) * P * (dP_error + delta_error)
                + 3 * T * P * (dP.abs() + delta.abs()))
    dS_error = (dS_error + U * (dS.abs() + dS_error) + H * 2.0 ** -e_ds).masked_fill(~causal, 0.0)
    dS_total = dS.abs() + dS_error
    P16_error = (((1 + rho) * (1 + U) - 1) * P + H).masked_fill(~causal, 0.0)

    dq = scale * dS @ kh
    dq_bound = scale * (dS_error @ kh.abs() * (1 + U) + (U + _gamma(S)) * (dS_total @ kh.abs())
                        + H * dS_total.sum(-1, keepdim=True)) + T * dq.abs()
    dk = scale * dS.transpose(-1, -2) @ qh
    dk_bound = scale * (dS_error.transpose(-1, -2) @ qh.abs() * (1 + U)
                        + (U + _gamma(S * group)) * (dS_total.transpose(-1, -2) @ qh.abs())
                        + H * dS_total.sum(-2)[..., None])
    dv = P.transpose(-1, -2) @ doh
    P_total = P + P16_error
    dv_bound = (P16_error.transpose(-1, -2) @ doh.abs() * (1 + U)
                + (U + _gamma(S * group)) * (P_total.transpose(-1, -2) @ doh.abs())
                + H * 2.0 ** -e_do * P_total.sum(-2)[..., None])
    dk, dv = _to_kv_heads(dk, group), _to_kv_heads(dv, group)
    dk_bound = _to_kv_heads(dk_bound, group) + T * dk.abs()
    dv_bound = _to_kv_heads(dv_bound, group) + T * dv.abs()
    magnitudes = dict(out=(P @ vh.abs()).permute(0, 2, 1, 3), d_v=_to_kv_heads(P.transpose(-1, -2) @ doh.abs(), group))
    as_q = lambda x: x.permute(0, 2, 1, 3)  # noqa: E731  [B, Hq, S, D] -> [B, S, Hq, D]
    reference = dict(out=as_q(out), lse=lse, d_q=as_q(dq), d_k=dk, d_v=dv)
    bound = dict(out=as_q(out_bound), lse=lse_bound, d_q=as_q(dq_bound), d_k=dk_bound, d_v=dv_bound)
    return ({n: x.numpy() for n, x in reference.items()}, {n: x.numpy() for n, x in bound.items()},
            {n: x.numpy() for n, x in magnitudes.items()})


def _backend(device, mode: str) -> dict:
    if mode == "coopmat":
        if not coopmat_supported(device.cooperative_matrix_properties):
            listed = ", ".join(s.describe() for s in device.cooperative_matrix_properties) or "none"
            pytest.skip(f"{device.name} has no 16x16x16 fp16 x fp16 + fp32 cooperative matrices (it lists: {listed})")
        return dict(emulate=False, subgroup_size=device.subgroup_size)
    if "shaderFloat16" not in device.features or not device.subgroup_operations & SUBGROUP_BASIC_BIT:
        pytest.skip(f"{device.name} lacks shaderFloat16 or basic subgroup operations in compute shaders")
    return dict(emulate=True, subgroup_size=device.subgroup_size)


def coopmat_attention_gpu(device, backend, q, k, v, d_out, scale, row_blocks=None):
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    options = dict(backend, shared_memory_bytes=device.limits.max_compute_shared_memory_size, row_blocks=row_blocks)
    plan = plan_coopmat_causal_attention(**dims, **_names(False), scale=scale, **options)
    plan += plan_coopmat_causal_attention_backward(**dims, **_names(True), scale=scale, **options)
    outputs = dict(out=q.shape, lse=(B, Hq, S), d_q=q.shape, d_k=k.shape, d_v=v.shape, delta=(B * Hq * S,),
                   absmax=(backward_absmax_scratch_nbytes(B, S, Hq, Hkv, D) // 4,))
    return run_plan(device, plan, dict(q=q, k=k, v=v, d_out=d_out), outputs), plan


def _assert_within(got, reference, bound, name):
    assert got.shape == reference.shape and np.isfinite(got).all(), f"{name}: shape {got.shape} or non-finite"
    excess = np.abs(got - reference) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess.max() <= 0, (f"{name}{list(worst)}: |error| {abs(got - reference)[worst]:.3e} > bound "
                               f"{bound[worst]:.3e} (reference {reference[worst]:.4e})")


# (B, S, Hq, Hkv, D, row_blocks): S = 1; S not a multiple of 16 or of the streamed 32 rows, with several
# key/query tiles per workgroup; GQA 4/1 and 4/2 and MHA; B = 2; D = 64, 32, 16; 2 and 4 subgroups (None:
# the default for the device; lavapipe's 32 KiB hold the 4-block tiles at D = 16 only, the H200's 48 KiB at
# every D: a case whose tiles the device cannot hold is skipped).
CASES = [
    (1, 1, 2, 2, 32, None),
    (1, 37, 4, 1, 64, 2),
    (1, 37, 4, 1, 64, 4),
    (2, 19, 4, 2, 16, 4),
    (1, 70, 2, 1, 16, 4),
    (1, 48, 2, 2, 32, 2),
]


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,row_blocks", CASES)
def test_attention_matches_float64_within_the_fp16_bound(vk_device, mode, B, S, Hq, Hkv, D, row_blocks):
    backend = _backend(vk_device, mode)
    shared = vk_device.limits.max_compute_shared_memory_size
    if row_blocks and max(shared_memory_nbytes(kernel, D, row_blocks) for kernel in coopmat_attention.KERNELS) > shared:
        pytest.skip(f"{vk_device.name}'s {shared} bytes of shared memory cannot hold the {row_blocks}-block tiles at D={D}")
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=7 * S + D)
    scale = 1 / math.sqrt(D)
    got, plan = coopmat_attention_gpu(vk_device, backend, q, k, v, d_out, scale, row_blocks)
    assert all(("COOPMAT_EMULATE" in d.shader) == backend["emulate"] for d in plan if "coopmat_attention" in d.shader)
    reference, bound, magnitude = fp16_attention_bounds(q, k, v, d_out, scale)
    for name in reference:
        _assert_within(got[name], reference[name], bound[name], name)
    # The bound can fail: at most 2% of the absolute sums it bounds (module docstring).
    for name in ("out", "d_v"):
        assert (bound[name] <= 2e-2 * magnitude[name] + 1e-6).all(), name


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_gradients_of_1e_minus_7_keep_fp16_precision(vk_device, mode):
    """d_out of 1e-7 (a loss divided by its token count): fp16 subnormals with a few bits unscaled. The
    kernels stage it times 2^e_do, so the bound holds; rounding it to fp16 unscaled would not (shown
    on d_v = P^T d_out with the reference's own P)."""
    backend = _backend(vk_device, mode)
    B, S, Hq, Hkv, D = 1, 37, 4, 2, 64
    q, k, v, d_out = attention_inputs(B, S, Hq, Hkv, D, seed=11)
    d_out = (d_out * 1e-7).astype(np.float32)
    scale = 1 / math.sqrt(D)
    got, _ = coopmat_attention_gpu(vk_device, backend, q, k, v, d_out, scale)
    reference, bound, _ = fp16_attention_bounds(q, k, v, d_out, scale)
    for name in ("d_q", "d_k", "d_v"):
        _assert_within(got[name], reference[name], bound[name], name)
    unscaled = d_out.astype(np.float16).astype(np.float64)
    _, unscaled_dv = OPS.causal_attention_backward(f64(unscaled), f64(q), f64(k), f64(v),
                                                   *OPS.causal_attention(f64(q), f64(k), f64(v), scale), scale)[1:]
    assert (np.abs(unscaled_dv.numpy() - reference["d_v"]) > bound["d_v"]).any()


@pytest.mark.parametrize("mode", ["coopmat", "emulated"])
def test_attention_rounds_its_inputs_to_fp16(vk_device, mode):
    """The kernels use fp16 inputs, not fp32 ones: their forward differs from the fp32 result by far
    more than fp32 rounding (the fp32 kernels agree with float64 to ~1e-7, test_kernels_transformer.py)."""
    backend = _backend(vk_device, mode)
    q, k, v, d_out = attention_inputs(1, 20, 2, 1, 32, seed=3)
    got, _ = coopmat_attention_gpu(vk_device, backend, q, k, v, d_out, 1 / math.sqrt(32))
    reference = OPS.causal_attention(f64(q), f64(k), f64(v), 1 / math.sqrt(32))[0].numpy()
    assert np.linalg.norm(got["out"] - reference) / np.linalg.norm(reference) > 1e-5


# ----------------------------------------------------------------------------------- through a program
def test_fp16_tc_program_runs_attention_on_the_tensor_core_kernels_and_reports_them(vk_device, tmp_path):
    """tiny-llama (D = 32, GQA 4/2): with fp16-tc (emulated on lavapipe) every causal_attention and
    causal_attention_backward op lowers to the coopmat kernels, the GEMM report counts them among the
    ops on tensor cores, and the step's loss stays near the fp32 route's (attention moves it by its
    fp16 rounding only: the full bound is test_precision_policy.py's business)."""
    from _helpers import LOSS_RTOL
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.runtime.delegate.executor import GEMM_OPS
    from vktrain.runtime.program.runner import TrainingRunner

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (1, 8))))
    generator = torch.Generator().manual_seed(5)
    token_ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=generator).numpy()
    labels = np.roll(token_ids, -1, axis=1)
    hparams = np.array([1e-3, 0.9, 0.999, 1e-8, 0.0], np.float32)  # lr, beta1, beta2, eps, weight decay
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as fp32_runner:
        fp32_loss = fp32_runner.step(token_ids, labels, hparams)
        assert not any(d.shader.startswith("coopmat_attention") for d in fp32_runner.executor.dispatches)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision=PRECISION_FP16_TC, emulate_tensor_cores=True) as runner:
        executor = runner.executor
        attention_ops = [f"{i}:{op.name}" for i, op in enumerate(executor.ops) if "causal_attention" in op.name]
        assert len(attention_ops) == 2 * model.config.n_layers, attention_ops
        assert set(attention_ops) <= set(executor.tensor_core_ops)
        for label in attention_ops:
            shaders = {d.shader.split("@")[0] for d in executor.dispatches
                       if d.name == label or d.name.startswith(label + ".")}  # the backward's are label.delta, ...
            expected = ({"coopmat_attention_fwd"} if label.endswith("causal_attention.default") else
                        {"attention_bwd_delta", "coopmat_absmax", "coopmat_attention_bwd"})
            assert shaders == expected, (label, shaders)
        report = runner.gemm_report()
        gemm_ops = sum(op.name in GEMM_OPS for op in executor.ops)
        assert f"{len(executor.tensor_core_ops)} of {gemm_ops} GEMM ops on tensor cores" in report, report
        loss = runner.step(token_ids, labels, hparams)
    assert math.isfinite(loss) and loss != fp32_loss
    assert abs(loss - fp32_loss) <= 1e-3 * abs(fp32_loss) + LOSS_RTOL, (loss, fp32_loss)


def test_emulated_kernels_run_the_longest_sequence_their_loop_budget_allows(vk_device):
    """The longest S the emulated DKV pass accepts (the tightest of the three at D = 64) runs to the end
    on this device within the bound: lavapipe's loop limit is not reached where the plans accept."""
    backend = _backend(vk_device, "emulated")
    D, options = 64, dict(group_heads=1, D=64, row_blocks=2, subgroup_size=backend["subgroup_size"])
    S = 1
    while coopmat_attention.emulated_loop_trips("backward_dkv", S=S + 1, **options) <= coopmat_attention.EMULATED_LOOP_BUDGET:
        S += 1
    q, k, v, d_out = attention_inputs(1, S, 1, 1, D, seed=13)
    got, _ = coopmat_attention_gpu(vk_device, backend, q, k, v, d_out, 1 / math.sqrt(D), row_blocks=2)
    reference, bound, _ = fp16_attention_bounds(q, k, v, d_out, 1 / math.sqrt(D))
    for name in reference:
        _assert_within(got[name], reference[name], bound[name], name)

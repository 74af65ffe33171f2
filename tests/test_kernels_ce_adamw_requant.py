"""GPU kernels fused_ce, adamw and q4gsw_requant (lavapipe) against the op library's CPU references.

References: torch.ops.vktrain.fused_ce / .adamw / .q4gsw_requant (vktrain/ops), torch.optim.AdamW for
the multi-step optimizer run, a float64 formula for the huge-logit cross-entropy, and
vktrain.quant.pack_w4x8 / unpack_w4x8 for the requant layout (no layout is re-implemented here).

Tolerances and why:
* fused_ce: every row is a few fp32 exp/log evaluations plus a length-V sum; Vulkan bounds exp/log
  error only loosely (ulp-scale), and the GPU sums the R row losses in fp32 while the reference sums in
  float64. loss: 2e-6 relative. dlogits: 2e-6 relative to the largest entry (1/n_valid scale), i.e. the
  absolute error of a probability, which is what matters for a gradient.
* adamw: m and v use only fp32 add/mul (correctly rounded in Vulkan) -> 1e-6 relative to the largest
  entry. The parameter update adds sqrt and two divisions (Vulkan allows ~3 ulp each). Single step:
  parameters ~1e-3 against an update ~lr = 3e-2, so the 2e-6 bound (relative to the largest entry)
  measures the update itself, bias corrections included. Ten steps against torch.optim.AdamW: 1e-6
  relative per element (the two sides drift apart by about an ulp per step), plus 1e-6 of the summed
  learning rates for entries near 0.
* q4gsw_requant: integer codes, compared exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain)
from vktrain import quant
from vktrain.runtime import Buffer, BufferBinding, Program
from vktrain.backend.kernel_planning.kernels import cross_entropy, optimizer, requant
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.registry import KERNELS


# ---- helpers -------------------------------------------------------------------------------------

class Buffers(dict):
    """name -> Buffer, destroyed together (the device lives for the whole session)."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def _replace(self, name, buffer):
        if name in self:
            self[name].destroy()
        self[name] = buffer
        return buffer

    def upload(self, name, array):
        return self._replace(name, Buffer.from_array(self.device, np.ascontiguousarray(array), name=name))

    def empty(self, name, nbytes):
        return self._replace(name, Buffer(self.device, nbytes, name=name))

    def destroy(self):
        for buffer in self.values():
            buffer.destroy()


@pytest.fixture
def buffers(vk_device):
    made = Buffers(vk_device)
    yield made
    made.destroy()


def assert_close_rel(actual, expected, rtol, what):
    """Max abs error relative to the reference's largest magnitude."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
    err = np.abs(actual - expected).max(initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def test_plans_are_registered():
    assert KERNELS["vktrain.fused_ce.default"] is cross_entropy.plan_fused_ce
    assert KERNELS["vktrain.adamw.default"] is optimizer.plan_adamw
    assert KERNELS["vktrain.q4gsw_requant.default"] is requant.plan_q4gsw_requant


# ---- fused_ce ------------------------------------------------------------------------------------

def run_fused_ce(vk_device, buffers, logits, labels, n_valid, *, workgroup_size=256, vec4=None,
                 in_place=False, max_group_count=None, replays=1):
    """(loss, dlogits) from the GPU; with replays > 1, one result per replay of the same Program."""
    R, V = logits.shape
    buffers.upload("logits", logits.astype(np.float32))
    buffers.upload("labels", labels.astype(np.int32))
    buffers.upload("n_valid", np.array([n_valid], np.float32))
    buffers.empty("loss", 4)
    buffers.empty("dlogits", 4 * R * V)
    buffers.empty("row_loss", cross_entropy.fused_ce_scratch_nbytes(R))
    dlogits_key = "logits" if in_place else "dlogits"
    plan = cross_entropy.plan_fused_ce(R=R, V=V, logits="logits", labels="labels", n_valid="n_valid",
                                       loss="loss", dlogits=dlogits_key, row_loss="row_loss",
                                       workgroup_size=workgroup_size, vec4=vec4)
    variants = [name for name, used in (("VEC4", V % 4 == 0 if vec4 is None else vec4),
                                        ("IN_PLACE", in_place)) if used]
    assert plan[0].shader == "fused_ce" + ("@" + "+".join(variants) if variants else "")
    results = []
    with Program(vk_device, plan, buffers, max_group_count=max_group_count) as program:
        for _ in range(replays):
            # Poison the outputs so a replay that skipped a write would be caught.
            buffers["loss"].write(np.array([np.nan], np.float32))
            if in_place:
                buffers["logits"].write(logits.astype(np.float32))
            else:
                buffers["dlogits"].write(np.full(R * V, np.nan, np.float32))
            program.replay()
            results.append((buffers["loss"].read(np.float32, ())[()],
                            buffers[dlogits_key].read(np.float32, (R, V))))
    return results if replays > 1 else results[0]


def reference_fused_ce(logits, labels, n_valid):
    loss, dlogits = torch.ops.vktrain.fused_ce(torch.from_numpy(logits), torch.from_numpy(labels).long(),
                                               torch.tensor(n_valid, dtype=torch.float32))
    return float(loss), dlogits.numpy()


def ce_rows_float64(logits, labels, n_valid):
    """loss from the definition in float64 (independent of the op library)."""
    z = logits.astype(np.float64)
    total = 0.0
    for r, label in enumerate(labels):
        if label >= 0:
            m = z[r].max()
            total += m + np.log(np.exp(z[r] - m).sum()) - z[r, label]
    return total / n_valid


# (R, V, workgroup size, vec4 kernel): V far above, equal to and below the workgroup size (in floats and
# in vec4s), R above it (the loss sum then has several rows per thread); V % 4 != 0 takes the scalar
# kernel, V % 4 == 0 the vec4 one unless forced to scalar.
# The in-place kernels (dlogits over the logits) run the vec4 and the scalar shapes.
CE_SHAPES = [(6, 5000, 256, None, False), (6, 5000, 256, False, False), (4, 1024, 256, None, False),
             (4, 256, 256, False, False), (3, 7, 256, None, False), (2, 4, 256, None, False),
             (300, 33, 64, None, False), (5, 1000, 32, None, False),
             (6, 5000, 256, None, True), (7, 999, 128, None, True),
             (6, 5000, 128, None, False)]  # the phone profiles' 128 lanes (op_lowering: _reduction_workgroup_size)


@pytest.mark.parametrize("R,V,workgroup_size,vec4,in_place", CE_SHAPES)
def test_fused_ce_matches_reference(vk_device, buffers, R, V, workgroup_size, vec4, in_place):
    rng = np.random.default_rng(R * 7919 + V)
    logits = (rng.standard_normal((R, V)) * 4).astype(np.float32)
    labels = rng.integers(0, V, size=R)
    labels[1] = -100                   # masked row
    labels[2 % R] = V - 1              # last class (bounds of the label read)
    labels[0] = 0
    n_valid = float((labels >= 0).sum())
    loss, dlogits = run_fused_ce(vk_device, buffers, logits, labels, n_valid, workgroup_size=workgroup_size,
                                 vec4=vec4, in_place=in_place)
    ref_loss, ref_dlogits = reference_fused_ce(logits, labels, n_valid)
    assert_close_rel(loss, ref_loss, 2e-6, "loss")
    assert_close_rel(dlogits, ref_dlogits, 2e-6, "dlogits")
    assert np.all(dlogits[1] == 0.0), "a masked row must get exactly zero gradient"


def test_fused_ce_huge_logits_keep_the_small_loss(vk_device, buffers):
    """Logits ~1e4: without max subtraction exp overflows; forming logsumexp - logit from two numbers
    of magnitude 1e4 would lose the small loss to cancellation (fp32 ulp of 1e4 is ~1e-3)."""
    R, V = 4, 5000
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((R, V)) * 0.01).astype(np.float32)
    logits[0] += 1e4                   # every logit huge
    logits[1, 17] = 1e4                # one dominant logit, the label: loss ~ 0 but not exactly
    logits[1, 18] = 1e4 - 9.0
    logits[2, :] = -1e4                # all hugely negative but one
    logits[2, 3] = 1e4
    logits[3, ::2] = 1e4               # ties at the max
    labels = np.array([11, 17, 4, 2])
    n_valid = 4.0
    loss, dlogits = run_fused_ce(vk_device, buffers, logits, labels, n_valid)
    ref_loss, ref_dlogits = reference_fused_ce(logits, labels, n_valid)
    assert_close_rel(loss, ce_rows_float64(logits, labels, n_valid), 2e-6, "loss vs float64")
    assert_close_rel(loss, ref_loss, 2e-6, "loss vs op library")
    assert_close_rel(dlogits, ref_dlogits, 2e-6, "dlogits")
    # Row 1 alone: loss = log(1 + e^-9 + ...) / 4 ~ 3e-5, which logsumexp - logit (two fp32 numbers
    # ~1e4) would round to 0. The fp32 sum 1 + e^-9 itself keeps ~3 digits of e^-9 (the ulp of 1 is
    # 1.2e-7 against 1.2e-4), hence 1e-3.
    row1 = ce_rows_float64(logits[1:2], labels[1:2], n_valid)
    only_row1, _ = run_fused_ce(vk_device, buffers, logits[1:2], labels[1:2], n_valid)
    assert row1 > 1e-5
    assert abs(only_row1 - row1) <= 1e-3 * row1


def test_fused_ce_negative_infinite_logits(vk_device, buffers):
    """-inf logits (a vocabulary mask) get probability 0, also when a row starts with them."""
    R, V = 3, 600
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((R, V)).astype(np.float32)
    logits[0, :300] = -np.inf          # every thread's first elements are -inf
    logits[1, 1::2] = -np.inf
    labels = np.array([450, 4, -1])
    loss, dlogits = run_fused_ce(vk_device, buffers, logits, labels, 2.0)
    ref_loss, ref_dlogits = reference_fused_ce(logits, labels, 2.0)
    assert_close_rel(loss, ref_loss, 2e-6, "loss")
    assert_close_rel(dlogits, ref_dlogits, 2e-6, "dlogits")
    assert np.all(dlogits[0, :300] == 0.0) and np.all(dlogits[1, 1::2] == 0.0)


@pytest.mark.parametrize("n_valid", [1.0, 0.0])
def test_fused_ce_all_rows_masked(vk_device, buffers, n_valid):
    """No valid row: loss 0 and zero gradient; n_valid is never divided by, so 0 gives 0, not NaN."""
    R, V = 5, 300
    logits = np.random.default_rng(3).standard_normal((R, V)).astype(np.float32)
    labels = np.array([-100, -1, -100, -7, -100])
    loss, dlogits = run_fused_ce(vk_device, buffers, logits, labels, n_valid)
    assert loss == 0.0
    assert np.all(dlogits == 0.0)
    if n_valid > 0:  # the op library refuses n_valid = 0
        ref_loss, ref_dlogits = reference_fused_ce(logits, labels, n_valid)
        assert ref_loss == 0.0 and np.all(ref_dlogits == 0.0)


def test_fused_ce_labels_past_vocabulary_are_ignored(vk_device, buffers):
    """The op library refuses labels >= V; the GPU cannot raise, so it ignores such rows (documented)."""
    R, V = 4, 100
    logits = np.random.default_rng(4).standard_normal((R, V)).astype(np.float32)
    labels = np.array([5, V, 2**31 - 1, 99])
    loss, dlogits = run_fused_ce(vk_device, buffers, logits, labels, 2.0)
    as_ignored = np.where(labels >= V, -1, labels)
    ref_loss, ref_dlogits = reference_fused_ce(logits, as_ignored, 2.0)
    assert_close_rel(loss, ref_loss, 2e-6, "loss")
    assert_close_rel(dlogits, ref_dlogits, 2e-6, "dlogits")
    with pytest.raises(ValueError, match="labels must be < V"):
        reference_fused_ce(logits, labels, 2.0)


@pytest.mark.parametrize("V", [257, 256])
def test_fused_ce_is_deterministic_and_splits_rows(vk_device, buffers, V):
    """Two replays give the same bits; rows split over several dispatches (group-count limit 7) give the
    same bits as one dispatch, so the row index honours the runtime's group offset."""
    R = 300
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    labels = rng.integers(-1, V, size=R)
    (loss_a, d_a), (loss_b, d_b) = run_fused_ce(vk_device, buffers, logits, labels, 123.0, replays=2)
    assert np.float32(loss_a).tobytes() == np.float32(loss_b).tobytes()
    assert d_a.tobytes() == d_b.tobytes()
    loss_split, d_split = run_fused_ce(vk_device, buffers, logits, labels, 123.0, max_group_count=7)
    assert np.float32(loss_split).tobytes() == np.float32(loss_a).tobytes()
    assert d_split.tobytes() == d_a.tobytes()
    ref_loss, _ = reference_fused_ce(logits, labels, 123.0)
    assert_close_rel(loss_a, ref_loss, 2e-6, "loss")


def test_fused_ce_plan_refuses_bad_arguments():
    names = dict(logits="l", labels="y", n_valid="n", loss="o", dlogits="d", row_loss="s")
    with pytest.raises(KernelArgumentError, match="power of two"):
        cross_entropy.plan_fused_ce(R=2, V=8, workgroup_size=96, **names)
    with pytest.raises(KernelArgumentError, match="V must be an int >= 1"):
        cross_entropy.plan_fused_ce(R=2, V=0, **names)
    with pytest.raises(KernelArgumentError, match="32 bits"):
        cross_entropy.plan_fused_ce(R=2**17, V=2**16, **names)
    with pytest.raises(KernelArgumentError, match="V % 4 == 0"):
        cross_entropy.plan_fused_ce(R=2, V=10, vec4=True, **names)


# ---- adamw ---------------------------------------------------------------------------------------

def f32(value):
    """The float32 value of a Python float, as a Python float: the GPU and torch then see the same
    hyper-parameters (torch.optim keeps Python floats, the GPU reads float32)."""
    return float(np.float32(value))


def test_adamw_ten_steps_one_recording_matches_torch_optim(vk_device, buffers):
    """One Program replayed 10 times; hparams and step rewritten before each replay, lr changing every
    step; numel = 1003 exercises the vec4 body and the 3-element tail."""
    numel = 1003
    rng = np.random.default_rng(6)
    param0 = rng.standard_normal(numel).astype(np.float32)
    beta1, beta2, eps, weight_decay = f32(0.9), f32(0.999), f32(1e-8), f32(0.1)
    for name, array in (("param", param0), ("exp_avg", np.zeros(numel, np.float32)),
                        ("exp_avg_sq", np.zeros(numel, np.float32)), ("grad", np.zeros(numel, np.float32)),
                        ("hparams", np.zeros(5, np.float32)), ("step", np.zeros(1, np.float32))):
        buffers.upload(name, array)
    plan = optimizer.plan_adamw(numel=numel, param="param", exp_avg="exp_avg", exp_avg_sq="exp_avg_sq",
                                grad="grad", hparams="hparams", step="step")
    assert [d.shader for d in plan] == ["adamw@VEC4", "adamw"]

    torch_param = torch.nn.Parameter(torch.from_numpy(param0.copy()))
    torch_opt = torch.optim.AdamW([torch_param], lr=1e-2, betas=(beta1, beta2), eps=eps,
                                  weight_decay=weight_decay)
    lr_sum = 0.0
    with Program(vk_device, plan, buffers) as program:
        for t in range(1, 11):
            lr = f32(1e-2 * (0.5 + 0.5 * np.cos(np.pi * t / 10)) + 1e-4)  # a cosine schedule
            grad = (rng.standard_normal(numel) * rng.uniform(0.01, 3)).astype(np.float32)
            buffers["grad"].write(grad)
            buffers["hparams"].write(np.array([lr, beta1, beta2, eps, weight_decay], np.float32))
            buffers["step"].write(np.array([t], np.float32))
            program.replay()

            torch_param.grad = torch.from_numpy(grad)
            torch_opt.param_groups[0]["lr"] = lr
            torch_opt.step()
            state = torch_opt.state[torch_param]
            param = buffers["param"].read(np.float32, numel)
            assert_close_rel(buffers["exp_avg"].read(np.float32, numel), state["exp_avg"].numpy(), 1e-6,
                             f"exp_avg step {t}")
            assert_close_rel(buffers["exp_avg_sq"].read(np.float32, numel), state["exp_avg_sq"].numpy(), 1e-6,
                             f"exp_avg_sq step {t}")
            # 1e-6 relative (~8 ulp; the two sides drift apart by about an ulp per step), and for entries
            # near 0 1e-6 of the distance the updates could have moved them (sum of lr so far).
            lr_sum += lr
            np.testing.assert_allclose(param, torch_param.detach().numpy(), rtol=1e-6, atol=1e-6 * lr_sum,
                                       err_msg=f"param after step {t}")


ADAMW_CASES = [
    # numel, beta1, beta2, weight decay, step t, max workgroups
    (1, 0.9, 0.999, 0.0, 1, 4096),       # tail only; 1 - beta2^1 = 1e-3
    (3, 0.9, 0.999, 0.01, 3, 4096),      # tail only; 1 - beta2^3 ~ 3e-3: fp32 pow would lose ~3 digits
    (4, 0.5, 0.9999, 0.0, 2, 4096),      # one vec4, no tail
    (517, 0.95, 0.99, 0.1, 1000, 4096),  # 1 - 0.95^1000 ~ 1: the correction vanishes
    (2001, 0.9, 0.999, 0.1, 12345, 2),   # 2 workgroups of 64 stride over 500 vec4s (4 passes), + tail
    (260, 0.0, 0.0, 0.0, 7, 4096),       # betas 0: plain normalised-gradient steps
]


@pytest.mark.parametrize("numel,beta1,beta2,weight_decay,t,max_groups", ADAMW_CASES)
def test_adamw_single_step_matches_op_library(vk_device, buffers, numel, beta1, beta2, weight_decay, t,
                                              max_groups):
    rng = np.random.default_rng(numel + t)
    # Parameters small against the update (~lr), so the update's error is not hidden by their rounding.
    param = (rng.standard_normal(numel) * 1e-3).astype(np.float32)
    exp_avg = (rng.standard_normal(numel) * 0.1).astype(np.float32)
    exp_avg_sq = (rng.uniform(0, 0.02, numel)).astype(np.float32)
    grad = rng.standard_normal(numel).astype(np.float32)
    lr = 3e-2
    hparams = np.array([lr, beta1, beta2, 1e-8, weight_decay], np.float32)
    step = np.array([t], np.float32)
    for name, array in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad),
                        ("hparams", hparams), ("step", step)):
        buffers.upload(name, array)
    plan = optimizer.plan_adamw(numel=numel, param="param", exp_avg="exp_avg", exp_avg_sq="exp_avg_sq",
                                grad="grad", hparams="hparams", step="step", workgroup_size=64,
                                max_groups=max_groups)
    with Program(vk_device, plan, buffers) as program:
        program.replay()
    ref_param, ref_m, ref_v = (x.numpy() for x in torch.ops.vktrain.adamw(
        *(torch.from_numpy(a) for a in (param, exp_avg, exp_avg_sq, grad, hparams)),
        torch.tensor(float(t), dtype=torch.float32)))
    assert_close_rel(buffers["exp_avg"].read(np.float32, numel), ref_m, 1e-6, "exp_avg")
    assert_close_rel(buffers["exp_avg_sq"].read(np.float32, numel), ref_v, 1e-6, "exp_avg_sq")
    assert_close_rel(buffers["param"].read(np.float32, numel), ref_param, 2e-6, "param")


def test_adamw_plan_splits_body_and_tail():
    names = dict(param="p", exp_avg="m", exp_avg_sq="v", grad="g", hparams="h", step="t")
    assert [d.shader for d in optimizer.plan_adamw(numel=8, **names)] == ["adamw@VEC4"]
    assert [d.shader for d in optimizer.plan_adamw(numel=2, **names)] == ["adamw"]
    with pytest.raises(KernelArgumentError, match="numel must be an int >= 1"):
        optimizer.plan_adamw(numel=0, **names)
    capped = optimizer.plan_adamw(numel=4 * 10**6, workgroup_size=128, max_groups=100, **names)
    assert capped[0].groups == (100, 1, 1)
    with pytest.raises(KernelArgumentError, match="max_groups must be an int >= 1"):
        optimizer.plan_adamw(numel=8, max_groups=0, **names)


# ---- q4gsw_requant -------------------------------------------------------------------------------

def run_requant(vk_device, buffers, latent, scales, group_size, *, max_group_count=None):
    N, K = latent.shape
    buffers.upload("latent", latent.astype(np.float32))
    buffers.upload("scales", scales.astype(np.float32))
    buffers.upload("weights", np.full(quant.w4x8_num_words(N, K), 0xDEADBEEF, np.uint32))  # poison
    plan = requant.plan_q4gsw_requant(N=N, K=K, group_size=group_size, out="weights", latent="latent",
                                      scales="scales")
    with Program(vk_device, plan, buffers, max_group_count=max_group_count) as program:
        program.replay()
    return buffers["weights"].read(np.uint32, quant.w4x8_num_words(N, K))


def requant_case(N, K, group_size, seed):
    """Latents over the whole code range and past both clamps, zero-scale entries, exact .5 ties."""
    rng = np.random.default_rng(seed)
    G = K // group_size
    scales = rng.uniform(0.05, 0.3, size=(G, N)).astype(np.float32)
    latent = (rng.uniform(-11, 11, size=(N, K)) * np.repeat(scales.T, group_size, axis=1)).astype(np.float32)
    scales[0, 1] = 0.0                         # a zero scale: its whole group gets code 8
    # Exact ties with power-of-two scales (the quotient is exact): roundEven picks the even neighbour,
    # and 7.5 -> 8 / -8.5 -> -8 then clamp to 7 / -8.
    scales[G - 1, 0] = 0.25
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.5, -8.5, 3.5, -3.5, 6.5, -7.5], np.float32)
    k0 = (G - 1) * group_size
    count = min(group_size, len(ties))
    latent[0, k0:k0 + count] = ties[:count] * 0.25
    return latent, scales


# (N, K, group_size): N % 8 == 4 (padding rows), K % 8 == 4 (padding column), one group, many groups
REQUANT_SHAPES = [(12, 20, 4), (16, 32, 8), (8, 12, 12), (4, 4, 4), (36, 136, 8), (64, 96, 32)]


@pytest.mark.parametrize("N,K,group_size", REQUANT_SHAPES)
def test_requant_matches_op_library_int_for_int(vk_device, buffers, N, K, group_size):
    latent, scales = requant_case(N, K, group_size, seed=N * 131 + K)
    words = run_requant(vk_device, buffers, latent, scales, group_size)
    flat = torch.ops.vktrain.q4gsw_requant(torch.from_numpy(latent), torch.from_numpy(scales), group_size).numpy()
    np.testing.assert_array_equal(words, quant.pack_w4x8(flat, K))
    np.testing.assert_array_equal(quant.unpack_w4x8(words, N, K), flat)
    codes = quant.unpack_flat(flat, K)
    assert (codes == quant.QMIN).any() and (codes == quant.QMAX).any(), "case must reach both clamps"


def test_requant_ties_round_half_to_even(vk_device, buffers):
    """Explicit expectations for the ties (independent of any reference implementation)."""
    N, K, group_size = 4, 16, 16
    scales = np.full((1, N), 0.5, np.float32)
    quotients = np.array([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, -0.5, -1.5, -2.5, -3.5, -6.5, -7.5, -8.5, 100])
    latent = np.tile(quotients * 0.5, (N, 1)).astype(np.float32)
    words = run_requant(vk_device, buffers, latent, scales, group_size)
    codes = quant.unpack_flat(quant.unpack_w4x8(words, N, K), K)
    expected = np.array([0, 2, 2, 4, 4, 6, 6, 7, -0, -2, -2, -4, -6, -8, -8, 7])
    np.testing.assert_array_equal(codes, np.tile(expected, (N, 1)))


def test_requant_infinities_and_zero_scale(vk_device, buffers):
    N, K, group_size = 8, 8, 4
    latent = np.zeros((N, K), np.float32)
    latent[:, 0], latent[:, 1], latent[:, 4] = np.inf, -np.inf, np.inf
    scales = np.full((2, N), 0.1, np.float32)
    scales[1, :] = 0.0                 # group 1 (k = 4..7): code 8 even for an infinite latent
    words = run_requant(vk_device, buffers, latent, scales, group_size)
    flat = torch.ops.vktrain.q4gsw_requant(torch.from_numpy(latent), torch.from_numpy(scales), group_size).numpy()
    np.testing.assert_array_equal(words, quant.pack_w4x8(flat, K))
    codes = quant.unpack_flat(flat, K)
    assert (codes[:, 0] == 7).all() and (codes[:, 1] == -8).all() and (codes[:, 4:] == 0).all()


def test_requant_split_dispatch(vk_device, buffers):
    """More work groups than the (lowered) per-axis limit: the word index honours the group offset."""
    N, K, group_size = 44, 300, 4     # 44 // 4 = 11 (odd N4), 300 % 8 == 4
    latent, scales = requant_case(N, K, group_size, seed=9)
    words = run_requant(vk_device, buffers, latent, scales, group_size, max_group_count=5)
    flat = torch.ops.vktrain.q4gsw_requant(torch.from_numpy(latent), torch.from_numpy(scales), group_size).numpy()
    np.testing.assert_array_equal(words, quant.pack_w4x8(flat, K))


def test_requant_output_feeds_linear_q4gsw(vk_device, buffers):
    """The requantized buffer is the next step's forward weight: linear_q4gsw on the GPU reads it as is."""
    from vktrain.backend.kernel_planning.kernels import linear

    N, K, group_size, M = 12, 20, 4, 6
    latent, scales = requant_case(N, K, group_size, seed=10)
    x = np.random.default_rng(11).standard_normal((M, K)).astype(np.float32)
    buffers.upload("latent", latent)
    buffers.upload("scales", scales)
    buffers.empty("weights", requant.requant_output_nbytes(N, K))
    buffers.upload("x", x)
    buffers.empty("y", 4 * M * N)
    plan = requant.plan_q4gsw_requant(N=N, K=K, group_size=group_size, out="weights", latent="latent",
                                      scales="scales")
    plan += linear.plan_linear_q4gsw(M=M, N=N, K=K, group_size=group_size, out="y", x="x", weights="weights",
                                     scales="scales")
    with Program(vk_device, plan, buffers) as program:
        assert program.barriers[1], "the forward must wait for the requant's writes"
        program.replay()
    tx, tl, ts = (torch.from_numpy(a) for a in (x, latent, scales))
    expected = torch.ops.vktrain.linear_q4gsw(tx, torch.ops.vktrain.q4gsw_requant(tl, ts, group_size), ts,
                                              group_size)
    assert_close_rel(buffers["y"].read(np.float32, (M, N)), expected.numpy(), 1e-5, "linear after requant")


def test_requant_plan_refuses_bad_shapes():
    names = dict(out="w", latent="l", scales="s")
    with pytest.raises(KernelArgumentError, match=r"N=6 \(out features\) must be a multiple of 4"):
        requant.plan_q4gsw_requant(N=6, K=8, group_size=4, **names)
    with pytest.raises(KernelArgumentError, match="K=12 must be a multiple of group_size=8"):
        requant.plan_q4gsw_requant(N=8, K=12, group_size=8, **names)
    # N % 8 == 4: W_4X8 pads to 16 rows, so an output sized for the flat [12, 4] bytes is too small.
    flat_sized = BufferBinding("w", size=12 * quant.padded_k(8) // 2)
    with pytest.raises(KernelArgumentError, match="out binds 48 bytes but the W_4X8 words .* take 64"):
        requant.plan_q4gsw_requant(N=12, K=8, group_size=4, out=flat_sized, latent="l", scales="s")
    assert requant.requant_output_nbytes(12, 8) == 64
    requant.plan_q4gsw_requant(N=12, K=8, group_size=4, out=BufferBinding("w", size=64), latent="l", scales="s")

"""The fp16 GEMM precision policy (docs/PRECISION.md, "The fp16 policy"): its route, `auto`'s choice from the
device profile's vendor tuning, and tiny-llama's training step under it on lavapipe against float64 and the
fp32 route, within the derived bound.

Step-1 loss bound (first order, as tests/test_precision_policy.py derives it for fp16-tc). The policy runs
every 4-bit base GEMM (forward y = x @ deq(W).T, and d_x) on the FP16 variant; only the forward ones move
the step's own loss. Each forward output e moves by at most eps_e, the per-element bound of
tests/test_kernels_fp16.py (fp16 rounding of x and deq(W): ~2u of S_e = sum_k |x_k w_k|, u = 2^-11, plus
the fp32 sums and fp16's subnormal spacing); to first order the loss moves by at most
sum_e |dL/dy_e| * eps_e (the gradients in float64 by autograd on the eager reference). Second-order terms
(~(2u)^2 relative) and the fp32 arithmetic of everything else fit in the fp32 parity tolerance LOSS_RTOL
added on top. A wrong weight, row or tile moves the loss by a whole term, far above the bound.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.contract import (METADATA_GEMM_PRECISIONS, PRECISION_AUTO, PRECISION_FP16, PRECISION_FP16_TC,
                              PRECISION_FP32, PRECISIONS)
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.lora.layers import LoRAQ4Linear
from vktrain.models import build_model
from vktrain.backend.kernel_planning.kernels.coopmat import select_gemm_route
from vktrain.backend.kernel_planning.planner import gemm_route_for, requirements_of, runs_fp16_kernel
from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.runtime.vk.coopmat import CooperativeMatrixShape
from vktrain.serialization.device_profile import (ADRENO_6XX, ADRENO_7XX, AMD_INTEGRATED, APPLE_MOLTENVK,
                                                  BUILTIN_PROFILES, DESKTOP_GPU, INTEL_INTEGRATED, LAVAPIPE, MALI_G7X,
                                                  MALI_G7XX, NVIDIA_COOPMAT, VENDOR_GEMM_TUNING, DeviceProfile,
                                                  DeviceProfileError, vendor_gemm_tuning)
from vktrain.backend.kernel_planning.kernels.linear_tiles import DEFAULT_GEMM_THREADS, GemmTiles

from _helpers import LOSS_RTOL, _cast_floating
from test_kernels_fp16 import fp16_gemm_bound

BATCH, SEQ = 2, 8
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
TENSOR_CORES = CooperativeMatrixShape(16, 16, 16, "float16", "float16", "float32", "float32", False, "subgroup")
BASE_GEMMS = ("vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default")


def _device(properties=(), features=frozenset({"shaderFloat16"})):
    """What select_gemm_route reads of a vktrain Device."""
    return SimpleNamespace(name="test-gpu", cooperative_matrix_properties=tuple(properties), features=features,
                           subgroup_operations=0x1, subgroup_size=32)


# ----------------------------------------------------------------------------------- no device needed
def test_fp16_runs_the_fp16_simt_kernels_where_the_device_has_shader_float16_and_falls_back_saying_why():
    route = select_gemm_route(PRECISION_FP16, PRECISIONS, _device())
    assert route.precision == PRECISION_FP16 and route.fp16_simt and not route.tensor_cores
    assert "FP16 SIMT kernels (fp16 operands, fp32 products and sums)" in route.describe()
    # Tensor cores or not, fp16 asks for the SIMT variant: fp16-tc is the policy that takes them.
    assert select_gemm_route(PRECISION_FP16, PRECISIONS, _device([TENSOR_CORES])).fp16_simt
    without = select_gemm_route(PRECISION_FP16, PRECISIONS, _device(features=frozenset()))
    assert without.precision == PRECISION_FP32 and not without.fp16_simt
    assert "fp16 asked, but test-gpu lacks shaderFloat16" in without.describe()
    old_blob = ("fp32", "fp16-tc")  # a blob written before the policy existed
    with pytest.raises(ValueError, match=f"allows GEMM precision fp32, fp16-tc .*{METADATA_GEMM_PRECISIONS}.*'fp16'"):
        select_gemm_route(PRECISION_FP16, old_blob, _device())


def test_fp16_on_webgpu_runs_the_f16_wgsl_kernels_where_the_adapter_has_shader_f16():
    from vktrain.backend.kernel_planning.kernels.coopmat import WGSL_F16_FEATURE
    from vktrain.runtime.webgpu.device import DEVICE_TYPE

    adapter = SimpleNamespace(name="test-adapter", device_type=DEVICE_TYPE, features=frozenset({WGSL_F16_FEATURE}),
                              kernel_features=frozenset({WGSL_F16_FEATURE}))
    route = select_gemm_route(PRECISION_FP16, PRECISIONS, adapter)
    assert (route.precision, route.wgsl, route.tensor_cores, route.fp16_simt) == (PRECISION_FP16, True, True, False)
    assert "f16 WGSL kernels" in route.describe()
    without = select_gemm_route(PRECISION_FP16, PRECISIONS,
                                SimpleNamespace(**dict(vars(adapter), kernel_features=frozenset())))
    assert not without.tensor_cores and "fp32 kernels run" in without.describe()
    # auto stays fp32 on WebGPU, whatever the profile prefers (the f16 WGSL step measured slower on the H200).
    assert select_gemm_route(PRECISION_AUTO, PRECISIONS, adapter, profile=ADRENO_7XX).precision == PRECISION_FP32


def test_auto_picks_fp16_only_where_the_profile_prefers_it_and_no_tensor_cores_run():
    phone = dataclasses.replace(ADRENO_7XX, name="phone")
    route = select_gemm_route(PRECISION_AUTO, PRECISIONS, _device(), profile=phone)
    assert route.precision == PRECISION_FP16 and route.fp16_simt
    assert route.reason.startswith("auto -> fp16: no tensor-core kernels, and the device profile prefers fp16")
    assert select_gemm_route(PRECISION_AUTO, PRECISIONS, _device([TENSOR_CORES]), profile=phone).tensor_cores
    for profile, device in ((DESKTOP_GPU, _device()), (phone, _device(features=frozenset())), (None, _device())):
        assert select_gemm_route(PRECISION_AUTO, PRECISIONS, device, profile=profile).precision == PRECISION_FP32
    assert select_gemm_route(PRECISION_AUTO, ("fp32", "fp16-tc"), _device(), profile=phone).precision == PRECISION_FP32
    # Planned for a phone profile with no device at hand (export --target): the profile decides.
    route = gemm_route_for(SimpleNamespace(metadata={}), MALI_G7XX)
    assert route.precision == PRECISION_FP32  # a blob allowing fp32 only
    route = gemm_route_for(SimpleNamespace(metadata={METADATA_GEMM_PRECISIONS: json.dumps(PRECISIONS)}), MALI_G7XX)
    assert route.fp16_simt and requirements_of(MALI_G7XX, route).float16


def test_the_vendor_table_gives_the_phone_and_laptop_profiles_their_tuning_with_sources():
    for profile, vendor in ((ADRENO_6XX, "adreno"), (ADRENO_7XX, "adreno"), (MALI_G7X, "mali"), (MALI_G7XX, "mali"),
                            (APPLE_MOLTENVK, "apple"), (INTEL_INTEGRATED, "intel"), (AMD_INTEGRATED, "amd")):
        row = VENDOR_GEMM_TUNING[vendor]
        assert (profile.prefers_fp16, profile.gemm_tiles) == (True, row.gemm_tiles)
        assert row.source in profile.source
        # The tiles the plan takes: the row's, or (empty) the default 16 x 16 threads at the op's bk (<= 16).
        tiles = GemmTiles(*profile.gemm_tiles) if profile.gemm_tiles else GemmTiles(16, 16, 16)
        assert profile.gemm_tiles or profile.max_workgroup_invocations >= DEFAULT_GEMM_THREADS
        assert tiles.threads_x * tiles.threads_y <= profile.max_workgroup_invocations
        assert tiles.shared_bytes <= profile.max_shared_memory_bytes  # fp32 tiles (fp16: half of it)
    for profile in (LAVAPIPE, NVIDIA_COOPMAT, DESKTOP_GPU):
        assert (profile.prefers_fp16, profile.gemm_tiles) == (False, ())
    assert vendor_gemm_tuning("Adreno (TM) 740") is VENDOR_GEMM_TUNING["adreno"]
    assert vendor_gemm_tuning("Mali-G715") is VENDOR_GEMM_TUNING["mali"]
    assert vendor_gemm_tuning("Apple M1") is VENDOR_GEMM_TUNING["apple"]
    assert vendor_gemm_tuning("Intel(R) Iris(R) Xe Graphics (TGL GT2)") is VENDOR_GEMM_TUNING["intel"]
    assert vendor_gemm_tuning("AMD Radeon 780M (RADV GFX1103_R1)") is VENDOR_GEMM_TUNING["amd"]
    assert vendor_gemm_tuning("Radeon RX Vega") is VENDOR_GEMM_TUNING["amd"]
    assert vendor_gemm_tuning("NVIDIA H200") is None
    assert vendor_gemm_tuning("llvmpipe (LLVM 15.0.6, 256 bits)") is None


def test_profile_files_carry_the_tuning_older_files_load_and_bad_tiles_are_refused_by_field():
    for profile in BUILTIN_PROFILES.values():
        assert DeviceProfile.from_json(profile.to_json()) == profile
    older = {k: v for k, v in ADRENO_7XX.to_dict().items() if k not in ("prefers_fp16", "gemm_tiles")}
    loaded = DeviceProfile.from_dict(older)
    assert (loaded.prefers_fp16, loaded.gemm_tiles) == (False, ())
    for tiles, shown in (([16, 8], "gemm_tiles must be empty"), ([16, 8, 12], "bk a multiple of 8"),
                         ([32, 8, 8], "32x8 threads exceed max_workgroup_invocations 128")):
        with pytest.raises(DeviceProfileError, match=shown):
            DeviceProfile.from_dict(dict(ADRENO_7XX.to_dict(), gemm_tiles=tiles), "phone.json")


def test_fp16_kernels_are_counted_by_their_variant_not_by_the_scales_pass():
    assert runs_fp16_kernel("linear_q4gsw@FP16") and runs_fp16_kernel("linear_q4gsw@HAS_BIAS+FP16")
    assert runs_fp16_kernel("coopmat_mm@AB_SCALE+BM=64") and not runs_fp16_kernel("coopmat_absmax")
    assert not runs_fp16_kernel("linear_q4gsw@HAS_BIAS") and not runs_fp16_kernel("linear_q4gsw_gemv")


# ----------------------------------------------------------------------------------- the training step
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from vktrain.export import export_training_step, lower_to_pte

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("pte") / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ))))
    generator = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    token_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels[1, -3:] = -1
    return path, model, (token_ids, labels)


def _scale(x: np.ndarray) -> float:
    """The FP16 kernels' per-tensor operand scale 2^e: max |x| * 2^e in [2^14, 2^15)."""
    largest = float(np.abs(x).max())
    return 1.0 if largest == 0.0 else 2.0 ** (14 - math.floor(math.log2(largest)))


def _float64_loss_and_fp16_bound(model, batch, head: bool = False) -> tuple[float, float, int]:
    """The float64 eager step-1 loss and the module docstring's first-order bound over every base GEMM (and,
    with `head`, the tied head's logits = h @ W^T, both operands scaled per tensor before their rounding)."""
    model = copy.deepcopy(model)
    _cast_floating(model, torch.float64)
    records = []

    def record(module, inputs, output):
        output.retain_grad()
        records.append((module, inputs[0].detach(), output))

    routed = [m for m in model.modules() if isinstance(m, LoRAQ4Linear)] + ([model.lm_head] if head else [])
    hooks = [m.register_forward_hook(record) for m in routed]
    token_ids, labels = batch
    loss = model.loss(token_ids, labels, (labels >= 0).sum().to(torch.float32))
    loss.backward()
    for hook in hooks:
        hook.remove()
    bound = 0.0
    for module, x, output in records:
        x = x.reshape(-1, module.in_features).numpy()
        if isinstance(module, LoRAQ4Linear):
            w, x_scale, w_scale = module.dequantized_weight().to(torch.float64).numpy(), 1.0, 1.0
        else:
            w = module.weight.detach().numpy()
            x_scale, w_scale = _scale(x), _scale(w)
        # d loss / d base output = d loss / d module output: the module adds the LoRA branch to it.
        d_y = output.grad.reshape(-1, module.out_features).abs().numpy()
        per_output = fp16_gemm_bound(x * x_scale, w.T * w_scale) / (x_scale * w_scale)
        bound += float((d_y * per_output).sum())
    return float(loss.detach()), bound, len(records)


def _step(path, device, batch, precision, steps=1, every_mm=False):
    token_ids, labels = batch
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, precision=precision,
                                 emulate_tensor_cores=every_mm) as runner:
        executor = runner.executor
        losses = [runner.step(token_ids.numpy(), labels.numpy(), HPARAMS) for _ in range(steps)]
        shaders = {executor.ops[int(d.name.split(":")[0])].name: set() for d in executor.dispatches
                   if d.name and d.name.split(":")[0].isdigit()}
        for d in executor.dispatches:
            if d.name and d.name.split(":")[0].isdigit():
                shaders[executor.ops[int(d.name.split(":")[0])].name].add(d.shader)
        return losses, executor, runner.gemm_report(), shaders


def test_tiny_llama_step_under_fp16_matches_float64_and_fp32_within_the_derived_bound(vk_device, tiny_llama):
    if "shaderFloat16" not in vk_device.features:
        pytest.skip(f"{vk_device.name} has no shaderFloat16")
    path, model, batch = tiny_llama
    (fp32_loss,), _, _, fp32_shaders = _step(path, vk_device, batch, PRECISION_FP32)
    (loss,), executor, report, shaders = _step(path, vk_device, batch, PRECISION_FP16)
    assert executor.gemm_route.fp16_simt and executor.schedule.requirements.float16
    # Every base GEMM (forward, d_x) runs its FP16 variant; d_x scales d_out first; nothing else changed.
    assert shaders["vktrain.linear_q4gsw.default"] == {"linear_q4gsw@FP16"}, shaders
    assert shaders["vktrain.linear_q4gsw_backward.default"] == {"coopmat_absmax", "linear_q4gsw_backward@FP16"}
    for op in set(shaders) - set(BASE_GEMMS):
        assert shaders[op] == fp32_shaders[op], op
    base_ops = [f"{i}:{op.name}" for i, op in enumerate(executor.ops) if op.name in BASE_GEMMS]
    assert sorted(executor.tensor_core_ops) == sorted(base_ops)
    assert f"{len(base_ops)} of" in report and "FP16 SIMT kernels" in report
    reference, bound, routed = _float64_loss_and_fp16_bound(model, batch)
    assert routed == 7 * model.config.n_layers  # the head is a plain mm over the tied embedding: fp32
    error, fp32_error = abs(loss - reference), abs(fp32_loss - reference)
    print(f"tiny-llama fp16 step-1 loss {loss!r} vs float64 {reference!r}: |err| {error:.2e}, bound {bound:.2e}; "
          f"fp32 route |err| {fp32_error:.2e}; |fp16 - fp32| {abs(loss - fp32_loss):.2e}")
    assert error <= bound + LOSS_RTOL * abs(reference)
    assert abs(loss - fp32_loss) <= bound + 2 * LOSS_RTOL * abs(reference)
    # The bound counts every |d loss / d y| as if all roundings pushed one way: 1.5% of the loss here, the
    # measured error ~7e-5. A wrong layout, row or tile of a base GEMM gives unrelated outputs, moving the loss
    # by a sizeable fraction of itself.
    assert bound < 2e-2 * abs(reference)
    assert fp32_error <= LOSS_RTOL * abs(reference) and loss != fp32_loss  # the step really rounded to fp16


def test_auto_under_a_phone_profile_runs_fp16_and_trains(vk_device, tiny_llama, monkeypatch):
    """adreno-7xx emulated on lavapipe: `auto` picks fp16 (the vendor table prefers it), the FP16 variants take
    the profile's tiles, and three steps' losses fall, each step's loss within the step-1 bound's reach of the
    fp32 route's (later steps differ by how far two precisions' AdamW updates part, not bounded here)."""
    if "shaderFloat16" not in vk_device.features:
        pytest.skip(f"{vk_device.name} has no shaderFloat16")
    path, _, batch = tiny_llama
    monkeypatch.setenv(DEVICE_PROFILE_ENV, "adreno-7xx")
    losses, executor, report, shaders = _step(path, vk_device, batch, PRECISION_AUTO, steps=3)
    assert executor.gemm_route.precision == PRECISION_FP16 and "auto -> fp16" in report
    tiles = {d.local_size for d in executor.dispatches if d.shader == "linear_q4gsw@FP16"}
    assert tiles == {ADRENO_7XX.gemm_tiles[:2] + (1,)}, tiles
    fp32_losses, *_ = _step(path, vk_device, batch, PRECISION_FP32, steps=3)
    assert losses[0] != fp32_losses[0] and abs(losses[0] - fp32_losses[0]) < 1e-3 * abs(fp32_losses[0])
    assert losses[2] < losses[0] and np.isfinite(losses).all()
    assert PRECISION_FP16_TC not in report


def test_tiny_llama_step_with_every_mm_on_fp16_stays_within_the_bound_with_the_head(vk_device, tiny_llama):
    """The test path (emulate_tensor_cores: the fp16 route without its size gate) sends every aten.mm / addmm
    whose operands the FP16 variant reads in place to matmul@...+FP16, the tied head's logits among them; the
    step-1 loss stays within the bound of the base GEMMs and the head (the LoRA products do not move it at
    step 1: B starts at zero)."""
    if "shaderFloat16" not in vk_device.features:
        pytest.skip(f"{vk_device.name} has no shaderFloat16")
    path, model, batch = tiny_llama
    (loss,), executor, report, shaders = _step(path, vk_device, batch, PRECISION_FP16, every_mm=True)
    assert "every mm (test path)" in report
    mm_shaders = shaders["aten.mm.default"] | shaders.get("aten.addmm.default", set())
    assert any(s.startswith("matmul@") and s.endswith("+FP16") for s in mm_shaders), mm_shaders
    dim, vocab = model.config.dim, model.config.vocab_size
    heads = [d for d in executor.dispatches if d.shader.startswith("matmul@") and "FP16" in d.shader
             and executor.ops[int(d.name.split(":")[0])].name == "aten.mm.default"
             and [list(executor.graph.tensor(v).shape) for v in executor.ops[int(d.name.split(":")[0])].args[:2]]
             == [[BATCH * SEQ, dim], [dim, vocab]]]
    assert len(heads) == 1, "the tied head's logits run the FP16 variant"
    reference, bound, routed = _float64_loss_and_fp16_bound(model, batch, head=True)
    assert routed == 7 * model.config.n_layers + 1
    error = abs(loss - reference)
    print(f"tiny-llama fp16 (every mm) step-1 loss {loss!r} vs float64 {reference!r}: |err| {error:.2e}, "
          f"bound {bound:.2e}")
    assert error <= bound + LOSS_RTOL * abs(reference)
    assert bound < 3e-2 * abs(reference)

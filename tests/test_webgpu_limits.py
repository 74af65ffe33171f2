"""The WebGPU runtime under the limits a browser grants, and the limits WGSL itself imposes.

* A Device opened with reduced limits (BROWSER_DEFAULT_LIMITS: 16 KiB of workgroup storage, 256
  invocations, requested from the lavapipe adapter, which has 32 KiB / 1024) reports what it was granted;
  the kernel plans size their tiles by it, so tiny-llama's step at a shape whose default attention tiles
  need more than 16 KiB loads with smaller tiles and trains to the same losses (1e-5 relative).
* Requests outside [vktrain's minimum, the adapter's value], and tiles that do not fit, are refused with
  the limit named.
* The WGSL attention kernels keep per-thread arrays of 32 entries (WGSL cannot size them by an override):
  tiles needing more are refused at load, and tiles exactly at the cap compute the right values.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import test_kernels_transformer as transformer  # attention_gpu, attention_inputs, check_attention
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.backend.kernel_planning.kernels import attention, linear
from vktrain.backend.kernel_planning.kernels.attention import AttentionTiles
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.dispatch import ScheduleError

from _helpers import runner_losses

pytest.importorskip("wgpu", reason="the WebGPU runtime needs wgpu (pip install 'vktrain[webgpu]')")
from vktrain.runtime.webgpu import Device, WebGPUUnavailableError, reflect_wgsl  # noqa: E402
from vktrain.runtime.webgpu.device import BROWSER_DEFAULT_LIMITS  # noqa: E402
from vktrain.runtime_shaders.wgsl import wgsl_source  # noqa: E402
from vktrain.backend.kernel_planning import plan_schedule

STORAGE = "max-compute-workgroup-storage-size"
INVOCATIONS = "max-compute-invocations-per-workgroup"
STEPS = 3
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
# 8 x 256 tokens: 8 query tiles of 32 rows x 4 heads x 8 sequences = 256 workgroups, so the default
# forward and DQ tilings want 32 x 32 tiles (18 and 22 KiB at D = 32), which 16 KiB cannot hold. One
# layer of tiny-llama (the tiling is per layer the same) keeps the 2048-token steps affordable on lavapipe.
LLAMA_BATCH, LLAMA_SEQ = 8, 256
LLAMA_LAYERS = 1


@pytest.fixture(scope="module")
def browser_device():
    try:
        device = Device(limits=BROWSER_DEFAULT_LIMITS)
    except WebGPUUnavailableError as exc:
        pytest.skip(f"no usable WebGPU adapter: {exc}")
    yield device
    messages = device.take_validation_messages()
    device.close()
    assert not messages, f"wgpu logged errors: {messages}"


def test_reduced_limits_are_requested_and_reported(browser_device):
    adapter = dict(browser_device.adapter.limits)
    assert adapter[STORAGE] > BROWSER_DEFAULT_LIMITS[STORAGE]  # lavapipe: 32 KiB, so the request reduces it
    assert browser_device.limits.max_compute_shared_memory_size == BROWSER_DEFAULT_LIMITS[STORAGE] == 16384
    assert browser_device.limits.max_compute_work_group_invocations == BROWSER_DEFAULT_LIMITS[INVOCATIONS] == 256


@pytest.mark.parametrize("limits,message", [
    ({STORAGE: 8192}, f"{STORAGE} = 8192 is outside \\[16384 \\(vktrain's minimum\\)"),
    ({STORAGE: 1 << 30}, f"{STORAGE} = 1073741824 is outside .* \\(the adapter's\\)"),
    ({"max-texture-dimension-2d": 4096}, "'max-texture-dimension-2d' is not a limit vktrain asks for"),
    ({INVOCATIONS: 256.0}, f"{INVOCATIONS} must be an int, got 256.0"),
])
def test_limits_outside_the_adapter_or_vktrain_minimum_are_refused(limits, message):
    with pytest.raises(WebGPUUnavailableError, match=message):
        Device(limits=limits)


def test_tiles_that_do_not_fit_are_refused_naming_the_limit():
    base = dict(B=1, S=64, Hq=2, Hkv=2, D=32, q="q", k="k", v="v", out="o", lse="l", scale=0.25)
    with pytest.raises(KernelArgumentError, match=f"needs 18048 bytes of .*{STORAGE}\\); the device has 16384"):
        attention.plan_causal_attention(**base, tiles=AttentionTiles(32, 32, 4), shared_memory_bytes=16384)
    with pytest.raises(KernelArgumentError, match=f"256 threads exceed .*{INVOCATIONS}.* of 128"):
        attention.plan_causal_attention(**base, tiles=AttentionTiles(64, 8, 4), max_workgroup_size=128)
    # Not even the smallest tiling fits: the reason says what the smallest needs.
    with pytest.raises(KernelArgumentError, match=f"no tile configuration .*{STORAGE}.*4x4 tiles, need 6416 bytes"):
        attention.plan_causal_attention(**{**base, "D": 128}, shared_memory_bytes=4096)
    tiles = linear.GemmTiles(16, 16, 32)  # 32 KiB of operand tiles
    with pytest.raises(KernelArgumentError, match=f"needs 32768 bytes of .*{STORAGE}\\), more than the device's 16384"):
        linear.plan_linear_q4gsw(M=256, N=128, K=128, group_size=32, out="y", x="x", weights="w", scales="s",
                                 tiles=tiles, shared_memory_bytes=16384)


def test_wgsl_attention_requirements_are_read_from_the_kernels():
    forward = reflect_wgsl("attention_fwd", wgsl_source("attention_fwd"))
    ids = {name: forward.override_names[name] for name in ("D", "BQ", "BK", "TPR")}
    fits = {ids["D"]: 128, ids["BQ"]: 4, ids["BK"]: 32, ids["TPR"]: 4}  # both arrays exactly full
    assert forward.unmet_requirements(fits) == []
    too_wide = forward.unmet_requirements({**fits, ids["D"]: 256})
    assert len(too_wide) == 1 and too_wide[0].startswith("D / 4u / TPR <= 8u (output vec4s per thread")
    assert too_wide[0].endswith("is false: 16 vs 8")
    too_long = forward.unmet_requirements({**fits, ids["BK"]: 64})
    assert len(too_long) == 1 and "BK / TPR <= 8u" in too_long[0] and too_long[0].endswith("16 vs 8")
    assert "cannot be evaluated" in forward.unmet_requirements({})[0]  # a missing override is not a pass
    backward = reflect_wgsl("attention_bwd@DQ", wgsl_source("attention_bwd@DQ"))
    assert [e for e, _ in backward.requirements] == ["D / 4u / TPR <= 8u", "COLS / TPR <= 8u"]


@pytest.mark.parametrize("pass_name", ["forward", "dq", "dkv"])
def test_attention_tiles_beyond_the_wgsl_arrays_are_refused_at_load(webgpu_device, pass_name):
    """cols / threads_per_row = 64 scores per thread: the Vulkan kernel sizes its arrays by the constants,
    the WGSL one has 8 entries (registers), so the WebGPU Program refuses the dispatch before it builds anything."""
    B, S, Hq, Hkv, D = 1, 70, 2, 1, 16
    q, k, v, d_out = transformer.attention_inputs(B, S, Hq, Hkv, D, seed=5)
    wide = AttentionTiles(4, 64, 1)
    tiles = {"forward": {"tiles": wide}, "dq": {"dq_tiles": wide}, "dkv": {"dkv_tiles": wide}}[pass_name]
    kernel, requirement = {"forward": ("attention_fwd", "BK / TPR <= 8u"),
                           "dq": ("attention_bwd@DQ", "COLS / TPR <= 8u"),
                           "dkv": ("attention_bwd@DKV", "COLS / TPR <= 8u")}[pass_name]
    with pytest.raises(ScheduleError, match=f"WGSL kernel '{kernel}' cannot run .*{requirement} .*64 vs 8"):
        transformer.attention_gpu(webgpu_device, q, k, v, 0.25, d_out, **tiles)


@pytest.mark.parametrize("D,tiles", [(16, AttentionTiles(4, 8, 1)), (128, AttentionTiles(4, 8, 4))])
def test_attention_tiles_at_the_wgsl_array_cap_are_right(webgpu_device, D, tiles):
    """8 scores (D = 16) or 8 output vec4s (D = 128) per thread: the arrays full, every entry used."""
    B, S, Hq, Hkv = 1, 45, 2, 1
    q, k, v, d_out = transformer.attention_inputs(B, S, Hq, Hkv, D, seed=D)
    scale = 1 / math.sqrt(D)
    got = transformer.attention_gpu(webgpu_device, q, k, v, scale, d_out, tiles=tiles, dq_tiles=tiles,
                                    dkv_tiles=tiles)
    transformer.check_attention(got, q, k, v, d_out, scale, fwd_tol=1e-6, bwd_tol=1e-6)


@pytest.fixture(scope="module")
def long_llama_program(tmp_path_factory):
    from vktrain.export import export_training_step, lower_to_pte

    model = build_model("tiny-llama", n_layers=LLAMA_LAYERS)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("pte") / "tiny_llama_long_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (LLAMA_BATCH, LLAMA_SEQ))))
    return path


def _batches():
    generator = torch.Generator().manual_seed(99)
    first, letters = ord("a"), 16
    for _ in range(STEPS):
        token_ids = first + torch.randint(0, letters, (LLAMA_BATCH, LLAMA_SEQ), generator=generator)
        labels = first + (token_ids - first + 3 * (torch.roll(token_ids, 1, dims=1) - first)) % letters
        yield token_ids, labels


def _train(path, device):
    with TrainingRunner.from_pte(path, device, planner=plan_schedule) as runner:
        dispatches = list(runner.executor.dispatches)
        return runner_losses(runner, _batches(), HPARAMS), dispatches


def _attention_constants(dispatches) -> dict[str, set]:
    return {shader: {d.specialization() for d in dispatches if d.shader == shader}
            for shader in ("attention_fwd", "attention_bwd@DQ", "attention_bwd@DKV")}


def test_tiny_llama_under_browser_limits_trains_as_with_the_adapters(webgpu_device, browser_device,
                                                                      long_llama_program):
    losses, dispatches = _train(long_llama_program, browser_device)
    default_losses, default_dispatches = _train(long_llama_program, webgpu_device)
    reduced, default = _attention_constants(dispatches), _attention_constants(default_dispatches)
    # The limits changed the tiling (so the comparison below tests the fitted tiles), not the work.
    assert reduced["attention_fwd"] != default["attention_fwd"]
    assert reduced["attention_bwd@DQ"] != default["attention_bwd@DQ"]
    assert [d.shader for d in dispatches] == [d.shader for d in default_dispatches]
    limit = browser_device.limits.max_compute_shared_memory_size
    for dispatch in dispatches:
        interface = browser_device.pipelines.interface(dispatch.shader)
        used = interface.workgroup_memory_bytes(dict(dispatch.specialization()))
        assert used is not None, f"{dispatch.shader}: workgroup memory not computable"  # so it was checked
        assert used <= limit, f"{dispatch.label}: {used} bytes of workgroup memory"
        assert dispatch.local_size is None or math.prod(dispatch.local_size) <= 256
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, default_losses, rtol=1e-5)

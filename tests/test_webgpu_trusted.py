"""vktrain's WGSL kernels compiled without naga's runtime checks (wgpu-native trusted shader modules)
give the same bits as with them: GEMMs at the Vulkan tests' edge shapes, attention forward and
backward, fused_ce, and three tiny-llama training steps (losses, LoRA state, AdamW moments). Also: the
option is reported and refused where it cannot apply, and it reaches only the pipeline cache's kernels.

The session's `webgpu_device` takes the default (checks off where wgpu-native has trusted modules);
`checked_device` here is the same adapter with the checks on.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import test_kernels_ce_adamw_requant as ce_adamw
import test_kernels_transformer as transformer
from test_webgpu_parity import HPARAMS, LLAMA_BATCH, LLAMA_SEQ
from test_wgsl_kernels import _gemm_cases, run_gemm_case

from vktrain.runtime.webgpu import shader_modules
from vktrain.runtime.webgpu.device import RUNTIME_CHECKS_ENV
from vktrain.runtime.webgpu.errors import WebGPUUnavailableError
from vktrain.backend.kernel_planning import plan_schedule


@pytest.fixture(scope="module")
def checked_device(webgpu_device):
    from vktrain.runtime.webgpu import Device

    if webgpu_device.runtime_checks:
        pytest.skip(f"{webgpu_device.name}: no trusted shader modules, so nothing to compare "
                    f"({shader_modules.trusted_modules_unavailable(webgpu_device.handle)})")
    device = Device(webgpu_device.info.index, runtime_checks=True)
    yield device
    messages = device.take_validation_messages()
    device.close()
    assert not messages, messages


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, np.float32).view(np.uint32)


def test_default_is_trusted_and_reported(webgpu_device, checked_device):
    assert webgpu_device.runtime_checks is False and checked_device.runtime_checks is True
    assert webgpu_device.kernel_report().endswith("; runtime checks off (wgpu-native trusted modules)")
    assert checked_device.kernel_report().endswith("; runtime checks on")


def test_gemms_give_the_same_bits_with_and_without_checks(webgpu_device, checked_device):
    for label, dispatches, inputs, shape in _gemm_cases():
        checked = run_gemm_case(checked_device, dispatches, inputs, shape)
        assert np.isfinite(checked).all(), label
        np.testing.assert_array_equal(_bits(run_gemm_case(webgpu_device, dispatches, inputs, shape)), _bits(checked),
                                      err_msg=f"{label} via {[d.shader for d in dispatches]}")


@pytest.mark.parametrize("B,S,Hq,Hkv,D,tiles,dq_tiles,dkv_tiles", transformer.ATTENTION_CASES)
def test_attention_gives_the_same_bits_with_and_without_checks(webgpu_device, checked_device, B, S, Hq, Hkv, D,
                                                               tiles, dq_tiles, dkv_tiles):
    q, k, v, d_out = transformer.attention_inputs(B, S, Hq, Hkv, D, seed=S + D)
    kwargs = dict(tiles=tiles, dq_tiles=dq_tiles, dkv_tiles=dkv_tiles)
    checked = transformer.attention_gpu(checked_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    trusted = transformer.attention_gpu(webgpu_device, q, k, v, 1 / math.sqrt(D), d_out, **kwargs)
    for name, value in checked.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_array_equal(_bits(trusted[name]), _bits(value), err_msg=name)


@pytest.mark.parametrize("R,V", [(5, 37), (9, 4096), (3, 1000)])
def test_fused_ce_gives_the_same_bits_with_and_without_checks(webgpu_device, checked_device, R, V):
    rng = np.random.default_rng(R * V)
    logits = (rng.standard_normal((R, V)) * 4).astype(np.float32)
    labels = rng.integers(0, V, R).astype(np.int32)
    labels[0] = -1  # a masked row
    results = []
    for device in (checked_device, webgpu_device):
        buffers = ce_adamw.Buffers(device)
        try:
            results.append(ce_adamw.run_fused_ce(device, buffers, logits, labels, R - 1))
        finally:
            buffers.destroy()
    (checked_loss, checked_grad), (trusted_loss, trusted_grad) = results
    assert np.isfinite(checked_loss) and np.isfinite(checked_grad).all()
    assert _bits(np.array(trusted_loss)) == _bits(np.array(checked_loss))
    np.testing.assert_array_equal(_bits(trusted_grad), _bits(checked_grad))


def test_tiny_llama_steps_give_the_same_losses_and_state(webgpu_device, checked_device, tmp_path):
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.runtime.program.runner import TrainingRunner
    from _helpers import runner_losses

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (LLAMA_BATCH, LLAMA_SEQ))))
    generator = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    batches = [(torch.randint(0, vocab, (LLAMA_BATCH, LLAMA_SEQ), generator=generator),
                torch.randint(0, vocab, (LLAMA_BATCH, LLAMA_SEQ), generator=generator)) for _ in range(3)]
    runs = []
    for device in (checked_device, webgpu_device):
        with TrainingRunner.from_pte(path, device, planner=plan_schedule) as runner:
            losses = runner_losses(runner, batches, HPARAMS)
            state = runner.lora_state()
            moments = {name: runner.read_state("optimizer.exp_avg_sq." + name.removeprefix("model."))
                       for name in state}
            runs.append((np.asarray(losses, np.float32), state, moments, runner.gemm_report()))
    (checked_losses, checked_state, checked_moments, checked_report), (losses, state, moments, report) = runs
    assert "runtime checks on" in checked_report and "runtime checks off" in report
    assert np.isfinite(checked_losses).all() and len(checked_losses) == 3
    np.testing.assert_array_equal(_bits(losses), _bits(checked_losses))
    assert state.keys() == checked_state.keys() and state
    for name in state:
        np.testing.assert_array_equal(_bits(state[name]), _bits(checked_state[name]), err_msg=name)
        np.testing.assert_array_equal(_bits(moments[name]), _bits(checked_moments[name]), err_msg=name)


def test_checks_follow_the_environment_and_bad_values_are_refused(webgpu_device, monkeypatch):
    from vktrain.runtime.webgpu import Device

    index = webgpu_device.info.index
    monkeypatch.setenv(RUNTIME_CHECKS_ENV, "ON")
    with Device(index) as device:
        assert device.runtime_checks is True
    with Device(index, runtime_checks=False) as device:
        assert device.runtime_checks is False  # the argument wins over the environment
    monkeypatch.setenv(RUNTIME_CHECKS_ENV, "maybe")
    with pytest.raises(WebGPUUnavailableError, match=rf"{RUNTIME_CHECKS_ENV}='maybe': expected one of on, off"):
        Device(index)
    monkeypatch.delenv(RUNTIME_CHECKS_ENV)
    with pytest.raises(WebGPUUnavailableError, match=r"expected True, False or None, got 'off'"):
        Device(index, runtime_checks="off")


def test_trusted_modules_are_refused_where_they_cannot_apply(webgpu_device, monkeypatch):
    from vktrain.runtime.webgpu import Device

    assert shader_modules.trusted_modules_unavailable(webgpu_device.handle) is None
    reason = shader_modules.trusted_modules_unavailable(object())
    assert "builtins.object, not wgpu-native's" in reason
    with pytest.raises(WebGPUUnavailableError, match="trusted shader module 'k': the device is a builtins.object"):
        shader_modules.create_trusted_wgsl_module(object(), "k", "@compute @workgroup_size(1) fn main() {}")
    # A wgpu-native build without the function (or another wgpu backend): off is refused, the default is on.
    monkeypatch.setattr(shader_modules, "trusted_modules_unavailable", lambda handle: "no trusted modules here")
    with pytest.raises(WebGPUUnavailableError, match=r"without runtime checks, but no trusted modules here; "
                                                     r"leave the checks on"):
        Device(webgpu_device.info.index, runtime_checks=False)
    with Device(webgpu_device.info.index) as device:
        assert device.runtime_checks is True


def test_only_the_pipeline_cache_kernels_are_trusted(webgpu_device, monkeypatch):
    """The cache's kernels go through the trusted path; ad hoc WGSL through the handle keeps the checks."""
    from vktrain.runtime.webgpu import pipelines

    made = []
    real = pipelines.create_trusted_wgsl_module
    monkeypatch.setattr(pipelines, "create_trusted_wgsl_module",
                        lambda handle, label, code: made.append(label) or real(handle, label, code))
    webgpu_device.pipelines._modules.pop("fused_ce_sum", None)
    webgpu_device.pipelines._module("fused_ce_sum")
    webgpu_device.handle.create_shader_module(code="@compute @workgroup_size(1) fn main() {}")
    assert made == ["fused_ce_sum"]


def test_bench_runs_the_webgpu_side_once_per_setting():
    """scripts/bench_webgpu.py --webgpu-runtime-checks off on: the devices it opens, the keys and pairs."""
    import argparse
    import importlib.util
    from pathlib import Path

    from vktrain.contract import PRECISION_FP16_TC, PRECISION_FP32

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_webgpu.py"
    spec = importlib.util.spec_from_file_location("bench_webgpu", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    both = argparse.Namespace(webgpu_runtime_checks=["off", "on", "off"])
    assert bench.bench_devices(both) == [("vulkan", "vulkan", {}), ("webgpu", "webgpu", {"runtime_checks": False}),
                                         ("webgpu+checks-on", "webgpu", {"runtime_checks": True})]
    assert bench.bench_devices(argparse.Namespace(webgpu_runtime_checks=None)) == [("vulkan", "vulkan", {}),
                                                                                   ("webgpu", "webgpu", {})]
    labels = ("vulkan", "webgpu", "webgpu+checks-on")
    assert bench.compared_pairs([PRECISION_FP32], labels) == [("vulkan", "webgpu"), ("webgpu", "webgpu+checks-on")]
    assert ("webgpu:fp16-tc", "webgpu+checks-on:fp16-tc") in bench.compared_pairs([PRECISION_FP32, PRECISION_FP16_TC],
                                                                                  labels)


# Index 5 of a 4-element workgroup array: with naga's checks the index is clamped (a[3] = 13); a trusted
# module reads past the array (undefined behaviour in general; lavapipe puts `b` right after `a`).
_OUT_OF_BOUNDS_WGSL = """
@group(0) @binding(0) var<storage, read_write> io: array<u32>;
var<workgroup> a: array<u32, 4>;
var<workgroup> b: array<u32, 4>;
@compute @workgroup_size(4) fn main(@builtin(local_invocation_index) i: u32) {
    a[i] = i + 10u;
    b[i] = i + 100u;
    workgroupBarrier();
    if (i == 0u) { io[1] = a[io[0]]; }
}
"""


def _read_out_of_bounds(device, module) -> int:
    wgpu, handle = device.wgpu, device.handle
    pipeline = handle.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    io = handle.create_buffer_with_data(data=np.array([5, 0], np.uint32),
                                        usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    group = handle.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                     entries=[{"binding": 0, "resource": {"buffer": io}}])
    encoder = handle.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, group)
    compute.dispatch_workgroups(1)
    compute.end()
    device.queue.submit([encoder.finish()])
    try:
        return int(device.download(io, 0, 8).view(np.uint32)[1])
    finally:
        io.destroy()


def test_trusted_modules_drop_the_bounds_checks_that_ad_hoc_modules_keep(webgpu_device):
    checked = webgpu_device.handle.create_shader_module(code=_OUT_OF_BOUNDS_WGSL)
    assert _read_out_of_bounds(webgpu_device, checked) == 13  # clamped to the last element
    if "llvmpipe" not in webgpu_device.name:
        pytest.skip("what a trusted module reads past an array is the driver's layout (checked on lavapipe)")
    trusted = shader_modules.create_trusted_wgsl_module(webgpu_device.handle, "oob", _OUT_OF_BOUNDS_WGSL)
    assert _read_out_of_bounds(webgpu_device, trusted) == 101  # b[1]: no clamp

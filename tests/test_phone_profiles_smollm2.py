"""A SmolLM2-shaped step (SmolLM2-135M's widths, vocabulary and heads, one layer, random weights) under the most
constrained phone profile, adreno-6xx (16 KiB of shared memory, 128-invocation workgroups, bounded submits, a
1 GiB budget), on lavapipe: the losses of desktop-gpu bit for bit, and `vktrain inspect --device-profile`'s fit
report equal to what the runtime allocates under that profile.

Why bit for bit (scripts/bench_phone_profiles.py derives it for the whole model): both profiles plan 128
invocations per workgroup (the same shared-memory trees in fused_ce over 49,152 classes and rms_norm over 576),
neither promises a subgroup size lavapipe has, and adreno's 16 x 8-thread GEMM tiles give the same 64 x 128
output tiles, hence the same split-K slices, as desktop-gpu's; tiles change which thread computes an output, not
its sum. A kernel that read the profile's shared memory wrongly, a binding window or a submit cut in the wrong
place, changes the bits."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.cli import main
from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV
from vktrain.serialization.device_profile import ADRENO_6XX, PHONE_PROFILES

from test_profile_limits import SMOLLM2_SHAPED

BATCH, SEQ, STEPS = 1, 32, 2
HPARAMS = np.array([2e-3, 0.9, 0.999, 1e-8, 0.0], np.float32)


def test_adreno_6xx_is_the_most_constrained_phone_profile():
    # The one the lead runs on the H200 too (bench_phone_profiles.py GPU_PROFILE): no phone has less of a limit.
    for field in ("max_shared_memory_bytes", "max_workgroup_invocations", "max_storage_buffer_range",
                  "max_allocation_bytes", "memory_budget_bytes", "max_dispatches_per_submit"):
        assert getattr(ADRENO_6XX, field) == min(getattr(p, field) for p in PHONE_PROFILES), field


@pytest.fixture(scope="module")
def smol_step(tmp_path_factory):
    import torch

    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-llama", **SMOLLM2_SHAPED)
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, targets="*_proj", group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (BATCH, SEQ))))
    path = tmp_path_factory.mktemp("smol") / "smol_step.pte"
    path.write_bytes(lower_methods_to_pte(methods))
    return path


def _train(path, device, monkeypatch, profile):
    from vktrain.runtime.program.runner import TrainingRunner

    monkeypatch.setenv(DEVICE_PROFILE_ENV, profile)
    ids = np.random.default_rng(5).integers(0, SMOLLM2_SHAPED["vocab_size"], (BATCH, SEQ + 1))
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, precision="fp32", timing=False) as runner:
        losses = [runner.step(ids[:, :-1], ids[:, 1:], HPARAMS) for _ in range(STEPS)]
        eval_bytes = runner.eval_method().executor.owned_bytes
        executor = runner.executor
        return losses, dict(step=executor.owned_bytes, eval=eval_bytes,
                            largest=max(b.size_bytes for b in executor.schedule.buffers),
                            submits=executor.program.submits_per_replay,
                            recorded=executor.program.recorded_dispatch_count)


def test_a_smollm2_shaped_step_under_adreno_6xx_gives_desktop_gpu_s_losses_and_the_fit_it_reports(
        vk_device, smol_step, monkeypatch, capsys):
    desktop, _ = _train(smol_step, vk_device, monkeypatch, "desktop-gpu")
    phone, used = _train(smol_step, vk_device, monkeypatch, "adreno-6xx")
    assert phone == desktop  # the derived bound: 0 (module docstring)
    assert phone[-1] < phone[0]
    assert used["submits"] == -(-used["recorded"] // ADRENO_6XX.max_dispatches_per_submit)

    monkeypatch.delenv(DEVICE_PROFILE_ENV)
    assert main(["inspect", str(smol_step), "--device-profile", "adreno-6xx", "--precision", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (d,) = report["delegates"]
    assert report["fits"] and report["refusals"] == [] and d["refusals"] == []
    # What inspect plans with no device is what the runtime allocated under the emulated profile.
    assert (report["step_device_memory_bytes"], report["eval"]["device_memory_bytes"]) == (used["step"], used["eval"])
    assert report["device_memory_bytes"] == used["step"] + used["eval"] <= ADRENO_6XX.memory_budget_bytes
    assert d["largest_allocation"]["bytes"] == used["largest"] <= ADRENO_6XX.max_allocation_bytes
    # Dispatches and submits as the runtime records them, at the run's precision (auto would plan fp16 here).
    assert (d["submits"], d["recorded_dispatches"]) == (used["submits"], used["recorded"])
    assert 0 < d["largest_binding"]["bytes"] <= ADRENO_6XX.max_storage_buffer_range

"""Emulated device limits (issue 29): `intersect(device, target)` field by field, tiny-llama training on lavapipe
under each built-in phone profile (`--device-profile` / VKTRAIN_DEVICE_PROFILE), profiles the device cannot
emulate and programs over a profile's limits refused by name, and `vktrain inspect --device-profile`'s fit
report."""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from vktrain.cli import main
from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV, planning_profile, profile_of
from vktrain.serialization.device_profile import (ADRENO_6XX, ADRENO_7XX, API_WEBGPU, BUILTIN_PROFILES,
                                                  LAPTOP_PROFILES, LAVAPIPE, MALI_G7X, NVIDIA_COOPMAT, PHONE_PROFILES,
                                                  DeviceProfileError, resolve_profile)
from vktrain.serialization.profile_emulation import EmulationError, intersect
from vktrain.backend.kernel_planning import plan_schedule

# Every built-in device class a program is planned down to: the phones and the laptops' integrated GPUs.
CLASSES = PHONE_PROFILES + LAPTOP_PROFILES
PHONES = tuple(p.name for p in CLASSES)
BATCH, SEQ, STEPS = 2, 16, 3
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
# A device with more of everything than every phone profile, and subgroups of 64 (an Adreno's).
BIG = dataclasses.replace(LAVAPIPE, name="big", subgroup_size=64, max_shared_memory_bytes=65536,
                          max_storage_buffer_range=1 << 30, max_allocation_bytes=1 << 32,
                          max_push_constants_bytes=256, min_storage_buffer_offset_alignment=4)


# ---------------------------------------------------------------------------------------------- intersect
@pytest.mark.parametrize("target", CLASSES, ids=lambda p: p.name)
def test_intersect_takes_every_limit_and_feature_of_the_target(target):
    got = intersect(BIG, target)
    kept = {"name", "source", "api", "subgroup_size", "subgroup_operations"}
    for field in dataclasses.fields(target):
        if field.name not in kept:
            assert getattr(got, field.name) == getattr(target, field.name), field.name
    assert got.api == BIG.api and target.name in got.name and BIG.name in got.name and target.source in got.source
    if target.subgroup_size == BIG.subgroup_size:  # adreno, amd: 64 lanes on both
        assert (got.subgroup_size, got.subgroup_operations) == (64, target.subgroup_operations)
    else:  # mali's 16, apple's and intel's 32 lanes the device cannot give: no size promised, the portable path
        assert (got.subgroup_size, got.subgroup_operations) == (0, ())


@pytest.mark.parametrize("field, value, shown", [
    ("max_shared_memory_bytes", 65536 * 2, "131072 is above the device's 65536"),
    ("max_workgroup_invocations", 2048, "2048 is above the device's 1024"),
    ("max_storage_buffer_range", 1 << 31, "2147483648 is above the device's 1073741824"),
    ("max_allocation_bytes", 1 << 33, "8589934592 is above the device's 4294967296"),
    ("max_push_constants_bytes", 512, "512 is above the device's 256"),
    ("max_storage_buffers_per_stage", 64, "64 is above the device's 32"),
    ("max_workgroup_size", (1024, 2048, 64), "1024x2048x64 is above the device's 1024x1024x1024"),
    ("max_workgroup_count", (65536, 1, 1), "65536x1x1 is above the device's 65535x65535x65535"),
    ("min_storage_buffer_offset_alignment", 2, "2 is finer than the device's 4"),
])
def test_a_limit_above_the_devices_is_refused_naming_the_field_and_both_values(field, value, shown):
    target = dataclasses.replace(ADRENO_7XX, name="greedy", **{field: value})
    with pytest.raises(EmulationError, match=rf"big cannot emulate device profile 'greedy': {field}: the profile's "
                                             rf"{shown}"):
        intersect(BIG, target)
    assert intersect(BIG, dataclasses.replace(target, **{field: getattr(BIG, field)})).name  # at the device's: fine


@pytest.mark.parametrize("field", ["float16", "int64"])
def test_a_feature_the_device_lacks_is_refused(field):
    device = dataclasses.replace(BIG, **{field: False})
    with pytest.raises(EmulationError, match=rf"{field}: the profile's yes against the device's no"):
        intersect(device, dataclasses.replace(ADRENO_7XX, int64=True))
    # the profile without it turns it off on a device that has it
    assert getattr(intersect(BIG, dataclasses.replace(ADRENO_7XX, **{field: False})), field) is False


def test_subgroup_operations_and_cooperative_matrices_the_device_lacks_are_refused():
    with pytest.raises(EmulationError, match=r"subgroup_operations: the profile's clustered against"):
        intersect(BIG, dataclasses.replace(ADRENO_7XX, subgroup_operations=("basic", "clustered")))
    coopmat = dataclasses.replace(ADRENO_7XX, subgroup_size=32, cooperative_matrix=NVIDIA_COOPMAT.cooperative_matrix)
    with pytest.raises(EmulationError, match=r"cooperative_matrix: .*16x16x16 float16\*float16\+float16.*; "
                                             r"subgroup_size: the profile's 32 .* against the device's 64"):
        intersect(BIG, coopmat)
    assert intersect(NVIDIA_COOPMAT, DESKTOP_LIKE).cooperative_matrix == ()  # a profile without them: off


DESKTOP_LIKE = BUILTIN_PROFILES["desktop-gpu"]


def test_a_webgpu_device_emulates_without_push_constants():
    device = dataclasses.replace(BIG, api=API_WEBGPU, subgroup_size=0, subgroup_operations=(), int64=False,
                                 max_push_constants_bytes=0)
    got = intersect(device, ADRENO_7XX)
    assert (got.api, got.max_push_constants_bytes, got.subgroup_size) == (API_WEBGPU, 0, 0)


def test_profile_names_and_files_resolve_and_bad_ones_are_refused(tmp_path):
    assert resolve_profile("mali-g7x") is MALI_G7X
    path = tmp_path / "p.json"
    path.write_text(ADRENO_6XX.to_json())
    assert resolve_profile(str(path)) == ADRENO_6XX
    with pytest.raises(DeviceProfileError, match="'adreno-9xx' is neither a built-in profile"):
        resolve_profile("adreno-9xx")
    with pytest.raises(DeviceProfileError, match="cannot read it"):
        resolve_profile(str(tmp_path / "missing.json"))


def test_planning_profile_reads_the_environment(vk_device):
    own = profile_of(vk_device)
    assert planning_profile(vk_device, {}) == own
    assert planning_profile(vk_device, {DEVICE_PROFILE_ENV: "mali-g7x"}) == intersect(own, MALI_G7X)


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory):
    """A 1-layer tiny-llama training step (and eval method) at batch 2 x seq 16."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama", n_layers=1)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    step, evaluation = export_training_and_eval_steps(model, (BATCH, SEQ))
    path = tmp_path_factory.mktemp("pte") / "tiny_step.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


def _train(path, device, monkeypatch, profile, precision="fp32"):
    """STEPS losses under `profile`; fp32 by default, the policy whose losses the emulated limits must not move
    (`auto` picks fp16 on the phone profiles: tests/test_precision_fp16.py)."""
    from vktrain.runtime.program.runner import TrainingRunner

    if profile is None:
        monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    else:
        monkeypatch.setenv(DEVICE_PROFILE_ENV, profile)
    ids = np.random.default_rng(1).integers(0, 256, (BATCH, SEQ))
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, precision=precision) as runner:
        losses = [runner.step(ids, np.roll(ids, -1, axis=1), HPARAMS) for _ in range(STEPS)]
        program = runner.executor.program  # closing the runner drops it; its counters stay readable
        return losses, runner.executor, program


def test_tiny_llama_trains_under_each_phone_profile_with_the_unconstrained_losses(vk_device, tiny_step, monkeypatch):
    whole, executor, _ = _train(tiny_step, vk_device, monkeypatch, None)
    assert executor.gemm_route.fp32_tuning == "cpu"  # lavapipe's own: the CPU bodies
    for name in PHONES:
        losses, executor, program = _train(tiny_step, vk_device, monkeypatch, name)
        profile = BUILTIN_PROFILES[name]
        req = executor.schedule.requirements
        assert name in executor.profile.name
        assert (req.max_shared_memory_bytes, req.max_workgroup_invocations, req.min_storage_buffer_offset_alignment) \
            == (profile.max_shared_memory_bytes, profile.max_workgroup_invocations,
                profile.min_storage_buffer_offset_alignment)
        # No int64 on the phones: the GPU tuning of the fp32 GEMMs, not lavapipe's CPU bodies. Other kernels,
        # but at tiny-llama's sizes each output's sum runs in the same order: bit-identical.
        assert executor.gemm_route.fp32_tuning == "gpu"
        assert losses == whole, name
        assert program.submits_per_replay == -(-program.recorded_dispatch_count // 256)  # bounded by default
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("layer", ["vulkan", "webgpu"])
def test_bounded_submits_give_the_losses_of_one_submit(layer, request, tiny_step, tmp_path, monkeypatch):
    # A step cut into submits of 7 dispatches against the same plan in one submit: adreno-7xx's plan on
    # Vulkan; the device's own on WebGPU (lavapipe's WebGPU adapter lacks features the phone profiles have).
    device = request.getfixturevalue("vk_device" if layer == "vulkan" else "webgpu_device")
    base = ADRENO_7XX if layer == "vulkan" else profile_of(device)
    losses = {}
    for bound in (0, 7):
        path = tmp_path / f"bound-{bound}.json"
        path.write_text(dataclasses.replace(base, name=f"bound-{bound}", max_dispatches_per_submit=bound).to_json())
        losses[bound], _, program = _train(tiny_step, device, monkeypatch, str(path))
        expected = 1 if bound == 0 else -(-program.recorded_dispatch_count // bound)
        assert program.submits_per_replay == expected and program.submit_count == STEPS * expected
    assert expected > 10  # a real cut: the 1-layer step records over 70 dispatches
    assert losses[7] == losses[0]
    assert losses[7][-1] < losses[7][0]


def test_a_profile_with_a_too_small_limit_is_refused_naming_it(vk_device, tiny_step, tmp_path, capsys):
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, 4096))
    small_alloc = tmp_path / "small_alloc.json"
    small_alloc.write_text(dataclasses.replace(ADRENO_7XX, name="small-alloc", max_allocation_bytes=65536).to_json())
    small_binding = tmp_path / "small_binding.json"
    small_binding.write_text(dataclasses.replace(ADRENO_7XX, name="small-binding", max_storage_buffer_range=4096)
                             .to_json())
    base = ["train", str(tiny_step), "--steps", "1", "--no-progress", "--data", str(data), "--device-profile"]
    assert main(base + [str(small_alloc)]) == 2
    err = capsys.readouterr().err
    assert "needs an allocation of 131072 bytes, over the max allocation size of 65536 bytes (device profile " \
           "'small-alloc (emulated on" in err
    assert main(base + [str(small_binding)]) == 2
    assert "more than the max storage binding size of 4096 bytes (device profile 'small-binding (emulated" in \
        capsys.readouterr().err
    assert main(base + ["nvidia-coopmat"]) == 2  # more than lavapipe has
    assert "cannot emulate device profile 'nvidia-coopmat': max_shared_memory_bytes: the profile's 49152 is above " \
           "the device's 32768" in capsys.readouterr().err
    assert main(base + ["adreno-9xx"]) == 2
    assert "'adreno-9xx' is neither a built-in profile" in capsys.readouterr().err


def test_train_command_takes_the_profile(vk_device, tiny_step, tmp_path, monkeypatch):
    from vktrain.train.command import add_train_arguments, run_train

    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, 4096))
    runs = {}
    for profile in (None, "mali-g7xx"):
        records = tmp_path / f"{profile}.json"
        argv = [str(tiny_step), "--steps", "2", "--no-progress", "--log-every", "0", "--data", str(data),
                "--json", str(records), "--precision", "fp32"] + (["--device-profile", profile] if profile else [])
        args = add_train_arguments(argparse.ArgumentParser()).parse_args(argv)
        assert run_train(args, vk_device) == 0
        runs[profile] = [r["loss"] for r in json.loads(records.read_text())]
    assert runs[None] == runs["mali-g7xx"]
    import os
    assert DEVICE_PROFILE_ENV not in os.environ  # set only while the command ran


# ---------------------------------------------------------------------------------------------- fit report
def test_inspect_counts_the_dispatches_and_submits_the_runtime_records_at_the_same_precision(
        vk_device, tiny_step, monkeypatch, capsys):
    """`inspect --device-profile P --precision X` plans what `train --device-profile P --precision X` records.
    auto picks fp16 on a phone, whose GEMMs take dispatches fp32's do not: an fp32 run beside an auto inspect
    counted fewer (132 vs 137 on a SmolLM2-shaped layer)."""
    from vktrain.runtime.program.runner import TrainingRunner

    counted = {}
    for precision in ("fp32", "auto"):
        monkeypatch.setenv(DEVICE_PROFILE_ENV, "adreno-6xx")
        with TrainingRunner.from_pte(tiny_step, vk_device, planner=plan_schedule, precision=precision) as runner:
            executor = runner.executor
            used = (len(executor.dispatches), executor.program.recorded_dispatch_count,
                    executor.program.submits_per_replay, executor.gemm_route.precision)
        monkeypatch.delenv(DEVICE_PROFILE_ENV)
        assert main(["inspect", str(tiny_step), "--device-profile", "adreno-6xx", "--precision", precision,
                     "--json"]) == 0
        (d,) = json.loads(capsys.readouterr().out)["delegates"]
        assert (d["dispatches"], d["recorded_dispatches"], d["submits"], d["gemm_precision"]) == used, precision
        counted[precision] = used
    assert counted["auto"][3] == "fp16" and counted["auto"][1] > counted["fp32"][1]
    assert main(["inspect", str(tiny_step), "--device-profile", "adreno-6xx"]) == 0  # the default: auto
    assert f"dispatches: {counted['auto'][0]} (GEMMs fp16, as vktrain train --precision plans them" \
        in capsys.readouterr().out
    assert main(["inspect", str(tiny_step), "--precision", "fp32"]) == 2
    assert "vktrain inspect: error: --precision fp32 plans the program for a device profile: it needs " \
           "--device-profile" in capsys.readouterr().err


def test_inspect_reports_the_fit_of_a_profile_with_no_device(tiny_step, tmp_path, capsys):
    assert main(["inspect", str(tiny_step), "--device-profile", "adreno-6xx", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["profile"] == "adreno-6xx"
    (d,) = report["delegates"]
    assert d["refusals"] == [] and d["dispatches"] > 0
    assert d["recorded_dispatches"] >= d["dispatches"] and d["max_dispatches_per_submit"] == 256
    assert d["submits"] == -(-d["recorded_dispatches"] // 256)
    assert 0 < d["largest_binding"]["bytes"] <= ADRENO_6XX.max_storage_buffer_range
    assert 0 < d["largest_allocation"]["bytes"] <= d["device_memory_bytes"]
    # every constant the step reads is on the device: at least its stored bytes
    assert main(["inspect", str(tiny_step), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["delegates"][0]
    assert d["device_memory_bytes"] >= summary["constants"]["stored_deduplicated_bytes"] + \
        summary["memory"]["state_bytes"]
    tiny = tmp_path / "tiny.json"
    tiny.write_text(dataclasses.replace(ADRENO_6XX, name="tiny", max_allocation_bytes=d["largest_allocation"]["bytes"]
                                        - 4, max_dispatches_per_submit=7).to_json())
    assert main(["inspect", str(tiny_step), "--device-profile", str(tiny)]) == 0
    text = capsys.readouterr().out
    assert f"submits per step: {-(-d['recorded_dispatches'] // 7)} (at most 7 of its {d['recorded_dispatches']} " \
           f"recorded dispatches each)" in text
    assert "on device profile tiny: does NOT fit" in text
    assert f"refused (max_allocation_bytes): buffer '{d['largest_allocation']['buffer']}'" in text
    assert f"needs an allocation of {d['largest_allocation']['bytes']} bytes, over the profile's max allocation " \
           f"size of {d['largest_allocation']['bytes'] - 4} bytes" in text
    assert "change: " in text
    binding = tmp_path / "binding.json"
    binding.write_text(dataclasses.replace(ADRENO_6XX, name="narrow", max_storage_buffer_range=4096).to_json())
    assert main(["inspect", str(tiny_step), "--device-profile", str(binding), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"]
    (refusal,) = report["delegates"][0]["refusals"]
    assert refusal["limit"] == "max_storage_buffer_range" and "--batch or --seq" in refusal["change"]
    assert "max storage binding size of 4096 bytes (device profile 'narrow')" in refusal["message"]


def test_devices_profiles_lists_the_builtins_with_their_sources(capsys):
    assert main(["devices", "--profiles"]) == 0
    text = capsys.readouterr().out
    for profile in BUILTIN_PROFILES.values():
        assert profile.name in text and f"source: {profile.source}" in text


def test_eval_under_a_phone_profile_gives_the_unconstrained_loss(vk_device, tiny_step, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(3).integers(0, 256, 2048))
    results = {}
    for profile in (None, "adreno-6xx"):
        out = tmp_path / f"eval-{profile}.json"
        assert main(["eval", str(tiny_step), "--data", str(data), "--max-batches", "2", "--json", str(out),
                     "--precision", "fp32"] + (["--device-profile", profile] if profile else [])) == 0
        results[profile] = json.loads(out.read_text())
    assert results[None]["loss"] == results["adreno-6xx"]["loss"]
    assert main(["eval", str(tiny_step), "--data", str(data), "--device-profile", "nvidia-coopmat"]) == 2
    assert "cannot emulate device profile 'nvidia-coopmat'" in capsys.readouterr().err


def test_devices_names_the_builtins_the_local_device_can_emulate(vk_device, capsys):
    assert main(["devices"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "can emulate (--device-profile):" in line)
    emulated = line.split(":", 1)[1].strip().split(", ")
    assert set(PHONES) <= set(emulated)  # lavapipe has at least every phone class's limits
    assert "nvidia-coopmat" not in emulated  # no cooperative matrices, less shared memory


def test_generate_under_a_phone_profile_gives_the_unconstrained_tokens(vk_device, tmp_path, monkeypatch):
    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    tokens = {}
    for profile in (None, "mali-g7x"):
        out = tmp_path / f"generate-{profile}.json"
        assert main(["generate", "--model", "tiny-llama", "--model-arg", "n_layers=1", "--prompt-ids", "1,2,3",
                     "--max-new-tokens", "6", "--json", str(out), "--program-cache", str(tmp_path / "cache")]
                    + (["--device-profile", profile] if profile else [])) == 0
        tokens[profile] = json.loads(out.read_text())["tokens"]
    assert len(tokens[None]) == 6 and tokens[None] == tokens["mali-g7x"]


# ---------------------------------------------------------------------------------------------- memory budgets
def test_a_program_over_the_memory_budget_does_not_fit_and_is_refused_at_load(vk_device, tiny_step, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    assert main(["inspect", str(tiny_step), "--device-profile", "adreno-7xx", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    step, total = report["step_device_memory_bytes"], report["device_memory_bytes"]
    assert report["fits"] and report["memory_budget_bytes"] == ADRENO_7XX.memory_budget_bytes
    assert step == sum(d["device_memory_bytes"] for d in report["delegates"])
    assert 0 < report["eval"]["device_memory_bytes"] == total - step < step  # eval binds the step's weights

    def profile(name, budget):
        path = tmp_path / f"{name}.json"
        path.write_text(dataclasses.replace(ADRENO_7XX, name=name, memory_budget_bytes=budget).to_json())
        return str(path)

    small = profile("small-memory", total - 4)
    assert main(["inspect", str(tiny_step), "--device-profile", small]) == 0
    text = capsys.readouterr().out
    assert "on device profile small-memory: does NOT fit" in text
    assert f"refused (memory_budget_bytes): the program needs {total} bytes of device memory, over the memory " \
           f"budget of {total - 4} bytes (device profile 'small-memory')" in text
    assert "--lora-rank" in text and "checkpoint" not in text

    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, 4096))
    assert main(["train", str(tiny_step), "--steps", "1", "--no-progress", "--data", str(data),
                 "--device-profile", profile("step-only", step - 4)]) == 2
    assert f"the program needs {step} bytes of device memory, over the memory budget of {step - 4} bytes (device " \
           f"profile 'step-only (emulated on" in capsys.readouterr().err
    # The runtime counts what it allocates as the report does: the step fits its own bytes, and the eval
    # method, which binds the step's state and frozen weights, needs exactly the report's total.
    evaluate = ["eval", str(tiny_step), "--data", str(data), "--max-batches", "1", "--device-profile"]
    assert main(evaluate + [small]) == 2
    assert f"the program needs {total} bytes of device memory, over the memory budget of {total - 4} bytes" in \
        capsys.readouterr().err
    assert main(evaluate + [profile("exact", total)]) == 0


def test_eval_reuses_the_step_s_activation_memory_gives_the_same_losses_and_inspect_counts_it(
        vk_device, tiny_step, capsys, monkeypatch):
    from vktrain.serialization.schedule_memory import TRANSIENT_ROLES
    from vktrain.runtime.program.evaluation import EvalMethod
    from vktrain.runtime.program.runner import TrainingRunner

    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    assert main(["inspect", str(tiny_step), "--device-profile", "adreno-7xx", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    monkeypatch.setenv(DEVICE_PROFILE_ENV, "adreno-7xx")  # the runtime plans for the same profile
    rng = np.random.default_rng(3)
    train_ids, eval_ids = rng.integers(0, 256, (BATCH, SEQ)), rng.integers(0, 256, (BATCH, SEQ))
    runs = []
    for reuse in (False, True):
        with TrainingRunner.from_pte(tiny_step, vk_device, planner=plan_schedule) as runner:
            runner._eval = EvalMethod(runner.pte, runner.executor, reuse_activations=reuse, planner=plan_schedule)
            losses = []
            for _ in range(STEPS):  # eval between steps: each overwrites the other's activations
                losses.append(runner.evaluate(eval_ids, np.roll(eval_ids, -1, axis=1)))
                losses.append(runner.step(train_ids, np.roll(train_ids, -1, axis=1), HPARAMS))
            losses.append(runner.evaluate(eval_ids, np.roll(eval_ids, -1, axis=1)))
            step, method = runner.executor, runner._eval.executor
            offered = step.transient_buffers()
            transient = {b.key: b.size_bytes for b in method.schedule.buffers if b.role in TRANSIENT_ROLES}
            reused = {key: next((k for k, b in offered.items() if b is method._buffers[key]), None) for key in transient}
            runs.append((losses, step.owned_bytes, method.owned_bytes, sum(method.buffer_bytes.values()), transient,
                         reused, {k: b.size for k, b in offered.items()}))
    (losses_own, _, own_bytes, _, _, _, _), (losses, step_bytes, method_bytes, allocated, transient, reused,
                                             offered) = runs
    assert losses == losses_own  # bit for bit: the step's activations are dead between calls
    assert losses[-1] < losses[0]  # the steps between changed the adapters eval reads
    taken = [theirs for theirs in reused.values() if theirs is not None]
    assert taken and len(taken) == len(set(taken))  # each step buffer at most once, never its state or outputs
    assert all(offered[theirs] >= transient[key] for key, theirs in reused.items() if theirs is not None)
    excess = [nbytes for key, nbytes in transient.items() if reused[key] is None]
    assert method_bytes == allocated == own_bytes - sum(transient.values()) + sum(excess) < own_bytes
    # inspect counts eval's memory as the runtime allocates it.
    assert report["step_device_memory_bytes"] == step_bytes
    assert report["eval"]["device_memory_bytes"] == method_bytes
    assert report["device_memory_bytes"] == step_bytes + method_bytes


def test_inspect_all_lists_every_builtin_profile(tiny_step, capsys):
    assert main(["inspect", str(tiny_step), "--device-profile", "all", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)["profiles"]
    assert [r["profile"] for r in reports] == list(BUILTIN_PROFILES)
    for r in reports:
        (d,) = r["delegates"]
        assert r["memory_budget_bytes"] == BUILTIN_PROFILES[r["profile"]].memory_budget_bytes
        assert 0 < d["shader_variants"] <= d["dispatches"]
    assert main(["inspect", str(tiny_step), "--device-profile", "all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:5] == ["profile", "fits", "dispatches", "shader", "variants"]
    for r, line in zip(reports, lines[2:]):
        d = r["delegates"][0]
        assert line.split()[:5] == [r["profile"], "yes", str(d["dispatches"]), str(d["shader_variants"]),
                                    str(d["submits"])]


def test_generation_counts_prefill_and_decode_against_the_budget(vk_device, tmp_path, monkeypatch):
    from vktrain.generate.runner import GenerationRunner

    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    cache = tmp_path / "cache"
    assert main(["generate", "--model", "tiny-llama", "--model-arg", "n_layers=1", "--prompt-ids", "1,2",
                 "--max-new-tokens", "1", "--program-cache", str(cache)]) == 0
    (pte,) = cache.rglob("*.pte")

    def load(budget):
        path = tmp_path / f"budget-{budget}.json"
        path.write_text(dataclasses.replace(MALI_G7X, name="gen", memory_budget_bytes=budget).to_json())
        monkeypatch.setenv(DEVICE_PROFILE_ENV, str(path))
        return GenerationRunner.from_pte(pte, vk_device)

    with load(MALI_G7X.memory_budget_bytes) as runner:
        prefill, decode = runner.prefill_method.executor, runner.decode_method.executor
        needed = prefill.owned_bytes + decode.owned_bytes
        assert 0 < decode.owned_bytes < needed == decode.program_bytes
    from vktrain.errors import GraphLoweringError
    with pytest.raises(GraphLoweringError, match=f"the program needs {needed} bytes of device memory, over the "
                                                 f"memory budget of {needed - 4} bytes"):
        load(needed - 4)
    load(needed).close()


# ---------------------------------------------------------------------------------------------- embedded schedules
def test_a_step_exported_for_each_class_runs_its_embedded_schedule_under_that_profile(vk_device, tmp_path,
                                                                                      monkeypatch):
    """`vktrain export --target P` then `--device-profile P`: the schedule embedded for P is the one that runs
    (every class promises the 8 storage buffers per dispatch the kernels bind; with the Vulkan-required 4 no
    embedded schedule fitted its own profile and the runtime silently planned at load), with the losses of P
    planned at load."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.train.targets import Target, TargetEmbedder

    model = build_model("tiny-llama", n_layers=1)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (BATCH, SEQ))))
    ids = np.random.default_rng(2).integers(0, 256, (BATCH, SEQ + 1))
    for profile in (ADRENO_6XX, LAPTOP_PROFILES[0]):
        path = tmp_path / f"{profile.name}.pte"
        path.write_bytes(lower_methods_to_pte(methods, rewrite_blobs=TargetEmbedder([Target(profile)])))
        monkeypatch.setenv(DEVICE_PROFILE_ENV, profile.name)
        runs = []
        for precision in ("auto", "fp16"):  # auto: the embedded schedule; fp16 given: planned at load
            with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision=precision) as runner:
                runs.append(([runner.step(ids[:, :-1], ids[:, 1:], HPARAMS) for _ in range(2)], runner.target))
        (embedded, target), (planned, none) = runs
        assert target is not None and target.profile.name == profile.name and none is None
        assert embedded == planned

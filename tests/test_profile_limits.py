"""Every built-in device profile's plan keeps to its limits (issues 25 and 29): tiny-llama's step and eval
methods and a one-layer SmolLM2-shaped step (its vocabulary, width and heads: rows of 12,288 vec4 logits, a
576-wide norm), planned for each built-in as `vktrain export --target` and `--device-profile` plan them, pass
the embedded-schedule verifier against that profile (check_schedule_profile: every local size, as each module
specializes it, within max_workgroup_invocations and max_workgroup_size; the requirements within the
profile), and no workgroup asks for more than the Vulkan 1.1 floor's 128 invocations on the phone profiles."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vktrain.backend.kernel_planning.planner import plan_schedule
from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
from vktrain.runtime.program.fit import _shared_with
from vktrain.serialization.blob import deserialize_blob
from vktrain.serialization.device_profile import BUILTIN_PROFILES
from vktrain.serialization.embedded import embed_schedules
from vktrain.serialization.pte import PteFile
from vktrain.serialization.schedule import module_dispatches
from vktrain.serialization.verify_schedule import check_shader_modules, verify_embedded_schedule
from vktrain.train.targets import _module_for

SMOLLM2_SHAPED = dict(vocab_size=49152, dim=576, n_heads=9, n_kv_heads=3, hidden=1536, n_layers=1)


def _graphs(path, model, shape, **config):
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    torch.manual_seed(0)
    network = build_model(model, **config)
    apply_lora(network, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(network, shape)))
    path.write_bytes(lower_methods_to_pte(methods))
    pte = PteFile.load(path)
    return {method: deserialize_blob(pte.execution_plan(method).delegates[0].data, named_data=pte.named_data)
            for method in pte.method_names}


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2-shaped"])
def graphs(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    if request.param == "tiny-llama":
        return _graphs(folder / "tiny.pte", "tiny-llama", (2, 16))
    return _graphs(folder / "smol.pte", "tiny-llama", (1, 32), **SMOLLM2_SHAPED)


@pytest.mark.parametrize("profile", list(BUILTIN_PROFILES.values()), ids=list(BUILTIN_PROFILES))
def test_each_built_in_profile_s_plan_passes_the_verifier_under_that_profile(graphs, profile):
    step = graphs[TRAIN_METHOD]
    planned = {TRAIN_METHOD: plan_schedule(step, profile, state_guard=True)}
    planned.update({method: plan_schedule(graph, profile, shared=_shared_with([step], graph))
                    for method, graph in graphs.items() if method != TRAIN_METHOD})
    for method, schedule in planned.items():
        (embedded,), modules = embed_schedules([(profile, schedule)], _module_for, serialize=False)
        check_shader_modules(modules, method)
        verify_embedded_schedule(schedule, embedded, dataclasses.replace(graphs[method], shader_modules=modules),
                                 f"{method} for {profile.name}")
        largest = max(math.prod(modules[i].workgroup_size(d) or d.local_size or (1,))
                      for d, i in zip(module_dispatches(schedule), embedded.dispatch_modules))
        assert largest <= profile.max_workgroup_invocations, (method, profile.name, largest)
        if profile.max_workgroup_invocations == 128:  # the phones and desktop-gpu: Vulkan's floor, used fully
            assert largest == 128, (method, profile.name, largest)


def test_a_plan_made_at_load_is_verified_when_the_profile_is_emulated(vk_device, monkeypatch):
    """The device enforces its own limits, not an emulated profile's: a plan for VKTRAIN_DEVICE_PROFILE is
    verified at load (GraphExecutor's `verify`), one for the device's own profile is not (it is this process's)."""
    from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV
    from vktrain.runtime.program.schedules import method_schedule

    seen = []

    def planner(graph, profile, **options):
        seen.append(profile.name)
        return "schedule"

    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    assert method_schedule(None, vk_device, planner=planner).verify is False
    monkeypatch.setenv(DEVICE_PROFILE_ENV, "mali-g7x")
    assert method_schedule(None, vk_device, planner=planner) == ("schedule", True)
    assert "mali-g7x (emulated on" in seen[-1]

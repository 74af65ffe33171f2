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


def test_a_plan_made_at_load_is_verified_when_the_profile_is_emulated(vk_device, monkeypatch, tmp_path):
    """The device enforces its own limits, not an emulated profile's: a plan for VKTRAIN_DEVICE_PROFILE is
    checked against the profile at load (each kernel's workgroup size as its SPIR-V declares it) and verified
    by the executor (`verify`); a plan for the device's own profile is not. A planner ignoring the emulated
    limits (lavapipe's 256-lane workgroups under mali-g7x's 128) is refused naming the dispatch."""
    from _helpers import export_mlp_lora_training_step
    from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV
    from vktrain.runtime.program.schedules import method_schedule
    from vktrain.serialization.verify import VerificationError

    export_mlp_lora_training_step(tmp_path / "mlp.pte", (2, 8), 64)
    pte = PteFile.load(tmp_path / "mlp.pte")
    graph = deserialize_blob(pte.execution_plan(TRAIN_METHOD).delegates[0].data, named_data=pte.named_data)
    seen = []

    def planner(graph, profile, **options):
        seen.append(profile.name)
        return plan_schedule(graph, profile, **options)

    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    assert method_schedule(graph, vk_device, planner=planner).verify is False
    monkeypatch.setenv(DEVICE_PROFILE_ENV, "mali-g7x")
    assert method_schedule(graph, vk_device, planner=planner).verify is True
    assert "mali-g7x (emulated on" in seen[-1]

    def unlimited(graph, profile, **options):  # the kernels as before this check: 256 lanes, the profile's record
        wide = dataclasses.replace(profile, max_workgroup_invocations=1024, max_workgroup_size=(1024, 1024, 64))
        return dataclasses.replace(plan_schedule(graph, wide, **options),
                                   requirements=plan_schedule(graph, profile, **options).requirements)

    with pytest.raises(VerificationError, match=r"mlp.pte: dispatch \d+ \(.*\): local size \(256, 1, 1\) is over "
                                                r"profile 'mali-g7x \(emulated on"):
        method_schedule(graph, vk_device, planner=unlimited, source="mlp.pte")


def test_the_generation_program_plans_within_every_profile(tmp_path):
    """`vktrain generate`'s program (prefill and decode, M = 1: the GEMV kernels), each method planned for every
    built-in profile, passes the verifier under it."""
    from vktrain.cli import main

    cache = tmp_path / "cache"
    assert main(["generate", "--model", "tiny-llama", "--model-arg", "n_layers=1", "--model-arg", "dim=256",
                 "--model-arg", "hidden=768", "--prompt-ids", "1,2", "--max-new-tokens", "1",
                 "--program-cache", str(cache)]) == 0
    (path,) = cache.rglob("*.pte")
    pte = PteFile.load(path)
    graphs = {method: deserialize_blob(pte.execution_plan(method).delegates[0].data, named_data=pte.named_data)
              for method in pte.method_names}
    shaders = set()
    for profile in BUILTIN_PROFILES.values():
        for method, graph in graphs.items():
            schedule = plan_schedule(graph, profile)
            (embedded,), modules = embed_schedules([(profile, schedule)], _module_for, serialize=False)
            verify_embedded_schedule(schedule, embedded, dataclasses.replace(graph, shader_modules=modules),
                                     f"{method} for {profile.name}")
            shaders |= {d.shader for d in schedule.dispatches}
    assert any(name.startswith("linear_q4gsw_gemv") for name in shaders)


def test_the_default_gemv_tiles_keep_to_the_workgroup_limit():
    """Decode GEMVs of SmolLM2 (K = 1536 forward; d_x over N = 1536 and 576) and Llama-3.2-1B (8192 x 2048,
    d_x of 2048 x 8192) take 256 threads by default, 128 where the profile allows 128."""
    from vktrain.backend.kernel_planning.kernels.linear import default_gemv_tiles

    for reduction4, outputs, backward in ((1536 // 4, 576 // 8, False), (1536 // 8, 576 // 4, True),
                                          (576 // 8, 1536 // 4, True), (2048 // 4, 8192 // 8, False),
                                          (8192 // 8, 2048 // 4, True)):
        wide = default_gemv_tiles(1, reduction4, outputs, backward)
        narrow = default_gemv_tiles(1, reduction4, outputs, backward, shared_memory_bytes=16384,
                                    max_workgroup_size=128)
        assert wide.wg_x * wide.wg_y == 256 and narrow.wg_x * narrow.wg_y == 128, (wide, narrow)


@pytest.mark.parametrize("M, N, K, bias, vec4", [(70, 99, 300, True, False), (130, 96, 2048, False, True)],
                         ids=["addmm-edges", "mm-split-k-vec4"])
def test_the_128_thread_matmul_tile_gives_the_64x64_tile_s_bits(vk_device, M, N, K, bias, vec4):
    """matmul.slang at 32 x 64 (128 threads, a profile with Vulkan's 128 invocations) against 64 x 64 (256):
    the same split over K (scratch given: the 64 x 64 tile's choice) and every output bit for bit, partial tiles
    at the M and N edges and a bias included."""
    import numpy as np

    from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm
    from vktrain.runtime import Buffer, Program
    from vktrain.serialization.strided_view import StridedView

    rng = np.random.default_rng(M + N + K)
    arrays = {"a": rng.standard_normal((M, K)).astype(np.float32),
              "b": (rng.standard_normal((K, N)) * 0.1).astype(np.float32),
              "d": rng.standard_normal((M, N)).astype(np.float32)}
    scratch = gemm_scratch_nbytes(1, M, N, K)
    arrays["scratch"] = np.full(max(1, scratch // 4), np.nan, np.float32)

    def plan(max_workgroup_size):
        extra = dict(bias="d", bias_view=StridedView.contiguous((M, N)), beta=0.5) if bias else {}
        return plan_gemm("out", "a", StridedView.contiguous((M, K)), "b", StridedView.contiguous((K, N)),
                         scratch="scratch" if scratch else None, max_workgroup_size=max_workgroup_size, **extra)

    def run(dispatches):
        buffers = {key: Buffer.from_array(vk_device, value, name=key) for key, value in arrays.items()}
        buffers["out"] = Buffer.from_array(vk_device, np.full((M, N), np.nan, np.float32), name="out")
        try:
            with Program(vk_device, dispatches, buffers) as program:
                program.replay()
            return buffers["out"].read(np.float32, (M, N))
        finally:
            for buffer in buffers.values():
                buffer.destroy()

    wide, narrow = plan(None), plan(128)
    assert "TILE_M=32+TILE_N=64" in narrow[0].shader and "TILE_M" not in wide[0].shader
    assert ("VEC4_C" in narrow[0].shader) == vec4 and len(wide) == len(narrow) == (2 if scratch else 1)
    assert narrow[0].groups == (wide[0].groups[0], -(-M // 32), wide[0].groups[2])
    assert [d.label for d in narrow] == [d.label for d in wide]  # split over K alike (.splitN, .reduce)
    assert (scratch > 0) == vec4  # the second case splits K
    expected, got = run(wide), run(narrow)
    assert np.isfinite(expected).all()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))

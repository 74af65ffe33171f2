"""Schedules embedded at export (`vktrain export --target`, issue 25): the blob carries per device profile the
schedule of each method and the shader modules it runs; the runtime runs the one the device satisfies, with
pipelines from the embedded modules, and refuses a program whose schedules it satisfies none of.

Models: tiny-llama's training step with its eval method (the eval schedule binds the step's buffers) and the
2-layer mlp-lora step (the verifier and the fuzzer)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from _helpers import export_mlp_lora_training_step
from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
from vktrain.backend.kernel_planning.planner import plan_schedule
from vktrain.runtime.program import fuzz
from vktrain.runtime.program.fit import _shared_with
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.blob import deserialize_blob, read_for_rewrite, serialize_blob
from vktrain.serialization.device_profile import BUILTIN_PROFILES, LAVAPIPE, NVIDIA_COOPMAT
from vktrain.serialization.embedded import NoMatchingScheduleError, select_schedule
from vktrain.serialization.pte import PteFile
from vktrain.serialization.schedule import serialize_schedule
from vktrain.serialization.verify import VerificationError
from vktrain.serialization.verify_schedule import verify_embedded
from vktrain.train.targets import Target, TargetEmbedder, TargetError, resolve_targets

HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
BATCH, SEQ = 2, 16


def _export_llama(path, targets):
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (BATCH, SEQ))))
    embedder = TargetEmbedder(targets) if targets else None
    path.write_bytes(lower_methods_to_pte(methods, rewrite_blobs=embedder))
    return embedder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(plain .pte, .pte with every built-in target, the embedder that wrote it, .pte with nvidia-coopmat only)."""
    folder = tmp_path_factory.mktemp("embed")
    plain, everything, coopmat = folder / "plain.pte", folder / "all.pte", folder / "coopmat.pte"
    _export_llama(plain, [])
    embedder = _export_llama(everything, resolve_targets("all", local=lambda: None))
    _export_llama(coopmat, [Target(NVIDIA_COOPMAT)])
    return plain, everything, embedder, coopmat


def _graphs(path):
    pte = PteFile.load(path)
    return {method: deserialize_blob(pte.execution_plan(method).delegates[0].data, named_data=pte.named_data)
            for method in pte.method_names}


def _batches():
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        token_ids = torch.randint(0, 256, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, 256, (BATCH, SEQ), generator=generator)
        labels[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = -1
        yield token_ids.numpy(), labels.numpy()


def _train(path, device):
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, timing=False) as runner:
        losses = [runner.step(token_ids, labels, HPARAMS) for token_ids, labels in _batches()]
        eval_loss = runner.evaluate(*next(_batches()))
        origin = "schedule planned at load" if runner.target is None else \
            f"schedule embedded for device profile {runner.target.profile.name!r}"
        assert runner.gemm_report().endswith(origin)  # train's startup line says which
        return (losses, eval_loss, runner.target, serialize_schedule(runner.executor.schedule),
                serialize_schedule(runner.eval_method().executor.schedule))


def test_every_built_in_schedule_embedded_is_the_one_planned_at_load_byte_for_byte(llama):
    """For every built-in profile: export's plan of each method equals planning the graphs read back from the
    .pte, the eval method with the step's buffers it binds found independently (fit.py's reading), and every
    built-in is embedded with exactly those bytes (each plan keeps to its profile's limits, the Vulkan 1.1
    floor's 128 invocations included: the verifier checked each at export and checks them again here)."""
    _, everything, embedder, _ = llama
    graphs = _graphs(everything)
    step, evaluation = graphs[TRAIN_METHOD], graphs[EVAL_METHOD]
    embedded = {method: {e.profile.name: e.schedule_bytes for e in graph.schedules} for method, graph in graphs.items()}
    assert list(embedded[TRAIN_METHOD]) == embedder.embedded == list(embedded[EVAL_METHOD]) == list(BUILTIN_PROFILES)
    assert embedder.left_out == []
    for profile in BUILTIN_PROFILES.values():
        planned_step = plan_schedule(step, profile, state_guard=True)
        planned_eval = plan_schedule(evaluation, profile, shared=_shared_with([step], evaluation))
        assert embedded[TRAIN_METHOD][profile.name] == serialize_schedule(planned_step), profile.name
        assert embedded[EVAL_METHOD][profile.name] == serialize_schedule(planned_eval), profile.name
    for graph in graphs.values():
        verify_embedded(graph, "all.pte")
    # The modules' workgroup sizes are reflected: elementwise's VEC4 lanes and the split-K reduce's are
    # specialized (id 0), 256 lanes unless a profile allows fewer.
    modules = {m.name: m for m in step.shader_modules}
    assert (modules["elementwise@ARITY=1+VEC4"].local_size, modules["elementwise@ARITY=1+VEC4"].local_size_spec_ids) \
        == ((256, 1, 1), (0, -1, -1))
    # One copy of each module however many profiles and dispatches run it.
    for graph in graphs.values():
        keys = [(m.name, m.kind, m.code) for m in graph.shader_modules]
        assert len(keys) == len(set(keys)) and len(graph.shader_modules) < sum(len(e.dispatch_modules)
                                                                            for e in graph.schedules)


def test_a_blob_keeps_its_bytes_without_schedules_and_reads_back_what_was_embedded(llama):
    """Old format: a blob written with no schedules is the blob from before; the tables read back equal."""
    plain, everything, _, _ = llama
    pte = PteFile.load(everything)
    data = pte.execution_plan(TRAIN_METHOD).delegates[0].data
    graph, named = read_for_rewrite(data, pte.named_data)
    assert serialize_blob(graph, named) == bytes(data)
    stripped = dataclasses.replace(graph, schedules=[], shader_modules=[])
    plain_pte = PteFile.load(plain)
    assert serialize_blob(stripped, named) == bytes(plain_pte.execution_plan(TRAIN_METHOD).delegates[0].data)
    assert _graphs(plain)[TRAIN_METHOD].schedules == []


def test_lavapipe_trains_from_the_embedded_schedule_bit_identically_to_planning_at_load(llama, vk_device,
                                                                                         monkeypatch):
    """--target lavapipe (among others): the runner takes lavapipe's schedule by the matching rule, builds its
    pipelines from the blob's modules (the local SPIR-V is never read), and its losses and eval loss equal
    those of the same program planned at load, bit for bit."""
    plain, everything, _, _ = llama
    reference = _train(plain, vk_device)
    import vktrain.runtime.vk.pipelines as pipelines

    def no_local_spirv(name):
        raise AssertionError(f"read the local SPIR-V of {name!r}")

    monkeypatch.setattr(pipelines, "load_spirv", no_local_spirv)
    losses, eval_loss, target, step_schedule, eval_schedule = _train(everything, vk_device)
    assert target is not None and target.profile.name == "lavapipe"
    assert (losses, eval_loss) == reference[:2]
    assert reference[2] is None  # the plain .pte was planned at load
    # The same dispatches as planning at load (the GEMM route's reason names the device, not the profile).
    from vktrain.serialization.schedule import deserialize_schedule

    for ours, theirs in ((step_schedule, reference[3]), (eval_schedule, reference[4])):
        a, b = deserialize_schedule(ours), deserialize_schedule(theirs)
        assert a.dispatches == b.dispatches and a.buffers == b.buffers and a.placements == b.placements


def test_an_embedded_schedule_is_verified_once_at_load(llama, vk_device, monkeypatch):
    """Each embedded schedule goes through verify_schedule once, as it is read (verify_embedded), not again in
    the executor that runs it (it is the load's costliest check after reading the schedule); the eval method reads
    and checks only the schedule of the step's profile, not every profile's."""
    import vktrain.runtime.delegate.executor as executor
    import vktrain.serialization.verify_schedule as verify_schedule

    _, everything, _, _ = llama
    calls = []
    original = verify_schedule.verify_schedule

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(verify_schedule, "verify_schedule", counted)
    monkeypatch.setattr(executor, "verify_schedule", counted)
    with TrainingRunner.from_pte(everything, vk_device, planner=plan_schedule, timing=False) as runner:
        runner.eval_method()
        assert runner.target is not None
    graphs = _graphs(everything)
    assert len(graphs[TRAIN_METHOD].schedules) == len(BUILTIN_PROFILES) > 1
    assert len(calls) == len(graphs[TRAIN_METHOD].schedules) + 1


def test_a_program_with_only_a_profile_lavapipe_cannot_satisfy_is_refused_naming_what_it_lacks(llama, vk_device,
                                                                                                capsys):
    _, _, _, coopmat = llama
    with pytest.raises(NoMatchingScheduleError, match=r"embeds schedules for the device profiles nvidia-coopmat, "
                                                      r"and .* runs none of them; it lacks, per profile: "
                                                      r"nvidia-coopmat: .*cooperative matrices"):
        TrainingRunner.from_pte(coopmat, vk_device, planner=plan_schedule, timing=False)
    from vktrain import cli

    assert cli.main(["train", str(coopmat), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vktrain train: error: ") and "nvidia-coopmat" in err and "lacks" in err


def test_the_matching_rule_takes_the_schedule_the_device_satisfies(llama):
    """lavapipe (and a device with its limits under another name, and more memory) satisfies lavapipe's
    schedule (CPU bodies for 8-lane subgroups), not nvidia-coopmat's; the H200 the reverse; a device with
    smaller workgroups is refused with the reason."""
    _, everything, _, _ = llama
    graph = _graphs(everything)[TRAIN_METHOD]
    assert select_schedule(graph.schedules, graph.shader_modules, LAVAPIPE).profile.name == "lavapipe"
    other = dataclasses.replace(LAVAPIPE, name="my-cpu", max_allocation_bytes=1 << 34)
    assert select_schedule(graph.schedules, graph.shader_modules, other).profile.name == "lavapipe"
    coopmat = select_schedule(graph.schedules, graph.shader_modules, NVIDIA_COOPMAT)
    assert coopmat.profile.name == "nvidia-coopmat"
    small = dataclasses.replace(LAVAPIPE, name="small", max_workgroup_invocations=64, max_workgroup_size=(64, 64, 64))
    with pytest.raises(NoMatchingScheduleError, match="max_workgroup_invocations"):
        select_schedule(graph.schedules, graph.shader_modules, small)


def test_a_device_with_tensor_cores_is_told_when_no_embedded_schedule_uses_them(llama):
    """The startup line's hint (runner.gemm_report): a device listing cooperative matrices, and a .pte whose
    schedules are all for profiles without them (desktop-gpu alone, the old default's pick on an H100), is told
    how to get them; not when a coopmat schedule is embedded, nor on a device without them, nor without schedules."""
    from types import SimpleNamespace

    from vktrain.runtime.program.embedded import unused_tensor_cores_hint

    _, everything, _, _ = llama
    graph = _graphs(everything)[TRAIN_METHOD]
    without = SimpleNamespace(schedules=[e for e in graph.schedules if not e.profile.cooperative_matrix])
    assert without.schedules and len(without.schedules) < len(graph.schedules)
    tensor_cores = SimpleNamespace(cooperative_matrix_properties=NVIDIA_COOPMAT.cooperative_matrix)
    hint = unused_tensor_cores_hint(without, tensor_cores)
    assert "--precision fp16-tc" in hint and "--target portable" in hint
    assert unused_tensor_cores_hint(graph, tensor_cores) == ""
    assert unused_tensor_cores_hint(without, SimpleNamespace(cooperative_matrix_properties=())) == ""
    assert unused_tensor_cores_hint(SimpleNamespace(schedules=[]), tensor_cores) == ""


def test_targets_are_resolved_by_name_and_a_bad_one_is_refused():
    local = lambda: dataclasses.replace(LAVAPIPE, name="here")  # noqa: E731
    assert [t.profile.name for t in resolve_targets("portable", local)] == ["here", "nvidia-coopmat", "desktop-gpu",
                                                                             "adreno-6xx"]
    assert [t.optional for t in resolve_targets("lavapipe,all", local)][:2] == [False, True]
    assert resolve_targets("none", local) == []
    with pytest.raises(TargetError, match="device profile 'nope' is neither a built-in profile .* or local, portable, "
                                          "all, none"):
        resolve_targets("nope", local)
    with pytest.raises(TargetError, match="cannot be combined"):
        resolve_targets("none,lavapipe", local)
    with pytest.raises(TargetError, match="no Vulkan device"):
        resolve_targets("local", lambda: None)


def test_a_named_target_whose_plan_breaks_its_limits_is_refused(tmp_path):
    """A profile below the Vulkan floor (32 invocations per workgroup): kernels with a fixed workgroup of 64
    (the copies, the reductions) cannot keep to it, and export refuses the target naming it."""
    tiny = tmp_path / "tiny-workgroups.json"
    tiny.write_text(dataclasses.replace(LAVAPIPE, name="tiny-workgroups", max_workgroup_invocations=32,
                                        max_workgroup_size=(32, 32, 32)).to_json())
    with pytest.raises(TargetError, match=r"--target tiny-workgroups: the .forward. method cannot be planned for this "
                                          r"profile: .*(workgroup limits|32 invocations|device's 32)"):
        export_mlp_lora_training_step(tmp_path / "x.pte", (2, 8), 64, target=str(tiny))


@pytest.fixture(scope="module")
def mlp_embedded(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "mlp.pte"
    export_mlp_lora_training_step(path, (2, 8), 64, target="lavapipe")
    return path.read_bytes()


def _edited(data: bytes, edit):
    pte = PteFile.from_bytes(data)
    graph = deserialize_blob(pte.execution_plan().delegates[0].data, named_data=pte.named_data)
    edit(graph)
    return graph


def _unsplittable_over_the_group_limit(graph):
    """Every module without the group-offset header (same push bytes), under a profile of 1 group per axis."""
    graph.shader_modules[:] = [dataclasses.replace(m, push_header=False, push_constant_bytes=m.kernel_push_bytes)
                               for m in graph.shader_modules]
    graph.schedules[0] = dataclasses.replace(graph.schedules[0], profile=dataclasses.replace(
        graph.schedules[0].profile, max_workgroup_count=(1, 1, 1)))


def _a_fixed_workgroup_size_over_the_profile(graph):
    """A module that fixes its workgroup size (no specialization) at 2048 invocations, over lavapipe's 1024."""
    schedule = graph.schedules[0].schedule()
    index = next(i for d, i in zip(schedule.dispatches, graph.schedules[0].dispatch_modules) if d.local_size is None)
    graph.shader_modules[index] = dataclasses.replace(graph.shader_modules[index], local_size=(2048, 1, 1),
                                                      local_size_spec_ids=(-1, -1, -1))


@pytest.mark.parametrize("edit, check", [
    (lambda g: g.schedules.__setitem__(0, dataclasses.replace(g.schedules[0], dispatch_modules=(
        len(g.shader_modules),) + g.schedules[0].dispatch_modules[1:])), "check_schedule_modules"),
    (lambda g: g.shader_modules.__setitem__(g.schedules[0].dispatch_modules[0], dataclasses.replace(
        g.shader_modules[g.schedules[0].dispatch_modules[0]], name=next(
            m.name for m in g.shader_modules if m.name != g.shader_modules[g.schedules[0].dispatch_modules[0]].name))),
     "check_schedule_modules"),
    (lambda g: g.shader_modules.__setitem__(g.schedules[0].dispatch_modules[0], dataclasses.replace(
        g.shader_modules[g.schedules[0].dispatch_modules[0]], push_constant_bytes=4096)), "check_schedule_modules"),
    (lambda g: g.shader_modules.__setitem__(0, dataclasses.replace(g.shader_modules[0], code=b"\0" * 24)),
     "check_shader_modules"),
    (_unsplittable_over_the_group_limit, "check_schedule_profile"),
    (_a_fixed_workgroup_size_over_the_profile, "check_schedule_profile"),
    (lambda g: g.schedules.__setitem__(0, dataclasses.replace(g.schedules[0], profile=dataclasses.replace(
        g.schedules[0].profile, subgroup_size=16))), "check_schedule_profile"),
    # A profile promising fewer storage buffers per stage than a dispatch binds (AdamW binds 6).
    (lambda g: g.schedules.__setitem__(0, dataclasses.replace(g.schedules[0], profile=dataclasses.replace(
        g.schedules[0].profile, max_storage_buffers_per_stage=4))), "check_schedule_profile"),
])
def test_the_verifier_refuses_inconsistent_embedded_tables(mlp_embedded, edit, check):
    graph = _edited(mlp_embedded, edit)
    with pytest.raises(VerificationError) as caught:
        verify_embedded(graph, "edited")
    assert caught.value.check == check


def test_the_verifier_refuses_a_binding_outside_its_buffer(mlp_embedded):
    from vktrain.serialization.schedule import deserialize_schedule

    def edit(graph):
        schedule = deserialize_schedule(graph.schedules[0].schedule_bytes)
        dispatch = schedule.dispatches[0]
        binding = dispatch.bindings[0]
        moved = dataclasses.replace(binding, offset=schedule.buffer(binding.buffer).size_bytes + 64, size=4)
        dispatch = dataclasses.replace(dispatch, bindings=(moved,) + tuple(dispatch.bindings[1:]))
        schedule = dataclasses.replace(schedule, dispatches=(dispatch,) + schedule.dispatches[1:])
        graph.schedules[0] = dataclasses.replace(graph.schedules[0], schedule_bytes=serialize_schedule(schedule))

    with pytest.raises(VerificationError, match="outside the buffer") as caught:
        verify_embedded(_edited(mlp_embedded, edit), "edited")
    assert caught.value.check == "check_schedule_bindings"


def test_re_signed_mutants_of_the_embedded_tables_are_refused_cleanly(mlp_embedded):
    """The fuzz campaign with every mutant in the blob's graph flatbuffer (mostly its embedded tables) and the
    graph checksum recomputed: no escape (an exception outside the error family), and the embedded tables'
    checks are reached."""
    bugs, table = [], fuzz.campaign(mlp_embedded, 150, seed=1, resigned_share=1.0,
                                    on_outcome=lambda o: bugs.append(o) if o.is_bug else None)
    assert not bugs, [(o.label, o.mutant.description, o.detail) for o in bugs[:5]]
    labels = {label for _, label in table}
    assert labels & {"refused: ScheduleFormatError", "refused: verify.check_schedule_graph",
                     "refused: verify.check_schedule_modules", "refused: verify.check_schedule_bindings",
                     "refused: verify.check_shader_modules"}, labels


def test_an_emulated_profile_no_embedded_schedule_fits_plans_at_load(llama, vk_device, monkeypatch):
    """--device-profile adreno-7xx on a .pte embedding only nvidia-coopmat: planned at load for the emulated
    phone (as before --target), not refused; the real device would be."""
    _, _, _, coopmat = llama
    monkeypatch.setenv("VKTRAIN_DEVICE_PROFILE", "adreno-7xx")
    with TrainingRunner.from_pte(coopmat, vk_device, planner=plan_schedule, timing=False) as runner:
        assert runner.target is None and runner.executor.emulating
        assert np.isfinite(runner.step(*next(_batches()), HPARAMS))


def test_webgpu_trains_from_an_embedded_wgsl_schedule_like_planning_at_load(webgpu_device, tmp_path, monkeypatch):
    """A WebGPU profile (the local adapter's, as `vktrain devices --runtime webgpu --json` writes it) embeds
    WGSL modules; the WebGPU runtime runs that schedule with pipelines from them (the local WGSL sources never
    read) and trains mlp-lora with the losses of the plain .pte planned at load, bit for bit. Vulkan-only
    schedules on the WebGPU runtime plan at load."""
    from vktrain.runtime.device_profiles import profile_of

    profile_file = tmp_path / "adapter.json"
    profile_file.write_text(profile_of(webgpu_device).to_json())
    plain, embedded, vulkan_only = tmp_path / "plain.pte", tmp_path / "wgsl.pte", tmp_path / "vulkan.pte"
    export_mlp_lora_training_step(plain, (2, 8), 64)
    export_mlp_lora_training_step(embedded, (2, 8), 64, target=str(profile_file))
    export_mlp_lora_training_step(vulkan_only, (2, 8), 64, target="lavapipe")
    graph = _edited(embedded.read_bytes(), lambda g: None)
    assert {m.kind for m in graph.shader_modules} == {"wgsl"}
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))) for _ in range(3)]

    def losses(path, device=webgpu_device):
        with TrainingRunner.from_pte(path, device, planner=plan_schedule, timing=False) as runner:
            return [runner.step(t, l, HPARAMS) for t, l in batches], runner.target

    # The embedded WGSL has no subgroup bodies (a WebGPU profile promises no subgroups): the reference is the
    # same adapter planning at load without them.
    from vktrain.runtime.webgpu import Device

    with Device(kernel_features=sorted(webgpu_device.kernel_features - {"subgroup"})) as portable:
        reference, planned = losses(plain, portable)
    assert losses(vulkan_only)[1] is None and planned is None
    import vktrain.runtime_shaders.wgsl as wgsl

    def no_local_wgsl(name, features=frozenset()):
        raise AssertionError(f"read the local WGSL of {name!r}")

    monkeypatch.setattr(wgsl, "wgsl_source", no_local_wgsl)
    ours, target = losses(embedded)
    assert target is not None and target.profile.api == "webgpu" and ours == reference


def test_inspect_reports_each_embedded_profile(llama):
    """`vktrain inspect --json` (summarize_pte): per embedded profile of each method, its dispatches, shader
    variants, modules and their bytes, and planned memory, as the schedule and the module table hold them."""
    from vktrain.runtime.program.summary import summarize_pte

    _, everything, _, _ = llama
    report = summarize_pte(everything.read_bytes(), str(everything))
    graphs = _graphs(everything)
    methods = {TRAIN_METHOD: report["delegates"][0], EVAL_METHOD: report["other_methods"][EVAL_METHOD]["delegates"][0]}
    for method, delegate in methods.items():
        graph = graphs[method]
        assert delegate["shader_modules"] == {"count": len(graph.shader_modules),
                                              "bytes": sum(len(m.code) for m in graph.shader_modules)}
        assert [e["profile"] for e in delegate["embedded_schedules"]] == [e.profile.name for e in graph.schedules]
        for entry, embedded in zip(delegate["embedded_schedules"], graph.schedules):
            schedule = embedded.schedule()
            assert entry["dispatches"] == len(schedule.dispatches)
            assert entry["shader_variants"] == len({(d.shader, d.specialization()) for d in schedule.dispatches})
            ids = set(embedded.dispatch_modules)
            assert entry["shader_modules"] == len(ids)
            assert entry["module_bytes"] == sum(len(graph.shader_modules[i].code) for i in ids)
            assert entry["device_memory_bytes"] == sum(b.size_bytes for b in schedule.buffers if b.role != "shared")


def test_among_schedules_that_fit_the_rule_prefers_this_device_then_larger_planned_limits(llama):
    """Two fitting schedules: the one planned for exactly this device's planning fields wins wherever it is;
    otherwise the one planned with the larger shared memory; a tie goes to the first embedded."""
    from vktrain.serialization.embedded import EmbeddedSchedule

    _, everything, _, _ = llama
    graph = _graphs(everything)[TRAIN_METHOD]
    own = next(e for e in graph.schedules if e.profile.name == "lavapipe")
    schedule = own.schedule()
    smaller = dataclasses.replace(schedule, requirements=dataclasses.replace(schedule.requirements,
                                                                             max_shared_memory_bytes=16384))
    small_profile = dataclasses.replace(LAVAPIPE, name="small-cpu", max_shared_memory_bytes=16384)
    small = EmbeddedSchedule(small_profile, serialize_schedule(smaller), own.dispatch_modules)
    twin = dataclasses.replace(own, profile=dataclasses.replace(LAVAPIPE, name="twin", max_allocation_bytes=1 << 33))
    modules = graph.shader_modules

    def chosen(schedules, device):
        return select_schedule(schedules, modules, device).profile.name

    assert chosen([small, own], LAVAPIPE) == "lavapipe"  # exactly this device
    assert chosen([small, own], small_profile) == "small-cpu"  # exactly that one (lavapipe's needs more shared)
    other = dataclasses.replace(LAVAPIPE, name="other", max_allocation_bytes=1 << 34)
    assert chosen([small, own], other) == "lavapipe"  # larger planned shared memory
    assert chosen([twin, own], other) == "twin"  # a tie: the first embedded

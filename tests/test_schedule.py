"""The schedule as data (issue 25): planning is a pure function of the graph and a device target, its result
serialises to deterministic bytes that read back equal, and a GraphExecutor runs a schedule it is given
exactly as one it planned itself, refusing one planned for another graph or a device it does not fit.

Models: tiny-llama's training step (attention, rope, rms_norm: most kernel families) and a 2-layer mlp-lora
whose 16384-row embedding (2 MiB) a 1 MiB binding limit cuts into windows."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from _helpers import export_mlp_lora_training_step
from vktrain.runtime.delegate.executor import GraphExecutor, shader_sources
from vktrain.backend.kernel_planning.kernels.coopmat import GemmRoute
from vktrain.backend.kernel_planning.planner import plan_schedule
from vktrain.serialization.device_profile import NVIDIA_COOPMAT
from vktrain.runtime.program import fuzz
from vktrain.runtime.device_profiles import profile_of
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.runtime.program.schedules import NoScheduleError
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.verify import VerificationError
from vktrain.serialization.verify_schedule import verify_schedule
from vktrain.serialization.schedule import (PlannedGemm, Schedule, ScheduleBuffer, ScheduleFormatError,
                                            ScheduleMismatchError, ScheduleRequirements, TensorPlacement,
                                            deserialize_schedule, serialize_schedule)
from _helpers import planned

HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
STEPS = 3
MLP_BATCH, MLP_SEQ, MLP_VOCAB = 2, 8, 16384  # embedding 16384 x 32 float32 = 2 MiB
LLAMA_BATCH, LLAMA_SEQ = 2, 16
SMALL_BINDING = 1 << 20


@pytest.fixture(scope="module")
def mlp_pte(tmp_path_factory):
    path = tmp_path_factory.mktemp("pte") / "mlp_lora_step.pte"
    export_mlp_lora_training_step(path, (MLP_BATCH, MLP_SEQ), MLP_VOCAB)
    return path


@pytest.fixture(scope="module")
def llama_pte(tmp_path_factory):
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("pte") / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (LLAMA_BATCH, LLAMA_SEQ))))
    return path


def _graph(path, device):
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, timing=False) as runner:
        return runner.graph


def _batches(vocab: int, batch: int, seq: int):
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        token_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels[torch.rand((batch, seq), generator=generator) < 0.2] = -1
        yield token_ids.numpy(), labels.numpy()


def _train(path, device, batches, **options):
    """(losses, every state tensor after the steps, the executor's schedule) of STEPS steps."""
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, timing=False, **options) as runner:
        losses = [runner.step(token_ids, labels, HPARAMS) for token_ids, labels in batches]
        state = {name: runner.executor.read_state(name) for name in runner.executor.state_names}
        return losses, state, runner.executor.schedule


def _binding_size(schedule: Schedule, binding: BufferBinding) -> int:
    return binding.size if binding.size is not None else schedule.buffer(binding.buffer).size_bytes - binding.offset


def test_dispatch_fields_round_trip_with_their_types():
    """Every Dispatch field, spec constants of each type and a whole-buffer binding included."""
    dispatch = Dispatch("test_axpy", (3, 2), [BufferBinding("a", 256, 64, "r"), BufferBinding("b", 0, None, "rw"),
                                              BufferBinding("a", 512)],
                        push_constants=b"\x01\x00\x00\x00\xff\xff\xff\xff", spec_constants={3: 1.5, 4: True, 5: -7,
                                                                                         6: 2**32 - 1},
                        local_size=(64, 1, 1), label="0:aten.add.Tensor")
    schedule = Schedule("digest", ScheduleRequirements("vulkan", 1 << 27, 16, 32768, 1024, 1024, 8, ("shuffle",),
                                                       True, True, (16, 16, 16)),
                        PlannedGemm("fp32", False, "why", False, 32, 128, 128, 512, "cpu", False),
                        (ScheduleBuffer("a", 1024, "input"), ScheduleBuffer("b", 4, "scratch")),
                        (TensorPlacement(0, "a", 0, 1024),), (dispatch, Dispatch("copy", 1, ["b"])), ("0:x",), 1 << 20)
    back = deserialize_schedule(serialize_schedule(schedule))
    assert back == schedule
    specs = dict(back.dispatches[0].spec_constants)
    assert [type(specs[i]) for i in (3, 4, 5, 6)] == [float, bool, int, int]
    assert back.dispatches[0].bindings[1].size is None and back.dispatches[0].bindings[2].access is None
    assert back.scratch_bytes == 4


def test_bytes_that_are_not_a_schedule_are_refused():
    with pytest.raises(ScheduleFormatError, match="not a vktrain schedule"):
        deserialize_schedule(b"\0" * 64)
    with pytest.raises(ScheduleFormatError, match="identifier"):
        deserialize_schedule(b"VKS")


def test_planned_gemm_holds_every_field_of_the_gemm_route():
    assert [f.name for f in dataclasses.fields(PlannedGemm)] == [f.name for f in dataclasses.fields(GemmRoute)]


def test_planning_twice_gives_the_same_bytes_which_read_back_equal(vk_device, llama_pte):
    graph = _graph(llama_pte, vk_device)
    for options in ({}, dict(precision="fp16-tc", emulate_tensor_cores=True)):
        first, second = plan_schedule(graph, profile_of(vk_device), **options), plan_schedule(graph, profile_of(vk_device), **options)
        data = serialize_schedule(first)
        assert data == serialize_schedule(second)
        back = deserialize_schedule(data)
        assert back == first and serialize_schedule(back) == data
        # What the schedule says, checked against the graph: every tensor placed inside its buffer, every
        # binding inside its buffer, the inputs' buffers written by the host.
        assert {p.value_id for p in back.placements} == set(graph.used_tensor_ids())
        for placement in back.placements:
            assert placement.offset + placement.size_bytes <= back.buffer(placement.key).size_bytes
        for dispatch in back.dispatches:
            for binding in dispatch.bindings:
                assert binding.offset + _binding_size(back, binding) <= back.buffer(binding.buffer).size_bytes
        by_value = {p.value_id: p for p in back.placements}
        assert {back.buffer(by_value[v].key).role for v in graph.inputs} == {"input"}
        assert bool(back.tensor_core_ops) == bool(options)


def test_bindings_and_placements_read_fast_equal_the_generated_accessors(vk_device, llama_pte):
    """schedule.py reads ScheduleBinding and TensorPlacement through table_scalars (one vtable lookup per table);
    field for field it gives what the flatc-generated accessors give, absent (default) fields included."""
    from vktrain.serialization.flatbuffer_reading import table_scalars
    from vktrain.serialization.generated.vkt_blob import Schedule as FbSchedule
    from vktrain.serialization.schedule import _BINDING_FIELDS, _PLACEMENT_FIELDS

    data = serialize_schedule(plan_schedule(_graph(llama_pte, vk_device), profile_of(vk_device), state_guard=True))
    root = FbSchedule.Schedule.GetRootAs(data, 0)
    placements = [root.Placements(i) for i in range(root.PlacementsLength())]
    assert placements and any(p.Offset() == 0 for p in placements)  # absent: the default
    for table in placements:
        assert table_scalars(table, _PLACEMENT_FIELDS) == [table.ValueId(), table.Buffer(), table.Offset(),
                                                           table.SizeBytes()]
    bindings = [root.Dispatches(i).Bindings(j) for i in range(root.DispatchesLength())
                for j in range(root.Dispatches(i).BindingsLength())]
    assert len({b.Access() for b in bindings}) > 1 and any(b.Offset() == 0 for b in bindings)
    for table in bindings:
        assert table_scalars(table, _BINDING_FIELDS) == [table.Buffer(), table.Offset(), table.SizeBytes(),
                                                         table.Access()]


def test_a_schedule_read_back_trains_bit_identically(vk_device, llama_pte):
    graph = _graph(llama_pte, vk_device)
    batches = list(_batches(128, LLAMA_BATCH, LLAMA_SEQ))
    for options in ({}, dict(precision="fp16-tc", emulate_tensor_cores=True)):
        losses, state, planned_at_load = _train(llama_pte, vk_device, batches, **options)
        # The runner plans the step with its state guard (TrainingRunner.state_guard): read back with it.
        schedule = deserialize_schedule(serialize_schedule(plan_schedule(graph, profile_of(vk_device), **options,
                                                                         state_guard=True)))
        assert schedule == planned_at_load and schedule.state_guard is not None
        read_back_losses, read_back_state, _ = _train(llama_pte, vk_device, batches, schedule=schedule)
        assert np.mean(losses[-1:]) < losses[0]  # it trains
        assert [float(x).hex() for x in read_back_losses] == [float(x).hex() for x in losses]
        for name, array in state.items():
            np.testing.assert_array_equal(read_back_state[name], array, err_msg=name)


def test_a_smaller_binding_limit_plans_windows_that_train(vk_device, mlp_pte):
    graph = _graph(mlp_pte, vk_device)
    full = plan_schedule(graph, profile_of(vk_device))
    small = deserialize_schedule(serialize_schedule(plan_schedule(graph, profile_of(vk_device), max_binding_bytes=SMALL_BINDING)))
    assert serialize_schedule(small) != serialize_schedule(full)
    assert small.requirements.max_storage_buffer_range == SMALL_BINDING == small.max_binding_bytes
    sizes = lambda s: [_binding_size(s, b) for d in s.dispatches for b in d.bindings]  # noqa: E731
    assert max(sizes(full)) > SMALL_BINDING >= max(sizes(small))
    assert len(small.dispatches) > len(full.dispatches)  # the embedding in windows
    batches = list(_batches(MLP_VOCAB, MLP_BATCH, MLP_SEQ))
    losses, state, _ = _train(mlp_pte, vk_device, batches, schedule=full)
    windowed_losses, windowed_state, _ = _train(mlp_pte, vk_device, batches, schedule=small)
    # The windows gather the same rows: the same arithmetic, bit for bit.
    assert windowed_losses == losses
    for name, array in state.items():
        np.testing.assert_array_equal(windowed_state[name], array, err_msg=name)


def test_a_schedule_the_device_cannot_run_is_refused(vk_device, mlp_pte, llama_pte):
    graph = _graph(mlp_pte, vk_device)
    profile = profile_of(vk_device)
    shared = profile.max_shared_memory_bytes
    roomier = plan_schedule(graph, dataclasses.replace(profile, max_shared_memory_bytes=2 * shared))
    with pytest.raises(ScheduleMismatchError, match=rf"it relies on max_shared_memory_bytes {2 * shared} "
                                                    rf"\(the device has {shared}\)"):
        GraphExecutor(vk_device, graph, roomier)
    # A profile of another device: the H200's (tensor cores, 4 GiB bindings, subgroups of 32).
    with pytest.raises(ScheduleMismatchError, match="16x16x16 float16 x float16 \\+ float32 cooperative matrices"):
        GraphExecutor(vk_device, graph, plan_schedule(graph, NVIDIA_COOPMAT, precision="fp16-tc"))
    fp16 = plan_schedule(graph, profile_of(vk_device), precision="fp16-tc", emulate_tensor_cores=True)
    other_subgroups = dataclasses.replace(fp16, requirements=dataclasses.replace(fp16.requirements,
                                                                                 subgroup_size=64))
    with pytest.raises(ScheduleMismatchError, match="subgroups of 64 lanes"):
        GraphExecutor(vk_device, graph, other_subgroups)
    with pytest.raises(VerificationError, match="planned for another graph"):
        GraphExecutor(vk_device, _graph(llama_pte, vk_device), fp16)
    with pytest.raises(ScheduleMismatchError, match="pass none of precision"):
        TrainingRunner.from_pte(mlp_pte, vk_device, schedule=fp16, precision="fp32")
    # The same schedule on the device it fits runs.
    GraphExecutor(vk_device, graph, fp16, timing=False).close()


_PLAN_WITHOUT_A_DEVICE = """
import sys
from vktrain.backend.kernel_planning.planner import plan_schedule
from vktrain.serialization import read_blob
from vktrain.serialization.device_profile import load_profile
from vktrain.serialization.schedule import serialize_schedule

graph = read_blob(sys.argv[1])
data = serialize_schedule(plan_schedule(graph, load_profile(sys.argv[2]), precision=sys.argv[3],
                                        emulate_tensor_cores=sys.argv[3] == "fp16-tc"))
opened = sorted(m for m in sys.modules if m in ("vulkan", "wgpu") or m.startswith(("vulkan.", "wgpu.")))
assert not opened, f"planning loaded a device layer: {opened}"
sys.stdout.buffer.write(data)
"""


def test_the_planner_needs_no_device(vk_device, llama_pte, tmp_path):
    """A fresh interpreter with the graph and a profile file (no device opened, no device layer loaded) plans
    the bytes planned at load from the device it opened (its planning profile) and run by the executor."""
    from vktrain.serialization import write_blob

    graph = _graph(llama_pte, vk_device)
    blob, profile_file = tmp_path / "graph.vkt", tmp_path / "local.json"
    with open(blob, "wb") as out:
        write_blob(graph, out)
    profile_file.write_text(profile_of(vk_device).to_json())
    for precision in ("fp32", "fp16-tc"):
        emulate = precision == "fp16-tc"
        schedule = planned(vk_device, graph, precision=precision, emulate_tensor_cores=emulate)
        with GraphExecutor(vk_device, graph, schedule, timing=False) as executor:
            expected = serialize_schedule(executor.schedule)
        without_device = subprocess.run([sys.executable, "-c", _PLAN_WITHOUT_A_DEVICE, str(blob), str(profile_file),
                                         precision], capture_output=True, check=True, timeout=300).stdout
        assert without_device == expected, precision


# --- the verifier and the fuzzer ------------------------------------------------------------------------

def _with_dispatch(schedule: Schedule, index: int, **changes) -> Schedule:
    dispatches = list(schedule.dispatches)
    dispatches[index] = dataclasses.replace(dispatches[index], **changes)
    return dataclasses.replace(schedule, dispatches=tuple(dispatches))


def _with_binding(schedule: Schedule, **changes) -> Schedule:
    """The schedule with binding 0 of its first dispatch changed."""
    first = schedule.dispatches[0]
    bindings = (dataclasses.replace(first.bindings[0], **changes),) + first.bindings[1:]
    return _with_dispatch(schedule, 0, bindings=bindings)


def test_the_verifier_refuses_each_broken_fact(vk_device, mlp_pte):
    graph = _graph(mlp_pte, vk_device)
    schedule = plan_schedule(graph, profile_of(vk_device))
    sources = shader_sources()
    verify_schedule(schedule, graph, sources)  # as planned: passes
    first = schedule.dispatches[0].bindings[0]
    size = schedule.buffer(first.buffer).size_bytes
    alignment = schedule.requirements.min_storage_buffer_offset_alignment
    broken = {
        "outside the buffer's": _with_binding(schedule, offset=size - size % alignment, size=2 * alignment),
        "not a multiple of the planned alignment": _with_binding(schedule, offset=alignment // 2 or 1),
        "more than the planned max storage binding size": dataclasses.replace(
            schedule, requirements=dataclasses.replace(schedule.requirements, max_storage_buffer_range=4)),
        "has no kernel source": _with_dispatch(schedule, 1, shader="no_such_kernel@X"),
        "more than the 112 every device takes": _with_dispatch(schedule, 1, push_constants=bytes(116)),
        "would be split into": _with_dispatch(schedule, 1, groups=(2**32 - 1, 2**32 - 1, 1)),
        "over the planned workgroup limits": _with_dispatch(schedule, 1, local_size=(2048, 1, 1)),
        "have no placement": dataclasses.replace(schedule, placements=schedule.placements[1:]),
        "bytes, the graph records": dataclasses.replace(schedule, placements=(dataclasses.replace(
            schedule.placements[0], size_bytes=schedule.placements[0].size_bytes + 4),) + schedule.placements[1:]),
    }
    for expected, bad in broken.items():
        with pytest.raises(VerificationError, match=expected):
            verify_schedule(bad, graph, sources)
        with pytest.raises(VerificationError, match=expected):  # the executor verifies what it is given
            GraphExecutor(vk_device, graph, bad)


def test_the_runner_plans_nothing_itself_it_calls_the_planner_it_is_given(vk_device, mlp_pte):
    """The runtime holds no kernel choice: without a schedule or a planner a load is refused, naming the file;
    with a planner, the runner calls it once for the step with the device's profile and the planning options."""
    with pytest.raises(NoScheduleError, match=rf"{mlp_pte}: no schedule for .*no planner was given"):
        TrainingRunner.from_pte(mlp_pte, vk_device, planner=None)
    calls = []

    def planner(graph, profile, **options):
        calls.append((profile, options))
        return plan_schedule(graph, profile, **options)

    with TrainingRunner.from_pte(mlp_pte, vk_device, planner=planner, max_binding_bytes=SMALL_BINDING) as runner:
        assert runner.executor.schedule == plan_schedule(runner.graph, profile_of(vk_device), state_guard=True,
                                                         max_binding_bytes=SMALL_BINDING)
    assert calls == [(profile_of(vk_device), dict(precision="auto", emulate_tensor_cores=False,
                                                  max_binding_bytes=SMALL_BINDING, state_guard=True))]


def test_the_state_guard_is_planned_into_the_schedule_read_back_and_verified(vk_device, mlp_pte):
    """plan_schedule(state_guard=True) plans the guard's dispatches over the step's state buffers: one backup
    range per state tensor (the runtime's names, the graph's order) and, for each, a check dispatch binding the
    tensor where the schedule places it; the bytes read back equal and the verifier refuses a guard binding
    outside its buffer. The runner's guard replays them (tests/test_state_guard.py, test_train_loop.py)."""
    graph = _graph(mlp_pte, vk_device)
    plain = plan_schedule(graph, profile_of(vk_device))
    schedule = plan_schedule(graph, profile_of(vk_device), state_guard=True)
    assert plain.state_guard is None and dataclasses.replace(schedule, state_guard=None) == plain
    guard = schedule.state_guard
    names = [graph.tensor(s.state_id).name for s in graph.mutable_state]
    assert [t.name for t in guard.tensors] == names and len(guard.save) == len(names) + 2
    placed = {p.value_id: p for p in schedule.placements}
    for state, tensor, check in zip(graph.mutable_state, guard.tensors, guard.save[1:-1]):
        where = placed[state.state_id]
        assert check.bindings[1] == BufferBinding(where.key, where.offset, where.size_bytes, "r")
        assert check.bindings[0] == BufferBinding("guard:slot", tensor.slot_offset, where.size_bytes, "w")
        assert tensor.slot_offset % 256 == 0 and tensor.slot_offset + tensor.size_bytes <= guard.slot_bytes
    back = deserialize_schedule(serialize_schedule(schedule))
    assert back == schedule and serialize_schedule(back) == serialize_schedule(schedule)
    sources = shader_sources()
    verify_schedule(back, graph, sources)
    check = guard.save[1]
    outside = dataclasses.replace(check, bindings=(dataclasses.replace(check.bindings[0], offset=guard.slot_bytes),)
                                  + check.bindings[1:])
    broken = dataclasses.replace(schedule, state_guard=dataclasses.replace(guard, save=(guard.save[0], outside)
                                                                            + guard.save[2:]))
    with pytest.raises(VerificationError, match=r"state guard save dispatch 1 .* is outside the buffer's"):
        verify_schedule(broken, graph, sources)
    # A step run by a schedule planned without the guard has none: the training loop keeps host copies.
    with TrainingRunner.from_pte(mlp_pte, vk_device, schedule=plain, timing=False) as runner:
        assert runner.state_guard() is None


SCHEDULE_MUTANTS = 400


def test_schedule_mutants_are_refused_cleanly_or_verified(vk_device, mlp_pte):
    """Mutated schedule bytes: every one refused by the reader or the verifier, or read as a schedule the
    verifier accepts; none escapes as another exception. The step's schedule as the runner plans it: its state
    guard's tables too."""
    graph = _graph(mlp_pte, vk_device)
    original = serialize_schedule(plan_schedule(graph, profile_of(vk_device), max_binding_bytes=SMALL_BINDING,
                                                state_guard=True))
    table = fuzz.schedule_campaign(original, graph, shader_sources(), SCHEDULE_MUTANTS, seed=0)
    print(f"\n{SCHEDULE_MUTANTS} schedule mutants: {dict(table)}")
    assert not [label for label in table if label.startswith("BUG")], table
    refused = sum(count for label, count in table.items() if label.startswith("refused"))
    assert refused >= SCHEDULE_MUTANTS // 4, table
    assert any(label.startswith("refused: verify.check_schedule") for label in table), table


def test_a_schedule_binding_another_executors_state_runs_with_it(vk_device, mlp_pte):
    """The methods of a program share state (eval reads the step's adapters): a schedule planned with
    `shared` binds the owner's buffers at their offsets, runs as the executor planned at load does, and is
    refused by an executor not given them."""
    graph = _graph(mlp_pte, vk_device)
    token_ids, labels = next(_batches(MLP_VOCAB, MLP_BATCH, MLP_SEQ))
    inputs = (token_ids, labels, HPARAMS, np.float32((labels >= 0).sum()))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph), timing=False) as owner:
        shared = owner.shared_state()
        schedule = deserialize_schedule(serialize_schedule(plan_schedule(graph, profile_of(vk_device), shared=shared)))
        assert {buffer.role for buffer in schedule.buffers if buffer.key.startswith("shared:")} == {"shared"}
        outputs = []
        for given in (planned(vk_device, graph, shared=shared), schedule):
            owner.reset_state()
            with GraphExecutor(vk_device, graph, given, timing=False, shared=shared) as borrower:
                outputs.append(borrower.run(*inputs)[0])
                outputs.append(owner.read_state("model.layers.0.lora_A"))  # the step updated the owner's state
        np.testing.assert_array_equal(outputs[2], outputs[0])
        np.testing.assert_array_equal(outputs[3], outputs[1])
        assert not np.array_equal(outputs[1], owner.initial_state("model.layers.0.lora_A"))
        with pytest.raises(ScheduleMismatchError, match="which this executor was not given"):
            GraphExecutor(vk_device, graph, schedule)


def test_a_webgpu_schedule_read_back_trains_bit_identically_and_vulkan_ones_are_refused(vk_device, webgpu_device,
                                                                                        mlp_pte):
    graph = _graph(mlp_pte, vk_device)
    batches = list(_batches(MLP_VOCAB, MLP_BATCH, MLP_SEQ))
    losses, state, planned_at_load = _train(mlp_pte, webgpu_device, batches)
    schedule = deserialize_schedule(serialize_schedule(plan_schedule(graph, profile_of(webgpu_device),
                                                                     state_guard=True)))
    assert schedule == planned_at_load and schedule.requirements.api == "webgpu"
    read_back_losses, read_back_state, _ = _train(mlp_pte, webgpu_device, batches, schedule=schedule)
    assert read_back_losses == losses
    for name, array in state.items():
        np.testing.assert_array_equal(read_back_state[name], array, err_msg=name)
    with pytest.raises(ScheduleMismatchError, match="the schedule is for the vulkan runtime, the device is webgpu"):
        GraphExecutor(webgpu_device, graph, plan_schedule(graph, profile_of(vk_device)))
    with pytest.raises(ScheduleMismatchError, match="the schedule is for the webgpu runtime, the device is vulkan"):
        GraphExecutor(vk_device, graph, schedule)


def test_the_profile_chooses_the_route_the_device_chooses(vk_device, webgpu_device, mlp_pte):
    """Planning reads the profile (planner.ProfileAsDevice): the GEMM route and fp32 tuning it gives are the
    ones select_gemm_route / select_gemm_tuning give for the opened device itself."""
    from vktrain.backend.kernel_planning.kernels.coopmat import select_gemm_route
    from vktrain.contract import allowed_precisions
    from vktrain.backend.kernel_planning.kernels.gemm_tuning import select_gemm_tuning
    from vktrain.backend.kernel_planning.planner import gemm_route_for

    graph = _graph(mlp_pte, vk_device)
    allowed = allowed_precisions(graph.metadata)
    for device in (vk_device, webgpu_device):
        profile = profile_of(device)
        for precision, emulate in (("auto", False), ("fp32", False), ("fp16-tc", False), ("fp16-tc", True)):
            from_device = dataclasses.replace(select_gemm_route(precision, allowed, device, emulate=emulate,
                                                                profile=profile),
                                              fp32_tuning=select_gemm_tuning(device))
            assert gemm_route_for(graph, profile, precision, emulate_tensor_cores=emulate) == from_device, \
                (device.name, precision, emulate)

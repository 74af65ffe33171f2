"""The native runtime's loader (native/, C++) against the Python reader, and under the fuzz corpus.

Its inspector reads a tiny-llama training step + eval .pte and reports what `vktrain inspect --json`
(vktrain/runtime/program/summary.py) reports: two independent readers of the same bytes. Then 2,000
mutants of the project's fuzzer (vktrain.runtime.program.fuzz) of a .pte with an embedded schedule go through
the loader built with AddressSanitizer + UBSan, in one process: each is loaded or refused with a documented code and a
message, with no sanitizer report and no hang; every mutant it loads, the Python loader loads too (and a plan
whose delegate reads inputs nothing writes, fuzz seed 11's escape, is refused by both).

Its schedule reader (--schedule, native/src/schedule_*.cc) against vktrain/serialization/schedule.py and
verify_schedule.py: the same summary of a planned tiny-llama schedule, the same refusals of hand-made bad
schedules, and the same verdict on 2,000 fuzz mutants of a schedule under the sanitizers; then the schedule
interpreter's load path (--spirv-dir: the step planned against the shaders' SPIR-V, no device) on those
mutants under the sanitizers too.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vktrain.runtime.program import fuzz
from vktrain.runtime.program.summary import summarize_pte
from vktrain.serialization.verify import VerificationError

from _helpers import build_native, export_mlp_lora_training_step

REPO = Path(__file__).resolve().parents[1]
REFUSAL_CODES = {10, 11, 12, 13, 14, 15, 16, 17}  # native/src/status.h ErrorCode (the loader's)
FUZZ_MUTANTS = 2000


@pytest.fixture(scope="module")
def inspector() -> Path:
    return build_native() / "vktrain-native-inspect"


@pytest.fixture(scope="module")
def sanitized_inspector() -> Path:
    return build_native("--sanitize") / "vktrain-native-inspect"


@pytest.fixture(scope="module")
def llama_pte(tmp_path_factory) -> Path:
    """tiny-llama's training step and eval method in one .pte (what `vktrain export` writes)."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    step, evaluation = export_training_and_eval_steps(model, (2, 16))
    path = tmp_path_factory.mktemp("native") / "tiny_llama.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


def _run(binary: Path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _expected_delegate(python_method: dict) -> dict:
    """The fields the native report shares with `vktrain inspect --json`'s delegate, from the Python report."""
    (d,) = python_method["delegates"]
    c, m = d["constants"], d["memory"]
    return {
        "backend_id": d["backend_id"], "payload_bytes": d["payload_bytes"], "ops": d["ops"],
        "op_histogram": d["op_histogram"],
        "constants": {"count": c["count"], "bytes": c["bytes"], "stored_bytes": c["stored_bytes"],
                      "stored_forms": c["stored_forms"]},
        "memory": {"planned_bytes": m["planned_bytes"], "memory_objects": m["memory_objects"],
                   "state_bytes": m["state_bytes"]},
        "mutable_state": d["mutable_state"], "inputs": d["inputs"], "outputs": d["outputs"],
        "metadata_keys": set(d["metadata"]),  # the Python report lists refusals and baked scalars apart
    }


def test_the_native_inspector_reports_what_the_python_reader_reports(inspector, llama_pte):
    import json

    result = _run(inspector, "--json", llama_pte)
    assert result.returncode == 0, result.stderr
    native = json.loads(result.stdout)
    python = summarize_pte(llama_pte.read_bytes())
    assert (native["pte_bytes"], native["named_data_bytes"]) == (python["pte_bytes"], python["named_data_bytes"])
    python_methods = {"forward": python, **python.get("other_methods", {})}
    assert native["main_method"] == "forward" and set(native["methods"]) == set(python_methods) == {"forward", "eval"}
    for name, method in python_methods.items():
        got = native["methods"][name]
        assert (got["delegate_calls"], got["kernel_calls"], got["operators"]) == (
            method["delegate_calls"], method["kernel_calls"], method["operators"]), name
        delegate = dict(got["delegate"])
        assert delegate.pop("format_version") == 1 and delegate.pop("checksummed") is True
        delegate["metadata_keys"] = set(delegate["metadata_keys"]) - {"refusals", "baked_scalars"}
        assert delegate == _expected_delegate(method), name
    # Non-trivial on both sides: the step has state, narrow constants and named data.
    step = native["methods"]["forward"]["delegate"]
    assert step["ops"] > 500 and len(step["mutable_state"]) > 50 and "bfloat16" in step["constants"]["stored_forms"]
    assert native["named_data_bytes"] > 0


def test_bad_files_are_refused_with_exit_2_naming_the_file(inspector, llama_pte, tmp_path):
    data = llama_pte.read_bytes()
    cut = tmp_path / "cut.pte"
    cut.write_bytes(data[:len(data) // 2])
    result = _run(inspector, cut)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"vktrain-native-inspect: error: {cut}: ")
    flipped = bytearray(data)
    constants = fuzz.file_regions(data)["blob constants"]
    flipped[constants.start + 5] ^= 0x10
    edited = tmp_path / "flipped.pte"
    edited.write_bytes(bytes(flipped))
    result = _run(inspector, edited)
    assert result.returncode == 2
    assert "crc32 of its" in result.stderr and "the constant data was modified or corrupted" in result.stderr
    missing = _run(inspector, tmp_path / "absent.pte")
    assert missing.returncode == 2 and f"cannot open {tmp_path / 'absent.pte'}: No such file" in missing.stderr


@pytest.fixture(scope="module")
def mlp_pte(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("native") / "mlp.pte"
    export_mlp_lora_training_step(path, (2, 8), 64)
    return path


@pytest.fixture(scope="module")
def mlp_embedded_pte(tmp_path_factory) -> Path:
    """The mlp step with its lavapipe schedule and shader modules embedded (`vktrain export --target lavapipe`)."""
    path = tmp_path_factory.mktemp("native") / "mlp_lavapipe.pte"
    export_mlp_lora_training_step(path, (2, 8), 64, target="lavapipe")
    return path


def test_a_negative_scalar_type_is_refused_not_divided_by(sanitized_inspector, mlp_pte, tmp_path):
    """A fuzzer finding (seed 4): ScalarType is an int8, so a hostile file may hold -1, which had no element
    size; the arena check divided by it. Located with the flatc-generated accessors, independently."""
    import struct

    from vktrain.serialization.pte_schema.executorch_flatbuffer.Program import Program as FbProgram
    from vktrain.serialization.pte_schema.executorch_flatbuffer.Tensor import Tensor as FbTensor
    from vktrain.serialization.flatbuffer_reading import union_as

    data = bytearray(mlp_pte.read_bytes())
    tensor = union_as(FbProgram.GetRootAs(bytes(data), 0).ExecutionPlan(0).Values(0).Val(), FbTensor)
    struct.pack_into("<b", data, tensor._tab.Pos + tensor._tab.Offset(4), -1)  # Tensor.scalar_type
    edited = tmp_path / "negative.pte"
    edited.write_bytes(bytes(data))
    result = _run(sanitized_inspector, edited)
    assert "runtime error" not in result.stderr and result.returncode == 2, result.stderr
    assert (f"{edited}: plan 'forward' value 0 (UNKNOWN[2, 8]): scalar type UNKNOWN is not supported "
            "[check_tensor_records]") in result.stderr


def test_control_bytes_quoted_from_the_file_are_escaped_in_messages(inspector, mlp_pte, tmp_path):
    """A fuzzer finding (seed 5): a message quotes names from the file, which may hold a NUL (it cut the
    message short) or a newline (it split --fuzz-dir's one line per file); they print as \\xNN, as Python's
    repr shows them. Here the plan's name "forward" -> "for\\x00\\nrd", located with the flatc accessors."""
    from vktrain.serialization.pte_schema.executorch_flatbuffer.Program import Program as FbProgram

    data = bytearray(mlp_pte.read_bytes())
    plan = FbProgram.GetRootAs(bytes(data), 0).ExecutionPlan(0)
    name = plan._tab.Vector(plan._tab.Offset(4))  # ExecutionPlan.name's bytes
    data[name + 3:name + 5] = b"\0\n"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "renamed.pte").write_bytes(bytes(data))
    expected = "no execution plan 'forward' (a training step); it has ['for\\x00\\x0ard']"
    single = _run(inspector, corpus / "renamed.pte")
    assert single.returncode == 2, single.stderr
    assert single.stderr == f"vktrain-native-inspect: error: {corpus / 'renamed.pte'}: {expected}\n", single.stderr
    listing = _run(inspector, "--fuzz-dir", corpus)
    assert listing.stdout == f"renamed.pte\t11\t{corpus / 'renamed.pte'}: {expected}\n", listing.stdout


def test_a_vector_referenced_again_and_again_is_refused_before_memory_runs_out(sanitized_inspector, tmp_path):
    """A Program whose 64 values all point at one Tensor with a 1M-entry `sizes` vector: a 4 MB file that
    would make the reader copy 256 MB (or terabytes, with more references). The copy budget refuses it."""
    import flatbuffers
    import numpy as np

    from vktrain.serialization.pte_schema.executorch_flatbuffer import (EValue, ExecutionPlan, KernelTypes,
                                                                          Program, Tensor)

    builder = flatbuffers.Builder(1 << 23)
    sizes = builder.CreateNumpyVector(np.ones(1 << 20, np.int32))
    Tensor.Start(builder)
    Tensor.AddScalarType(builder, 6)
    Tensor.AddSizes(builder, sizes)
    tensor = Tensor.End(builder)
    EValue.Start(builder)
    EValue.AddValType(builder, KernelTypes.KernelTypes.Tensor)
    EValue.AddVal(builder, tensor)
    value = EValue.End(builder)
    ExecutionPlan.StartValuesVector(builder, 64)
    for _ in range(64):
        builder.PrependUOffsetTRelative(value)
    values = builder.EndVector()
    name = builder.CreateString("forward")
    ExecutionPlan.Start(builder)
    ExecutionPlan.AddName(builder, name)
    ExecutionPlan.AddValues(builder, values)
    plan = ExecutionPlan.End(builder)
    Program.StartExecutionPlanVector(builder, 1)
    builder.PrependUOffsetTRelative(plan)
    plans = builder.EndVector()
    Program.Start(builder)
    Program.AddExecutionPlan(builder, plans)
    builder.Finish(Program.End(builder), file_identifier=b"ET12")
    path = tmp_path / "shared_sizes.pte"
    path.write_bytes(bytes(builder.Output()))
    result = _run(sanitized_inspector, path)
    assert result.returncode == 2, result.stderr
    assert (f"{path}: Program flatbuffer references more data than it holds (the same vectors or strings again and "
            "again: over twice its size copied)") in result.stderr


def _plan_inputs_dropped(data: bytes) -> dict[str, bytes]:
    """Edits of ExecutionPlan.inputs, located with the flatc-generated accessors: its vtable entry zeroed
    (the plan has no inputs) and its length one less (the last input left out)."""
    import struct

    from vktrain.serialization.pte_schema.executorch_flatbuffer.Program import Program as FbProgram

    plan = FbProgram.GetRootAs(data, 0).ExecutionPlan(0)
    vtable_entry = plan._tab.Pos - struct.unpack_from("<i", data, plan._tab.Pos)[0] + 10  # slot of `inputs`
    length = plan._tab.Vector(plan._tab.Offset(10)) - 4
    edits = {}
    for name, position, code, value in (("no-inputs.pte", vtable_entry, "<H", 0),
                                        ("one-input-less.pte", length, "<I", plan.InputsLength() - 1)):
        edited = bytearray(data)
        struct.pack_into(code, edited, position, value)
        edits[name] = bytes(edited)
    return edits


def test_fuzz_mutants_are_refused_cleanly_under_sanitizers(sanitized_inspector, mlp_embedded_pte, tmp_path):
    """The mutants of a .pte whose blob embeds a schedule and its shader modules: they reach the embedded
    tables' checks too (native/src/embedded.cc verify_embedded)."""
    original = mlp_embedded_pte.read_bytes()
    corpus = tmp_path / "mutants"
    corpus.mkdir()
    mutants = {}
    for index, mutant in zip(range(FUZZ_MUTANTS), fuzz.mutants(original, seed=0)):
        name = f"{index:05d}.pte"
        (corpus / name).write_bytes(mutant.data)
        mutants[name] = mutant
    (corpus / "original.pte").write_bytes(original)
    unfed = _plan_inputs_dropped(original)  # the family of fuzz seed 11's escape, drawn here every run
    for name, data in unfed.items():
        (corpus / name).write_bytes(data)

    result = _run(sanitized_inspector, "--fuzz-dir", corpus, timeout=120)
    assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = {}
    for line in result.stdout.splitlines():
        name, code, message = line.split("\t", 2)
        outcomes[name] = (int(code), message)
    assert set(outcomes) == set(mutants) | {"original.pte"} | set(unfed)
    assert outcomes["original.pte"] == (0, "ok")
    for name, data in unfed.items():
        assert outcomes[name][0] == 14 and outcomes[name][1].endswith("[check_delegate_inputs_written]"), outcomes[name]
        with pytest.raises(VerificationError, match="which nothing writes before the call"):
            fuzz.load(data)
    for name, (code, message) in outcomes.items():
        assert code == 0 or (code in REFUSAL_CODES and message.startswith(str(corpus / name) + ":")), (name, code, message)
    # The mutants reach every layer: the .pte reader, the blob reader, both checksums, the plan checks.
    assert {11, 12, 13, 14} <= {code for code, _ in outcomes.values()}
    embedded = [message for code, message in outcomes.values() if code and "blob: embedded schedule 0" in message]
    assert len(embedded) >= 5, embedded

    # What the native loader accepts, the Python loader accepts too, but for what only Python checks yet
    # (in a re-signed graph, whose checksum was recomputed): each op's outputs re-inferred from the op
    # definitions, and an embedded schedule's graph digest (the sha256 of Python reprs; schedule_verify.cc).
    for name, (code, _) in outcomes.items():
        if code == 0 and name != "original.pte":
            outcome = fuzz.run_one(mutants[name], fuzz.program_meaning(*fuzz.load(original)))
            assert not outcome.label.startswith("refused") or (
                mutants[name].family == fuzz.RESIGNED and (outcome.label == "refused: verify.check_op_shapes" or
                                                           "planned for another graph" in outcome.detail)), (
                name, mutants[name].description, outcome.label, outcome.detail)


def test_the_device_probe_sees_the_device_the_python_runtime_uses(inspector, vk_device):
    """--devices (native Vulkan calls) and the Python runtime (the `vulkan` binding) report the same limits."""
    import re

    result = _run(inspector, "--devices")
    assert result.returncode == 0, result.stderr
    blocks = re.split(r"\ndevice \d+: ", "\n" + result.stdout.split("\n", 1)[1])[1:]
    assert len(blocks) == len(vk_device.available_devices)
    block = blocks[vk_device.info.index]
    assert block.startswith(vk_device.info.name + " (")
    limits = vk_device.limits
    assert f"maxStorageBufferRange {limits.max_storage_buffer_range}," in block
    assert f"minStorageBufferOffsetAlignment {limits.min_storage_buffer_offset_alignment}," in block
    assert f"maxComputeSharedMemorySize {limits.max_compute_shared_memory_size}," in block
    assert f"maxComputeWorkGroupInvocations {limits.max_compute_work_group_invocations}," in block


# --- the schedule reader ------------------------------------------------------------------------------------

def _graph_of(pte: Path):
    return fuzz.load(pte.read_bytes())[1].graph


def _plan(graph, **options):
    """`graph` planned on lavapipe's built-in profile: no device is opened."""
    from vktrain.backend.kernel_planning.planner import plan_schedule
    from vktrain.serialization.device_profile import LAVAPIPE

    return plan_schedule(graph, LAVAPIPE, **options)


def _expected_schedule_summary(schedule) -> dict:
    from collections import Counter

    from vktrain.serialization.schedule import ROLES

    roles = {}
    for buffer in schedule.buffers:
        total = roles.setdefault(buffer.role, {"count": 0, "bytes": 0})
        total["count"] += 1
        total["bytes"] += buffer.size_bytes
    needs = schedule.requirements
    return {"format_version": 1, "graph_digest": schedule.graph_digest,
            "buffers": {role: roles[role] for role in ROLES if role in roles},
            "placements": len(schedule.placements), "dispatches": len(schedule.dispatches),
            "shader_variants": dict(Counter(d.shader for d in schedule.dispatches)),
            "requirements": {"api": needs.api, "max_storage_buffer_range": needs.max_storage_buffer_range,
                             "min_storage_buffer_offset_alignment": needs.min_storage_buffer_offset_alignment,
                             "max_shared_memory_bytes": needs.max_shared_memory_bytes,
                             "max_workgroup_invocations": needs.max_workgroup_invocations,
                             "max_workgroup_size_x": needs.max_workgroup_size_x, "subgroup_size": needs.subgroup_size,
                             "subgroup_operations": list(needs.subgroup_operations), "float16": needs.float16,
                             "int64": needs.int64, "cooperative_matrix": list(needs.cooperative_matrix)},
            "gemm": {"precision": schedule.gemm.precision, "tensor_cores": schedule.gemm.tensor_cores},
            "max_binding_bytes": schedule.max_binding_bytes, "tensor_core_ops": len(schedule.tensor_core_ops)}


@pytest.fixture(scope="module")
def llama_schedule(llama_pte):
    graph = _graph_of(llama_pte)
    return graph, _plan(graph)


def test_the_native_schedule_reader_reports_what_the_python_schedule_holds(inspector, llama_pte, llama_schedule,
                                                                           tmp_path):
    import json

    from vktrain.serialization.schedule import serialize_schedule

    _, schedule = llama_schedule
    path = tmp_path / "llama.vks"
    path.write_bytes(serialize_schedule(schedule))
    result = _run(inspector, "--schedule", path, "--pte", llama_pte, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == _expected_schedule_summary(schedule)
    text = _run(inspector, "--schedule", path)
    assert text.returncode == 0 and f"dispatches: {len(schedule.dispatches)} " in text.stdout, text.stderr


def _bad_schedules(schedule):
    """(what, schedule) pairs that verify_schedule refuses, one fact each."""
    import dataclasses

    from vktrain.serialization.dispatch import BufferBinding

    def with_dispatch(index, **changes):
        dispatches = list(schedule.dispatches)
        dispatches[index] = dataclasses.replace(dispatches[index], **changes)
        return dataclasses.replace(schedule, dispatches=tuple(dispatches))

    index = next(i for i, d in enumerate(schedule.dispatches) if d.bindings)
    first = schedule.dispatches[index]
    size = schedule.buffer(first.bindings[0].buffer).size_bytes
    align = schedule.requirements.min_storage_buffer_offset_alignment
    past_end = BufferBinding(first.bindings[0].buffer, -(-size // align) * align, None, first.bindings[0].access)
    needs = schedule.requirements
    yield "binding out of range", with_dispatch(index, bindings=(past_end,) + first.bindings[1:])
    too_long = BufferBinding(first.bindings[0].buffer, 0, size + 4, first.bindings[0].access)
    yield "binding longer than its buffer", with_dispatch(index, bindings=(too_long,) + first.bindings[1:])
    misaligned = BufferBinding(first.bindings[0].buffer, align // 2 or 1, 4, first.bindings[0].access)
    if align > 1:
        yield "misaligned binding", with_dispatch(index, bindings=(misaligned,) + first.bindings[1:])
    yield "unknown shader", with_dispatch(index, shader="no_such_kernel@VEC4")
    yield "oversized push constants", with_dispatch(index, push_constants=bytes(116))
    yield "local size over the limit", with_dispatch(index, local_size=(needs.max_workgroup_size_x * 2, 1, 1),
                                                     spec_constants=())
    yield "too many split dispatches", with_dispatch(index, groups=(65535 * 1024 + 1, 65535 * 1024 + 1, 1))
    yield "binding size limit", dataclasses.replace(schedule, requirements=dataclasses.replace(
        needs, max_storage_buffer_range=4))
    placement = schedule.placements[0]
    yield "placement of the wrong size", dataclasses.replace(
        schedule, placements=(dataclasses.replace(placement, size_bytes=placement.size_bytes + 4),)
        + schedule.placements[1:])
    yield "a tensor without placement", dataclasses.replace(schedule, placements=schedule.placements[1:])


def test_schedules_the_python_verifier_refuses_are_refused_natively_with_its_message(inspector, llama_pte,
                                                                                    llama_schedule, tmp_path):
    from vktrain.runtime.delegate.executor import shader_sources
    from vktrain.serialization.schedule import deserialize_schedule, serialize_schedule
    from vktrain.serialization.verify import VerificationError
    from vktrain.serialization.verify_schedule import verify_schedule

    graph, schedule = llama_schedule
    for number, (what, bad) in enumerate(_bad_schedules(schedule)):
        path = tmp_path / f"bad{number}.vks"
        path.write_bytes(serialize_schedule(bad))
        with pytest.raises(VerificationError) as refused:
            verify_schedule(deserialize_schedule(path.read_bytes()), graph, shader_sources(), str(path))
        result = _run(inspector, "--schedule", path, "--pte", llama_pte)
        assert result.returncode == 2, (what, result.stdout, result.stderr)
        assert result.stderr == f"vktrain-native-inspect: error: {refused.value}\n", what

    # The reader's own refusals: another file, another format version.
    data = bytearray(serialize_schedule(schedule))
    for what, mutate, expected in (
            ("another identifier", lambda b: b.__setitem__(slice(4, 8), b"VKT1"), "without the VKS1 identifier"),
            ("truncated", lambda b: b.__delitem__(slice(len(b) // 2, None)), "fails the flatbuffers Verifier")):
        bad = bytearray(data)
        mutate(bad)
        path = tmp_path / "bad.vks"
        path.write_bytes(bytes(bad))
        result = _run(inspector, "--schedule", path)
        assert result.returncode == 2 and str(path) in result.stderr and expected in result.stderr, (what, result.stderr)
    missing = _run(inspector, "--schedule", tmp_path / "absent.vks")
    assert missing.returncode == 2 and "absent.vks" in missing.stderr, missing.stderr


def test_schedule_fuzz_mutants_get_the_python_verdict_under_sanitizers(sanitized_inspector, mlp_pte, tmp_path):
    from vktrain.runtime.delegate.executor import shader_sources
    from vktrain.serialization.schedule import serialize_schedule

    graph = _graph_of(mlp_pte)
    schedule = _plan(graph)
    original = serialize_schedule(schedule)
    corpus = tmp_path / "schedules"
    corpus.mkdir()
    mutants = {}
    for index, mutant in zip(range(FUZZ_MUTANTS), fuzz.schedule_mutants(original, seed=0)):
        name = f"{index:05d}.vks"
        (corpus / name).write_bytes(mutant.data)
        mutants[name] = mutant
    (corpus / "original.vks").write_bytes(original)

    result = _run(sanitized_inspector, "--schedule-fuzz-dir", corpus, "--pte", mlp_pte, timeout=120)
    assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = {}
    for line in result.stdout.splitlines():
        name, code, message = line.split("\t", 2)
        outcomes[name] = (int(code), message)
    assert set(outcomes) == set(mutants) | {"original.vks"}
    assert outcomes["original.vks"] == (0, "ok")
    for name, (code, message) in outcomes.items():
        assert code == 0 or (code in REFUSAL_CODES and message.startswith(str(corpus / name) + ":")), (name, code, message)
    assert {14, 17} <= {code for code, _ in outcomes.values()}

    # Python's verdict on each: the same acceptance, but for two known differences. The graph digest only
    # Python compares (native accepts a schedule whose digest string alone was changed). The flatbuffers
    # Verifier only the native reader runs: it refuses bytes Python's lazy reader reads past (a string
    # without its terminating zero, a misaligned table), a few dozen of the 2,000.
    sources = shader_sources()
    disagreements, verifier_only = [], 0
    for name, mutant in mutants.items():
        python = fuzz.run_schedule_one(mutant, schedule, graph, sources)
        (code, message), python_accepts = outcomes[name], python.label.startswith("accepted")
        if (code == 0) == python_accepts:
            continue
        if code == 0 and "planned for another graph" in python.detail:
            continue
        if code == 17 and "fails the flatbuffers Verifier" in message:
            verifier_only += 1
            continue
        disagreements.append((name, mutant.description, outcomes[name], python.label, python.detail))
    assert not disagreements, disagreements[:10]
    assert verifier_only < FUZZ_MUTANTS // 20, verifier_only

    # The schedule interpreter's load path (native/src/step_plan.cc) on the same mutants, under the same
    # sanitizers, with no device (lavapipe's caps): every dispatch planned against its SPIR-V, every placement,
    # binding range, push-constant size and specialization constant checked. It refuses every mutant the reader
    # refuses, with the same code and message, and more (shader mismatches, code 18), each naming the file.
    from vktrain.runtime_shaders.build import SPIRV_DIR

    planned = _run(sanitized_inspector, "--schedule-fuzz-dir", corpus, "--pte", mlp_pte, "--spirv-dir", SPIRV_DIR,
                   timeout=300)
    assert "Sanitizer" not in planned.stderr and "runtime error" not in planned.stderr, planned.stderr[-3000:]
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan_outcomes = {}
    for line in planned.stdout.splitlines():
        name, code, message = line.split("\t", 2)
        plan_outcomes[name] = (int(code), message)
    assert set(plan_outcomes) == set(outcomes) and plan_outcomes["original.vks"] == (0, "ok")
    for name, (code, message) in plan_outcomes.items():
        if outcomes[name][0] != 0:
            assert (code, message) == outcomes[name], name
        else:
            assert code == 0 or (code in REFUSAL_CODES | {18} and message.startswith(str(corpus / name) + ":")), \
                (name, code, message)
    assert 18 in {code for code, _ in plan_outcomes.values()}

"""Bad .pte files are refused before anything is allocated, with a VktrainError naming what is wrong.

A seeded mutational fuzzer (vktrain.runtime.program.fuzz) runs 2,000 mutants of an exported mlp-lora
training step through the runner's load path; then one test per finding of issue 11, each a byte edit
of the exported file at a field located with the flatc-generated accessors (independently of the
reader under test), and a few accepted mutants train on lavapipe exactly like the original.
"""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from vktrain.errors import VktrainError
from vktrain.runtime.program import fuzz
from vktrain.serialization.pte import MissingMethodError, PteFile, PteFormatError
from vktrain.serialization.pte_schema.executorch_flatbuffer.Program import Program as FbProgram
from vktrain.serialization.pte_schema.executorch_flatbuffer.Tensor import Tensor as FbPteTensor
from vktrain.runtime.program.interpreter import ProgramInterpreter, verify_training_program
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.verify import VerificationError, check_device_memory, check_op_shapes
from vktrain.serialization import BlobFormatError
from vktrain.serialization import graph as g
from vktrain.serialization.flatbuffer_reading import union_as
from vktrain.serialization.generated.vkt_blob.Tensor import Tensor as FbBlobTensor
from vktrain.serialization.generated.vkt_blob.ValueKind import ValueKind
from vktrain.serialization.generated.vkt_blob.VkGraph import VkGraph as FbVkGraph

from _helpers import export_mlp_lora_training_step
from vktrain.backend.kernel_planning import plan_schedule

BATCH, SEQ, VOCAB = 2, 8, 64
FUZZ_MUTANTS = 2000


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "step.pte"
    export_mlp_lora_training_step(path, (BATCH, SEQ), VOCAB)
    return path, path.read_bytes()


# --- locating fields in the file (flatc-generated accessors; positions are absolute in the file) ------

def _vector_position(table, slot: int, index: int, element_size: int) -> int:
    return table._tab.Vector(table._tab.Offset(slot)) + index * element_size


def _scalar_position(table, slot: int) -> int:
    return table._tab.Pos + table._tab.Offset(slot)


def _vtable_entry_position(table, slot: int) -> int:
    """Where the table's vtable stores the offset of field `slot` (0 there = the field is absent)."""
    position = table._tab.Pos
    return position - struct.unpack_from("<i", table._tab.Bytes, position)[0] + slot


def _plan(data: bytes):
    return FbProgram.GetRootAs(data, 0).ExecutionPlan(0)


def _plan_tensor(data: bytes, value_index: int) -> FbPteTensor:
    return union_as(_plan(data).Values(value_index).Val(), FbPteTensor)


def _blob_graph(data: bytes) -> FbVkGraph:
    regions = fuzz.file_regions(data)
    return FbVkGraph.GetRootAs(data, regions["blob graph"].start)


def _edit(data: bytes, position: int, code: str, value) -> bytes:
    edited = bytearray(data)
    struct.pack_into(code, edited, position, value)
    return bytes(edited)


def _write(tmp_path, data: bytes, name: str = "edited.pte"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


# --- the fuzzer --------------------------------------------------------------------------------------

def test_two_thousand_mutants_are_refused_cleanly_or_mean_what_the_original_means(exported):
    _, data = exported
    bugs, seen = [], set()

    def record(outcome):
        seen.add((outcome.mutant.family, outcome.mutant.region))
        if outcome.is_bug:
            bugs.append(outcome)

    start = time.perf_counter()
    table = fuzz.campaign(data, FUZZ_MUTANTS, seed=0, on_outcome=record)
    elapsed = time.perf_counter() - start
    print(f"\n{FUZZ_MUTANTS} mutants in {elapsed:.1f} s\n{fuzz.format_table(table)}")
    assert not bugs, "\n".join(f"{o.label} [{o.mutant.family} in {o.mutant.region}: {o.mutant.description}] {o.detail}"
                               for o in bugs[:10])
    labels = {label for (_, label) in table}
    # The mutants reach every layer: the .pte reader, both blob checksums, the blob reader, the verifier.
    for expected in ("refused: pte format", "refused: blob graph checksum", "refused: blob constant checksum",
                     "refused: blob format", "refused: verify.check_delegate_io", fuzz.ACCEPTED_UNCHANGED):
        assert expected in labels, (expected, labels)
    assert {region for _, region in seen} == set(fuzz.file_regions(data))
    assert {family for family, _ in seen} == set(fuzz.MUTATORS) | {fuzz.RESIGNED}


def test_the_fuzzer_is_reproducible_from_its_seed(exported):
    _, data = exported
    first = [m.description for m, _ in zip(fuzz.mutants(data, seed=7), range(50))]
    again = [m.description for m, _ in zip(fuzz.mutants(data, seed=7), range(50))]
    other = [m.description for m, _ in zip(fuzz.mutants(data, seed=8), range(50))]
    assert first == again and first != other


def test_the_meaning_comparison_sees_a_changed_program(exported):
    """Guards the fuzz test's own oracle: a re-signed edit of one scalar argument (the embedding's
    padding_idx, -1 -> -2: structurally valid, so nothing but its meaning changes) loads and is reported
    as changed (such edits are what per-op re-inference, verify.check_op_shapes, is for)."""
    from vktrain.serialization.generated.vkt_blob.Int import Int as FbInt

    _, data = exported
    graph = _blob_graph(data)
    integers = [union_as(graph.Values(i).Value(), FbInt) for i in range(graph.ValuesLength())
                if graph.Values(i).ValueType() == ValueKind.Int]
    scalar = next(value for value in integers if value.Value() == -1)
    edited = bytearray(_edit(data, _scalar_position(scalar, 4), "<q", -2))
    fuzz._resign_blob(edited, fuzz.file_regions(data))
    pte, program = fuzz.load(data)
    outcome = fuzz.run_one(fuzz.Mutant(bytes(edited), fuzz.RESIGNED, "blob graph", "scalar edit"),
                           fuzz.program_meaning(pte, program))
    assert outcome.label == fuzz.ACCEPTED_CHANGED and "graph values" in outcome.detail


# --- the findings of issue 11, one edit each -------------------------------------------------------

def test_an_edited_output_shape_is_refused_by_the_graph_checksum(exported, tmp_path):
    path, data = exported
    graph = _blob_graph(data)
    op = graph.Chain(graph.ChainLength() // 2)
    output = union_as(graph.Values(op.Outputs(0)).Value(), FbBlobTensor)
    position = _vector_position(output, 6, output.ShapeLength() - 1, 8)
    edited = _edit(data, position, "<q", 0)  # e.g. [4, 64, 8] -> [4, 64, 0]
    with pytest.raises(BlobFormatError, match=rf"{_write(tmp_path, edited)}: plan 'forward' delegate 0 blob: "
                                              "graph checksum mismatch"):
        verify_training_program(PteFile.load(tmp_path / "edited.pte"))


def test_an_op_input_rewired_to_another_tensor_of_the_same_shape_is_refused(exported, tmp_path):
    _, data = exported
    graph = _blob_graph(data)
    shape_of = {}
    for i in range(graph.ValuesLength()):
        if graph.Values(i).ValueType() == ValueKind.Tensor:
            tensor = union_as(graph.Values(i).Value(), FbBlobTensor)
            shape_of[i] = (tensor.Dtype(), tuple(tensor.ShapeAsNumpy().tolist()) if tensor.ShapeLength() else ())
    for op_index in range(graph.ChainLength()):
        op = graph.Chain(op_index)
        arg = op.Args(0)
        twins = [v for v, shape in shape_of.items() if v != arg and shape == shape_of.get(arg)]
        if twins:
            break
    edited = _edit(data, _vector_position(op, 6, 0, 4), "<i", twins[0])
    with pytest.raises(BlobFormatError, match="graph checksum mismatch"):
        fuzz.load(edited)


def test_a_changed_constant_is_refused_unless_constant_verification_is_off(exported):
    _, data = exported
    constants = fuzz.file_regions(data)["blob constants"]
    edited = bytearray(data)
    edited[constants.start + 5] ^= 0x40
    edited = bytes(edited)
    with pytest.raises(BlobFormatError, match=r"constant \d+ \(read by tensor value \d+ \(.+\)\): crc32 of its"):
        fuzz.load(edited)
    program = verify_training_program(PteFile.from_bytes(edited), verify_constants=False)
    original = verify_training_program(PteFile.from_bytes(data))
    assert [bytes(g.stored_bytes(c)) for c in program.graph.constants] != [bytes(g.stored_bytes(c)) for c in original.graph.constants]


def _arena_sizes_position(data: bytes, arena: int) -> int:
    return _vector_position(_plan(data), 20, arena, 8)


def test_arena_sizes_from_the_file_are_capped_and_never_allocated_as_written(exported):
    _, data = exported
    pte = PteFile.from_bytes(data)
    plan = pte.execution_plan()
    arena = max(range(len(plan.non_const_buffer_sizes)), key=lambda i: plan.non_const_buffer_sizes[i])
    huge = _edit(data, _arena_sizes_position(data, arena), "<q", 1 << 40)
    with pytest.raises(VerificationError, match=rf"ask for {(1 << 40) + sum(plan.non_const_buffer_sizes) - plan.non_const_buffer_sizes[arena]} "
                                                r"bytes of host memory .*; this machine has \d+") as caught:
        verify_training_program(PteFile.from_bytes(huge))
    assert caught.value.check == "check_arenas"

    # Below the machine's RAM the size is accepted (a planner may round up), but only what the tensors
    # need is allocated: the end of the last tensor placed in the arena.
    large = PteFile.from_bytes(_edit(data, _arena_sizes_position(data, arena), "<q", 1 << 31))
    interpreter = ProgramInterpreter(large, large.execution_plan(), delegate=lambda index, args: [])
    need = max(v.allocation_info.memory_offset + v.nbytes for v in plan.values
               if getattr(v, "allocation_info", None) is not None and v.allocation_info.memory_id == arena)
    assert len(interpreter._arenas[arena]) == need <= plan.non_const_buffer_sizes[arena]

    small = _edit(data, _arena_sizes_position(data, arena), "<q", need - 1)
    with pytest.raises(VerificationError, match=rf"lie past the end of arena {arena}, whose non_const_buffer_sizes "
                                                rf"entry is {need - 1}"):
        verify_training_program(PteFile.from_bytes(small))


def test_a_tensor_placed_outside_its_arena_is_named(exported, tmp_path):
    path, data = exported
    tensor = _plan_tensor(data, 0)
    offset_position = _scalar_position(tensor.AllocationInfo(), 6)  # memory_offset_low
    edited = _edit(data, offset_position, "<I", 4160)
    with pytest.raises(VerificationError, match=rf"{_write(tmp_path, edited)}: plan 'forward' value 0 "
                                                r"\(LONG\[2, 8\]\): bytes \[4160, 4288\) lie past the end of arena 1"):
        verify_training_program(PteFile.load(tmp_path / "edited.pte"))


def test_two_live_tensors_sharing_bytes_are_refused(exported):
    _, data = exported
    pte = PteFile.from_bytes(data)
    plan = pte.execution_plan()
    token_ids, labels = plan.inputs[0], plan.inputs[1]  # both LONG[2, 8]
    target = plan.values[labels].allocation_info.memory_offset
    edited = _edit(data, _scalar_position(_plan_tensor(data, token_ids).AllocationInfo(), 6), "<I", target)
    with pytest.raises(VerificationError, match=rf"values {token_ids} and {labels}, both used by the plan inputs, "
                                                r"have overlapping bytes \[0, 128\) and \[0, 128\) in arena 1") as caught:
        fuzz.load(edited)
    assert caught.value.check == "check_planned_storage_disjoint"


def test_a_plan_input_left_out_of_the_memory_plan_is_refused(exported):
    _, data = exported
    labels = PteFile.from_bytes(data).execution_plan().inputs[1]
    edited = _edit(data, _vtable_entry_position(_plan_tensor(data, labels), 16), "<H", 0)  # drop allocation_info
    with pytest.raises(VerificationError, match=rf"value {labels} \(LONG\[2, 8\]\) has neither allocation_info nor "
                                                r"data \(data_buffer_idx 0\); only the output of executorch_prim::"
                                                r"et_view.default may") as caught:
        fuzz.load(edited)
    assert caught.value.check == "check_storageless_tensors"


def test_a_delegate_input_that_no_plan_input_writes_is_refused(exported, tmp_path):
    """scripts/fuzz_pte.py --seed 11's escape (byte 176 of this file = 0: the vtable entry of
    ExecutionPlan.inputs): a plan without inputs loaded, and its delegate would have read arena bytes
    nothing writes. One entry dropped (the vector's length 4 -> 3) is refused the same way."""
    _, data = exported
    plan = _plan(data)
    no_inputs = _edit(data, _vtable_entry_position(plan, 10), "<H", 0)
    with pytest.raises(VerificationError, match=rf"{_write(tmp_path, no_inputs)}: plan 'forward': delegate input 0 "
                                                r"\(token_ids\) is plan value 0, which nothing writes before the call: "
                                                r"not one of the plan's inputs \[\], not a constant") as caught:
        verify_training_program(PteFile.load(tmp_path / "edited.pte"))
    assert caught.value.check == "check_delegate_inputs_written"
    three = _edit(data, _vector_position(plan, 10, 0, 4) - 4, "<I", 3)
    with pytest.raises(VerificationError, match=r"delegate input 3 \(n_valid\) is plan value 3, .* inputs \[0, 1, 2\]"):
        fuzz.load(three)


def test_the_fuzzer_verifies_the_eval_method_as_its_first_use_would(tmp_path):
    """TrainingRunner loads a .pte's eval method on first use (EvalMethod); the fuzzer loads it as that would,
    and counts it in a program's meaning, so a mutant of the eval plan alone is judged, not taken for
    accepted-unchanged (here the eval plan's inputs vector one shorter, and its name changed, located with the
    flatc accessors)."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=1, activation="relu")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    step, evaluation = export_training_and_eval_steps(model, (BATCH, SEQ))
    data = lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation})
    pte, program = fuzz.load(data)
    meaning = fuzz.program_meaning(pte, program)
    assert meaning["eval graph ops"] and meaning["eval graph ops"] != meaning["graph ops"]
    program_table = FbProgram.GetRootAs(data, 0)
    plan = next(program_table.ExecutionPlan(i) for i in range(program_table.ExecutionPlanLength())
                if program_table.ExecutionPlan(i).Name() == EVAL_METHOD.encode())
    edited = _edit(data, _vector_position(plan, 10, 0, 4) - 4, "<I", plan.InputsLength() - 1)
    outcome = fuzz.run_one(fuzz.Mutant(edited, "word-rewrite", "pte program", "eval inputs one less"), meaning)
    assert outcome.label == "refused: verify.check_delegate_inputs_written", outcome
    assert f"plan 'eval': delegate input {plan.InputsLength() - 1}" in outcome.detail
    renamed = bytearray(data)
    renamed[_vector_position(plan, 4, 3, 1)] = ord("x")  # ExecutionPlan.name "eval" -> "evax"
    outcome = fuzz.run_one(fuzz.Mutant(bytes(renamed), "byte-rewrite", "pte program", "eval renamed"), meaning)
    assert outcome.label == "refused: UnsupportedProgramError" and "has no 'eval' method" in outcome.detail, outcome


def test_delegate_arguments_are_checked_against_the_graph_inputs(exported):
    _, data = exported
    tensor = _plan_tensor(data, 0)  # token_ids, LONG[2, 8]
    reshaped = _edit(_edit(data, _vector_position(tensor, 8, 0, 4), "<i", 4), _vector_position(tensor, 8, 1, 4),
                     "<i", BATCH * SEQ // 4)  # the same bytes as [4, 4]: no other check can object
    with pytest.raises(VerificationError, match=rf"delegate input 0 \(token_ids\) is plan value 0, LONG\[4, 4\]; "
                                                rf"the delegate graph declares INT64\[{BATCH}, {SEQ}\]"):
        fuzz.load(reshaped)
    as_float = _edit(data, _scalar_position(tensor, 4), "<b", 6)  # ScalarType.FLOAT
    with pytest.raises(VerificationError, match=r"FLOAT\[2, 8\]; the delegate graph declares INT64\[2, 8\]"):
        fuzz.load(as_float)


def test_a_non_contiguous_dim_order_is_refused_at_verification(exported):
    _, data = exported
    dim_order = _vector_position(_plan_tensor(data, 0), 10, 0, 1)  # Tensor.dim_order: [ubyte]
    edited = bytearray(data)
    edited[dim_order:dim_order + 2] = bytes([1, 0])
    with pytest.raises(VerificationError, match=r"value 0 \(LONG\[2, 8\]\): dim_order is \[1, 0\], expected \[0, 1\]"):
        fuzz.load(bytes(edited))


def test_a_plan_output_other_than_the_loss_is_refused(exported):
    _, data = exported
    plan = PteFile.from_bytes(data).execution_plan()
    hparams = plan.inputs[2]  # FLOAT[5]
    edited = _edit(data, _vector_position(_plan(data), 12, 0, 4), "<i", hparams)  # ExecutionPlan.outputs[0]
    with pytest.raises(VerificationError, match=rf"output is value {hparams} \(FLOAT\[5\]\); expected the loss, a "
                                                rf"FLOAT\[\] the delegate returns \(one of values \[{plan.outputs[0]}\]\)"):
        fuzz.load(edited)


def test_device_memory_asked_for_by_the_graph_is_capped(exported):
    _, data = exported
    pte, program = fuzz.load(data)
    # Memory objects, plus the used tensors with storage of their own (views and in-place outputs use
    # another's; a value no op reads or writes any more, e.g. a transpose a pass dropped, gets no buffer).
    used = [program.graph.values[i] for i in program.graph.used_tensor_ids()]
    own = [v for v in used if v.mem_obj_id == -1 and v.storage_of == -1]
    assert len(own) < sum(v.mem_obj_id == -1 for v in used)  # some share
    needed = sum(m.size_bytes for m in program.graph.memory_objects) + sum(v.nbytes for v in own)
    check_device_memory(pte.source, program.graph, needed)  # exactly enough
    with pytest.raises(VerificationError, match=rf"ask for {needed} bytes of device memory in all; the device's "
                                                rf"largest memory heap has {needed - 1}"):
        check_device_memory(pte.source, program.graph, needed - 1)
    largest = max(m.size_bytes for m in program.graph.memory_objects)
    with pytest.raises(VerificationError, match=rf"memory object \d+ asks for {largest} bytes"):
        check_device_memory(pte.source, program.graph, largest - 1)


def test_the_loaders_re_infer_every_op_from_the_op_definitions(exported):
    """load_delegate_graph's default rule is the torch-free op definitions: the exported graph passes
    it; the same graph with one op's declared output shape changed (what a re-signed or buggy writer
    produces) is refused naming the op and both shapes; an op the runtime has no kernel for is refused."""
    import dataclasses

    import inspect

    from vktrain.serialization.verify import infer_from_op_definitions, load_delegate_graph

    default = inspect.signature(load_delegate_graph).parameters["infer_op_shapes"].default
    assert default is infer_from_op_definitions
    _, data = exported
    pte, program = fuzz.load(data)
    graph = program.graph
    check_op_shapes(pte.source, graph, infer_from_op_definitions)
    index, op = next((i, op) for i, op in enumerate(graph.ops) if op.name == "aten.mm.default")
    output = graph.tensor(op.outputs[0])
    wrong = dataclasses.replace(output, shape=output.shape[:-1] + (output.shape[-1] + 1,))
    values = list(graph.values)
    values[op.outputs[0]] = wrong
    with pytest.raises(VerificationError, match=rf"delegate op {index} \(aten.mm.default\) declares outputs "
                                                rf"FLOAT32\[.*\]; its inputs give FLOAT32\[.*\]"):
        check_op_shapes(pte.source, dataclasses.replace(graph, values=tuple(values)), infer_from_op_definitions)
    int_list = next(i for i, value in enumerate(graph.values) if isinstance(value, g.IntListValue))
    ops = list(graph.ops)
    ops[index] = dataclasses.replace(op, outputs=(int_list,))  # fuzz seed 11: was a GraphError naming no file
    with pytest.raises(VerificationError, match=rf"{pte.source}: delegate op {index} \(aten.mm.default\) outputs "
                                                rf"values \[{int_list}\], IntListValue; its definition gives tensors"):
        check_op_shapes(pte.source, dataclasses.replace(graph, ops=tuple(ops)), infer_from_op_definitions)
    ops[index] = dataclasses.replace(op, name="aten.no_such_op.default")
    with pytest.raises(VerificationError, match=r"aten.no_such_op.default\): vktrain's runtime has no kernel"):
        check_op_shapes(pte.source, dataclasses.replace(graph, ops=tuple(ops)), infer_from_op_definitions)


def test_the_op_shape_hook_compares_inferred_outputs_with_the_declared_ones(exported):
    """check_op_shapes is where the torch-free op definitions plug in; here with a stand-in rule that
    knows one op (its declared outputs, or those with one dimension changed)."""
    _, data = exported
    pte, program = fuzz.load(data)
    graph = program.graph
    index, op = next((i, op) for i, op in enumerate(graph.ops) if graph.tensor(op.outputs[0]).shape)
    declared = [(graph.tensor(o).dtype, tuple(graph.tensor(o).shape)) for o in op.outputs]

    def infer(wrong):
        def rule(name, args, graph_):
            assert graph_ is graph
            if name != op.name or list(args) != [graph.values[a] for a in op.args]:
                return None
            dtype, shape = declared[0]
            return [(dtype, shape[:-1] + (shape[-1] + 1,))] + declared[1:] if wrong else declared
        return rule

    check_op_shapes(pte.source, graph, None)
    check_op_shapes(pte.source, graph, infer(wrong=False))
    dtype, shape = declared[0]
    with pytest.raises(VerificationError, match=rf"delegate op {index} \({op.name}\) declares outputs "
                                                rf"{dtype.name}\[{', '.join(map(str, shape))}\].*; its inputs give "
                                                rf"{dtype.name}\[{', '.join(map(str, shape[:-1] + (shape[-1] + 1,)))}\]"):
        check_op_shapes(pte.source, graph, infer(wrong=True))


def test_an_eight_byte_file_and_a_missing_method_are_clean_errors(tmp_path, exported):
    path = _write(tmp_path, b"\0\0\0\0ET12", "tiny.pte")
    with pytest.raises(VktrainError, match=str(path)):
        TrainingRunner.from_pte(path, planner=plan_schedule)
    with pytest.raises(MissingMethodError, match="no execution plan 'backward'; it has \\['forward'\\]"):
        verify_training_program(PteFile.load(exported[0]), "backward")
    assert issubclass(MissingMethodError, PteFormatError) and issubclass(MissingMethodError, KeyError)


# --- accepted mutants train like the original (lavapipe) ---------------------------------------------

def test_accepted_mutants_train_exactly_like_the_original(exported, tmp_path, vk_device):
    path, data = exported
    pte, program = fuzz.load(data)
    meaning = fuzz.program_meaning(pte, program)
    accepted = []
    for mutant in fuzz.mutants(data, seed=3, resigned_share=0.0):
        if mutant.region != "blob constants" and fuzz.run_one(mutant, meaning).label == fuzz.ACCEPTED_UNCHANGED:
            accepted.append(mutant)
            if len(accepted) == 3:
                break
    rng = np.random.default_rng(0)
    token_ids, labels = rng.integers(0, VOCAB, (2, BATCH, SEQ))
    hparams = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)

    def losses(file):
        with TrainingRunner.from_pte(file, vk_device, planner=plan_schedule) as runner:
            return [runner.step(token_ids, labels, hparams) for _ in range(2)]

    reference = losses(path)
    for index, mutant in enumerate(accepted):
        assert losses(_write(tmp_path, mutant.data, f"accepted{index}.pte")) == reference, mutant.description

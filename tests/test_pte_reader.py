"""vktrain.serialization.pte reads .pte files produced by executorch exactly as executorch reads them back.

The reference is executorch's own `deserialize_pte_binary`; constant bytes are also checked against
the exported module's parameters.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vktrain.errors import VktrainError
from vktrain.serialization import pte

executorch = pytest.importorskip("executorch")
from executorch.exir import ExecutorchBackendConfig, to_edge, to_edge_transform_and_lower  # noqa: E402
from executorch.exir import schema as et_schema  # noqa: E402
from executorch.exir._serialize._program import _get_extended_header, deserialize_pte_binary  # noqa: E402
from executorch.exir.backend.test.op_partitioner_demo import AddMulPartitionerDemo  # noqa: E402
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult  # noqa: E402
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult  # noqa: E402
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass  # noqa: E402

from vktrain.serialization.blob import deserialize_blob, serialize_blob  # noqa: E402
from vktrain.serialization.graph import DType, OpCall, TensorValue, VkGraph  # noqa: E402

from _helpers import assert_import_loads_none  # noqa: E402


class TinyModel(torch.nn.Module):
    """Linear (constant weights), mm against a buffer, a mutated buffer, a reduction, two outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.arange(12.0).reshape(4, 3))
        self.register_buffer("calls", torch.tensor([41.0]))

    def forward(self, x, y):
        self.calls.add_(1.0)
        a = self.lin(x)
        b = torch.mm(x, self.table) + y
        return torch.relu(a) * b, a.sum() + self.calls


_ARGS = (torch.randn(2, 4), torch.randn(2, 3))


@pytest.fixture(scope="module")
def pte_files(tmp_path_factory):
    """name -> (path, model): portable-only, delegated (payload in a segment), delegated inline, and
    portable with the mutated buffer's initial value serialized (a mutable data segment)."""
    out = tmp_path_factory.mktemp("pte")
    model = TinyModel()
    programs = {
        "portable": to_edge(torch.export.export(model, _ARGS)).to_executorch(),
        "delegate_segment": to_edge_transform_and_lower(
            torch.export.export(model, _ARGS), partitioner=[AddMulPartitionerDemo()]).to_executorch(),
        "delegate_inline": to_edge_transform_and_lower(
            torch.export.export(model, _ARGS), partitioner=[AddMulPartitionerDemo()]).to_executorch(
            ExecutorchBackendConfig(extract_delegate_segments=False)),
        "initialized_state": to_edge(torch.export.export(model, _ARGS)).to_executorch(
            ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(["calls"])])),
    }
    files = {}
    for name, program in programs.items():
        path = out / f"{name}.pte"
        path.write_bytes(program.buffer)
        files[name] = (path, model)
    return files


def _value_matches(ours, theirs) -> None:
    """Field-by-field comparison of one of our EValues against executorch's dataclass."""
    val = theirs.val
    if isinstance(val, et_schema.Tensor):
        assert isinstance(ours, pte.Tensor)
        assert ours.scalar_type == int(val.scalar_type)
        assert ours.storage_offset == val.storage_offset
        assert list(ours.sizes) == list(val.sizes)
        assert list(ours.dim_order) == list(val.dim_order)
        assert ours.requires_grad == val.requires_grad
        assert ours.data_buffer_idx == val.data_buffer_idx
        assert ours.layout == val.layout
        assert ours.shape_dynamism == int(val.shape_dynamism)
        if val.allocation_info is None:
            assert ours.allocation_info is None
        else:
            assert ours.allocation_info.memory_id == val.allocation_info.memory_id
            assert ours.allocation_info.memory_offset == val.allocation_info.memory_offset
        if val.extra_tensor_info is None:
            assert ours.extra_tensor_info is None
        else:
            assert ours.extra_tensor_info.fully_qualified_name == val.extra_tensor_info.fully_qualified_name
            assert ours.extra_tensor_info.mutable_data_segments_idx == val.extra_tensor_info.mutable_data_segments_idx
    elif isinstance(val, et_schema.Int):
        assert ours == pte.Int(val.int_val)
    elif isinstance(val, et_schema.Bool):
        assert ours == pte.Bool(val.bool_val)
    elif isinstance(val, et_schema.Double):
        assert ours == pte.Double(float(val.double_val))
    elif isinstance(val, et_schema.String):
        assert ours == pte.String(val.string_val)
    elif isinstance(val, et_schema.IntList):
        assert ours == pte.IntList(tuple(val.items))
    elif isinstance(val, et_schema.DoubleList):
        assert ours == pte.DoubleList(tuple(val.items))
    elif isinstance(val, et_schema.BoolList):
        assert ours == pte.BoolList(tuple(val.items))
    elif isinstance(val, et_schema.TensorList):
        assert ours == pte.TensorList(tuple(val.items))
    elif isinstance(val, et_schema.OptionalTensorList):
        assert ours == pte.OptionalTensorList(tuple(val.items))
    elif isinstance(val, et_schema.Null):
        assert ours == pte.Null()
    else:
        raise AssertionError(f"unexpected executorch value {val!r}")


def _instruction_matches(ours, theirs) -> None:
    args = theirs.instr_args
    expected = {
        et_schema.KernelCall: lambda a: pte.KernelCall(a.op_index, tuple(a.args)),
        et_schema.DelegateCall: lambda a: pte.DelegateCall(a.delegate_index, tuple(a.args)),
        et_schema.MoveCall: lambda a: pte.MoveCall(a.move_from, a.move_to),
        et_schema.JumpFalseCall: lambda a: pte.JumpFalseCall(a.cond_value_index, a.destination_instruction),
        et_schema.FreeCall: lambda a: pte.FreeCall(a.value_index),
    }[type(args)](args)
    assert ours == expected


@pytest.mark.parametrize("name", ["portable", "delegate_segment", "delegate_inline", "initialized_state"])
def test_reader_agrees_with_executorch(pte_files, name):
    path, _ = pte_files[name]
    data = path.read_bytes()
    reference = deserialize_pte_binary(data).program
    ours = pte.PteFile.load(path)

    assert ours.program_version == reference.version
    assert ours.method_names == [plan.name for plan in reference.execution_plan]
    for ref_plan in reference.execution_plan:
        plan = ours.execution_plan(ref_plan.name)
        assert list(plan.inputs) == list(ref_plan.inputs)
        assert list(plan.outputs) == list(ref_plan.outputs)
        assert list(plan.non_const_buffer_sizes) == list(ref_plan.non_const_buffer_sizes)
        assert [(op.name, op.overload) for op in plan.operators] == \
            [(op.name, op.overload) for op in ref_plan.operators]
        assert len(plan.values) == len(ref_plan.values)
        for our_value, ref_value in zip(plan.values, ref_plan.values):
            _value_matches(our_value, ref_value)
        assert len(plan.chains) == len(ref_plan.chains)
        for chain, ref_chain in zip(plan.chains, ref_plan.chains):
            assert list(chain.inputs) == list(ref_chain.inputs)
            assert list(chain.outputs) == list(ref_chain.outputs)
            assert len(chain.instructions) == len(ref_chain.instructions)
            for instruction, ref_instruction in zip(chain.instructions, ref_chain.instructions):
                _instruction_matches(instruction, ref_instruction)
        assert len(plan.delegates) == len(ref_plan.delegates)
        for delegate, ref_delegate in zip(plan.delegates, ref_plan.delegates):
            assert delegate.id == ref_delegate.id
            assert delegate.compile_specs == tuple((s.key, bytes(s.value)) for s in ref_delegate.compile_specs)
            # deserialize_pte_binary moves segment payloads back inline: compare the bytes themselves.
            assert bytes(delegate.data) == bytes(reference.backend_delegate_data[ref_delegate.processed.index].data)
        if ref_plan.container_meta_type is not None:
            assert plan.container_meta == (ref_plan.container_meta_type.encoded_inp_str,
                                           ref_plan.container_meta_type.encoded_out_str)
        # Every constant tensor's bytes are a prefix of executorch's restored constant buffer.
        for value in plan.values:
            if isinstance(value, pte.Tensor) and value.is_constant:
                storage = reference.constant_buffer[value.data_buffer_idx].storage
                assert bytes(ours.tensor_data(value)) == bytes(storage[:value.nbytes])


def test_header_matches_executorchs_extended_header(pte_files):
    for path, _ in pte_files.values():
        data = path.read_bytes()
        reference = _get_extended_header(data)
        header = pte.PteFile.load(path).header
        assert header.file_identifier == b"ET12"
        assert header.has_extended_header == (reference is not None)
        if reference is not None:
            assert header.program_size == reference.program_size
            assert header.segment_base_offset == reference.segment_base_offset
            assert header.segment_data_size == reference.segment_data_size


def test_constants_are_the_module_parameters(pte_files):
    path, model = pte_files["portable"]
    ours = pte.PteFile.load(path)
    plan = ours.execution_plan()
    constants = [v for v in plan.values if isinstance(v, pte.Tensor) and v.is_constant]
    by_shape = {v.sizes: np.frombuffer(ours.tensor_data(v), np.float32).reshape(v.sizes) for v in constants}
    np.testing.assert_array_equal(by_shape[(3, 4)], model.lin.weight.detach().numpy())
    np.testing.assert_array_equal(by_shape[(3,)], model.lin.bias.detach().numpy())
    np.testing.assert_array_equal(by_shape[(4, 3)], model.table.numpy())
    # The mutated buffer is planned memory (allocation_info), not a constant.
    assert any(isinstance(v, pte.Tensor) and v.sizes == (1,) and v.allocation_info is not None for v in plan.values)


def test_initial_state_of_a_mutable_buffer_is_read_from_its_segment(pte_files):
    path, model = pte_files["initialized_state"]
    data = path.read_bytes()
    ours = pte.PteFile.from_bytes(data)
    reference = deserialize_pte_binary(data)
    assert len(ours.mutable_data_segments) == 1
    (state,) = [v for v in ours.execution_plan().values
                if isinstance(v, pte.Tensor) and v.allocation_info is not None and v.data_buffer_idx > 0]
    initial = ours.tensor_data(state)
    assert np.frombuffer(initial, np.float32).tolist() == [41.0]
    assert bytes(initial) == bytes(reference.mutable_data[state.data_buffer_idx].storage[:state.nbytes])
    # Without the pass the buffer is planned memory like any activation: nothing serialized.
    plain = pte.PteFile.load(pte_files["portable"][0])
    planned = [v for v in plain.execution_plan().values if isinstance(v, pte.Tensor) and v.allocation_info is not None]
    assert planned and all(plain.tensor_data(v) is None for v in planned)
    assert plain.mutable_data_segments == []


def test_delegates_expose_the_backend_blob(pte_files):
    segment_file = pte.PteFile.load(pte_files["delegate_segment"][0])
    inline_file = pte.PteFile.load(pte_files["delegate_inline"][0])
    (in_segment,), (inline,) = segment_file.delegates, inline_file.delegates
    assert in_segment.id == inline.id == "BackendWithCompilerDemo"
    assert in_segment.location == 1 and inline.location == 0
    assert bytes(in_segment.data) == bytes(inline.data)
    assert b"aten.mm.default" in bytes(in_segment.data)  # the demo backend's textual program
    # The delegate call is in the chain, and the portable ops that were lowered are gone.
    plan = segment_file.execution_plan()
    assert sum(isinstance(i, pte.DelegateCall) for i in plan.instructions) == 1
    names = {op.qualified_name for op in segment_file.operators}
    assert "aten::mm.out" not in names and "aten::relu.out" in names
    assert "aten::mm.out" in {op.qualified_name for op in pte.PteFile.load(pte_files["portable"][0]).operators}


def test_unknown_method_names_the_available_ones(pte_files):
    ours = pte.PteFile.load(pte_files["portable"][0])
    with pytest.raises(KeyError, match="forward"):
        ours.execution_plan("backward")


def test_truncated_files_raise_pte_format_error(pte_files, tmp_path):
    for name in ("portable", "delegate_segment"):
        data = pte_files[name][0].read_bytes()
        header = pte.PteFile.from_bytes(data).header
        cuts = {1, 7, 8, 20, 40, header.program_size // 2, header.program_size - 1, header.program_size,
                header.segment_base_offset + 1, len(data) - 1}
        for cut in sorted(c for c in cuts if 0 < c < len(data)):
            with pytest.raises(pte.PteFormatError):
                pte.PteFile.from_bytes(data[:cut])
    path = tmp_path / "truncated.pte"
    path.write_bytes(data[:len(data) - 1])
    with pytest.raises(pte.PteFormatError, match="truncated"):
        pte.PteFile.load(path)
    empty = tmp_path / "empty.pte"
    empty.write_bytes(b"")
    with pytest.raises(pte.PteFormatError, match="empty"):
        pte.PteFile.load(empty)


def test_every_refusal_names_the_file(pte_files, tmp_path):
    data = pte_files["delegate_segment"][0].read_bytes()
    for name, contents in (("header.pte", data[:36]),  # inside the 32-byte extended header
                           ("identifier.pte", data[:4] + b"ET99" + data[8:]),
                           ("program.pte", data[:pte.PteFile.from_bytes(data).header.program_size - 1])):
        path = tmp_path / name
        path.write_bytes(contents)
        with pytest.raises(pte.PteFormatError, match=f"^{path}: "):
            pte.PteFile.load(path)


def test_a_missing_method_is_a_clean_error_and_still_a_key_error(pte_files):
    ours = pte.PteFile.load(pte_files["portable"][0])
    with pytest.raises(pte.MissingMethodError, match=r"has no execution plan 'backward'; it has \['forward'\]") as caught:
        ours.execution_plan("backward")
    assert isinstance(caught.value, VktrainError) and isinstance(caught.value, KeyError)


def test_wrong_identifier_is_refused(pte_files):
    data = bytearray(pte_files["portable"][0].read_bytes())
    data[4:8] = b"ET99"
    with pytest.raises(pte.PteFormatError, match="ET99"):
        pte.PteFile.from_bytes(bytes(data))
    data[4:8] = b"PK\x03\x04"
    with pytest.raises(pte.PteFormatError, match="not a .pte"):
        pte.PteFile.from_bytes(bytes(data))


def test_random_corruption_raises_only_pte_format_error(pte_files):
    data = pte_files["delegate_segment"][0].read_bytes()
    program_size = pte.PteFile.from_bytes(data).header.program_size
    rng = np.random.default_rng(3)
    refused = 0
    for _ in range(200):
        corrupt = bytearray(data)
        position = int(rng.integers(8, program_size))
        corrupt[position] ^= int(rng.integers(1, 256))
        try:
            pte.PteFile.from_bytes(bytes(corrupt))
        except pte.PteFormatError:
            refused += 1
    assert refused > 0


def test_reader_never_imports_torch_or_executorch():
    assert_import_loads_none(["vktrain.serialization.pte"], forbidden=["torch", "executorch"])


# --- a vktrain blob carried through a real .pte ----------------------------------------------------

class VktrainBlobTestBackend(BackendDetails):
    """Test-only backend: its payload is a vktrain blob with the partition's parameters and op names."""

    @staticmethod
    def preprocess(edge_program, compile_specs):
        graph = VkGraph()
        ids = {}
        parameters = edge_program.graph_signature.inputs_to_parameters
        for node in edge_program.graph.nodes:
            if node.op == "placeholder" and node.name in parameters:
                array = edge_program.state_dict[parameters[node.name]].detach().numpy()
                ids[node.name] = graph.add_constant_tensor(array, name=parameters[node.name])
            elif node.op == "placeholder":
                shape = tuple(node.meta["val"].shape)
                ids[node.name] = graph.add_value(TensorValue(DType.FLOAT32, shape, name=node.name))
                graph.inputs.append(ids[node.name])
            elif node.op == "call_function":
                ids[node.name] = graph.add_value(TensorValue(DType.FLOAT32, tuple(node.meta["val"].shape)))
                args = [ids[a.name] for a in node.args if isinstance(a, torch.fx.Node)]
                graph.ops.append(OpCall(str(node.target), args, [ids[node.name]]))
            elif node.op == "output":
                graph.outputs = [ids[a.name] for a in node.args[0]]
        graph.metadata["source_model"] = "TwoLinears"
        return PreprocessResult(processed_bytes=serialize_blob(graph))


class _TagEverything(Partitioner):
    def __init__(self):
        self.delegation_spec = DelegationSpec(VktrainBlobTestBackend.__name__, [])

    def partition(self, program):
        from torch.export.graph_signature import InputKind
        parameter_names = {spec.arg.name for spec in program.graph_signature.input_specs
                           if spec.kind == InputKind.PARAMETER}
        for node in program.graph_module.graph.nodes:
            if node.op == "call_function" or node.name in parameter_names:
                node.meta["delegation_tag"] = "tag0"
        return PartitionResult(tagged_exported_program=program, partition_tags={"tag0": self.delegation_spec})


def test_a_vktrain_blob_survives_a_pte_round_trip_zero_copy_and_aligned(tmp_path):
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.first = torch.nn.Linear(8, 16, bias=False)
            self.second = torch.nn.Linear(16, 4, bias=False)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    model = TwoLinears()
    program = to_edge_transform_and_lower(torch.export.export(model, (torch.randn(2, 8),)),
                                          partitioner=[_TagEverything()]).to_executorch()
    path = tmp_path / "vktrain_blob.pte"
    path.write_bytes(program.buffer)

    ours = pte.PteFile.load(path)
    (delegate,) = ours.delegates
    assert delegate.id == "VktrainBlobTestBackend" and delegate.location == 1  # in a segment
    graph = deserialize_blob(delegate.data)
    assert graph.metadata == {"source_model": "TwoLinears"}
    by_name = {graph.values[i].name: i for i, v in enumerate(graph.values)
               if isinstance(v, TensorValue) and v.constant_id >= 0}
    first = graph.constant_array(by_name["first.weight"])
    np.testing.assert_array_equal(first, model.first.weight.detach().numpy())
    np.testing.assert_array_equal(graph.constant_array(by_name["second.weight"]), model.second.weight.detach().numpy())
    assert any("relu" in op.name for op in graph.ops)
    # The weights are views into the file's mmap, 16-byte aligned in the file itself.
    file_start = np.frombuffer(ours.buffer, np.uint8).ctypes.data
    for constant in graph.constants:
        address = np.frombuffer(constant, np.uint8).ctypes.data
        assert 0 < address - file_start < len(ours.buffer)
        assert (address - file_start) % 16 == 0

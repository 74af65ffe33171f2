"""VktrainVulkanBackend.preprocess: a partitioned edge program -> the delegate blob (vktrain.serialization).

The blob's op chain is a faithful list of the edge ops, in graph order, named by their registry key
(`aten.mm.default`, `vktrain.adamw.default`, ...); views/reshapes are ops too (the runtime implements
them as copies or aliases). Arguments are passed positionally in schema order, defaults filled in, so
the runtime never needs keyword handling. Non-tensor arguments become Int/Double/Bool/String/list
values; dtype, device, layout and memory_format arguments become strings (e.g. "float32").

Constants: parameters, frozen buffers and lifted constants read by the delegate. An argument the op
registry marks for prepacking (q4gsw weights) is stored as Q4GSW_W4X8 (vktrain.quant.pack_w4x8);
everything else as PLAIN. Identical bytes are stored once by the blob writer.

Mutable state: each mutated buffer is a non-constant tensor with a MutableState(state, update,
initial constant); an all-zero initial value (AdamW moments, step, lora_B) stores no constant and starts
zero-filled.

Memory: every intermediate tensor is planned (backend/memory_planning.py); inputs, state and constants
get their own allocations. Metadata records planned and unplanned bytes and the partitioner's refusals.
"""
from __future__ import annotations

import json
from typing import Any, Sequence, final

import numpy as np
import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from vktrain.partitioner.op_registry import W4X8, get_op_features, op_key
from vktrain.partitioner.partitioner import BACKEND_ID, refusals_from_compile_specs
from vktrain.quant import pack_w4x8
from vktrain.serialization import blob
from vktrain.serialization import graph as vk

from .memory_planning import LiveInterval, plan_memory

# Metadata keys this backend writes (besides vk.METADATA_PLANNED_MEMORY_BYTES).
METADATA_BACKEND = "backend"
METADATA_UNPLANNED_MEMORY_BYTES = "unplanned_memory_bytes"
METADATA_STATE_BYTES = "state_bytes"
METADATA_REFUSALS = "refusals"

_TORCH_TO_DTYPE = {
    torch.float32: vk.DType.FLOAT32, torch.float16: vk.DType.FLOAT16, torch.int32: vk.DType.INT32,
    torch.int64: vk.DType.INT64, torch.uint8: vk.DType.UINT8, torch.bool: vk.DType.BOOL, torch.int8: vk.DType.INT8,
}


def vk_dtype(dtype: torch.dtype) -> vk.DType:
    try:
        return _TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"tensor dtype {dtype} cannot be stored in a vktrain blob; supported: "
                         f"{sorted(str(d) for d in _TORCH_TO_DTYPE)}") from None


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


class _GraphBuilder:
    def __init__(self, program: ExportedProgram) -> None:
        self.program = program
        self.signature = program.graph_signature
        self.graph = vk.VkGraph()
        self.node_values: dict[Node, int | tuple[int, ...]] = {}
        self.constant_values: dict[tuple[Node, str], int] = {}  # (placeholder, layout) -> value id
        self.constant_nodes: set[Node] = set()
        self.state_nodes: dict[str, Node] = {}  # buffer FQN -> placeholder
        self.intermediates: dict[int, int] = {}  # value id -> index of the op that writes it
        self.last_use: dict[int, int] = {}

    # -- placeholders ---------------------------------------------------------------------------
    def _tensor_data(self, node: Node) -> tuple[str, torch.Tensor]:
        sig = self.signature
        name = (sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers.get(node.name)
                or sig.inputs_to_lifted_tensor_constants.get(node.name))
        if name in self.program.state_dict:
            return name, self.program.state_dict[name]
        if name in self.program.constants:
            return name, self.program.constants[name]
        raise KeyError(f"placeholder '{node.name}' ({name}) has no data in the program's state_dict or constants")

    def _add_placeholders(self) -> None:
        mutated = set(self.signature.buffers_to_mutate.values())
        user_inputs = set(self.signature.user_inputs)
        for node in self.program.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in user_inputs:
                value_id = self._new_tensor(node.meta["val"], node.name)
                self.graph.inputs.append(value_id)
                self.node_values[node] = value_id
            elif self.signature.inputs_to_buffers.get(node.name) in mutated:
                fqn = self.signature.inputs_to_buffers[node.name]
                value_id = self._new_tensor(node.meta["val"], fqn)
                self.node_values[node] = value_id
                self.state_nodes[fqn] = node
            elif (node.name in self.signature.inputs_to_parameters or node.name in self.signature.inputs_to_buffers
                  or node.name in self.signature.inputs_to_lifted_tensor_constants):
                self.constant_nodes.add(node)  # values created on first use, in the layout that use needs
            else:
                raise ValueError(f"placeholder '{node.name}' is neither a user input, a constant nor mutable state")

    def _constant(self, node: Node, layout: str | None = None, k: int | None = None) -> int:
        key = (node, layout or "PLAIN")
        if key in self.constant_values:
            return self.constant_values[key]
        fqn, data = self._tensor_data(node)
        array = _numpy(data)
        if layout == W4X8:
            array = pack_w4x8(array, k)
            value_id = self.graph.add_constant_tensor(array, vk.Layout.Q4GSW_W4X8, fqn)
        elif layout is None:
            value_id = self.graph.add_constant_tensor(array, vk.Layout.PLAIN, fqn)
        else:
            raise ValueError(f"unknown prepack layout {layout!r} for constant {fqn}")
        self.constant_values[key] = value_id
        return value_id

    def _new_tensor(self, fake: Any, name: str) -> int:
        if not isinstance(fake, torch.Tensor):
            raise ValueError(f"'{name}' is expected to be a tensor, its metadata is {type(fake).__name__}")
        shape = tuple(int(d) for d in fake.shape)
        return self.graph.add_value(vk.TensorValue(vk_dtype(fake.dtype), shape, name=name))

    # -- arguments ------------------------------------------------------------------------------
    def _use(self, value_id: int, op_index: int) -> int:
        self.last_use[value_id] = max(self.last_use.get(value_id, op_index), op_index)
        return value_id

    def _arg_value(self, arg: Any, op_index: int) -> int:
        if isinstance(arg, Node):
            if arg in self.constant_nodes:
                return self._use(self._constant(arg), op_index)
            value = self.node_values.get(arg)
            if not isinstance(value, int):
                raise ValueError(f"argument '{arg.name}' has no single tensor value (got {value!r})")
            return self._use(value, op_index)
        if arg is None:
            return self.graph.add_value(vk.NullValue())
        if isinstance(arg, bool):
            return self.graph.add_value(vk.BoolValue(arg))
        if isinstance(arg, int):
            return self.graph.add_value(vk.IntValue(arg))
        if isinstance(arg, float):
            return self.graph.add_value(vk.DoubleValue(arg))
        if isinstance(arg, str):
            return self.graph.add_value(vk.StringValue(arg))
        if isinstance(arg, torch.dtype):
            return self.graph.add_value(vk.StringValue(str(arg).removeprefix("torch.")))
        if isinstance(arg, (torch.device, torch.layout, torch.memory_format)):
            return self.graph.add_value(vk.StringValue(str(arg).removeprefix("torch.")))
        if isinstance(arg, (list, tuple)):
            if all(isinstance(a, bool) for a in arg) and arg:
                return self.graph.add_value(vk.BoolListValue(tuple(arg)))
            if all(isinstance(a, int) and not isinstance(a, bool) for a in arg):
                return self.graph.add_value(vk.IntListValue(tuple(arg)))
            if all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in arg):
                return self.graph.add_value(vk.DoubleListValue(tuple(arg)))
            return self.graph.add_value(vk.ValueListValue(tuple(self._arg_value(a, op_index) for a in arg)))
        raise ValueError(f"argument {arg!r} of type {type(arg).__name__} cannot be stored in a vktrain blob")

    @staticmethod
    def _schema_args(node: Node) -> list[tuple[str, Any]]:
        """(name, value) of every non-out argument in schema order, defaults filled in."""
        schema = node.target._schema
        result = []
        for i, argument in enumerate(schema.arguments):
            if argument.is_out:
                continue
            if i < len(node.args):
                value = node.args[i]
            elif argument.name in node.kwargs:
                value = node.kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                raise ValueError(f"{op_key(node.target)} ('{node.name}'): required argument '{argument.name}' is missing")
            result.append((argument.name, value))
        return result

    # -- ops ------------------------------------------------------------------------------------
    def _add_op(self, node: Node) -> None:
        key = op_key(node.target)
        if key == "getitem":
            source, index = node.args
            self.node_values[node] = self.node_values[source][index]
            return
        op_index = len(self.graph.ops)
        arguments = self._schema_args(node)
        features = get_op_features(key)
        prepacked = features.prepacked_args() if features is not None else {}
        arg_ids = []
        for i, (name, value) in enumerate(arguments):
            if i in prepacked:
                if value not in self.constant_nodes:
                    raise ValueError(f"{key} ('{node.name}'): argument '{name}' must be a constant to be prepacked "
                                     f"as {prepacked[i]}")
                arg_ids.append(self._use(self._constant(value, prepacked[i], self._q4gsw_k(arguments)), op_index))
            else:
                arg_ids.append(self._arg_value(value, op_index))
        fake = node.meta["val"]
        if isinstance(fake, (tuple, list)):
            outputs = tuple(self._new_tensor(f, f"{node.name}[{i}]") for i, f in enumerate(fake))
            self.node_values[node] = outputs
        else:
            outputs = (self._new_tensor(fake, node.name),)
            self.node_values[node] = outputs[0]
        for value_id in outputs:
            self.intermediates[value_id] = op_index
        self.graph.ops.append(vk.OpCall(key, tuple(arg_ids), outputs))

    @staticmethod
    def _q4gsw_k(arguments: list[tuple[str, Any]]) -> int:
        """K of a q4gsw op = scales.shape[0] * group_size (CONTRACTS.md)."""
        named = dict(arguments)
        return int(named["scales"].meta["val"].shape[0]) * int(named["group_size"])

    # -- outputs --------------------------------------------------------------------------------
    def _add_outputs(self, output_node: Node) -> None:
        results = output_node.args[0]
        specs = self.signature.output_specs
        if len(results) != len(specs):
            raise ValueError(f"output node has {len(results)} values, the signature lists {len(specs)}")
        end = len(self.graph.ops)
        for result, spec in zip(results, specs):
            value_id = self._arg_value(result, end)
            if spec.kind == OutputKind.BUFFER_MUTATION:
                state_node = self.state_nodes[spec.target]
                _, initial = self._tensor_data(state_node)
                initial_array = _numpy(initial)
                initial_constant = -1 if not np.any(initial_array) else self.graph.add_constant(initial_array)
                self.graph.mutable_state.append(
                    vk.MutableState(self.node_values[state_node], value_id, initial_constant))
            elif spec.kind == OutputKind.USER_OUTPUT:
                self.graph.outputs.append(value_id)
            else:
                raise ValueError(f"delegate output of kind {spec.kind} ({spec.target}) is not supported")

    # -- memory ---------------------------------------------------------------------------------
    def _plan_memory(self) -> tuple[int, int]:
        intervals = []
        for value_id, first in self.intermediates.items():
            tensor = self.graph.values[value_id]
            intervals.append(LiveInterval(value_id, tensor.nbytes, first, self.last_use.get(value_id, first)))
        plan = plan_memory(intervals)
        for value_id, object_id in plan.assignment.items():
            tensor = self.graph.values[value_id]
            self.graph.values[value_id] = vk.TensorValue(tensor.dtype, tensor.shape, tensor.layout,
                                                         tensor.constant_id, object_id, tensor.name)
        self.graph.memory_objects = [vk.MemoryObject(i, size) for i, size in enumerate(plan.object_sizes)]
        return plan.planned_bytes, sum(t.nbytes for t in intervals)

    def build(self) -> vk.VkGraph:
        self._add_placeholders()
        for node in self.program.graph.nodes:
            if node.op == "call_function":
                self._add_op(node)
            elif node.op == "output":
                self._add_outputs(node)
            elif node.op != "placeholder":
                raise ValueError(f"node '{node.name}' of kind {node.op} cannot be lowered")
        planned, unplanned = self._plan_memory()
        state_bytes = sum(self.graph.values[s.state_id].nbytes for s in self.graph.mutable_state)
        self.graph.metadata.update({
            METADATA_BACKEND: BACKEND_ID,
            vk.METADATA_PLANNED_MEMORY_BYTES: str(planned),
            METADATA_UNPLANNED_MEMORY_BYTES: str(unplanned),
            METADATA_STATE_BYTES: str(state_bytes),
        })
        return self.graph


def build_vk_graph(program: ExportedProgram, compile_specs: Sequence[CompileSpec] = ()) -> vk.VkGraph:
    """The VkGraph of one partitioned (delegated) edge program."""
    graph = _GraphBuilder(program).build()
    refusals = refusals_from_compile_specs(compile_specs)
    graph.metadata[METADATA_REFUSALS] = json.dumps([r.__dict__ for r in refusals])
    graph.validate()
    return graph


@final
class VktrainVulkanBackend(BackendDetails):
    """ExecuTorch backend id "VktrainVulkanBackend" (executorch finds it by this class name)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        return PreprocessResult(processed_bytes=blob.serialize_blob(build_vk_graph(edge_program, compile_specs)))


assert VktrainVulkanBackend.__name__ == BACKEND_ID

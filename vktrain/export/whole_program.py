"""Lower a program the op registry takes whole into ONE delegate, without ExecuTorch's to_edge.

Why: to_edge retraces the whole program (its decompositions, then about ten ExportPass passes, each a
fake-tensor re-execution) and to_executorch re-executes every delegate's original program in fake mode
once per pass. For a 30-layer training step that is minutes of work whose result is known in advance:
when every node is supported, the partition is the whole graph. So this route

1. checks every node against the registry (the partitioner's per-node check) and the program's
   signature (only user inputs, parameters, buffers and lifted constants in; user outputs and buffer
   mutations out); any refusal leaves the program to the standard route (to_edge, partition, fallback);
2. runs the backend's preprocess on the exported ATen program itself (op_key reads ATen view ops as
   their `_copy` form, which is all the edge dialect would have changed for these programs);
3. builds the outer edge program by hand: the user inputs, one executorch_call_delegate, the user
   outputs; to_executorch then emits a standard .pte (the same structure the standard route gives).

The LoweredBackendModule's original_module is a signature stub (NaN / zero outputs of the right shapes
and dtypes), because to_executorch re-executes it in every pass; the real program stays reachable as
`lowered.meta["source_program"]`, and the delegate blob holds everything the runtime needs.
"""
from __future__ import annotations

import operator
from typing import Mapping

import torch
import torch.utils._pytree as pytree
from executorch.exir import EdgeCompileConfig, EdgeProgramManager
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.lowered_backend_module import LoweredBackendModule
from executorch.exir.verification.verifier import EXIREdgeDialectVerifier
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                          TensorArgument)

from vktrain.backend.preprocess import VktrainVulkanBackend
from vktrain.contract import BACKEND_ID
from vktrain.partitioner import VktrainPartitioner
from vktrain.partitioner.op_registry import first_refusal
from vktrain.partitioner.partitioner import REFUSALS_SPEC_KEY

_INPUT_KINDS = (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_OUTPUT_KINDS = (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)
_COMPILE_CONFIG = EdgeCompileConfig(_check_ir_validity=False)
LOWERED_NAME = "lowered_module_0"


def takes_whole(program: ExportedProgram, partitioner: VktrainPartitioner) -> bool:
    """True when every node of `program` is accepted (and none blocklisted) and its signature is one the
    delegate can own entirely. Records the outcome on the partitioner as partition() would."""
    signature = program.graph_signature
    if any(spec.kind not in _INPUT_KINDS for spec in signature.input_specs) or \
            any(spec.kind not in _OUTPUT_KINDS for spec in signature.output_specs):
        return False
    if any(node.op not in ("placeholder", "call_function", "output") for node in program.graph.nodes) or \
            first_refusal(program, partitioner.operator_blocklist) is not None:
        return False
    partitioner.refusals = []
    partitioner.num_partitions = 1
    return True


def _fake_user_outputs(program: ExportedProgram) -> list:
    values = program.graph.output_node().args[0]
    return [value.meta["val"] for value, spec in zip(values, program.graph_signature.output_specs)
            if spec.kind == OutputKind.USER_OUTPUT]


def _user_input_placeholders(program: ExportedProgram) -> list[torch.fx.Node]:
    user_inputs = set(program.graph_signature.user_inputs)
    return [node for node in program.graph.nodes if node.op == "placeholder" and node.name in user_inputs]


def _program(graph: torch.fx.Graph, root: torch.nn.Module, input_names: list[str], output_names: list[str],
             source: ExportedProgram, out_spec) -> ExportedProgram:
    """An ExportedProgram of user inputs -> user outputs over `graph` (no state), for the edge dialect."""
    module = torch.fx.GraphModule(root, graph)
    signature = ExportGraphSignature(
        [InputSpec(InputKind.USER_INPUT, TensorArgument(name), None) for name in input_names],
        [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name), None) for name in output_names])
    entry = source.module_call_graph[0].signature
    call_graph = [ModuleCallEntry("", ModuleCallSignature(
        inputs=[TensorArgument(name) for name in input_names], outputs=[TensorArgument(name) for name in output_names],
        in_spec=entry.in_spec, out_spec=out_spec))]
    return ExportedProgram(root=module, graph=module.graph, graph_signature=signature, state_dict={},
                           range_constraints={}, module_call_graph=call_graph, example_inputs=None, constants={},
                           verifiers=[EXIREdgeDialectVerifier(edge_compile_config=_COMPILE_CONFIG, class_only=True)])


def _signature_stub(program: ExportedProgram) -> ExportedProgram:
    """user inputs -> outputs of the program's user-output shapes and dtypes (NaN, or 0 for integers)."""
    graph = torch.fx.Graph()
    inputs = []
    for source in _user_input_placeholders(program):
        node = graph.placeholder(source.name)
        node.meta["val"] = source.meta["val"]
        inputs.append(node.name)
    outputs = []
    for fake in _fake_user_outputs(program):
        fill = float("nan") if fake.dtype.is_floating_point else 0
        node = graph.call_function(torch.ops.aten.full.default, (list(fake.shape), fill), {"dtype": fake.dtype})
        node.meta["val"] = fake
        outputs.append(node)
    graph.output(tuple(outputs))
    return _program(graph, torch.nn.Module(), inputs, [node.name for node in outputs], program,
                    pytree.tree_structure(tuple(range(len(outputs)))))


def _outer_program(program: ExportedProgram, lowered: LoweredBackendModule) -> ExportedProgram:
    """user inputs -> executorch_call_delegate(lowered, inputs...) -> user outputs, with the program's own
    input names and pytree specs (the .pte method takes and returns what the program did)."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    setattr(root, LOWERED_NAME, lowered)
    inputs = []
    for source in _user_input_placeholders(program):
        node = graph.placeholder(source.name)
        node.meta["val"] = source.meta["val"]
        inputs.append(node)
    fakes = _fake_user_outputs(program)
    call = graph.call_function(executorch_call_delegate, (graph.get_attr(LOWERED_NAME), *inputs))
    call.meta["val"] = tuple(fakes)
    outputs = []
    for i, fake in enumerate(fakes):
        node = graph.call_function(operator.getitem, (call, i))
        node.meta["val"] = fake
        outputs.append(node)
    graph.output(tuple(outputs))
    return _program(graph, root, [node.name for node in inputs], [node.name for node in outputs], program,
                    program.module_call_graph[0].signature.out_spec)


def lower_whole(program: ExportedProgram, compile_specs: list[CompileSpec]) -> ExportedProgram:
    """The outer edge program of `program` delegated whole (check takes_whole first)."""
    specs = list(compile_specs) + [CompileSpec(REFUSALS_SPEC_KEY, b"[]")]
    result = VktrainVulkanBackend.preprocess(program, specs)
    lowered = LoweredBackendModule(_signature_stub(program), BACKEND_ID, result.processed_bytes, specs,
                                   result.data_store_output)
    lowered.meta = {"source_program": program}
    return _outer_program(program, lowered)


def whole_program_manager(programs: Mapping[str, ExportedProgram],
                          partitioners: Mapping[str, VktrainPartitioner]) -> EdgeProgramManager | None:
    """The EdgeProgramManager of the methods, each delegated whole, or None when some method is not taken
    whole (the caller then lowers every method the standard way)."""
    if not all(takes_whole(program, partitioners[name]) for name, program in programs.items()):
        return None
    return EdgeProgramManager({name: lower_whole(program, partitioners[name].compile_specs)
                               for name, program in programs.items()}, compile_config=_COMPILE_CONFIG)

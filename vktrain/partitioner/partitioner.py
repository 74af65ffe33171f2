"""VktrainPartitioner: an ExecuTorch Partitioner that tags every node the op registry accepts.

Built on torch.fx's CapabilityBasedPartitioner (largest connected groups of accepted nodes). Constants
and mutated buffers used only inside a partition are tagged into it (executorch's tag_constant_data /
tag_mutated_buffer), so frozen weights and all training state (LoRA tensors, AdamW moments, step) live
in the delegate blob. Refused nodes stay outside; `partitioner.refusals` lists them with the reason, and
the same list travels to the backend in the compile spec `REFUSALS_SPEC_KEY` (JSON) so the blob records
it for `vktrain inspect`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from vktrain.contract import BACKEND_ID

from .op_registry import PRESERVED_OPS, node_refusal, op_key

REFUSALS_SPEC_KEY = "vktrain_refusals"


@dataclass(frozen=True)
class Refusal:
    node: str     # fx node name
    op: str       # registry key of the op
    reason: str


class _RegistrySupport(OperatorSupportBase):
    """Ask the op registry about each node; remember why refused nodes were refused."""

    def __init__(self, program: ExportedProgram, blocklist: frozenset[str]) -> None:
        super().__init__()
        self.program = program
        self.blocklist = blocklist
        self.refusals: dict[str, Refusal] = {}

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        reason = node_refusal(node, self.program, self.blocklist)
        if reason is not None:
            self.refusals[node.name] = Refusal(node.name, op_key(node.target), reason)
            return False
        return True


class VktrainPartitioner(Partitioner):
    """Partition an edge program for the vktrain Vulkan backend.

    operator_blocklist: op keys (e.g. "aten.relu.default") to keep out of the delegate regardless of the
    registry. compile_specs: extra CompileSpecs passed to preprocess.
    """

    def __init__(self, operator_blocklist: Iterable[str] = (), compile_specs: Iterable[CompileSpec] = ()) -> None:
        super().__init__()
        self.operator_blocklist = frozenset(operator_blocklist)
        self.compile_specs = list(compile_specs)
        self.refusals: list[Refusal] = []
        self.num_partitions = 0

    def ops_to_not_decompose(self, ep: ExportedProgram):
        """Keep PRESERVED_OPS whole through to_edge, but only where this partitioner will take the node
        (a refused node must decompose into core ATen, which ExecuTorch's CPU kernels cover).

        When every such node of `ep` is taken, no per-node check is returned: ExecuTorch then preserves
        the ops with one decomposition table (skipped when nothing in the graph decomposes), instead of
        its per-node path, which retraces the whole program twice more (minutes for a 30-layer step)."""
        def keep(node: torch.fx.Node) -> bool:
            return node_refusal(node, blocklist=self.operator_blocklist) is None
        preserved = [node for node in ep.graph.nodes if node.op == "call_function" and node.target in PRESERVED_OPS]
        return list(PRESERVED_OPS), (None if all(keep(node) for node in preserved) else keep)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        support = _RegistrySupport(exported_program, self.operator_blocklist)
        capability = CapabilityBasedPartitioner(
            exported_program.graph_module, support, allows_single_node_partition=True)
        partitions = capability.propose_partitions()
        # A getitem of a refused producer is refused only as a consequence; keep the root causes.
        self.refusals = [r for r in support.refusals.values()
                         if not (r.op == "getitem" and _producer_name(exported_program, r.node) in support.refusals)]
        self.num_partitions = len(partitions)

        refusal_spec = CompileSpec(REFUSALS_SPEC_KEY, json.dumps([asdict(r) for r in self.refusals]).encode())
        delegation_spec = DelegationSpec(BACKEND_ID, self.compile_specs + [refusal_spec])
        partition_tags: dict[str, DelegationSpec] = {}
        for partition in partitions:
            tag = f"vktrain_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            partition_tags[tag] = delegation_spec
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=partition_tags)


def _producer_name(program: ExportedProgram, getitem_name: str) -> str | None:
    for node in program.graph.nodes:
        if node.name == getitem_name:
            source = node.args[0]
            return source.name if isinstance(source, torch.fx.Node) else None
    return None


def refusals_from_compile_specs(compile_specs: Iterable[CompileSpec]) -> list[Refusal]:
    for spec in compile_specs:
        if spec.key == REFUSALS_SPEC_KEY:
            return [Refusal(**r) for r in json.loads(bytes(spec.value).decode())]
    return []

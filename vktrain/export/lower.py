"""Lower an ExportedProgram to a .pte (ExecuTorch program bytes) through the vktrain partitioner."""
from __future__ import annotations

import copy
from typing import Mapping, Optional

from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from torch.export import ExportedProgram

import vktrain.backend.preprocess  # noqa: F401  (registers VktrainVulkanBackend with ExecuTorch)
from vktrain.partitioner import VktrainPartitioner

from vktrain.runtime.program.summary import read_pte
from vktrain.errors import VktrainError

# Buffer-name patterns whose initial contents must survive when left outside the delegate
# (by default ExecuTorch leaves mutable buffers uninitialised). Covers all training state.
_STATE_PATTERNS = ["model.", "optimizer."]


class LoweringError(VktrainError, RuntimeError):
    """Lowering lost part of the program's meaning (e.g. a mutable state update)."""


def _refusal_summary(partitioner: VktrainPartitioner) -> str:
    """One line per refused op: how many nodes, and the first node's reason."""
    by_op: dict[str, list[str]] = {}
    for refusal in partitioner.refusals:
        by_op.setdefault(refusal.op, []).append(refusal.reason)
    if not by_op:
        return "no node was refused"
    return "refused: " + "; ".join(f"{op} x{len(reasons)} ({reasons[0]})" for op, reasons in by_op.items())


def _delegated_mutations(edge_program: ExportedProgram) -> set[str]:
    names = set()
    for node in edge_program.graph.nodes:
        if node.op == "get_attr":
            lowered = getattr(edge_program.graph_module, node.target)
            original = getattr(lowered, "original_module", None)
            if original is not None:
                names |= set(original.graph_signature.buffers_to_mutate.values())
    return names


def to_edge_lowered(program: ExportedProgram, partitioner: VktrainPartitioner | None = None):
    """The EdgeProgramManager after partitioning + preprocess. The program is deep-copied first, since
    lowering rewrites it in place. Raises LoweringError if a mutated buffer of `program` is updated
    neither by a delegate nor by the remaining top-level program."""
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    expected = set(program.graph_signature.buffers_to_mutate.values())
    try:
        edge = to_edge_transform_and_lower(
            copy.deepcopy(program),
            partitioner=[partitioner],
            # vktrain's custom ops are not core ATen; their schemas are still checked by the edge dialect.
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
    except RuntimeError as e:
        # ExecuTorch's own errors here (typically state split across partitions) do not say which
        # refusal caused them; add that.
        raise LoweringError(f"executorch failed to lower the partitioned program ({e}); "
                            f"{_refusal_summary(partitioner)}") from e
    lowered = edge.exported_program()
    kept = set(lowered.graph_signature.buffers_to_mutate.values()) | _delegated_mutations(lowered)
    lost = sorted(expected - kept)
    if lost:
        raise LoweringError(f"lowering dropped the update of {len(lost)} mutable buffer(s): {lost}; "
                            f"{_refusal_summary(partitioner)}")
    return edge


def lower_to_pte(program: ExportedProgram, partitioner: VktrainPartitioner | None = None,
                 named_data: Optional[Mapping[str, bytes]] = None) -> bytes:
    """Partition, preprocess into the vktrain delegate, and serialize the whole program as .pte bytes.
    `named_data` (key -> bytes, e.g. the model's tokenizer: keys in vktrain.contract) goes into the
    Program's named data, one segment each, stored once.

    Raises LoweringError when a delegate would silently vanish: ExecuTorch removes a delegate call whose
    outputs are unused, even when the delegate updates state (e.g. an optimizer partition split off from
    the loss because a node in between was refused)."""
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    edge = to_edge_lowered(program, partitioner)
    graph = edge.exported_program().graph
    n_delegates = sum(1 for n in graph.nodes if n.op == "call_function" and "executorch_call_delegate" in str(n.target))
    for key, data in (named_data or {}).items():
        edge._named_data_store.add_named_data(key, bytes(data))  # executorch has no public setter (1.5)
    buffer = edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(_STATE_PATTERNS)])).buffer
    emitted = read_pte(buffer).delegate_calls
    if emitted != n_delegates:
        raise LoweringError(f"{n_delegates - emitted} of {n_delegates} delegate(s) were dropped from the program "
                            f"(their outputs are unused, so their state updates would be lost); "
                            f"{_refusal_summary(partitioner)}")
    return buffer

"""Lower an ExportedProgram to a .pte (ExecuTorch program bytes) through the vktrain partitioner."""
from __future__ import annotations

import copy
from typing import Callable, Mapping, Optional

from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from torch.export import ExportedProgram

from vktrain.backend.preprocess import NAMED_DATA_MIN_BYTES_SPEC_KEY, named_data_spec  # (registers the backend)
from vktrain.partitioner import VktrainPartitioner

from vktrain.serialization.pte import DelegateCall, PteFile
from .whole_program import whole_program_manager
from vktrain.contract import BACKEND_ID, TRAIN_METHOD
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
    """The EdgeProgramManager of one program (method "forward") after partitioning + preprocess; see
    to_edge_lowered_methods."""
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    return to_edge_lowered_methods({TRAIN_METHOD: program}, {TRAIN_METHOD: partitioner})


def _partitioners_for(programs: dict[str, ExportedProgram],
                      partitioners: dict[str, VktrainPartitioner] | None) -> dict[str, VktrainPartitioner]:
    """One partitioner per method (a partitioner's refusals are those of the last program it partitioned).
    With several methods, each passes named_data_spec() to preprocess: their shared constants are stored once."""
    partitioners = dict(partitioners or {})
    unknown = sorted(set(partitioners) - set(programs))
    if unknown:
        raise ValueError(f"partitioners given for method(s) {unknown} that are not among {sorted(programs)}")
    chosen = {name: partitioners.get(name) or VktrainPartitioner() for name in programs}
    if len(programs) > 1:
        for partitioner in chosen.values():
            if not any(spec.key == NAMED_DATA_MIN_BYTES_SPEC_KEY for spec in partitioner.compile_specs):
                partitioner.compile_specs.append(named_data_spec())
    return chosen


def to_edge_lowered_methods(programs: dict[str, ExportedProgram],
                            partitioners: dict[str, VktrainPartitioner] | None = None):
    """The EdgeProgramManager of several methods (name -> program) after partitioning + preprocess. The
    programs are deep-copied first, since lowering rewrites them in place. Raises LoweringError if a
    mutated buffer of a program is updated neither by a delegate nor by the remaining top-level program."""
    partitioners = _partitioners_for(programs, partitioners)
    try:
        edge = to_edge_transform_and_lower(
            {name: copy.deepcopy(program) for name, program in programs.items()},
            partitioner={name: [partitioner] for name, partitioner in partitioners.items()},
            # vktrain's custom ops are not core ATen; their schemas are still checked by the edge dialect.
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
    except RuntimeError as e:
        # ExecuTorch's own errors here (typically state split across partitions) do not say which
        # refusal caused them; add that.
        raise LoweringError(f"executorch failed to lower the partitioned program ({e}); "
                            f"{_refusal_summaries(partitioners)}") from e
    for name, program in programs.items():
        expected = set(program.graph_signature.buffers_to_mutate.values())
        lowered = edge.exported_program(name)
        kept = set(lowered.graph_signature.buffers_to_mutate.values()) | _delegated_mutations(lowered)
        lost = sorted(expected - kept)
        if lost:
            raise LoweringError(f"lowering dropped the update of {len(lost)} mutable buffer(s) of method {name!r}: "
                                f"{lost}; {_refusal_summary(partitioners[name])}")
    return edge


def _refusal_summaries(partitioners: dict[str, VktrainPartitioner]) -> str:
    if len(partitioners) == 1:
        return _refusal_summary(next(iter(partitioners.values())))
    return "; ".join(f"method {name!r}: {_refusal_summary(p)}" for name, p in partitioners.items())


def _count_delegate_calls(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and "executorch_call_delegate" in str(n.target))


def lower_to_pte(program: ExportedProgram, partitioner: VktrainPartitioner | None = None,
                 named_data: Optional[Mapping[str, bytes]] = None, rewrite_blobs: Optional["BlobRewriter"] = None
                 ) -> bytes:
    """Partition, preprocess into the vktrain delegate, and serialize the whole program (method "forward")
    as .pte bytes; see lower_methods_to_pte."""
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    return lower_methods_to_pte({TRAIN_METHOD: program}, {TRAIN_METHOD: partitioner}, named_data, rewrite_blobs)


# (method -> its vktrain delegate blobs in graph order, the delegates' named data key -> bytes) -> the blobs to
# write instead, same shape: how `vktrain export --target` embeds schedules (vktrain/train/targets.py).
BlobRewriter = Callable[[dict[str, list[bytes]], Mapping[str, bytes]], dict[str, list[bytes]]]


def _vktrain_delegates(edge, methods) -> dict[str, list]:
    """Method -> its vktrain LoweredBackendModules, in graph order."""
    found = {}
    for name in methods:
        module = edge.exported_program(name).graph_module
        found[name] = [getattr(module, node.target) for node in module.graph.nodes if node.op == "get_attr"
                       and getattr(getattr(module, node.target), "backend_id", None) == BACKEND_ID]
    return found


def _rewrite_blobs(edge, methods, rewrite: BlobRewriter) -> None:
    """Replace the vktrain delegates' blobs by what `rewrite` makes of them, before they are emitted."""
    delegates = _vktrain_delegates(edge, methods)
    named = {}
    for lowered in (lowered for group in delegates.values() for lowered in group):
        output = lowered.named_data_store_output
        for key, entry in (output.pte_data.items() if output is not None else ()):
            data = output.buffers[entry.buffer_index]
            named[key] = data if isinstance(data, bytes) else data.to_bytes()
    rewritten = rewrite({name: [lowered.processed_bytes for lowered in group] for name, group in delegates.items()},
                        named)
    for name, group in delegates.items():
        for lowered, blob in zip(group, rewritten[name], strict=True):
            lowered._processed_bytes = blob  # executorch 1.5 has no setter; the emitter reads this


def lower_methods_to_pte(programs: dict[str, ExportedProgram],
                         partitioners: dict[str, VktrainPartitioner] | None = None,
                         named_data: Optional[Mapping[str, bytes]] = None,
                         rewrite_blobs: Optional[BlobRewriter] = None) -> bytes:
    """Partition, preprocess into the vktrain delegate, and serialize several methods (name -> program) as
    ONE .pte. Constants the methods share are stored once (the backend puts them in ExecuTorch's named
    data, keyed by content; see vktrain/backend/preprocess.py). `named_data` (key -> bytes, e.g. the
    model's tokenizer: keys in vktrain.contract) goes into the Program's named data too, one segment each.
    `rewrite_blobs` (BlobRewriter) replaces the vktrain delegate blobs before the program is emitted.

    Raises LoweringError when a delegate would silently vanish: ExecuTorch removes a delegate call whose
    outputs are unused, even when the delegate updates state (e.g. an optimizer partition split off from
    the loss because a node in between was refused)."""
    partitioners = _partitioners_for(programs, partitioners)
    # Programs the registry takes whole skip to_edge (minutes for a 30-layer step); see whole_program.py.
    edge = whole_program_manager(programs, partitioners) or to_edge_lowered_methods(programs, partitioners)
    n_delegates = sum(_count_delegate_calls(edge.exported_program(name).graph) for name in programs)
    if rewrite_blobs is not None:
        _rewrite_blobs(edge, programs, rewrite_blobs)
    for key, data in (named_data or {}).items():
        edge._named_data_store.add_named_data(key, bytes(data))  # executorch has no public setter (1.5)
    buffer = edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(_STATE_PATTERNS)])).buffer
    emitted = sum(isinstance(instruction, DelegateCall) for plan in PteFile.from_bytes(buffer).execution_plans
                  for instruction in plan.instructions)
    if emitted != n_delegates:
        raise LoweringError(f"{n_delegates - emitted} of {n_delegates} delegate(s) were dropped from the program "
                            f"(their outputs are unused, so their state updates would be lost); "
                            f"{_refusal_summaries(partitioners)}")
    return buffer

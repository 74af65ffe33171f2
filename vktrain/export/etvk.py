"""Programs written with upstream ExecuTorch's et_vk training ops, lowered through vktrain.

A training step written with `torch.ops.et_vk.*` (forward through et_vk.linear_q4gsw, et_vk.fused_ce, the
backward with et_vk.linear_q4gsw_backward / et_vk.linear_dW, the update with et_vk.adamw_step on the
module's buffers) exports with `torch.export.export` as it is: adamw_step writes its buffers in place,
which torch.export keeps (its schema returns aliases, so the program cannot be functionalised, nor go
through to_edge, while the call is in it). `map_etvk_calls` rewrites every et_vk call into its vktrain
call first (vktrain/partitioner/etvk_rewrite.py: the Python floats it was traced with become constants,
adamw_step's writes become `copy_`s of vktrain.adamw's outputs into the buffers), then decomposes, which
turns the copies into the program's buffer mutations. `lower_etvk_program` lowers the result like any
vktrain step, into one delegate whose metadata lists the baked scalars (`vktrain inspect` shows them).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from torch.export import ExportedProgram

from vktrain.partitioner import VktrainPartitioner
from vktrain.partitioner.etvk_rewrite import EtvkMappingError, baked_scalars_spec, rewrite_etvk_calls

from .lower import lower_to_pte
from .training import in_registry_ops


@dataclass
class EtvkProgram:
    program: ExportedProgram   # the et_vk calls replaced by vktrain calls, decomposed into the registry's ops
    baked: list[dict]          # per et_vk call with Python floats: {"node", "op", "scalars": {argument: value}}


def map_etvk_calls(program: ExportedProgram) -> EtvkProgram:
    """A copy of `program` (torch.export's output, with et_vk calls) in vktrain ops only, decomposed into
    the ops the registry takes. Raises EtvkMappingError naming the first et_vk call that has no mapping."""
    program = copy.deepcopy(program)
    baked = rewrite_etvk_calls(program, in_place_writes=True)
    return EtvkProgram(in_registry_ops(program), baked)


def lower_etvk_program(program: ExportedProgram, partitioner: VktrainPartitioner | None = None) -> bytes:
    """The .pte of a program with et_vk calls: map_etvk_calls, then vktrain's lowering; the blob's metadata
    lists the baked scalars (contract.METADATA_BAKED_SCALARS)."""
    mapped = map_etvk_calls(program)
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    partitioner.compile_specs.append(baked_scalars_spec(mapped.baked))
    return lower_to_pte(mapped.program, partitioner)


__all__ = ["EtvkMappingError", "EtvkProgram", "lower_etvk_program", "map_etvk_calls"]

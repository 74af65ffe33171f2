"""Programs written with upstream ExecuTorch's et_vk training ops, lowered through vktrain.

A training step written with `torch.ops.et_vk.*` (forward through et_vk.linear_q4gsw, et_vk.fused_ce, the
backward with et_vk.linear_q4gsw_backward / et_vk.linear_dW, the update with et_vk.adamw_step on the
module's buffers) exports with `torch.export.export` as it is: adamw_step writes its buffers in place,
which torch.export keeps (its schema returns aliases, so the program cannot be functionalised while the
call is in it). `map_etvk_calls` rewrites every et_vk call into the vktrain call its record in
vktrain/partitioner/etvk_ops.py describes: the Python floats it was traced with become constants of the
program, repacked weights become constants in vktrain's flat layout, and adamw_step's in-place writes
become `copy_`s of vktrain.adamw's outputs into the buffers, which decomposition turns into the program's
buffer mutations. `lower_etvk_program` then lowers the step like any other vktrain program, into one
delegate whose metadata lists the baked scalars (`vktrain inspect` reports them).
"""
from __future__ import annotations

import copy
import json
import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx import Node

import vktrain.ops  # noqa: F401 (torch.ops.vktrain)
from vktrain.backend.preprocess import metadata_spec
from vktrain.contract import METADATA_BAKED_SCALARS
from vktrain.errors import VktrainError
from vktrain.opdefs import Refusal
from vktrain.partitioner import VktrainPartitioner
from vktrain.partitioner.etvk_ops import ETVK_BY_KEY, Baked, MappedCall, Repacked, mapped_call
from vktrain.partitioner.op_registry import op_key
from vktrain.quant.etvk import flat_from_etvk

from .lower import lower_to_pte
from .training import in_registry_ops


class EtvkMappingError(VktrainError, ValueError):
    """An et_vk call of the program has no vktrain equivalent (the reason names the node and the argument)."""


@dataclass
class EtvkProgram:
    program: ExportedProgram   # the et_vk calls replaced by vktrain calls, decomposed into the registry's ops
    baked: list[dict]          # per et_vk call with Python floats: {"node", "op", "scalars": {argument: value}}


def _constant_tensor(program: ExportedProgram, name: str) -> torch.Tensor | None:
    """The value of a constant placeholder (parameter, buffer or lifted constant), else None."""
    signature = program.graph_signature
    target = (signature.inputs_to_parameters.get(name) or signature.inputs_to_buffers.get(name)
              or signature.inputs_to_lifted_tensor_constants.get(name))
    if target is None:
        return None
    return program.state_dict[target] if target in program.state_dict else program.constants[target]


class _Rewriter:
    def __init__(self, program: ExportedProgram) -> None:
        self.program = program
        self.graph = program.graph
        signature = program.graph_signature
        self.buffers = dict(signature.inputs_to_buffers)
        self.written: dict[str, str] = {}    # buffer placeholder -> the et_vk node writing it
        self.repacked: dict[tuple[str, int], Node] = {}
        self.fake_mode = next(n.meta["val"].fake_mode for n in self.graph.nodes
                              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))

    def add_constant(self, name: str, tensor: torch.Tensor) -> Node:
        """A new lifted-constant placeholder holding `tensor`, placed (node and input spec) before the user inputs."""
        specs = self.program.graph_signature.input_specs
        index = next((i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT), len(specs))
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        anchor = placeholders[index] if index < len(placeholders) else next(
            n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(anchor):
            node = self.graph.placeholder(name)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        self.program.constants[node.name] = tensor
        specs.insert(index, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), target=node.name))
        return node

    def value(self, node: Node, name: str, value):
        if isinstance(value, Baked):
            tensor = torch.tensor(value.values, dtype=torch.float32).reshape(value.shape)
            return self.add_constant(f"etvk_{node.name}_{name}", tensor)
        if isinstance(value, Repacked):
            return self.repack(value)
        return value

    def repack(self, weight: Repacked) -> Node:
        """The weight in vktrain's flat layout: the placeholder itself where its bytes already are that."""
        source = self.repacked.get((weight.source.name, weight.K))
        if source is not None:
            return source
        packed = _constant_tensor(self.program, weight.source.name)
        if packed is None:
            raise EtvkMappingError(f"'{weight.source.name}' is a packed q4gsw weight but not a constant of the program "
                                   f"(expected a parameter, buffer or lifted constant)")
        flat = flat_from_etvk(packed.detach().cpu().numpy(), weight.K)
        source = weight.source
        if flat.shape != tuple(packed.shape) or not np.array_equal(flat, packed.cpu().numpy()):
            source = self.add_constant(f"{weight.source.name}_flat_k{weight.K}", torch.from_numpy(flat))
        self.repacked[(weight.source.name, weight.K)] = source
        return source

    def check_writes(self, node: Node, mapped: MappedCall) -> list[Node]:
        """The buffers an in-place et_vk call writes: distinct mutable buffers, each written by one call."""
        op = ETVK_BY_KEY[op_key(node.target)]
        arguments = dict(zip((a.name for a in op.schema.arguments), node.args))
        targets = []
        for _, name in mapped.writes_back:
            tensor = arguments[name]
            if not isinstance(tensor, Node) or tensor.name not in self.buffers:
                raise EtvkMappingError(
                    f"{op.key} ('{node.name}'): argument '{name}' is written in place, so it must be a buffer of the "
                    f"program (training state); got '{getattr(tensor, 'name', tensor)}'")
            if tensor.name in self.written or tensor in targets:
                raise EtvkMappingError(
                    f"{op.key} ('{node.name}'): buffer '{self.buffers[tensor.name]}' (argument '{name}') is already "
                    f"written by '{self.written.get(tensor.name, node.name)}'; each state tensor takes one update")
            targets.append(tensor)
        for tensor in targets:
            self.written[tensor.name] = node.name
        return targets

    def rewrite(self, node: Node) -> dict | None:
        try:
            mapped = mapped_call(node)
        except Refusal as exc:
            raise EtvkMappingError(str(exc)) from None
        targets = self.check_writes(node, mapped)
        definition = torch.ops.vktrain
        overload = getattr(getattr(definition, mapped.target.split(".")[1]), mapped.target.split(".")[2])
        with self.graph.inserting_before(node):
            args = tuple(self.value(node, arg.name, mapped.args.get(arg.name, arg.default_value))
                         for arg in overload._schema.arguments)
            call = self.graph.call_function(overload, args)
            call.meta.update(node.meta)
        if mapped.writes_back:
            # The et_vk call returned aliases of the buffers it wrote: their readers now read the new values.
            with self.graph.inserting_after(call):
                anchor = call
                for (index, _), buffer in zip(mapped.writes_back, targets):
                    with self.graph.inserting_after(anchor):
                        item = self.graph.call_function(operator.getitem, (call, index))
                    item.meta["val"] = node.meta["val"][index]
                    with self.graph.inserting_after(item):
                        anchor = self.graph.call_function(torch.ops.aten.copy_.default, (buffer, item))
                    anchor.meta["val"] = buffer.meta["val"]
                    for user in [u for u in node.users if u.target is operator.getitem and u.args[1] == index]:
                        user.replace_all_uses_with(item)
                        self.graph.erase_node(user)
        node.replace_all_uses_with(call)
        self.graph.erase_node(node)
        return {"node": node.name, "op": op_key(node.target), "scalars": mapped.baked} if mapped.baked else None


def map_etvk_calls(program: ExportedProgram) -> EtvkProgram:
    """A copy of `program` (torch.export's output, with et_vk calls) in vktrain ops only, decomposed into
    the ops the registry takes. Raises EtvkMappingError naming the first et_vk call that has no mapping."""
    program = copy.deepcopy(program)
    rewriter = _Rewriter(program)
    baked = []
    for node in list(program.graph.nodes):
        if node.op == "call_function" and op_key(node.target) in ETVK_BY_KEY:
            entry = rewriter.rewrite(node)
            if entry is not None:
                baked.append(entry)
    program.graph.lint()
    program.graph_module.recompile()
    return EtvkProgram(in_registry_ops(program), baked)


def lower_etvk_program(program: ExportedProgram, partitioner: VktrainPartitioner | None = None) -> bytes:
    """The .pte of a program with et_vk calls (map_etvk_calls, then vktrain's lowering); the blob's metadata
    lists the baked scalars (contract.METADATA_BAKED_SCALARS)."""
    mapped = map_etvk_calls(program)
    partitioner = partitioner if partitioner is not None else VktrainPartitioner()
    partitioner.compile_specs.append(metadata_spec(METADATA_BAKED_SCALARS, json.dumps(mapped.baked)))
    return lower_to_pte(mapped.program, partitioner)


__all__ = ["EtvkMappingError", "EtvkProgram", "lower_etvk_program", "map_etvk_calls"]

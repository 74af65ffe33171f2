"""Rewrite a program's et_vk calls into the vktrain calls their records describe (etvk_ops.py).

Every Python float of an et_vk call becomes a lifted constant of the program (Baked), a packed weight whose
bytes are not vktrain's flat layout becomes a new constant in that layout (Repacked, vktrain.quant.etvk),
and the call is replaced by its vktrain op. An in-place call (adamw_step) may only be rewritten where
the program still records mutations as `copy_` into its buffers (torch.export's output, before
decomposition; vktrain/export/etvk.py): its outputs are copied into the buffers it wrote.

The backend's preprocess rewrites what reaches it (a partition holding et_vk calls, e.g. the
et_vk.linear_q4gsw upstream's quantized-linear fusion produces), in place writes refused there; the
export (vktrain.export.etvk) rewrites before decomposing and hands its baked scalars on in the compile
spec BAKED_SCALARS_SPEC_KEY, so the blob's metadata lists every baked scalar once either way.
"""
from __future__ import annotations

import copy
import json
import operator
from typing import Sequence

import numpy as np
import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx import Node

import vktrain.ops  # noqa: F401 (torch.ops.vktrain)
from vktrain.errors import VktrainError
from vktrain.opdefs import Refusal
from vktrain.quant.etvk import flat_from_etvk

from .etvk_ops import ETVK_BY_KEY, Baked, MappedCall, Repacked, mapped_call
from .op_registry import op_key

BAKED_SCALARS_SPEC_KEY = "vktrain_etvk_baked_scalars"


class EtvkMappingError(VktrainError, ValueError):
    """An et_vk call of the program has no vktrain equivalent here (the reason names the node and argument)."""


def _constant_tensor(program: ExportedProgram, name: str) -> torch.Tensor | None:
    """The value of a constant placeholder (parameter, buffer or lifted constant), else None."""
    signature = program.graph_signature
    target = (signature.inputs_to_parameters.get(name) or signature.inputs_to_buffers.get(name)
              or signature.inputs_to_lifted_tensor_constants.get(name))
    if target is None:
        return None
    return program.state_dict[target] if target in program.state_dict else program.constants[target]


class _Rewriter:
    def __init__(self, program: ExportedProgram, in_place_writes: bool) -> None:
        self.program = program
        self.in_place_writes = in_place_writes
        self.graph = program.graph
        signature = program.graph_signature
        self.buffers = dict(signature.inputs_to_buffers)
        self.written: dict[str, str] = {}    # buffer placeholder -> the et_vk node writing it
        self.new_values: dict[Node, Node] = {}  # a written buffer's new value -> the buffer's placeholder
        self.repacked: dict[tuple[str, int], Node] = {}

    def add_constant(self, name: str, tensor: torch.Tensor) -> Node:
        """A new lifted-constant placeholder holding `tensor`, placed (node and input spec) before the user inputs."""
        specs = self.program.graph_signature.input_specs
        index = next((i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT), len(specs))
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        anchor = placeholders[index] if index < len(placeholders) else next(
            n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(anchor):
            node = self.graph.placeholder(name)
        fake_mode = next(n.meta["val"].fake_mode for n in self.graph.nodes
                         if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
        node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
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
        if not self.in_place_writes:
            raise EtvkMappingError(
                f"{op.key} ('{node.name}') writes {[name for _, name in mapped.writes_back]} in place, which a "
                f"functional (edge) program cannot express; lower the program torch.export gives with "
                f"vktrain.export.etvk.lower_etvk_program, which turns the writes into state updates")
        arguments = dict(zip((a.name for a in op.schema.arguments), node.args))
        targets = []
        for _, name in mapped.writes_back:
            # torch.export passes a buffer written before by the alias that call returned (now its new value).
            tensor = self.new_values.get(arguments[name], arguments[name])
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
        targets = self.check_writes(node, mapped) if mapped.writes_back else []
        _, name, overload_name = mapped.target.split(".")
        overload = getattr(getattr(torch.ops.vktrain, name), overload_name)
        with self.graph.inserting_before(node):
            args = tuple(self.value(node, arg.name, mapped.args.get(arg.name, arg.default_value))
                         for arg in overload._schema.arguments)
            call = self.graph.call_function(overload, args)
            call.meta.update(node.meta)
        if mapped.writes_back:
            # The new values are copied into the buffers (decomposition makes them the buffers' mutations);
            # the et_vk call returned aliases of those buffers: their readers read the new values.
            anchor = call
            for (index, _), buffer in zip(mapped.writes_back, targets):
                with self.graph.inserting_after(anchor):
                    item = self.graph.call_function(operator.getitem, (call, index))
                item.meta["val"] = node.meta["val"][index]
                self.new_values[item] = buffer
                with self.graph.inserting_after(item):
                    anchor = self.graph.call_function(torch.ops.aten.copy_.default, (buffer, item))
                anchor.meta["val"] = buffer.meta["val"]
                for user in [u for u in node.users if u.target is operator.getitem and u.args[1] == index]:
                    user.replace_all_uses_with(item)
                    self.graph.erase_node(user)
        node.replace_all_uses_with(call)
        self.graph.erase_node(node)
        return {"node": node.name, "op": op_key(node.target), "scalars": mapped.baked} if mapped.baked else None


def has_etvk_calls(program: ExportedProgram) -> bool:
    return any(node.op == "call_function" and op_key(node.target) in ETVK_BY_KEY for node in program.graph.nodes)


def rewrite_etvk_calls(program: ExportedProgram, *, in_place_writes: bool) -> list[dict]:
    """Rewrite every et_vk call of `program` (in place) into its vktrain call; returns the baked scalars,
    one {"node", "op", "scalars": {argument: value}} per call that had Python floats. Raises
    EtvkMappingError naming the first call that has no mapping (or writes in place without
    `in_place_writes`)."""
    rewriter = _Rewriter(program, in_place_writes)
    baked = []
    for node in list(program.graph.nodes):
        if node.op == "call_function" and op_key(node.target) in ETVK_BY_KEY:
            entry = rewriter.rewrite(node)
            if entry is not None:
                baked.append(entry)
    program.graph.lint()
    program.graph_module.recompile()
    return baked


def baked_scalars_spec(baked: list[dict]) -> CompileSpec:
    return CompileSpec(BAKED_SCALARS_SPEC_KEY, json.dumps(baked).encode())


def lower_etvk_calls(program: ExportedProgram, compile_specs: Sequence[CompileSpec]) -> tuple[ExportedProgram, list[dict]]:
    """For preprocess: `program` with its et_vk calls rewritten (a copy; the program itself when it has
    none) and every baked scalar of the lowering (the compile specs' and this rewrite's)."""
    baked = [entry for spec in compile_specs if spec.key == BAKED_SCALARS_SPEC_KEY
             for entry in json.loads(bytes(spec.value).decode())]
    if not has_etvk_calls(program):
        return program, baked
    program = copy.deepcopy(program)
    return program, baked + rewrite_etvk_calls(program, in_place_writes=False)


__all__ = ["BAKED_SCALARS_SPEC_KEY", "EtvkMappingError", "baked_scalars_spec", "has_etvk_calls", "lower_etvk_calls",
           "rewrite_etvk_calls"]

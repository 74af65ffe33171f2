"""The torch.library namespace `vktrain`: every op is registered from its torch-free definition
(vktrain/opdefs), so the torch side restates no argument list and no shape rule.

Each op is defined twice, as ExecuTorch expects: a functional overload (what torch.export records, one
node per call) and an `.out` overload whose keyword out tensors carry write-alias annotations. ExecuTorch's
`to_out_variant` pairs the two by comparing their schemas with the out arguments stripped, so the `.out`
schema is derived from the functional one: the same positional part, defaults included, plus one
`Tensor(a!) <output>_out` per output (`out` for a single unnamed one). The fake kernels are the
definition's shape function; the CPU kernel checks the call the same way, then runs the reference.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from vktrain.opdefs import OpDef, TensorMeta, op_def
from vktrain.opdefs.schema import Argument, Return, Schema

NAMESPACE = "vktrain"

# FRAGMENT rather than DEF: other modules may add overloads to the same namespace later.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype of a vktrain dtype name (the names are torch's without the `torch.` prefix)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name!r} is not a torch dtype name")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(value):
    """A torch argument as an op definition sees it: tensors as TensorMeta, everything else as is."""
    if isinstance(value, torch.Tensor):
        # Sizes stay as torch gives them: under export they may be SymInts, which the shape function
        # then guards on exactly where it compares them (dynamic row counts stay dynamic).
        return TensorMeta(tuple(value.shape), dtype_name(value.dtype))
    return value


def out_argument_names(schema: Schema) -> tuple[str, ...]:
    """The `.out` overload's out tensors: `<return name>_out`, or `out` for one unnamed return."""
    names = schema.output_names
    return names if names == ("out",) else tuple(f"{name}_out" for name in names)


def out_schema(schema: Schema) -> Schema:
    aliases = [chr(ord("a") + i) + "!" for i in range(len(schema.returns))]
    outs = tuple(Argument(name, "Tensor", kwarg_only=True, alias=alias)
                 for name, alias in zip(out_argument_names(schema), aliases))
    return replace(schema, overload="out", arguments=schema.arguments + outs,
                   returns=tuple(Return("Tensor", alias=alias) for alias in aliases))


def _bind(definition: OpDef, args: tuple):
    """Call of `definition` from the dispatcher's positional args (it drops trailing defaulted ones)."""
    arguments = definition.schema.arguments
    missing = tuple(a.default_value for a in arguments[len(args):])
    return definition.bind(tuple(tensor_meta(a) for a in args) + missing)


def _outputs(results, count: int) -> tuple:
    return results if count > 1 else (results,)


def define_op(name: str, reference: Callable) -> OpDef:
    """Register `vktrain::<name>` and `vktrain::<name>.out` from the definition of
    `vktrain.<name>.default`: CPU kernels run `reference` after the definition's checks, fake kernels are
    the definition's shape function. Returns the definition."""
    definition = op_def(f"{NAMESPACE}.{name}.default")
    schema = definition.schema
    out_names = out_argument_names(schema)
    count = len(schema.returns)

    def cpu(*args):
        definition.infer(_bind(definition, args))
        return reference(*args)

    def fake(*args):
        metas = definition.infer(_bind(definition, args))
        like = next(a for a in args if isinstance(a, torch.Tensor))
        results = tuple(like.new_empty(m.shape, dtype=torch_dtype(m.dtype)) for m in metas)
        return results if count > 1 else results[0]

    def out_cpu(*args, **outs):
        # Results are computed before any out tensor is written, so outs may alias inputs (in place).
        results = _outputs(cpu(*args), count)
        written = tuple(write_out(outs[n], r, n) for n, r in zip(out_names, results))
        return written if count > 1 else written[0]

    def out_fake(*args, **outs):
        results = _outputs(fake(*args), count)
        checked = tuple(check_out_like(outs[n], r, n) for n, r in zip(out_names, results))
        return checked if count > 1 else checked[0]

    _LIB.define(schema.render())
    _LIB.define(out_schema(schema).render())
    _LIB.impl(name, cpu, "CPU")
    _LIB.impl(f"{name}.out", out_cpu, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    torch.library.register_fake(f"{NAMESPACE}::{name}.out", out_fake, lib=_LIB)
    return definition


def write_out(out: torch.Tensor, result: torch.Tensor, out_name: str) -> torch.Tensor:
    """Copy a functional result into a caller-provided out tensor (aten's out= convention: resize if
    the shape differs, but never convert dtypes silently)."""
    if out.dtype != result.dtype:
        raise TypeError(f"out tensor '{out_name}' has dtype {out.dtype}, expected {result.dtype}")
    if out.shape != result.shape:
        out.resize_(result.shape)
    out.copy_(result)
    return out


def check_out_like(out: torch.Tensor, expected: torch.Tensor, out_name: str) -> torch.Tensor:
    """Fake-kernel counterpart of write_out: the out tensor must already match the result's metadata."""
    if out.dtype != expected.dtype or out.shape != expected.shape:
        raise ValueError(
            f"out tensor '{out_name}' is {out.dtype} {tuple(out.shape)}, "
            f"expected {expected.dtype} {tuple(expected.shape)}")
    return out

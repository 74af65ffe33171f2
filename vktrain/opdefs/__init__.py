"""One torch-free definition per op vktrain lowers: schema (arguments, outputs), argument dtypes and the
shape function (vktrain/opdefs/core.py). Every layer reads these instead of restating them:

* vktrain/ops: the torch library's functional, `.out` and fake kernels are derived from the definition;
* vktrain/partitioner: OpFeatures take argument names from the schema and refuse what the shape
  function refuses;
* vktrain/backend/kernel_planning/op_lowering.py: arguments are read by schema name, and every vktrain op is
  checked by its shape function before a kernel is planned;
* a load-time verifier: `infer_outputs(key, args)`.

Keys are `namespace.name.overload` everywhere (registries, kernels, the blob's op names).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from vktrain.errors import VktrainError
from vktrain.opdefs.aten import ATEN_OPS
from vktrain.opdefs.core import Call, DtypeRefusal, OpDef, Refusal, TensorMeta
from vktrain.opdefs.decode_ops import DECODE_OPS
from vktrain.opdefs.gemm_ops import SCALED_MM_OPS
from vktrain.opdefs.q8_0_ops import Q8_0_OPS
from vktrain.opdefs.schema import Argument, Return, Schema, SchemaError
from vktrain.opdefs.vktrain_ops import VKTRAIN_OPS

OP_DEFS: dict[str, OpDef] = {op.key: op for op in VKTRAIN_OPS + DECODE_OPS + Q8_0_OPS + SCALED_MM_OPS + ATEN_OPS}


class UnknownOpError(VktrainError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def op_def(key: str) -> OpDef:
    """The definition of `key` ('vktrain.rms_norm.default', 'aten.mm.default')."""
    definition = OP_DEFS.get(key)
    if definition is None:
        raise UnknownOpError(f"no op definition for {key!r}; vktrain defines {len(OP_DEFS)} ops "
                             f"(vktrain/opdefs): {', '.join(sorted(OP_DEFS))}")
    return definition


def infer_outputs(key: str, args: Sequence[Any] | Mapping[str, Any]) -> tuple[TensorMeta, ...] | None | str:
    """For a load-time verifier: the outputs (shape, dtype) a call of `key` produces, None when its
    definition computes no outputs (the graph's recorded ones stand), or the reason it is refused.

    `args` are the call's arguments in schema order (the blob's), or by schema name: tensors as
    TensorMeta(shape, dtype name), other arguments as Python values."""
    try:
        definition = op_def(key)
        call = Call(key, dict(args)) if isinstance(args, Mapping) else definition.bind(args)
        return definition.infer(call)
    except (Refusal, UnknownOpError, KeyError) as exc:
        return f"{key}: {exc}"


__all__ = ["Argument", "Call", "DtypeRefusal", "OP_DEFS", "OpDef", "Refusal", "Return", "Schema", "SchemaError",
           "TensorMeta", "UnknownOpError", "infer_outputs", "op_def"]

"""An op definition: its schema (arguments and outputs), the dtypes each tensor argument may have, and
ONE shape function that checks a call and returns its outputs' shapes and dtypes, or refuses it.

Shape functions see a `Call`: tensors as `TensorMeta(shape, dtype name)`, everything else as the Python
value (int, float, bool, str, tuple, None). They raise `Refusal` (directly or through the helpers below) with a
message naming the argument, what was found and what was expected. Torch-free: the torch op library
(fake kernels), the partitioner, the runtime's lowerings and a load-time verifier all call them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from vktrain.errors import VktrainError
from vktrain.opdefs.schema import Schema


class Refusal(VktrainError, ValueError):
    """A call an op definition refuses: a shape or value no implementation of the op accepts."""


class DtypeRefusal(Refusal, TypeError):
    """A refusal because of an argument's dtype (a TypeError, as torch raises for dtypes)."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Call:
    """One call of an op: its arguments by schema name."""
    key: str
    args: Mapping[str, Any]

    def tensor(self, name: str) -> TensorMeta:
        value = self.args[name]
        if not isinstance(value, TensorMeta):
            raise Refusal(f"{name} must be a tensor, got {type(value).__name__} {value!r}")
        return value

    def optional_tensor(self, name: str) -> TensorMeta | None:
        return None if self.args.get(name) is None else self.tensor(name)

    def integer(self, name: str) -> int:
        value = self.args[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise DtypeRefusal(f"{name} must be an int, got {type(value).__name__}")
        return value

    def real(self, name: str, what: str) -> float:
        """A finite float argument; `what` says what it is for (in the message)."""
        value = self.args[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DtypeRefusal(f"{name} must be a float ({what}), got {type(value).__name__}")
        if not math.isfinite(value):
            raise Refusal(f"{name} must be finite ({what}), got {value}")
        return float(value)


# Returns the outputs, or None where the rule checks the call without computing them (some aten ops).
ShapeFunction = Callable[[Call], "tuple[TensorMeta, ...] | None"]


@dataclass(frozen=True)
class OpDef:
    schema: Schema
    shape_function: ShapeFunction | None
    # Allowed dtype names per tensor argument (all of a tensor list's items); arguments not named
    # take any dtype. What the op means, not what a kernel implements (the CPU references also take
    # float64 so autograd can be checked in double precision; GPU kernels are float32).
    arg_dtypes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.schema.key

    def bind(self, values: Any) -> Call:
        """A Call from positional values in schema order (the blob's convention)."""
        values = tuple(values)
        names = self.schema.arg_names
        # A blob written before a trailing optional argument existed (causal_attention's `positions`) lists
        # fewer values: the missing ones take their schema defaults, as torch would.
        missing = self.schema.arguments[len(values):]
        if len(values) > len(names) or any(arg.default is None for arg in missing):
            raise Refusal(f"{self.key} takes {len(names)} arguments ({', '.join(names)}), got {len(values)}")
        return Call(self.key, {**dict(zip(names, values)), **{arg.name: arg.default_value for arg in missing}})

    def infer(self, call: Call) -> tuple[TensorMeta, ...] | None:
        """The outputs of `call` (None: this definition has no shape rule); raises Refusal."""
        for name, allowed in self.arg_dtypes.items():
            value = call.args.get(name)
            for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(tensor, TensorMeta) and tensor.dtype not in allowed:
                    raise DtypeRefusal(f"{name} must have dtype {' or '.join(allowed)}, got {tensor.dtype}")
        outputs = None if self.shape_function is None else self.shape_function(call)
        return None if outputs is None else tuple(outputs)


# ---- helpers for shape functions --------------------------------------------------------------------

def same_dtype(call: Call, name: str, reference_name: str) -> None:
    tensor, reference = call.tensor(name), call.tensor(reference_name)
    if tensor.dtype != reference.dtype:
        raise DtypeRefusal(
            f"{name} has dtype {tensor.dtype} but {reference_name} has {reference.dtype}; they must match")


def same_shape(call: Call, name: str, reference_name: str) -> None:
    tensor, reference = call.tensor(name), call.tensor(reference_name)
    if tensor.shape != reference.shape:
        raise Refusal(f"{name} must have the shape of {reference_name} {reference.shape}, got {tensor.shape}")


def rank(call: Call, name: str, ndim: int, layout: str) -> TensorMeta:
    tensor = call.tensor(name)
    if len(tensor.shape) != ndim:
        raise Refusal(f"{name} must be {ndim}-D {layout}, got shape {tensor.shape}")
    return tensor


def last_dim(call: Call, name: str, size: int, what: str) -> TensorMeta:
    tensor = call.tensor(name)
    if not tensor.shape or tensor.shape[-1] != size:
        raise Refusal(f"{name} must have shape [..., {size}] (last dim = {what}), got {tensor.shape}")
    return tensor


__all__ = ["Call", "DtypeRefusal", "OpDef", "Refusal", "ShapeFunction", "TensorMeta", "last_dim", "rank",
           "same_dtype", "same_shape"]

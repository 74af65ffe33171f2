"""What every op lowering does around its plan call (op_lowering.py, gemm_lowering.py): the op definition's
checks of the call (shapes, dtypes, the outputs it infers), the plan call that turns a kernel's refusal into
a GraphLoweringError naming the op, and the binding-limit test."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from vktrain.opdefs import Refusal, TensorMeta, op_def
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import Dispatch
from vktrain.backend.kernel_planning.kernels import KERNELS, layout
from vktrain.backend.kernel_planning.lowering_context import KERNEL_DTYPES, OpContext, TensorArg


def _meta(value: Any) -> Any:
    if isinstance(value, TensorArg):
        return TensorMeta(value.shape, value.dtype)
    if isinstance(value, list):
        return [_meta(v) for v in value]
    return value


def check_definition(ctx: OpContext, logical: dict[int, TensorMeta] | None = None) -> None:
    """Refuse what the op's definition refuses (or no kernel's dtype), and outputs other than it infers.
    `logical`: argument position -> the tensor the definition describes, for arguments stored prepacked."""
    definition = op_def(ctx.op.name)
    metas = [_meta(a) for a in ctx.args]
    for position, meta in (logical or {}).items():
        metas[position] = meta
    for name, meta in zip(definition.schema.arg_names, metas):
        if isinstance(meta, TensorMeta) and meta.dtype not in KERNEL_DTYPES:
            raise ctx.fail(f"{name} has dtype {meta.dtype}; the GPU kernels take {', '.join(sorted(KERNEL_DTYPES))}")
    try:
        expected = definition.infer(definition.bind(metas))
    except Refusal as exc:
        raise ctx.fail(str(exc)) from None
    for position, (output, meta) in enumerate(zip(ctx.outputs, expected or ())):
        if output.layout != vk.Layout.PLAIN:
            continue  # stored prepacked (q4gsw_requant's W_4X8 words): not the graph's logical tensor
        if (output.shape, output.dtype) != (meta.shape, meta.dtype):
            raise ctx.fail(f"output {position} is {output.dtype} {list(output.shape)}, the op's definition gives "
                           f"{meta.dtype} {list(meta.shape)}")


def call_plan(ctx: OpContext, plan: Optional[Callable[..., list[Dispatch]]] = None, **kwargs: Any) -> list[Dispatch]:
    """`plan`, by default the kernel registered under the op's key."""
    name = ctx.op.name if plan is None else plan.__name__
    try:
        return (plan or KERNELS[ctx.op.name])(label=ctx.label, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the {name} kernel refused it: {exc}") from exc


def over_binding_limit(ctx: OpContext, tensors: Sequence[TensorArg]) -> bool:
    """Whether a binding of one of `tensors` would be over the device's max storage binding size."""
    return layout.exceeds(ctx.binding_limit, [t.binding.size for t in tensors])


__all__ = ["call_plan", "check_definition", "over_binding_limit"]

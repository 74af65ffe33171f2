"""The SwiGLU family: swiglu and swiglu_backward (the Llama MLP's gate), elementwise.

Semantics (docs/CONTRACTS.md), sig = sigmoid(gate):
    h      = silu(gate) * up = gate * sig * up
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))        d_up = d_h * gate * sig
One dispatch each (vktrain/runtime_shaders/swiglu.slang): vec4 elements when numel % 4 == 0 (`@VEC4`),
single floats otherwise. Outputs must not overlap the inputs. The plans take the shared keyword
convention (op_lowering.py `_keyword_lowering`), so the runtime needs no adapter for these ops.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import binding, check_dtype, check_positive_ints, shader_variant, use_vec4
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

DEFAULT_WORKGROUP_SIZE = 128


def _variant(op: str, numel: int, workgroup_size: int, vec4: bool | None, backward: bool
             ) -> tuple[str, int]:
    """(shader name, VALUE count) for `numel` elements."""
    check_positive_ints(op, numel=numel, workgroup_size=workgroup_size)
    if numel > MAX_ELEMENTS:
        raise KernelArgumentError(f"{op}: {numel} elements exceed the kernel's 32-bit indexing "
                                  f"(at most {MAX_ELEMENTS}); split the tensor")
    vec4 = use_vec4(op, vec4, numel, "numel")
    return shader_variant("swiglu", VEC4=vec4, BACKWARD=backward), numel // 4 if vec4 else numel


def _numel(op: str, reference: str, shapes: dict[str, Any], dtypes: dict[str, Any]) -> int:
    """The element count shared by every operand (one elementwise pass over contiguous fp32 tensors)."""
    for name, dtype in dtypes.items():
        check_dtype(dtype, f"{op} {name}")
    mismatched = {name: list(shape) for name, shape in shapes.items() if tuple(shape) != tuple(shapes[reference])}
    if mismatched:
        raise KernelArgumentError(f"{op}: every operand must have the shape of {reference} "
                                  f"{list(shapes[reference])}, got {mismatched}")
    return math.prod(shapes[reference])


@register_kernel("vktrain.swiglu.default")
def plan_swiglu(*, gate: Any, gate_shape: Sequence[int], up: Any, up_shape: Sequence[int], out: Any,
                gate_dtype: Any = "float32", up_dtype: Any = "float32", vec4: bool | None = None,
                workgroup_size: int = DEFAULT_WORKGROUP_SIZE, label: str = "swiglu") -> list[Dispatch]:
    """Dispatches computing out = silu(gate) * up over contiguous fp32 tensors of one shape (the shared
    keyword convention of op_lowering.py); none for empty tensors.

    `vec4` picks the vec4 kernel; by default it is used whenever numel % 4 == 0 (the only case it serves).
    """
    numel = _numel("swiglu", "gate", {"gate": gate_shape, "up": up_shape}, {"gate": gate_dtype, "up": up_dtype})
    if numel == 0:
        return []
    shader, count = _variant("swiglu", numel, workgroup_size, vec4, backward=False)
    return [Dispatch(shader, groups=(ceil_div(count, workgroup_size), 1, 1),
                     bindings=(binding(gate, "r"), binding(up, "r"), binding(out, "w")),
                     push_constants=pack_push(count), local_size=(workgroup_size, 1, 1), label=label)]


@register_kernel("vktrain.swiglu_backward.default")
def plan_swiglu_backward(*, d_h: Any, d_h_shape: Sequence[int], gate: Any, gate_shape: Sequence[int], up: Any,
                         up_shape: Sequence[int], d_gate: Any, d_up: Any, d_h_dtype: Any = "float32",
                         gate_dtype: Any = "float32", up_dtype: Any = "float32", vec4: bool | None = None,
                         workgroup_size: int = DEFAULT_WORKGROUP_SIZE,
                         label: str = "swiglu_backward") -> list[Dispatch]:
    """Dispatches computing (d_gate, d_up) = swiglu_backward(d_h, gate, up); none for empty tensors."""
    numel = _numel("swiglu_backward", "d_h", {"d_h": d_h_shape, "gate": gate_shape, "up": up_shape},
                   {"d_h": d_h_dtype, "gate": gate_dtype, "up": up_dtype})
    if numel == 0:
        return []
    shader, count = _variant("swiglu_backward", numel, workgroup_size, vec4, backward=True)
    return [Dispatch(shader, groups=(ceil_div(count, workgroup_size), 1, 1),
                     bindings=(binding(d_h, "r"), binding(gate, "r"), binding(up, "r"), binding(d_gate, "w"),
                               binding(d_up, "w")),
                     push_constants=pack_push(count), local_size=(workgroup_size, 1, 1), label=label)]

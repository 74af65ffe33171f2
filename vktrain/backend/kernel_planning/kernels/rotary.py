"""The rotary family: rope (Llama/HF "rotate half" rotary position embedding).

Semantics (docs/CONTRACTS.md): x [B, S, H, D], cos/sin [S, D/2] or, per token (packed documents, whose
positions restart at each document), [B, S, D/2]; for i < D/2
    y[i] = x[i] * cos - x[i + D/2] * sin,   y[i + D/2] = x[i + D/2] * cos + x[i] * sin
The backward is rope(d_y, cos, -sin). The graph may pass a negated table to the plain kernel, or a
runner may call this plan with `negate_sin=True` on the forward's table (a specialization constant of
rope.slang; no negated copy is needed).

One dispatch (vktrain/runtime_shaders/rope.slang): one thread per 4 consecutive (i, i + D/2) pairs, vec4
loads and stores, so D must be a multiple of 8. The output must not overlap x.
"""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import binding, check_positive_ints
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

DEFAULT_WORKGROUP_SIZE = 64
NEGATE_SIN_SPEC_ID = 3


@register_kernel("vktrain.rope.default")
def plan_rope(*, B: int, S: int, H: int, D: int, x: Any, cos: Any, sin: Any, out: Any,
              negate_sin: bool = False, per_token: bool = False, workgroup_size: int = DEFAULT_WORKGROUP_SIZE,
              label: str = "rope") -> list[Dispatch]:
    """Dispatches computing out = rope(x, cos, -sin if negate_sin else sin).

    Buffers: x fp32 [B, S, H, D] contiguous; cos, sin fp32 [S, D/2], or [B, S, D/2] with `per_token`;
    out fp32 [B, S, H, D] (written).
    """
    check_positive_ints("rope", B=B, S=S, H=H, D=D, workgroup_size=workgroup_size)
    if D % 8:
        raise KernelArgumentError(
            f"rope: head dim D={D} is not supported; the kernel needs D % 8 == 0 (vec4 halves of D/2)")
    if B * S * H * D > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"rope: x [B={B}, S={S}, H={H}, D={D}] has {B * S * H * D} elements; the kernel indexes with "
            f"32 bits (at most {MAX_ELEMENTS})")
    if not isinstance(negate_sin, bool):
        raise KernelArgumentError(f"rope: negate_sin must be a bool, got {negate_sin!r}")
    quads = B * S * H * D // 8
    return [Dispatch(
        "rope", groups=(ceil_div(quads, workgroup_size), 1, 1),
        bindings=(binding(x, "r"), binding(cos, "r"), binding(sin, "r"), binding(out, "w")),
        push_constants=pack_push(quads, B * S if per_token else S, H, D // 8), spec_constants={NEGATE_SIN_SPEC_ID: negate_sin},
        local_size=(workgroup_size, 1, 1), label=label)]

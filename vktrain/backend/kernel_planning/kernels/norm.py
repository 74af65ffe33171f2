"""The normalisation family: rms_norm and rms_norm_backward (Llama RMSNorm over the last dim).

Semantics (docs/CONTRACTS.md, "Transformer ops"), x viewed as [rows, dim] (rows = product of the
leading dims):
    rstd = 1 / sqrt(mean(x^2) + eps)   [rows]        y = x * rstd * weight
    d_x  = rstd * (weight * d_y) - x * rstd^3 * mean(x * weight * d_y)
The norm weight is frozen (LoRA training), so the backward computes d_x only.

One dispatch each (vktrain/runtime_shaders/rms_norm.slang, `@BACKWARD` for the gradient): one workgroup
per row, threads striding over the row, partial sums added by a shared-memory tree in a fixed order, so
replays are bitwise identical. `@VEC4` moves vec4s and serves dim % 4 == 0 (Llama's 2048, 4096); the
plain kernel any dim. The backward reads the forward's `rstd` instead of recomputing it.
"""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import (
    binding, check_positive_ints, check_power_of_two_workgroup, shader_variant, use_vec4
)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

# A power of two (the tree halves it); 256 threads stream a 2048-wide Llama row in 2 vec4 loads each.
# Vulkan guarantees only 128 invocations per workgroup: pass 128 there.
DEFAULT_WORKGROUP_SIZE = 256


def _shader(op: str, dim: int, vec4: bool | None, backward: bool) -> str:
    """The rms_norm.slang variant: vec4 by default whenever dim % 4 == 0."""
    vec4 = use_vec4(op, vec4, dim, "dim", why="16-byte aligned rows")
    return shader_variant("rms_norm", VEC4=vec4, BACKWARD=backward)


def _check_common(op: str, rows: int, dim: int, workgroup_size: int) -> None:
    check_positive_ints(op, rows=rows, dim=dim)
    if rows * dim > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{op}: x [rows={rows}, dim={dim}] has {rows * dim} elements; the kernel indexes with 32 bits "
            f"(at most {MAX_ELEMENTS}): split the rows over several calls")
    check_power_of_two_workgroup(op, workgroup_size)


@register_kernel("vktrain.rms_norm.default")
def plan_rms_norm(*, rows: int, dim: int, x: Any, weight: Any, y: Any, rstd: Any, eps: float,
                  vec4: bool | None = None, workgroup_size: int = DEFAULT_WORKGROUP_SIZE,
                  label: str = "rms_norm") -> list[Dispatch]:
    """Dispatches computing (y, rstd) = rms_norm(x, weight, eps).

    Buffers (keys of the Program's buffer mapping, Buffer objects or BufferBindings):
      x  fp32 [rows, dim] contiguous    weight  fp32 [dim]
      y  fp32 [rows, dim] (written)     rstd    fp32 [rows] (written; the op's [..., 1])
    `vec4` picks the vec4 kernel; by default it is used whenever dim % 4 == 0 (the only case it serves).
    """
    _check_common("rms_norm", rows, dim, workgroup_size)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise KernelArgumentError(f"rms_norm: eps must be a float >= 0, got {eps!r}")
    return [Dispatch(
        _shader("rms_norm", dim, vec4, backward=False), groups=(rows, 1, 1),
        bindings=(binding(x, "r"), binding(weight, "r"), binding(y, "w"), binding(rstd, "w")),
        push_constants=pack_push(rows, dim, float(eps)), local_size=(workgroup_size, 1, 1), label=label)]


@register_kernel("vktrain.rms_norm_backward.default")
def plan_rms_norm_backward(*, rows: int, dim: int, d_y: Any, x: Any, weight: Any, rstd: Any, d_x: Any,
                           vec4: bool | None = None, workgroup_size: int = DEFAULT_WORKGROUP_SIZE,
                           label: str = "rms_norm_backward") -> list[Dispatch]:
    """Dispatches computing d_x = rms_norm_backward(d_y, x, weight, rstd).

    Buffers: d_y, x fp32 [rows, dim]; weight fp32 [dim]; rstd fp32 [rows] (from the forward);
    d_x fp32 [rows, dim] (written; must not overlap the inputs).
    """
    _check_common("rms_norm_backward", rows, dim, workgroup_size)
    return [Dispatch(
        _shader("rms_norm_backward", dim, vec4, backward=True), groups=(rows, 1, 1),
        bindings=(binding(d_y, "r"), binding(x, "r"), binding(weight, "r"), binding(rstd, "r"),
                  binding(d_x, "w")),
        push_constants=pack_push(rows, dim, 0.0), local_size=(workgroup_size, 1, 1), label=label)]

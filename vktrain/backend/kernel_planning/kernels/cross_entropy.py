"""The cross-entropy family: fused_ce (loss and logits gradient in one pass over the logits).

Semantics (docs/spec/training-ops.md): for rows with a label in [0, V)
    loss    = sum_r (logsumexp(logits[r]) - logits[r, labels[r]]) / n_valid
    dlogits = (softmax(logits[r]) - onehot(labels[r])) / n_valid
and 0 (no loss, zero gradient row) for rows with label < 0.

Labels >= V: the op library refuses them on the CPU; a kernel cannot raise, so the GPU treats such a
row as ignored (zero loss and gradient) and never reads outside the logits. An ignored row never
divides by n_valid, so a batch whose rows are all ignored yields loss 0 and zero dlogits for any n_valid.

Two dispatches (vktrain/runtime_shaders):
  fused_ce(@VEC4)  one workgroup per row: online softmax statistics, per-row loss into `row_loss`, then
                   dlogits (the row is read twice); @VEC4 moves vec4s and serves V % 4 == 0;
                   @IN_PLACE writes dlogits over the logits (when the caller passes the same buffer)
  fused_ce_sum     one workgroup: loss = sum of row_loss in a fixed order (deterministic: no float
                   atomics, so replays are bitwise identical)
The caller provides `row_loss`, a scratch buffer of `fused_ce_scratch_nbytes(R)` bytes.

Logits over the device's max storage binding size (`binding_limit`; a large vocabulary's [tokens, V]):
the rows pass runs as several dispatches over windows of whole rows, each binding its rows of the logits
and dlogits (push: the window's first row and where its logits start in the binding). Every row is
computed as unsplit, so the loss and dlogits are bit for bit the unsplit ones.
"""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import (
    BindingLimit, binding, check_positive_ints, check_power_of_two_workgroup, shader_variant, sub_binding, use_vec4
)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

# A power of two (the reductions halve it); 256 threads stream a row while keeping a few hundred rows
# in flight on a large GPU. Vulkan guarantees only 128 invocations per workgroup: pass 128 there.
DEFAULT_WORKGROUP_SIZE = 256


def fused_ce_scratch_nbytes(R: int) -> int:
    """Bytes of the `row_loss` scratch buffer fused_ce needs for R rows (one float32 per row)."""
    check_positive_ints("fused_ce", R=R)
    return 4 * R


@register_kernel("vktrain.fused_ce.default")
def plan_fused_ce(*, R: int, V: int, logits: Any, labels: Any, n_valid: Any, loss: Any, dlogits: Any,
                  row_loss: Any, workgroup_size: int = DEFAULT_WORKGROUP_SIZE, vec4: bool | None = None,
                  binding_limit: BindingLimit | None = None, label: str = "fused_ce") -> list[Dispatch]:
    """Dispatches computing (loss, dlogits) = fused_ce(logits, labels, n_valid).

    Buffers (keys of the Program's buffer mapping, Buffer objects or BufferBindings):
      logits   fp32 [R, V], contiguous          labels  int32 [R] (< 0 = ignored)
      n_valid  fp32 scalar (the loss divisor)    loss    fp32 scalar (written)
      dlogits  fp32 [R, V] (written). Pass the logits' own key/Buffer to overwrite the logits with the
               gradient in place (saves an [R, V] buffer when the logits are not needed afterwards);
               any other buffer must not overlap the logits.
      row_loss fp32 [R] scratch (`fused_ce_scratch_nbytes(R)` bytes), overwritten
    `vec4` picks the vec4 kernel; by default it is used whenever V % 4 == 0 (the only case it supports).
    `binding_limit`: logits over it are taken in windows of rows (module docstring).
    """
    check_positive_ints("fused_ce", R=R, V=V)
    check_power_of_two_workgroup("fused_ce", workgroup_size)
    if R * V > MAX_ELEMENTS:  # row and element indices are uint32 in the shaders
        raise KernelArgumentError(
            f"fused_ce: logits [R={R}, V={V}] has {R * V} elements; the kernel indexes with 32 bits "
            f"(at most {MAX_ELEMENTS}): split the rows over several calls")
    vec4 = use_vec4("fused_ce", vec4, V, "V", why="16-byte aligned rows")
    in_place = dlogits == logits
    window_rows = R
    if binding_limit is not None and not binding_limit.fits(4 * R * V):
        window_rows = binding_limit.window_bytes // (4 * V)
        if window_rows == 0:
            raise binding_limit.refusal(label, f"one row of the logits [R={R}, V={V}]", 4 * V)
    local_size = (workgroup_size, 1, 1)
    shader = shader_variant("fused_ce", VEC4=vec4, IN_PLACE=in_place)
    windows = []
    for first in range(0, R, window_rows):
        rows = min(window_rows, R - first)
        if window_rows == R:
            logits_bound, logits_skip = binding(logits, "rw" if in_place else "r"), 0
            dlogits_bound, dlogits_skip = binding(dlogits, "w"), 0
        else:
            logits_bound, logits_skip = sub_binding(logits, 4 * first * V, 4 * (first + rows) * V,
                                                    "rw" if in_place else "r", binding_limit.alignment)
            dlogits_bound, dlogits_skip = sub_binding(dlogits, 4 * first * V, 4 * (first + rows) * V, "w",
                                                      binding_limit.alignment)
        if in_place:
            bindings = (logits_bound, binding(labels, "r"), binding(n_valid, "r"), binding(row_loss, "w"))
        else:
            bindings = (logits_bound, binding(labels, "r"), binding(n_valid, "r"), dlogits_bound,
                        binding(row_loss, "w"))
        windows.append(Dispatch(
            shader, groups=(rows, 1, 1), bindings=bindings,
            push_constants=pack_push(R, V, first, logits_skip // 4, dlogits_skip // 4), local_size=local_size,
            label=f"{label}.rows" if window_rows == R else f"{label}.rows{first}"))
    total = Dispatch(
        "fused_ce_sum", groups=(1, 1, 1),
        bindings=(binding(row_loss, "r"), binding(loss, "w")),
        push_constants=pack_push(R), local_size=local_size, label=f"{label}.sum")
    return windows + [total]

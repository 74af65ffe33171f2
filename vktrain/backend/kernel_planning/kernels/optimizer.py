"""The optimizer family: one AdamW step, in place over optimizer state that stays on the GPU.

Update (torch.optim.AdamW, docs/spec/training-ops.md):
    p *= 1 - lr * wd;  m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
`hparams` (fp32 [5] = [lr, beta1, beta2, eps, weight_decay]) and `step` (fp32 scalar t, 1 on the first
update, a whole number < 2^24) are device buffers the host rewrites before every replay, so one
recorded Program serves every step, learning-rate schedules included. The shader computes the bias
corrections 1 - beta^t as -expm1(t log1p(beta - 1)) by series, so they keep full fp32 accuracy (a few
ulp) where a plain pow() would lose ~3 digits to cancellation (beta2 = 0.999, small t).

The op library's `adamw` is functional (returns new tensors); on the GPU the update is in place:
param, exp_avg and exp_avg_sq are read and overwritten.

Dispatches (vktrain/runtime_shaders/adamw.slang): `adamw@VEC4` updates the first numel // 4 vec4s, and
when numel % 4 != 0 the scalar `adamw` updates the 1-3 trailing elements (same whole-buffer bindings,
element offset in the push constants). Every workgroup first computes the step's scalars (the
bias corrections, a few microseconds of serial arithmetic), so the grid is capped at
`max_groups` workgroups whose threads stride over the tensor instead of one thread per vec4.

Over a BindingLimit (a phone's max storage binding size, --max-binding-mib) the update runs in windows of
the flat index space (kernels/elementwise_windows.py): each window binds the same elements [begin, end) of
param, grad, exp_avg and exp_avg_sq, starting at an aligned offset, and runs the unsplit plan over them.
Each element's update is the same arithmetic either way, so the split update is the unsplit one bit for bit.
"""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.elementwise_windows import element_windows, needs_windows, window_binding
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, binding, check_positive_ints
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

DEFAULT_WORKGROUP_SIZE = 128  # Vulkan guarantees at least 128 invocations per workgroup
# Enough workgroups to fill a large GPU a few times over (an H200 keeps ~2000 of 128 threads resident);
# beyond that, threads loop.
DEFAULT_MAX_GROUPS = 4096
# The shader indexes elements with uint32; keeping numel <= 2^31 leaves room for index + stride, so the
# strided loop can never wrap around.
_MAX_ELEMENTS = 2**31


@register_kernel("vktrain.adamw.default")
def plan_adamw(*, numel: int, param: Any, exp_avg: Any, exp_avg_sq: Any, grad: Any, hparams: Any, step: Any,
               workgroup_size: int = DEFAULT_WORKGROUP_SIZE, max_groups: int = DEFAULT_MAX_GROUPS,
               label: str = "adamw", binding_limit: BindingLimit | None = None) -> list[Dispatch]:
    """Dispatches for one in-place AdamW step over `numel` fp32 elements.

    Buffers (keys of the Program's buffer mapping, Buffer objects or BufferBindings):
      param, exp_avg, exp_avg_sq  fp32 [numel], read and overwritten
      grad                        fp32 [numel]
      hparams                     fp32 [5] = [lr, beta1, beta2, eps, weight_decay]
      step                        fp32 scalar t (1 on the first update)
    Over `binding_limit`: one plan per window of elements, each binding its slice of the four tensors.
    """
    check_positive_ints("adamw", numel=numel)
    if numel > _MAX_ELEMENTS:
        raise KernelArgumentError(
            f"adamw: {numel} elements exceed the kernel's limit of {_MAX_ELEMENTS} (32-bit indexing); "
            f"split the parameter")
    check_positive_ints("adamw", workgroup_size=workgroup_size, max_groups=max_groups)
    tensors = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grad": grad}
    if not needs_windows(binding_limit, [(buffer, numel) for buffer in tensors.values()]):
        return _plan_whole(numel, param, exp_avg, exp_avg_sq, grad, hparams, step, workgroup_size, max_groups, label)
    dispatches = []
    for begin, end in element_windows(numel, binding_limit):
        window = {}
        for name, buffer in tensors.items():
            access = "r" if name == "grad" else "rw"
            window[name], skipped = window_binding(buffer, begin, end, access, binding_limit, label, name)
            if skipped:  # every operand is indexed from its binding's first element
                raise KernelArgumentError(f"{label}: an AdamW update split over bindings needs {name} at an offset "
                                          f"aligned to {binding_limit.alignment} bytes; it is {skipped} elements "
                                          f"past one")
        dispatches += _plan_whole(end - begin, window["param"], window["exp_avg"], window["exp_avg_sq"],
                                  window["grad"], hparams, step, workgroup_size, max_groups, f"{label}.window{begin}")
    return dispatches


def _plan_whole(numel: int, param: Any, exp_avg: Any, exp_avg_sq: Any, grad: Any, hparams: Any, step: Any,
                workgroup_size: int, max_groups: int, label: str) -> list[Dispatch]:
    """The update of elements [0, numel) of these bindings: the vec4 body and the scalar tail."""
    bindings = (binding(param, "rw"), binding(exp_avg, "rw"), binding(exp_avg_sq, "rw"), binding(grad, "r"),
                binding(hparams, "r"), binding(step, "r"))
    local_size = (workgroup_size, 1, 1)
    dispatches = []
    n_vec4 = numel // 4
    if n_vec4:
        groups = min(ceil_div(n_vec4, workgroup_size), max_groups)
        dispatches.append(Dispatch(
            "adamw@VEC4", groups=(groups, 1, 1), bindings=bindings,
            push_constants=pack_push(0, n_vec4, groups * workgroup_size), local_size=local_size,
            label=f"{label}.vec4"))
    tail_start = 4 * n_vec4
    if tail_start < numel:
        dispatches.append(Dispatch(
            "adamw", groups=(1, 1, 1), bindings=bindings,
            push_constants=pack_push(tail_start, numel, workgroup_size), local_size=local_size,
            label=f"{label}.tail"))
    return dispatches

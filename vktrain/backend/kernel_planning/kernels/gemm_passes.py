"""The small passes around the GEMMs of the linear family and aten mm/bmm/addmm: the split-K reduce
(linear_splitk_reduce.slang: the second pass of a GEMM whose reduction was split into slices), the in-place
scale of a vktrain.mm_scaled product (its SCALE+IN_PLACE variant) and the operand-scale pass
(coopmat_absmax.slang: the per-tensor maxima the tensor-core and FP16 kernels scale their fp16 operands by)."""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import Dispatch, ceil_div, pack_push
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import binding, shader_variant

# 128: Vulkan's guaranteed maximum, so every device profile runs it; each output is its own sum over the
# slices, so the size changes no result.
REDUCE_WORKGROUP_SIZE = 128



def split_k_scratch_nbytes(rows: int, cols: int, split_k: int) -> int:
    """Bytes of scratch a GEMM producing [rows, cols] needs with `split_k` slices (0 when not split)."""
    return 0 if split_k <= 1 else 4 * split_k * rows * cols



def plan_splitk_reduce(*, out: Any, scratch: Any, count4: int, row_vec4s: int, split_k: int, bias: Any = None,
                       scale: float | None = None, label: str) -> Dispatch:
    """The second pass of a split-K GEMM (linear_splitk_reduce.slang, shared by the linear family and
    aten mm/bmm/addmm): out[e] = sum of scratch[s, e] over s = 0 .. split_k-1 in index order
    (+ bias[e % row_vec4s]; or, given `scale`, that sum times fp32(scale): vktrain.mm_scaled, whose slices
    are unscaled), over the `count4` vec4s of the output. `row_vec4s` is the vec4s of one output row, the
    bias length / 4 (only read with a bias; must be >= 1)."""
    if bias is not None and scale is not None:
        raise KernelArgumentError(f"{label}: the split-K reduce takes a bias or a scale, not both")
    bindings = [binding(out, "w"), binding(scratch, "r")] + ([binding(bias, "r")] if bias is not None else [])
    name = shader_variant("linear_splitk_reduce", HAS_BIAS=bias is not None, SCALE=scale is not None)
    return Dispatch(name, groups=(ceil_div(count4, REDUCE_WORKGROUP_SIZE), 1, 1), bindings=bindings,
                    push_constants=pack_push(count4, row_vec4s, split_k, *(() if scale is None else (float(scale),))),
                    local_size=(REDUCE_WORKGROUP_SIZE, 1, 1), label=label)


def plan_scale_in_place(*, out: Any, numel: int, scale: float, label: str) -> Dispatch:
    """out[e] = out[e] * fp32(scale) over the `numel` floats of `out`, in place (linear_splitk_reduce.slang's
    SCALE+IN_PLACE): vktrain.mm_scaled's scale after a product kernel that cannot scale its whole sum wrote the
    product into the output (coopmat_mm, GEMM windows); the same fp32 multiply as the elementwise mul_scalar."""
    return Dispatch("linear_splitk_reduce@SCALE+IN_PLACE", groups=(ceil_div(numel, REDUCE_WORKGROUP_SIZE), 1, 1),
                    bindings=[binding(out, "rw")], push_constants=pack_push(numel, 0, 1, float(scale)),
                    local_size=(REDUCE_WORKGROUP_SIZE, 1, 1), label=label)


# coopmat_absmax.slang (the per-tensor operand scales of the coopmat kernels and of the fp16 d_x here):
# workgroups of 128 threads (Vulkan's guaranteed maximum), each reading at least 8 vec4 of its tensor; at most ABSMAX_MAX_PARTIALS
# workgroups (hence partial maxima) per tensor, which every GEMM workgroup reduces.
_ABSMAX_VECS_PER_GROUP = 256 * 4
ABSMAX_MAX_PARTIALS = 256


def absmax_partials(numel: int) -> int:
    """How many partial maxima coopmat_absmax writes for a tensor of numel floats."""
    return max(1, min(ceil_div(numel // 4, _ABSMAX_VECS_PER_GROUP), ABSMAX_MAX_PARTIALS))


def absmax_scratch_nbytes(*numels: int) -> int:
    """Scratch the operand scales of a GEMM take: the partial maxima of each scaled operand."""
    return 4 * sum(absmax_partials(n) for n in numels)


def plan_absmax(absmax: Any, tensors: list[tuple[Any, int]], label: str) -> Dispatch:
    """One coopmat_absmax dispatch writing the partial maxima of |x| of one or two (x, numel) tensors
    into absmax, those of the first tensor first (numel % 4 == 0)."""
    (x0, numel0), (x1, numel1) = tensors[0], (tensors[1] if len(tensors) > 1 else (tensors[0][0], 0))
    groups0, groups1 = absmax_partials(numel0), absmax_partials(numel1) if numel1 else 0
    return Dispatch("coopmat_absmax", groups=(groups0 + groups1, 1, 1),
                    bindings=[binding(absmax, "w"), binding(x0, "r"), binding(x1, "r")],
                    push_constants=pack_push(numel0, numel1, groups0, groups1), label=label)


__all__ = ["ABSMAX_MAX_PARTIALS", "REDUCE_WORKGROUP_SIZE", "absmax_partials", "absmax_scratch_nbytes", "plan_absmax",
           "plan_scale_in_place", "plan_splitk_reduce", "split_k_scratch_nbytes"]

"""The GEMM ops' lowerings (op_lowering.py's table takes them): aten.mm, aten.addmm and vktrain.mm_scaled through
the GEMM's strided operands, aten.bmm, and the Q8_0 linear pair. A transpose the backend made a view costs
nothing: the GEMM reads it in place through its operand strides. Each allocates a split-K scratch where the
GEMM plan would split (skinny output, long reduction: kernels/matmul.py `gemm_scratch_nbytes`), and nothing
otherwise. `OpContext.gemm`, the GemmRoute chosen at load (kernels/coopmat.py), may send mm and addmm (with an
addend of the output's shape) to the tensor cores."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from vktrain.opdefs import op_def
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.backend.kernel_planning.kernels import coopmat, gemm_passes, layout, matmul
from vktrain.backend.kernel_planning.lowering_checks import call_plan, check_definition
from vktrain.backend.kernel_planning.lowering_context import OpContext, TensorArg


def coopmat_split_k_args(ctx: OpContext, kernel: str, m: int, n: int, reduction: int) -> dict:
    """A coopmat kernel's split-K (kernels/coopmat_tiling.py: small outputs, long reductions) on this route,
    whose targets are the device profile's: the slices and their scratch, if it splits."""
    split_k = ctx.gemm.default_split_k(kernel, m, n, reduction)
    if split_k == 1:
        return {}
    return {"split_k": split_k, "scratch": ctx.scratch(4 * split_k * m * n, "split_k")}


def _split_k_scratch(ctx: OpContext, batch: int, m: int, n: int, k: int, *tensors: TensorArg) -> BufferBinding | None:
    """The split-K scratch the default GEMM plan of [batch, m, k] @ [batch, k, n] uses, or None when it would
    not split (kernels/matmul.py: skinny outputs, long reductions; `tensors` over the binding limit: windows)."""
    nbytes = matmul.gemm_scratch_nbytes(batch, m, n, k, ctx.gemm.fp32_tuning, ctx.binding_limit,
                                        [tensor.binding.size for tensor in tensors])
    return ctx.scratch(nbytes, "split_k") if nbytes else None


def _float_matrices(ctx: OpContext, positions: Sequence[tuple[int, str]]) -> list[TensorArg]:
    """The GEMM operands, after the op definition's rank and shape checks; the GEMM kernels are fp32."""
    check_definition(ctx)
    tensors = [ctx.tensor(position, name) for position, name in positions]
    for tensor, (_, name) in zip(tensors, positions):
        if tensor.dtype != "float32":
            raise ctx.fail(f"{name} must be float32, got {tensor.dtype}")
    return tensors


MM_SCALED = "vktrain.mm_scaled.default"


def lower_gemm(ctx: OpContext) -> list[Dispatch]:
    """aten.mm / aten.addmm / vktrain.mm_scaled through the GEMM's strided operands (a lazily transposed input
    costs nothing); on the tensor cores where the route takes the product (an addmm's bias only as coopmat_mm's
    addend) and every operand fits one binding (coopmat binds whole operands), else through plan_gemm, which
    cuts operands over the binding limit into windows. mm_scaled's scale is the fp32 kernels' epilogue
    (plan_gemm's `scale`); where the product takes coopmat_mm or windows, neither of which scales a whole sum,
    the mm writes the output and a second dispatch multiplies it in place (`_scaled_product`)."""
    scale = None
    if ctx.op.name == "aten.addmm.default":
        bias, a, b = _float_matrices(ctx, ((0, "self"), (1, "mat1"), (2, "mat2")))
        beta, alpha = ctx.real(3, "beta"), ctx.real(4, "alpha")
    else:
        (a, b), bias, beta, alpha = _float_matrices(ctx, ((0, "self"), (1, "mat2"))), None, 1.0, 1.0
        scale = ctx.real(2, "scale") if ctx.op.name == MM_SCALED else None
    out = ctx.outputs[0]
    operands = (a, b, out) + ((bias,) if bias is not None else ())
    over = layout.exceeds(ctx.binding_limit, [t.binding.size for t in operands])
    b_transposed = None if over else ctx.gemm.dense_b_transposed(a.strided, b.strided)
    if scale is not None and (over or b_transposed is not None):
        return _scaled_product(ctx, out, scale)
    if b_transposed is not None and (bias is None or coopmat.takes_addend(bias.strided, out.shape, beta, alpha)):
        return call_plan(ctx, coopmat.plan_coopmat_mm, M=a.shape[0], N=b.shape[1], K=a.shape[1], out=out.binding,
                     a=a.binding, b=b.binding, b_transposed=b_transposed, addend=bias and bias.binding,
                     absmax=ctx.scratch(gemm_passes.absmax_scratch_nbytes(a.numel, b.numel), "absmax"),
                     **ctx.gemm.plan_options, **coopmat_split_k_args(
                         ctx, "coopmat_mm_b_transposed" if b_transposed else "coopmat_mm", a.shape[0], b.shape[1],
                         a.shape[1]))
    # fp16: matmul.slang's FP16 variant where the route's size gate takes the product and it reads both operands
    # in place from their bindings' start (each one's absmax pass reads its first numel elements).
    if (not over and ctx.gemm.fp16_takes_mm(a.shape[0], b.shape[1], a.shape[1])
            and matmul.fp16_reads_in_place(a.strided, b.strided)):
        m, n, k = a.shape[0], b.shape[1], a.shape[1]
        nbytes = matmul.gemm_scratch_nbytes(1, m, n, k)  # the shared-memory body's split (GPU tuning)
        return call_plan(ctx, matmul.plan_gemm, out=out.binding, a=a.binding, a_view=a.strided, b=b.binding,
                     b_view=b.strided, bias=bias and bias.binding, bias_view=bias and bias.strided, alpha=alpha,
                     beta=beta, scratch=ctx.scratch(nbytes, "split_k") if nbytes else None, fp16=True,
                     absmax=ctx.scratch(gemm_passes.absmax_scratch_nbytes(a.numel, b.numel), "absmax"),
                     max_workgroup_size=ctx.max_workgroup_size, scale=scale)
    try:
        scratch = _split_k_scratch(ctx, 1, a.shape[0], b.shape[1], a.shape[1], *operands)
        return matmul.plan_gemm(out.binding, a.binding, a.strided, b.binding, b.strided, bias=bias and bias.binding,
                                bias_view=bias and bias.strided, alpha=alpha, beta=beta, scratch=scratch,
                                tuning=ctx.gemm.fp32_tuning, binding_limit=ctx.binding_limit,
                                max_workgroup_size=ctx.max_workgroup_size, scale=scale, label=ctx.label)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the matmul kernel refused it: {exc}") from exc


def _scaled_product(ctx: OpContext, out: TensorArg, scale: float) -> list[Dispatch]:
    """mm_scaled as the pair it replaced: aten.mm's plan of the same operands on this route into the output, then
    the multiply by the scale in place (gemm_passes.plan_scale_in_place: the fp32 multiply of the elementwise
    mul, binding the output once, as WebGPU requires), as many dispatches as the pair."""
    as_mm = dataclasses.replace(ctx, op=vk.OpCall("aten.mm.default", ctx.op.args[:2], ctx.op.outputs),
                                args=ctx.args[:2])
    return lower_gemm(as_mm) + [gemm_passes.plan_scale_in_place(out=out.binding, numel=out.numel, scale=scale,
                                                                 label=f"{ctx.label}.scale")]


def lower_bmm(ctx: OpContext) -> list[Dispatch]:
    a, b = _float_matrices(ctx, ((0, "self"), (1, "mat2")))
    scratch = _split_k_scratch(ctx, a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return call_plan(ctx, self=a.binding, self_shape=a.shape, self_dtype=a.dtype, mat2=b.binding,
                 mat2_shape=b.shape, mat2_dtype=b.dtype, out=ctx.outputs[0].binding, scratch=scratch,
                 tuning=ctx.gemm.fp32_tuning, max_workgroup_size=ctx.max_workgroup_size)


def lower_linear_q8_0(ctx: OpContext) -> list[Dispatch]:
    """linear_q8_0 (x @ W^T) and its backward (d_out @ W) of a Q8_0 matrix W [N, K] (kernels/q8_0.py), with
    the GEMM tuning and split-K scratch aten.mm gets."""
    check_definition(ctx)
    name = op_def(ctx.op.name).schema.arg_names[0]  # x or d_out
    rows_input, codes, scales = ctx.tensor(0, name), ctx.tensor(1, "codes"), ctx.tensor(2, "scales")
    inner, columns = rows_input.shape[-1], ctx.outputs[0].shape[-1]
    scratch = _split_k_scratch(ctx, 1, rows_input.numel // inner if inner else 0, columns, inner, rows_input, codes,
                               scales, ctx.outputs[0])
    return call_plan(ctx, **{name: rows_input.binding, f"{name}_shape": rows_input.shape}, codes=codes.binding,
                 codes_shape=codes.shape, scales=scales.binding, scales_shape=scales.shape, out=ctx.outputs[0].binding,
                 scratch=scratch, tuning=ctx.gemm.fp32_tuning, binding_limit=ctx.binding_limit,
                 max_workgroup_size=ctx.max_workgroup_size)


GEMM_LOWERINGS = {
    "aten.mm.default": lower_gemm, "aten.addmm.default": lower_gemm, MM_SCALED: lower_gemm,
    "aten.bmm.default": lower_bmm,
    "vktrain.linear_q8_0.default": lower_linear_q8_0, "vktrain.linear_q8_0_backward.default": lower_linear_q8_0,
}

__all__ = ["GEMM_LOWERINGS", "MM_SCALED", "coopmat_split_k_args", "lower_bmm", "lower_gemm", "lower_linear_q8_0"]

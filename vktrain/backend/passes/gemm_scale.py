"""GEMM scales: a matmul product multiplied by a scalar becomes one vktrain.mm_scaled (vktrain/opdefs/gemm_ops.py),
one dispatch and one pass over the product fewer, with every fp32 rounding unchanged. What it is for: a LoRA
adapter's `h = x @ A^T; hs = h * scaling` and its backward's `d_hs = (d_out @ B) * scaling` (the lora_linear
expansion's chain), two elementwise muls per adapted linear per step.

The pattern, over fp32 tensors:

    m = mm(a, b);  q = view(...view(m))          (zero or more shape-only views, each read only by the next)
    y = mul(q, s)                                (aten.mul.Tensor or aten.mul.Scalar)

where q is read by nothing but that mul and s is a Python number (finite, within fp32's range) or a 0-d
float32 constant tensor (either operand of mul.Tensor). It becomes

    m = mm_scaled(a, b, s);  y = view(...view(m))      (without views the mm_scaled writes y)

Why the same bits: the mul computed fl(q * fp32(s)) from q = fl(sum_k a_k b_k), the product rounded to fp32
by the GEMM; a kernel that multiplies its finished fp32 sum by fp32(s) makes exactly that one more rounding,
whichever dispatch does it. So the kernels multiply only after the whole sum exists: matmul_thin.slang's and
matmul.slang's store when unsplit (matmul's alpha), linear_splitk_reduce.slang after adding the slices in order
when split; never a partial slice (the product of a scaled slice sum is another rounding). Kernels that
cannot (coopmat_mm, windows over the binding limit) write the product into the output and a second dispatch
multiplies it there by the same fp32(s), as the unfused mul did (op_lowering.py). Nothing is contracted: the
multiply follows the last add.

Left alone: a product read by anything else (the unscaled values are needed), a view that is not shape-only
(permute, expand, slice: the mul would see another layout), a tensor scale other than a 0-d constant, an mm
whose second operand is a constant (the q8_0_weights pass rewrites exactly those mm ops), other dtypes.
After the lora_linear expansion and fusion (their final chain), before every storage pass (the views of the
mm_scaled's operands are theirs to decide: it reads lazy transposes in place as aten.mm does).
"""
from __future__ import annotations

import math

import numpy as np

from vktrain.serialization import graph as vk

from ..lifetimes import GraphUses, analyze_uses
from .gemm_epilogue import fp32_tensor, product_chain, reads_a_constant

MM_SCALED = "vktrain.mm_scaled.default"
MUL_OPS = ("aten.mul.Tensor", "aten.mul.Scalar")
_FP32_MAX = float(np.finfo(np.float32).max)


def _scalar(graph: vk.VkGraph, value_id: int) -> float | None:
    """The multiplier `value_id` stands for: a number, or the value of a 0-d float32 constant; None otherwise
    (and for a number fp32 cannot hold: the kernels take the scale as an fp32 push constant, as the mul did)."""
    value = graph.values[value_id]
    if isinstance(value, (vk.IntValue, vk.DoubleValue)):
        number = float(value.value)
    elif (isinstance(value, vk.TensorValue) and value.constant_id >= 0 and value.shape == ()
          and value.dtype == vk.DType.FLOAT32 and value.layout == vk.Layout.PLAIN):
        number = float(graph.constant_array(value_id))
    else:
        return None
    return number if math.isfinite(number) and abs(number) <= _FP32_MAX else None


def _fusion_of(graph: vk.VkGraph, uses: GraphUses, index: int) -> tuple[int, tuple[int, ...], float] | None:
    """(mm index, view indices, scale) when the mul at `index` scales a product of the pattern; else None."""
    op = graph.ops[index]
    if op.name not in MUL_OPS or len(op.args) != 2 or len(op.outputs) != 1:
        return None
    out = fp32_tensor(graph, op.outputs[0])
    if out is None:
        return None
    for q, s in ((op.args[0], op.args[1]), (op.args[1], op.args[0])):
        product, scale = fp32_tensor(graph, q), _scalar(graph, s)
        if product is None or scale is None or product.shape != out.shape:
            continue
        chain = product_chain(graph, uses, q, index)
        if chain is None or reads_a_constant(graph, uses, graph.ops[chain[0]].args[1]):
            continue
        return chain[0], chain[1], scale
    return None


def fuse_gemm_scales(graph: vk.VkGraph) -> None:
    """Fold every mul of the module docstring's pattern into its mm (each mul has its own product chain)."""
    uses = analyze_uses(graph)
    replaced: dict[int, list[vk.OpCall]] = {}
    for index, op in enumerate(graph.ops):
        fusion = _fusion_of(graph, uses, index) if op.name in MUL_OPS else None
        if fusion is None:
            continue
        mm_index, views, scale = fusion
        mm = graph.ops[mm_index]
        (y,) = op.outputs
        scale_id = graph.add_value(vk.DoubleValue(scale))
        replaced[index] = []
        replaced[mm_index] = [vk.OpCall(MM_SCALED, (*mm.args, scale_id), (mm.outputs[0] if views else y,))]
        if views:
            last = graph.ops[views[-1]]
            replaced[views[-1]] = [vk.OpCall(last.name, last.args, (y,))]
    if replaced:
        graph.ops = [new for index, op in enumerate(graph.ops) for new in replaced.get(index, [op])]

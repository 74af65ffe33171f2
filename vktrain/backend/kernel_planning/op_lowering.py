"""The op-lowering table: one delegate-blob op (name, argument value ids, output value ids) -> Dispatches.

The blob stores every op as `OpCall(name, args, outputs)` with arguments positional in schema order,
defaults filled in (vktrain/backend/preprocess.py). Kernel families register plan functions with
differing calling conventions (vktrain/backend/kernel_planning/kernels); this table adapts each graph op to its
family's plan call:

Every op's argument names, order and outputs are its definition's (vktrain/opdefs; aten schemas
generated from torch), and kernels are registered under the op's key (`vktrain.rms_norm.default`).

* By default an op uses the shared keyword convention (`_keyword_lowering`; the aten families of
  kernels/layout.py, swiglu): every schema argument under its schema name, tensors as a buffer binding
  plus `<name>_shape` / `<name>_dtype`, the outputs under their names (`out` for a single unnamed one).
* vktrain ops (linear_q4gsw, linear_q4gsw_backward, linear_dW, fused_ce, adamw, q4gsw_requant, and the
  transformer ops rms_norm, rope, causal_attention with their backwards) have shape-explicit plan
  functions. Each call is first checked by the op definition's shape function (the same rule
  the partitioner and the torch fake kernels apply) and its outputs compared with what it returns;
  a small adapter per op then derives M / N / K / R / V (or B / S / H / D) from the shapes, allocates
  op-owned scratch (fused_ce's row losses, attention backward's `delta`) and passes the device's
  limits (shared memory, workgroup invocations; `OpContext.limits`) to the plans that size tiles or
  workgroups by them.
* aten.empty / empty_permuted need no GPU work: their contents are undefined (`kernel=None`).
* transposes (permute_copy, t_copy, transpose_copy) read strided views: a transpose the backend made a
  view (vktrain/backend/passes/views.py) costs nothing.
* the GEMM ops (mm, addmm, vktrain.mm_scaled, bmm, the Q8_0 linears) are gemm_lowering.py's; the checks and
  the plan call every lowering shares are lowering_checks.py's.

* `OpContext.gemm`, the GemmRoute chosen at load (kernels/coopmat.py), may send linear_q4gsw (without
  bias), linear_q4gsw_backward, mm and addmm (with an addend of the output's shape), and causal_attention
  (and its backward: kernels/coopmat_attention.py) to their tensor-core kernels; every other op keeps its
  fp32 kernel, and so does a linear q4gsw op with a binding over the limit (the fp32 kernels split it into
  windows, kernels/linear.py; the coopmat ones have no windows). A q4gsw op's tensor-core plan may take an
  addmm's rank-r product into its epilogue (`OpContext.rank_product`, offered by the planner:
  rank_epilogue.py).

The executor (executor.py) hands each lowering an OpContext of `TensorArg`s (lowering_context.py) whose bindings and views are the storage
the backend recorded in the blob, so view and in-place decisions never leak into this table.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from vktrain.opdefs import OP_DEFS, TensorMeta, op_def
from vktrain.quant import padded_k, w4x8_num_words
from vktrain.serialization import graph as vk

# Importing the kernels package imports every family, so KERNELS is complete.
from vktrain.backend.kernel_planning.kernels import (KERNELS, attention, coopmat, coopmat_attention, coopmat_tiling,
                                             copies, cross_entropy, gemm_passes, layout, linear, linear_tiles,
                                             norm)
from vktrain.backend.kernel_planning.gemm_lowering import GEMM_LOWERINGS, coopmat_split_k_args
from vktrain.backend.kernel_planning.lowering_checks import call_plan, check_definition, over_binding_limit
from vktrain.backend.kernel_planning.lowering_context import OpContext, OpLowering, TensorArg
from vktrain.errors import GraphLoweringError
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.strided_view import TRANSPOSE_OPS, StridedView, transposed_view


# ------------------------------------------------------------------------------------------------
# aten ops: the shared keyword convention
# ------------------------------------------------------------------------------------------------

def _keyword_lowering(key: str) -> Callable[[OpContext], list[Dispatch]]:
    """The shared keyword convention: the plan registered under `key` gets every schema argument under
    its name (tensors as binding + `<name>_shape` + `<name>_dtype`, tensor lists as bindings +
    `<name>_shapes` + `<name>_dtype`) and every output binding under its output name (`out` for a single
    unnamed one), after the op definition's checks."""
    schema = op_def(key).schema
    names, output_names = schema.arg_names, schema.output_names

    def lower(ctx: OpContext) -> list[Dispatch]:
        check_definition(ctx)
        kwargs: dict[str, Any] = {}
        for name, value in zip(names, ctx.args):
            if isinstance(value, TensorArg):
                kwargs[name] = value.binding
                kwargs[f"{name}_shape"] = value.shape
                kwargs[f"{name}_dtype"] = value.dtype
            elif isinstance(value, list):  # a tensor list (aten.cat's `tensors`)
                if not value:
                    raise ctx.fail(f"argument {name!r} is an empty tensor list")
                dtypes = {t.dtype for t in value}
                if len(dtypes) != 1:
                    raise ctx.fail(f"tensor list {name!r} mixes dtypes {sorted(dtypes)}")
                kwargs[name] = [t.binding for t in value]
                kwargs[f"{name}_shapes"] = [t.shape for t in value]
                kwargs[f"{name}_dtype"] = dtypes.pop()
            else:
                kwargs[name] = value
        kwargs.update((name, output.binding) for name, output in zip(output_names, ctx.outputs))
        parameters = inspect.signature(KERNELS[key]).parameters
        if "binding_limit" in parameters:  # it can split a tensor over the limit
            kwargs["binding_limit"] = ctx.binding_limit
        if "max_workgroup_size" in parameters:  # it sizes its workgroups by the device's limit
            kwargs["max_workgroup_size"] = ctx.max_workgroup_size
        try:
            return KERNELS[key](label=ctx.label, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ctx.fail(f"the kernel refused it: {exc}") from exc

    return lower


# ------------------------------------------------------------------------------------------------
# vktrain ops: shape-explicit plan functions
# ------------------------------------------------------------------------------------------------

def _check_q4gsw_call(ctx: OpContext) -> None:
    """The definition's checks of a linear q4gsw op, whose weights (argument 1) the blob stores as W_4X8
    words: the definition describes them as the flat uint8 [N, Kp/2] codes those words hold."""
    weights, scales, group_size = ctx.tensor(1, "weights"), ctx.tensor(2, "scales"), ctx.args[3]
    if weights.layout != vk.Layout.Q4GSW_W4X8:
        raise ctx.fail(f"weights (value {weights.value_id}) have layout {weights.layout.name}; the GPU kernels read "
                       f"Q4GSW_W4X8 words (the backend prepacks constant q4gsw weights)")
    logical = {}
    if len(scales.shape) == 2 and isinstance(group_size, int) and group_size > 0:
        n, k = _q4gsw_dims(scales, group_size)
        words = w4x8_num_words(n, k) if n % 4 == 0 and k % 4 == 0 else None
        if words is not None and weights.binding.size != 4 * words:
            raise ctx.fail(f"weights hold {weights.binding.size} bytes of W_4X8 words, expected {4 * words} for "
                           f"N={n}, K={k} (scales {list(scales.shape)}, group_size={group_size})")
        logical[1] = TensorMeta((n, padded_k(k) // 2), "uint8")
    check_definition(ctx, logical)


def _q4gsw_dims(scales: TensorArg, group_size: int) -> tuple[int, int]:
    """(N, K) from scales [G, N] and group_size (CONTRACTS.md: K = G * group_size)."""
    groups, n = scales.shape
    return n, groups * group_size


def _profile_tiles(ctx: OpContext, op: str) -> Optional[linear.GemmTiles]:
    """The device profile's tiles for the linear family's tiled body (DeviceProfile.gemm_tiles, the vendor
    table); on a profile without them allowing fewer invocations than the default tiles' 256, tiles within
    its limit (linear_tiles.narrow_gemm_tiles); else None, the kernels' default choice."""
    tiles = ctx.profile.gemm_tiles if ctx.profile is not None else ()
    if tiles:
        return linear.GemmTiles(*tiles)
    if ctx.profile is not None and ctx.max_workgroup_size < linear_tiles.DEFAULT_GEMM_THREADS:
        return linear_tiles.narrow_gemm_tiles(op, ctx.max_workgroup_size)
    return None


def _split_k_args(ctx: OpContext, plan: str, m: int, n: int, k: int, group_size: int = 0,
                  windowed: bool = False, fp16: bool = False) -> dict:
    """Scratch for the linear family's deterministic split-K (used when the output has too few tiles to
    fill the GPU, e.g. M = 128 tokens; never by an op cut into windows over the binding limit), the
    device's shared memory and tiles for the tile choice, and `fp16` (the FP16 variant, fp16 policy)."""
    tiles = _profile_tiles(ctx, plan)
    nbytes = 0 if windowed else linear.plan_scratch_nbytes(plan, M=m, N=n, K=k, group_size=group_size,
                                                           tuning=ctx.gemm.fp32_tuning, fp16=fp16, gemm_tiles=tiles)
    extra = {"shared_memory_bytes": ctx.shared_memory_bytes, "tuning": ctx.gemm.fp32_tuning}
    extra.update({"gemm_tiles": tiles} if tiles is not None else {}, **({"fp16": True} if fp16 else {}))
    if nbytes:
        extra["scratch"] = ctx.scratch(nbytes, "split_k")
    return extra


def _rank_args(ctx: OpContext, kernel: str, m: int, n: int, reduction: int) -> dict:
    """The coopmat plan's arguments that add `ctx.rank_product` in its epilogue (the output is then the
    product's; rank_epilogue.py), or {} where this plan cannot: it would split the reduction, its tiling's
    variant is not prebuilt (the emulated route builds them on demand), or the emulated loops would run past
    lavapipe's budget."""
    product = ctx.rank_product
    if product is None or ctx.gemm.wgsl or ctx.gemm.default_split_k(kernel, m, n, reduction) != 1:
        return {}
    tiling = coopmat_tiling.default_tiling(kernel, m, n, reduction, emulate=ctx.gemm.emulate)
    if ctx.gemm.emulate:
        trips = coopmat_tiling.emulated_loop_trips(tiling, reduction, ctx.gemm.subgroup_size, product.epilogue.rank)
        if trips > coopmat_tiling.EMULATED_LOOP_BUDGET:
            return {}
    elif tiling.name not in coopmat_tiling.RANK_TILINGS[kernel]:
        return {}
    return {"out": product.out, "rank_epilogue": product.epilogue}


def _lower_linear_q4gsw(ctx: OpContext) -> list[Dispatch]:
    _check_q4gsw_call(ctx)
    x, weights, scales = ctx.tensor(0, "x"), ctx.tensor(1, "weights"), ctx.tensor(2, "scales")
    group_size, bias = ctx.args[3], ctx.args[4]
    n, k = _q4gsw_dims(scales, group_size)
    m = x.numel // k
    gemm = dict(M=m, N=n, K=k, group_size=group_size, out=ctx.outputs[0].binding, x=x.binding,
                weights=weights.binding, scales=scales.binding)
    over = over_binding_limit(ctx, [x, weights, scales, ctx.outputs[0]] + ([] if bias is None else [bias]))
    # The coopmat kernel has no bias epilogue, and no windows: an op over the limit takes the fp32 kernels.
    if bias is None and not over and ctx.gemm.takes_tensor_cores(m, n, k):
        rank = _rank_args(ctx, "coopmat_linear_q4gsw", m, n, k)
        return call_plan(ctx, coopmat.plan_coopmat_linear_q4gsw, **{**gemm, **rank}, **ctx.gemm.plan_options,
                     **({} if rank else coopmat_split_k_args(ctx, "coopmat_linear_q4gsw", m, n, k)))
    # fp16: the FP16 variant of the tiled body; no windows (an op over the limit keeps the fp32 kernels).
    return call_plan(ctx, **gemm, bias=None if bias is None else bias.binding, binding_limit=ctx.binding_limit,
                 max_workgroup_size=ctx.max_workgroup_size,
                 **_split_k_args(ctx, "linear_q4gsw", m, n, k, group_size, over, fp16=ctx.gemm.fp16_simt and not over))


def _lower_linear_q4gsw_backward(ctx: OpContext) -> list[Dispatch]:
    _check_q4gsw_call(ctx)
    d_out, weights, scales = ctx.tensor(0, "d_out"), ctx.tensor(1, "weights"), ctx.tensor(2, "scales")
    group_size = ctx.args[3]
    n, k = _q4gsw_dims(scales, group_size)
    m = d_out.numel // n
    gemm = dict(M=m, N=n, K=k, group_size=group_size, out=ctx.outputs[0].binding, d_out=d_out.binding,
                weights=weights.binding, scales=scales.binding)
    over = over_binding_limit(ctx, [d_out, weights, scales, ctx.outputs[0]])
    if not over and ctx.gemm.takes_tensor_cores(m, k, n):
        rank = _rank_args(ctx, "coopmat_linear_q4gsw_backward", m, k, n)
        return call_plan(ctx, coopmat.plan_coopmat_linear_q4gsw_backward, **{**gemm, **rank}, **ctx.gemm.plan_options,
                     absmax=ctx.scratch(gemm_passes.absmax_scratch_nbytes(m * n), "absmax"),
                     **({} if rank else coopmat_split_k_args(ctx, "coopmat_linear_q4gsw_backward", m, k, n)))
    if ctx.gemm.fp16_simt and not over:
        return call_plan(ctx, **gemm, binding_limit=ctx.binding_limit, max_workgroup_size=ctx.max_workgroup_size,
                     absmax=ctx.scratch(gemm_passes.absmax_scratch_nbytes(m * n), "absmax"),
                     **_split_k_args(ctx, "linear_q4gsw_backward", m, n, k, group_size, fp16=True))
    return call_plan(ctx, **gemm, binding_limit=ctx.binding_limit, max_workgroup_size=ctx.max_workgroup_size,
                 **_split_k_args(ctx, "linear_q4gsw_backward", m, n, k, group_size, over))


def _lower_linear_dw(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    d_out, x = ctx.tensor(0, "d_out"), ctx.tensor(1, "x")
    n, k = d_out.shape[-1], x.shape[-1]
    m = d_out.numel // n if n else 0
    return call_plan(ctx, M=m, N=n, K=k, out=ctx.outputs[0].binding, d_out=d_out.binding, x=x.binding,
                 **_split_k_args(ctx, "linear_dW", m, n, k))


def _lower_fused_ce(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    logits, labels, n_valid = ctx.tensor(0, "logits"), ctx.tensor(1, "labels"), ctx.tensor(2, "n_valid")
    loss, dlogits = ctx.outputs
    rows, vocab = logits.shape
    row_loss = ctx.scratch(cross_entropy.fused_ce_scratch_nbytes(rows), "row_loss")
    return call_plan(ctx, R=rows, V=vocab, logits=logits.binding, labels=labels.binding, n_valid=n_valid.binding,
                 loss=loss.binding, dlogits=dlogits.binding, row_loss=row_loss, binding_limit=ctx.binding_limit,
                 workgroup_size=_reduction_workgroup_size(ctx, cross_entropy.DEFAULT_WORKGROUP_SIZE))


def _lower_adamw(ctx: OpContext) -> list[Dispatch]:
    """The GPU kernel updates (param, exp_avg, exp_avg_sq) in place. Where the blob stores an output in
    its input's storage (the backend's in-place pass) the kernel runs on it directly; otherwise the input
    is first copied into the output, which the kernel then updates."""
    check_definition(ctx)
    names = ("param", "exp_avg", "exp_avg_sq")
    sources = [ctx.tensor(i, name) for i, name in enumerate(names)]
    grad, hparams, step = ctx.tensor(3, "grad"), ctx.tensor(4, "hparams"), ctx.tensor(5, "step")
    numel = sources[0].numel
    dispatches: list[Dispatch] = []
    for source, target, name in zip(sources, ctx.outputs, names):
        if target.storage != source.storage:
            dispatches += copy_words(target.binding, source.binding, source.binding.size,
                                     label=f"{ctx.label}.copy_{name}", binding_limit=ctx.binding_limit)
    if numel == 0:
        return dispatches
    return dispatches + call_plan(ctx, numel=numel, param=ctx.outputs[0].binding,
                              exp_avg=ctx.outputs[1].binding, exp_avg_sq=ctx.outputs[2].binding,
                              grad=grad.binding, hparams=hparams.binding, step=step.binding,
                              binding_limit=ctx.binding_limit)


def _lower_q4gsw_requant(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    latent, scales = ctx.tensor(0, "latent"), ctx.tensor(1, "scales")
    group_size = ctx.args[2]
    n, k = _q4gsw_dims(scales, group_size)
    return call_plan(ctx, N=n, K=k, group_size=group_size, out=ctx.outputs[0].binding,
                 latent=latent.binding, scales=scales.binding)


# ------------------------------------------------------------------------------------------------
# Transformer ops (CONTRACTS.md "Transformer ops"): activations [B, S, H, D], fp32, contiguous
# ------------------------------------------------------------------------------------------------

def _reduction_workgroup_size(ctx: OpContext, default: int) -> int:
    """A shared-memory tree's default workgroup (rms_norm, fused_ce), lowered to the largest power of two the
    device allows. A smaller tree adds in another order: the same bits only while each thread holds one value
    of a row (fused_ce: V <= 4 x 128 on the 128-invocation profiles), else within fp32 summation's bound."""
    return layout.fitted_workgroup(default, ctx.max_workgroup_size)


def _lower_rms_norm(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    x, weight = ctx.tensor(0, "x"), ctx.tensor(1, "weight")
    y, rstd = ctx.outputs
    return call_plan(ctx, rows=x.numel // x.shape[-1], dim=x.shape[-1], x=x.binding, weight=weight.binding,
                 y=y.binding, rstd=rstd.binding, eps=ctx.real(2, "eps"), workgroup_size=_reduction_workgroup_size(ctx, norm.DEFAULT_WORKGROUP_SIZE))


def _lower_rms_norm_backward(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    d_y, x, weight, rstd = (ctx.tensor(i, name) for i, name in enumerate(("d_y", "x", "weight", "rstd")))
    return call_plan(ctx, rows=x.numel // x.shape[-1], dim=x.shape[-1], d_y=d_y.binding, x=x.binding,
                 weight=weight.binding, rstd=rstd.binding, d_x=ctx.outputs[0].binding,
                 workgroup_size=_reduction_workgroup_size(ctx, norm.DEFAULT_WORKGROUP_SIZE))


def _lower_rope(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    x, cos, sin = ctx.tensor(0, "x"), ctx.tensor(1, "cos"), ctx.tensor(2, "sin")
    batch, seq, heads, head_dim = x.shape
    return call_plan(ctx, B=batch, S=seq, H=heads, D=head_dim, x=x.binding, cos=cos.binding, sin=sin.binding,
                 out=ctx.outputs[0].binding, per_token=len(cos.shape) == 3)


def _attention_dims(q: TensorArg, k: TensorArg) -> dict[str, int]:
    """B, S, Hq, Hkv, D of q [B, S, Hq, D] and k = v [B, S, Hkv, D]."""
    batch, seq, q_heads, head_dim = q.shape
    return dict(B=batch, S=seq, Hq=q_heads, Hkv=k.shape[2], D=head_dim)


def _lower_causal_attention(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    q, k, v = ctx.tensor(0, "q"), ctx.tensor(1, "k"), ctx.tensor(2, "v")
    out, lse = ctx.outputs
    dims, shared = _attention_dims(q, k), ctx.shared_memory_bytes
    args = dict(**dims, q=q.binding, k=k.binding, v=v.binding, out=out.binding, lse=lse.binding,
                scale=ctx.real(3, "scale"), shared_memory_bytes=shared)
    if ctx.args[4] is not None:  # packed documents: the fp32 kernels' DOCUMENTS variant (no tensor-core one)
        return call_plan(ctx, **args, positions=ctx.tensor(4, "positions").binding,
                     max_workgroup_size=ctx.max_workgroup_size)
    if coopmat_attention.takes_tensor_cores(ctx.gemm, **dims, shared_memory_bytes=shared, backward=False):
        return call_plan(ctx, coopmat_attention.plan_coopmat_causal_attention, **args, **ctx.gemm.plan_options)
    return call_plan(ctx, **args, max_workgroup_size=ctx.max_workgroup_size)


def _lower_causal_attention_backward(ctx: OpContext) -> list[Dispatch]:
    check_definition(ctx)
    names = ("d_out", "q", "k", "v", "out", "lse")
    d_out, q, k, v, out, lse = (ctx.tensor(i, name) for i, name in enumerate(names))
    dims = _attention_dims(q, k)
    try:
        delta_nbytes = attention.causal_attention_backward_scratch_nbytes(dims["B"], dims["S"], dims["Hq"])
    except ValueError as exc:
        raise ctx.fail(f"the causal_attention_backward kernel refused it: {exc}") from exc
    delta = ctx.scratch(delta_nbytes, "delta")
    d_q, d_k, d_v = ctx.outputs
    args = dict(**dims, d_out=d_out.binding, q=q.binding, k=k.binding, v=v.binding, out=out.binding,
                lse=lse.binding, d_q=d_q.binding, d_k=d_k.binding, d_v=d_v.binding, delta=delta,
                scale=ctx.real(6, "scale"), shared_memory_bytes=ctx.shared_memory_bytes)
    if ctx.args[7] is not None:  # packed documents: as the forward
        return call_plan(ctx, **args, positions=ctx.tensor(7, "positions").binding,
                     max_workgroup_size=ctx.max_workgroup_size)
    if coopmat_attention.takes_tensor_cores(ctx.gemm, **dims, shared_memory_bytes=ctx.shared_memory_bytes,
                                            backward=True):
        absmax = ctx.scratch(coopmat_attention.backward_absmax_scratch_nbytes(**dims), "absmax")
        return call_plan(ctx, coopmat_attention.plan_coopmat_causal_attention_backward, **args, absmax=absmax,
                     **ctx.gemm.plan_options)
    return call_plan(ctx, **args, max_workgroup_size=ctx.max_workgroup_size)


# ------------------------------------------------------------------------------------------------
# Uninitialised tensors: no GPU work
# ------------------------------------------------------------------------------------------------

def _lower_empty(ctx: OpContext) -> list[Dispatch]:
    """aten.empty / empty_permuted: the output's buffer already exists and its contents are undefined by
    definition, so nothing runs (decomposed SiLU backwards build a `full_like` shaped after one). Only the
    contiguous physical layout exists on the GPU."""
    if ctx.op.name == EMPTY_PERMUTED:
        layout_order = ctx.args[1]
        if layout_order is None or tuple(layout_order) != tuple(range(len(ctx.outputs[0].shape))):
            raise ctx.fail(f"physical_layout {layout_order} is not the contiguous order; only contiguous tensors "
                           f"live on the GPU")
    else:
        memory_format = ctx.args[-1]
        if memory_format not in (None, "contiguous_format", "preserve_format"):
            raise ctx.fail(f"memory_format {memory_format!r} is not supported; only contiguous tensors live on "
                           f"the GPU")
    return []


EMPTY_PERMUTED = "aten.empty_permuted.default"
EMPTY = "aten.empty.memory_format"


def copy_words(out: BufferBinding, source: BufferBinding, nbytes: int, *, label: str,
               binding_limit: layout.BindingLimit | None = None) -> list[Dispatch]:
    """A flat copy of `nbytes` (a multiple of 4) from `source` to `out`; copy.slang moves 32-bit words,
    so one kernel copies every 4-byte dtype. Over `binding_limit` it runs in windows (copies.plan_copy)."""
    if nbytes % 4:
        raise GraphLoweringError(f"{label}: cannot copy {nbytes} bytes, the copy kernel moves 32-bit words")
    return copies.plan_copy(out, source, StridedView.contiguous((nbytes // 4,)), label=label,
                            binding_limit=binding_limit)


def _lower_transpose(ctx: OpContext) -> list[Dispatch]:
    """A materialised transpose: one strided copy, reading the input through its own view (so a chain
    of transposes costs one copy at most)."""
    source = ctx.tensor(0, "self")
    try:
        view = transposed_view(ctx.op.name, ctx.args[1:], source.strided)
        return copies.plan_copy(ctx.outputs[0].binding, source.binding, view, label=ctx.label,
                                binding_limit=ctx.binding_limit)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the copy kernel refused it: {exc}") from exc


# vktrain ops whose plans take derived sizes (M / N / K, B / S / H / D) instead of the keyword convention.
_VKTRAIN_LOWERINGS = {
    "vktrain.linear_q4gsw.default": _lower_linear_q4gsw,
    "vktrain.linear_q4gsw_backward.default": _lower_linear_q4gsw_backward,
    "vktrain.linear_dW.default": _lower_linear_dw,
    "vktrain.fused_ce.default": _lower_fused_ce,
    "vktrain.adamw.default": _lower_adamw,
    "vktrain.q4gsw_requant.default": _lower_q4gsw_requant,
    "vktrain.rms_norm.default": _lower_rms_norm,
    "vktrain.rms_norm_backward.default": _lower_rms_norm_backward,
    "vktrain.rope.default": _lower_rope,
    "vktrain.causal_attention.default": _lower_causal_attention,
    "vktrain.causal_attention_backward.default": _lower_causal_attention_backward,
}
# Ops whose lowering is not the shared keyword convention (every other defined op uses it).
_CUSTOM_LOWERINGS = {
    **_VKTRAIN_LOWERINGS,
    **{key: _lower_transpose for key in TRANSPOSE_OPS},
    **GEMM_LOWERINGS,
}

OP_LOWERINGS: dict[str, OpLowering] = {
    **{key: OpLowering(key, _CUSTOM_LOWERINGS.get(key) or _keyword_lowering(key)) for key in OP_DEFS},
    EMPTY: OpLowering(EMPTY, _lower_empty, needs_kernel=False),
    EMPTY_PERMUTED: OpLowering(EMPTY_PERMUTED, _lower_empty, needs_kernel=False),
}


def _executable(lowering: OpLowering) -> bool:
    return not lowering.needs_kernel or lowering.key in KERNELS


def supported_ops() -> list[str]:
    """Graph op names this runtime can execute (a lowering exists and the kernel it needs is registered);
    vktrain.opdefs.runtime_ops.RUNTIME_OPS says the same as data (tests/test_partitioner.py)."""
    return sorted(name for name, lowering in OP_LOWERINGS.items() if _executable(lowering))


def lowering_for(op: vk.OpCall, index: int) -> OpLowering:
    """The lowering of `op`, or GraphLoweringError("unsupported op <name>") naming what exists."""
    lowering = OP_LOWERINGS.get(op.name)
    if lowering is None or not _executable(lowering):
        raise GraphLoweringError(f"unsupported op {op.name} (op {index}): no Vulkan kernel implements it; "
                                 f"supported ops: {', '.join(supported_ops())}")
    # A blob written before an optional argument joined the schema (causal_attention's positions) has fewer:
    # the missing ones take their default, None.
    omitted = lowering.definition.schema.arguments[len(op.args):]
    if len(op.args) > len(lowering.arg_names) or any(argument.default != "None" for argument in omitted):
        raise GraphLoweringError(
            f"op {index} ({op.name}) has {len(op.args)} arguments, its schema has {len(lowering.arg_names)} "
            f"({', '.join(lowering.arg_names)})")
    if len(op.outputs) != lowering.num_outputs:
        raise GraphLoweringError(f"op {index} ({op.name}) has {len(op.outputs)} outputs, expected "
                                 f"{lowering.num_outputs}")
    return lowering



"""The op-lowering table: one delegate-blob op (name, argument value ids, output value ids) -> Dispatches.

The blob stores every op as `OpCall(name, args, outputs)` with arguments positional in schema order,
defaults filled in (vktrain/backend/preprocess.py). Kernel families register plan functions with
differing calling conventions (vktrain/runtime/delegate/kernels); this table adapts each graph op to its
family's plan call:

* aten ops use the shared convention of the aten families (kernels/layout.py): every schema argument
  under its schema name, tensors as a buffer binding plus `<name>_shape` / `<name>_dtype`, the output
  as `out`. The table only needs each op's schema argument names (`ATEN_SCHEMA_ARGS`).
* vktrain ops (linear_q4gsw, linear_q4gsw_backward, linear_dW, fused_ce, adamw, q4gsw_requant, and the
  transformer ops rms_norm, rope, causal_attention, swiglu with their backwards) have shape-explicit
  plan functions; a small adapter per op derives M / N / K / R / V (or B / S / H / D) from the shapes,
  checks them, allocates op-owned scratch (fused_ce's row losses, attention backward's `delta`) and
  passes the device's limits (shared memory, workgroup invocations; `OpContext.limits`) to the plans
  that size tiles or workgroups by them.
* aten.empty / empty_permuted need no GPU work: their contents are undefined (`kernel=None`).
* transposes (permute_copy, t_copy, transpose_copy) and aten.mm read strided views: a transpose the
  backend made a view (vktrain/backend/passes/views.py) costs nothing, and mm reads it in place
  through the GEMM's operand strides.
  mm / bmm / addmm allocate a split-K scratch when the GEMM plan would split (skinny output, long
  reduction: kernels/matmul.py `gemm_scratch_nbytes`), and nothing otherwise.

The executor (executor.py) hands each lowering `TensorArg`s whose bindings and views are the storage
the backend recorded in the blob, so view and in-place decisions never leak into this table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from vktrain.serialization import graph as vk

# Importing the kernels package imports every family, so KERNELS is complete.
from vktrain.runtime.delegate.kernels import KERNELS, attention, cross_entropy, layout, linear, matmul, norm
from vktrain.runtime.vk.schedule import BufferBinding, Dispatch
from vktrain.errors import VktrainError


# adamw's hparams tensor: [lr, beta1, beta2, eps, weight_decay] (CONTRACTS.md).
ADAMW_HPARAMS = 5


class GraphLoweringError(VktrainError, ValueError):
    """A graph op cannot be lowered: unknown op, wrong arity, or arguments no kernel accepts."""


# ------------------------------------------------------------------------------------------------
# What a lowering sees
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorArg:
    """A tensor value as a kernel binds it: `binding` covers exactly the value's bytes on the GPU.

    `dtype` is the graph dtype name ("float32", "int64", ...); int64 tensors are stored as int32 (the
    blob records it; the executor converts them on upload) and the aten families accept "int64" meaning
    exactly that. `layout` is the graph layout (q4gsw weights are W_4X8 words on the GPU). `view` is the
    strided view the blob records for a lazily transposed tensor (a permutation of another tensor's
    bytes, never materialised); the backend only leaves those for ops that read strided operands.
    """

    value_id: int
    binding: BufferBinding
    shape: tuple[int, ...]
    dtype: str
    layout: vk.Layout = vk.Layout.PLAIN
    view: Optional[layout.StridedView] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strided(self) -> layout.StridedView:
        """How a kernel reads this tensor from its binding (contiguous unless lazily transposed)."""
        return self.view if self.view is not None else layout.StridedView.contiguous(self.shape)

    @property
    def storage(self) -> Any:
        """The buffer key this tensor lives in (two TensorArgs with equal storage share bytes)."""
        return self.binding.buffer


@dataclass
class OpContext:
    """One op, decoded: `args` in schema order (TensorArg, None, int, float, bool, str, tuple of
    numbers, or list of TensorArg for a tensor list), `outputs` as TensorArg."""

    index: int
    op: vk.OpCall
    args: list
    outputs: list
    label: str
    # Allocates a scratch buffer owned by this op: (nbytes, purpose) -> binding.
    scratch: Callable[[int, str], BufferBinding]
    # The device's DeviceLimits (vktrain.runtime.vk.device), for kernels that size workgroups or shared
    # memory tiles by them; None: the Vulkan-guaranteed minimums the kernels default to.
    limits: Optional[Any] = None

    def fail(self, message: str) -> GraphLoweringError:
        return GraphLoweringError(f"op {self.index} ({self.op.name}): {message}")

    def tensor(self, position: int, name: str) -> TensorArg:
        value = self.args[position]
        if not isinstance(value, TensorArg):
            raise self.fail(f"argument {position} ({name}) must be a tensor, got {value!r}")
        return value

    def integer(self, position: int, name: str) -> int:
        value = self.args[position]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"argument {position} ({name}) must be an int, got {value!r}")
        return value

    def real(self, position: int, name: str) -> float:
        value = self.args[position]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"argument {position} ({name}) must be a number, got {value!r}")
        return float(value)

    @property
    def shared_memory_bytes(self) -> int:
        """Shared memory a workgroup may use on this device."""
        if self.limits is None:
            return attention.DEFAULT_SHARED_MEMORY_BYTES
        return int(self.limits.max_compute_shared_memory_size)

    @property
    def max_workgroup_size(self) -> int:
        """Invocations a workgroup may have on this device (1-D workgroups)."""
        if self.limits is None:
            return attention.DEFAULT_MAX_WORKGROUP_SIZE
        return min(int(self.limits.max_compute_work_group_invocations),
                   int(self.limits.max_compute_work_group_size[0]))


@dataclass(frozen=True)
class OpLowering:
    """How one graph op becomes dispatches: `kernel` is the registry key it needs (None: it needs no
    kernel), `arg_names` the schema's argument names in blob order, `num_outputs` the outputs it produces."""

    kernel: Optional[str]
    arg_names: tuple[str, ...]
    lower: Callable[[OpContext], list[Dispatch]]
    num_outputs: int = 1


# ------------------------------------------------------------------------------------------------
# aten ops: the shared keyword convention
# ------------------------------------------------------------------------------------------------

# Schema argument names, in schema order (keyword-only arguments included), of every aten op a family
# implements. The blob passes exactly these, positionally.
ATEN_SCHEMA_ARGS: dict[str, tuple[str, ...]] = {
    "aten.view_copy.default": ("self", "size"),
    "aten.clone.default": ("self", "memory_format"),
    "aten._to_copy.default": ("self", "dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"),
    "aten.permute_copy.default": ("self", "dims"),
    "aten.t_copy.default": ("self",),
    "aten.transpose_copy.int": ("self", "dim0", "dim1"),
    "aten.expand_copy.default": ("self", "size", "implicit"),
    "aten.unsqueeze_copy.default": ("self", "dim"),
    "aten.squeeze_copy.dims": ("self", "dim"),
    "aten.squeeze_copy.dim": ("self", "dim"),
    "aten.squeeze_copy.default": ("self",),
    "aten.alias_copy.default": ("self",),
    "aten.slice_copy.Tensor": ("self", "dim", "start", "end", "step"),
    "aten.select_copy.int": ("self", "dim", "index"),
    "aten.cat.default": ("tensors", "dim"),
    "aten.neg.default": ("self",),
    "aten.relu.default": ("self",),
    "aten.sigmoid.default": ("self",),
    "aten.silu.default": ("self",),
    "aten.exp.default": ("self",),
    "aten.rsqrt.default": ("self",),
    "aten.sqrt.default": ("self",),
    "aten.gelu.default": ("self", "approximate"),
    "aten.tanh.default": ("self",),
    "aten.erf.default": ("self",),
    "aten.log.default": ("self",),
    "aten.reciprocal.default": ("self",),
    "aten.abs.default": ("self",),
    "aten.pow.Tensor_Scalar": ("self", "exponent"),
    "aten.pow.Tensor_Tensor": ("self", "exponent"),
    "aten.mul.Scalar": ("self", "other"),
    "aten.add.Scalar": ("self", "other", "alpha"),
    "aten.sub.Scalar": ("self", "other", "alpha"),
    "aten.rsub.Scalar": ("self", "other", "alpha"),
    "aten.div.Scalar": ("self", "other"),
    "aten.add.Tensor": ("self", "other", "alpha"),
    "aten.sub.Tensor": ("self", "other", "alpha"),
    "aten.mul.Tensor": ("self", "other"),
    "aten.div.Tensor": ("self", "other"),
    "aten.maximum.default": ("self", "other"),
    "aten.minimum.default": ("self", "other"),
    "aten.silu_backward.default": ("grad_output", "self"),
    "aten.sigmoid_backward.default": ("grad_output", "output"),
    "aten.tanh_backward.default": ("grad_output", "output"),
    "aten.threshold_backward.default": ("grad_output", "self", "threshold"),
    "aten.gelu_backward.default": ("grad_output", "self", "approximate"),
    "aten.sum.dim_IntList": ("self", "dim", "keepdim", "dtype"),
    "aten.sum.default": ("self", "dtype"),
    "aten.mean.dim": ("self", "dim", "keepdim", "dtype"),
    "aten.amax.default": ("self", "dim", "keepdim"),
    "aten.mm.default": ("self", "mat2"),
    "aten.bmm.default": ("self", "mat2"),
    "aten.addmm.default": ("self", "mat1", "mat2", "beta", "alpha"),
    "aten.linear.default": ("input", "weight", "bias"),
    "aten.baddbmm.default": ("self", "batch1", "batch2", "beta", "alpha"),
    "aten.embedding.default": ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"),
    "aten.embedding_dense_backward.default": ("grad_output", "indices", "num_weights", "padding_idx",
                                              "scale_grad_by_freq"),
    # Fills: the tensor argument of the *_like ops only gives the shape (and default dtype).
    "aten.full.default": ("size", "fill_value", "dtype", "layout", "device", "pin_memory"),
    "aten.full_like.default": ("self", "fill_value", "dtype", "layout", "device", "pin_memory", "memory_format"),
    "aten.zeros_like.default": ("self", "dtype", "layout", "device", "pin_memory", "memory_format"),
    "aten.ones_like.default": ("self", "dtype", "layout", "device", "pin_memory", "memory_format"),
    "aten.scalar_tensor.default": ("s", "dtype", "layout", "device", "pin_memory"),
    # ExecuTorch's edge dialect spells dtype conversions this way (a dim order instead of a memory
    # format); only the contiguous dim order exists on the GPU.
    "dim_order_ops._to_dim_order_copy.default": ("self", "dtype", "layout", "device", "pin_memory", "non_blocking",
                                                 "dim_order"),
}


def _aten_lowering(key: str) -> Callable[[OpContext], list[Dispatch]]:
    names = ATEN_SCHEMA_ARGS[key]

    def lower(ctx: OpContext) -> list[Dispatch]:
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
        kwargs["out"] = ctx.outputs[0].binding
        try:
            return KERNELS[key](label=ctx.label, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ctx.fail(f"the kernel refused it: {exc}") from exc

    return lower


# ------------------------------------------------------------------------------------------------
# vktrain ops: shape-explicit plan functions
# ------------------------------------------------------------------------------------------------

def _check_float(ctx: OpContext, tensor: TensorArg, name: str) -> None:
    if tensor.dtype != "float32":
        raise ctx.fail(f"{name} must be float32, got {tensor.dtype}")


def _check_w4x8(ctx: OpContext, weights: TensorArg) -> None:
    if weights.layout != vk.Layout.Q4GSW_W4X8:
        raise ctx.fail(f"weights (value {weights.value_id}) have layout {weights.layout.name}; the GPU kernels read "
                       f"Q4GSW_W4X8 words (the backend prepacks constant q4gsw weights)")


def _q4gsw_dims(ctx: OpContext, scales: TensorArg, group_size: int) -> tuple[int, int]:
    """(N, K) from scales [G, N] and group_size (CONTRACTS.md: K = G * group_size)."""
    _check_float(ctx, scales, "scales")
    if len(scales.shape) != 2:
        raise ctx.fail(f"scales must be 2-D [G, N], got shape {list(scales.shape)}")
    groups, n = scales.shape
    return n, groups * group_size


def _rows(ctx: OpContext, tensor: TensorArg, width: int, name: str) -> int:
    """Rows of `tensor` viewed as [-1, width] (its last dim must be `width`)."""
    if not tensor.shape or tensor.shape[-1] != width:
        raise ctx.fail(f"{name} must have last dim {width}, got shape {list(tensor.shape)}")
    return tensor.numel // width


def _call(ctx: OpContext, kernel: str, **kwargs: Any) -> list[Dispatch]:
    try:
        return KERNELS[kernel](label=ctx.label, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the {kernel} kernel refused it: {exc}") from exc


def _split_k_args(ctx: OpContext, kernel: str, m: int, n: int, k: int) -> dict:
    """Scratch for the linear family's deterministic split-K (used when the output has too few tiles to
    fill the GPU, e.g. M = 128 tokens), and the device's shared memory for the tile choice."""
    nbytes = linear.plan_scratch_nbytes(kernel, M=m, N=n, K=k)
    extra = {"shared_memory_bytes": ctx.shared_memory_bytes}
    if nbytes:
        extra["scratch"] = ctx.scratch(nbytes, "split_k")
    return extra


def _lower_linear_q4gsw(ctx: OpContext) -> list[Dispatch]:
    x, weights, scales = ctx.tensor(0, "x"), ctx.tensor(1, "weights"), ctx.tensor(2, "scales")
    group_size = ctx.integer(3, "group_size")
    bias = ctx.args[4]
    _check_float(ctx, x, "x")
    _check_w4x8(ctx, weights)
    n, k = _q4gsw_dims(ctx, scales, group_size)
    m = _rows(ctx, x, k, "x")
    if bias is not None:
        if not isinstance(bias, TensorArg) or bias.shape != (n,):
            raise ctx.fail(f"bias must be a float32 [{n}] tensor or None, got {bias!r}")
        _check_float(ctx, bias, "bias")
    expected = x.shape[:-1] + (n,)
    if ctx.outputs[0].shape != expected:
        raise ctx.fail(f"output has shape {list(ctx.outputs[0].shape)}, expected {list(expected)}")
    return _call(ctx, "linear_q4gsw", M=m, N=n, K=k, group_size=group_size, out=ctx.outputs[0].binding,
                 x=x.binding, weights=weights.binding, scales=scales.binding,
                 bias=None if bias is None else bias.binding, **_split_k_args(ctx, "linear_q4gsw", m, n, k))


def _lower_linear_q4gsw_backward(ctx: OpContext) -> list[Dispatch]:
    d_out, weights, scales = ctx.tensor(0, "d_out"), ctx.tensor(1, "weights"), ctx.tensor(2, "scales")
    group_size = ctx.integer(3, "group_size")
    _check_float(ctx, d_out, "d_out")
    _check_w4x8(ctx, weights)
    n, k = _q4gsw_dims(ctx, scales, group_size)
    m = _rows(ctx, d_out, n, "d_out")
    expected = d_out.shape[:-1] + (k,)
    if ctx.outputs[0].shape != expected:
        raise ctx.fail(f"output has shape {list(ctx.outputs[0].shape)}, expected {list(expected)}")
    return _call(ctx, "linear_q4gsw_backward", M=m, N=n, K=k, group_size=group_size,
                 out=ctx.outputs[0].binding, d_out=d_out.binding, weights=weights.binding, scales=scales.binding,
                 **_split_k_args(ctx, "linear_q4gsw_backward", m, n, k))


def _lower_linear_dw(ctx: OpContext) -> list[Dispatch]:
    d_out, x = ctx.tensor(0, "d_out"), ctx.tensor(1, "x")
    _check_float(ctx, d_out, "d_out")
    _check_float(ctx, x, "x")
    if not d_out.shape or not x.shape:
        raise ctx.fail("d_out and x must have at least one dim")
    n, k = d_out.shape[-1], x.shape[-1]
    m = _rows(ctx, d_out, n, "d_out")
    if _rows(ctx, x, k, "x") != m:
        raise ctx.fail(f"d_out {list(d_out.shape)} and x {list(x.shape)} have different row counts")
    if ctx.outputs[0].shape != (n, k):
        raise ctx.fail(f"output has shape {list(ctx.outputs[0].shape)}, expected {[n, k]}")
    return _call(ctx, "linear_dW", M=m, N=n, K=k, out=ctx.outputs[0].binding, d_out=d_out.binding, x=x.binding,
                 **_split_k_args(ctx, "linear_dW", m, n, k))


def _lower_fused_ce(ctx: OpContext) -> list[Dispatch]:
    logits, labels, n_valid = ctx.tensor(0, "logits"), ctx.tensor(1, "labels"), ctx.tensor(2, "n_valid")
    loss, dlogits = ctx.outputs
    _check_float(ctx, logits, "logits")
    _check_float(ctx, n_valid, "n_valid")
    if len(logits.shape) != 2:
        raise ctx.fail(f"logits must be 2-D [R, V], got shape {list(logits.shape)}")
    rows, vocab = logits.shape
    if labels.dtype not in ("int32", "int64") or labels.shape != (rows,):
        raise ctx.fail(f"labels must be int32/int64 [{rows}], got {labels.dtype}{list(labels.shape)}")
    if n_valid.numel != 1 or loss.numel != 1:
        raise ctx.fail("n_valid and loss must be scalars")
    if dlogits.shape != logits.shape:
        raise ctx.fail(f"dlogits has shape {list(dlogits.shape)}, expected {list(logits.shape)}")
    row_loss = ctx.scratch(cross_entropy.fused_ce_scratch_nbytes(rows), "row_loss")
    return _call(ctx, "fused_ce", R=rows, V=vocab, logits=logits.binding, labels=labels.binding,
                 n_valid=n_valid.binding, loss=loss.binding, dlogits=dlogits.binding, row_loss=row_loss)


def _lower_adamw(ctx: OpContext) -> list[Dispatch]:
    """The GPU kernel updates (param, exp_avg, exp_avg_sq) in place. Where the blob stores an output in
    its input's storage (the backend's in-place pass) the kernel runs on it directly; otherwise the input
    is first copied into the output, which the kernel then updates."""
    names = ("param", "exp_avg", "exp_avg_sq")
    sources = [ctx.tensor(i, name) for i, name in enumerate(names)]
    grad, hparams, step = ctx.tensor(3, "grad"), ctx.tensor(4, "hparams"), ctx.tensor(5, "step")
    for tensor, name in zip(sources + [grad, hparams, step], names + ("grad", "hparams", "step")):
        _check_float(ctx, tensor, name)
    for tensor, name in zip(sources[1:] + [grad], names[1:] + ("grad",)):
        if tensor.shape != sources[0].shape:
            raise ctx.fail(f"{name} has shape {list(tensor.shape)}, param has {list(sources[0].shape)}")
    if hparams.shape != (ADAMW_HPARAMS,) or step.numel != 1:
        raise ctx.fail(f"hparams must be float32 [{ADAMW_HPARAMS}] and step a scalar, got "
                       f"{list(hparams.shape)} and {list(step.shape)}")
    numel = sources[0].numel
    dispatches: list[Dispatch] = []
    for source, target, name in zip(sources, ctx.outputs, names):
        if target.storage != source.storage:
            dispatches += copy_words(target.binding, source.binding, source.binding.size,
                                     label=f"{ctx.label}.copy_{name}")
    if numel == 0:
        return dispatches
    return dispatches + _call(ctx, "adamw", numel=numel, param=ctx.outputs[0].binding,
                              exp_avg=ctx.outputs[1].binding, exp_avg_sq=ctx.outputs[2].binding,
                              grad=grad.binding, hparams=hparams.binding, step=step.binding)


def _lower_q4gsw_requant(ctx: OpContext) -> list[Dispatch]:
    latent, scales = ctx.tensor(0, "latent"), ctx.tensor(1, "scales")
    group_size = ctx.integer(2, "group_size")
    _check_float(ctx, latent, "latent")
    n, k = _q4gsw_dims(ctx, scales, group_size)
    if latent.shape != (n, k):
        raise ctx.fail(f"latent must be [{n}, {k}], got {list(latent.shape)}")
    return _call(ctx, "q4gsw_requant", N=n, K=k, group_size=group_size, out=ctx.outputs[0].binding,
                 latent=latent.binding, scales=scales.binding)


# ------------------------------------------------------------------------------------------------
# Transformer ops (CONTRACTS.md "Transformer ops"): activations [B, S, H, D], fp32, contiguous
# ------------------------------------------------------------------------------------------------

def _check_output_shape(ctx: OpContext, position: int, expected: tuple[int, ...]) -> None:
    output = ctx.outputs[position]
    if output.shape != tuple(expected):
        raise ctx.fail(f"output {position} has shape {list(output.shape)}, expected {list(expected)}")
    _check_float(ctx, output, f"output {position}")


def _norm_workgroup_size(ctx: OpContext) -> int:
    """rms_norm's default workgroup, lowered to the largest power of two the device allows."""
    size = norm.DEFAULT_WORKGROUP_SIZE
    while size > ctx.max_workgroup_size:
        size //= 2
    return size


def _norm_rows(ctx: OpContext, x: TensorArg, weight: TensorArg) -> tuple[int, int]:
    """(rows, dim) of x [..., dim] normalised over its last dim with weight [dim]."""
    _check_float(ctx, x, "x")
    _check_float(ctx, weight, "weight")
    if not x.shape or weight.shape != x.shape[-1:]:
        raise ctx.fail(f"weight must be [D] for x [..., D], got weight {list(weight.shape)} and x {list(x.shape)}")
    return x.numel // x.shape[-1], x.shape[-1]


def _lower_rms_norm(ctx: OpContext) -> list[Dispatch]:
    x, weight = ctx.tensor(0, "x"), ctx.tensor(1, "weight")
    eps = ctx.real(2, "eps")
    rows, dim = _norm_rows(ctx, x, weight)
    _check_output_shape(ctx, 0, x.shape)
    _check_output_shape(ctx, 1, x.shape[:-1] + (1,))
    y, rstd = ctx.outputs
    return _call(ctx, "rms_norm", rows=rows, dim=dim, x=x.binding, weight=weight.binding, y=y.binding,
                 rstd=rstd.binding, eps=eps, workgroup_size=_norm_workgroup_size(ctx))


def _lower_rms_norm_backward(ctx: OpContext) -> list[Dispatch]:
    d_y, x, weight, rstd = (ctx.tensor(i, name) for i, name in enumerate(("d_y", "x", "weight", "rstd")))
    rows, dim = _norm_rows(ctx, x, weight)
    _check_float(ctx, d_y, "d_y")
    _check_float(ctx, rstd, "rstd")
    if d_y.shape != x.shape or rstd.shape != x.shape[:-1] + (1,):
        raise ctx.fail(f"expected d_y = x [..., D] and rstd [..., 1], got d_y {list(d_y.shape)}, x {list(x.shape)}, "
                       f"rstd {list(rstd.shape)}")
    _check_output_shape(ctx, 0, x.shape)
    return _call(ctx, "rms_norm_backward", rows=rows, dim=dim, d_y=d_y.binding, x=x.binding, weight=weight.binding,
                 rstd=rstd.binding, d_x=ctx.outputs[0].binding, workgroup_size=_norm_workgroup_size(ctx))


def _lower_rope(ctx: OpContext) -> list[Dispatch]:
    x, cos, sin = ctx.tensor(0, "x"), ctx.tensor(1, "cos"), ctx.tensor(2, "sin")
    for tensor, name in ((x, "x"), (cos, "cos"), (sin, "sin")):
        _check_float(ctx, tensor, name)
    if len(x.shape) != 4:
        raise ctx.fail(f"x must be 4-D [B, S, H, D], got shape {list(x.shape)}")
    batch, seq, heads, head_dim = x.shape
    if cos.shape != (seq, head_dim // 2) or sin.shape != cos.shape:
        raise ctx.fail(f"cos and sin must be [S, D/2] = {[seq, head_dim // 2]} for x {list(x.shape)}, got "
                       f"{list(cos.shape)} and {list(sin.shape)}")
    _check_output_shape(ctx, 0, x.shape)
    return _call(ctx, "rope", B=batch, S=seq, H=heads, D=head_dim, x=x.binding, cos=cos.binding, sin=sin.binding,
                 out=ctx.outputs[0].binding)


def _attention_dims(ctx: OpContext, q: TensorArg, k: TensorArg, v: TensorArg) -> tuple[int, int, int, int, int]:
    """(B, S, Hq, Hkv, D) of q [B, S, Hq, D] and k = v [B, S, Hkv, D]."""
    for tensor, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(ctx, tensor, name)
        if len(tensor.shape) != 4:
            raise ctx.fail(f"{name} must be 4-D [B, S, H, D], got shape {list(tensor.shape)}")
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim):
        raise ctx.fail(f"k and v must be [B, S, Hkv, D] = [{batch}, {seq}, Hkv, {head_dim}] for q {list(q.shape)}, "
                       f"got {list(k.shape)} and {list(v.shape)}")
    return batch, seq, q_heads, kv_heads, head_dim


def _lower_causal_attention(ctx: OpContext) -> list[Dispatch]:
    q, k, v = ctx.tensor(0, "q"), ctx.tensor(1, "k"), ctx.tensor(2, "v")
    scale = ctx.real(3, "scale")
    batch, seq, q_heads, kv_heads, head_dim = _attention_dims(ctx, q, k, v)
    _check_output_shape(ctx, 0, q.shape)
    _check_output_shape(ctx, 1, (batch, q_heads, seq))
    out, lse = ctx.outputs
    return _call(ctx, "causal_attention", B=batch, S=seq, Hq=q_heads, Hkv=kv_heads, D=head_dim, q=q.binding,
                 k=k.binding, v=v.binding, out=out.binding, lse=lse.binding, scale=scale,
                 shared_memory_bytes=ctx.shared_memory_bytes, max_workgroup_size=ctx.max_workgroup_size)


def _lower_causal_attention_backward(ctx: OpContext) -> list[Dispatch]:
    names = ("d_out", "q", "k", "v", "out", "lse")
    d_out, q, k, v, out, lse = (ctx.tensor(i, name) for i, name in enumerate(names))
    scale = ctx.real(6, "scale")
    batch, seq, q_heads, kv_heads, head_dim = _attention_dims(ctx, q, k, v)
    for tensor, name in ((d_out, "d_out"), (out, "out"), (lse, "lse")):
        _check_float(ctx, tensor, name)
    if d_out.shape != q.shape or out.shape != q.shape or lse.shape != (batch, q_heads, seq):
        raise ctx.fail(f"expected d_out = out = q {list(q.shape)} and lse {[batch, q_heads, seq]}, got "
                       f"{list(d_out.shape)}, {list(out.shape)}, {list(lse.shape)}")
    _check_output_shape(ctx, 0, q.shape)
    _check_output_shape(ctx, 1, k.shape)
    _check_output_shape(ctx, 2, v.shape)
    try:
        delta_nbytes = attention.causal_attention_backward_scratch_nbytes(batch, seq, q_heads)
    except ValueError as exc:
        raise ctx.fail(f"the causal_attention_backward kernel refused it: {exc}") from exc
    delta = ctx.scratch(delta_nbytes, "delta")
    d_q, d_k, d_v = ctx.outputs
    return _call(ctx, "causal_attention_backward", B=batch, S=seq, Hq=q_heads, Hkv=kv_heads, D=head_dim,
                 d_out=d_out.binding, q=q.binding, k=k.binding, v=v.binding, out=out.binding, lse=lse.binding,
                 d_q=d_q.binding, d_k=d_k.binding, d_v=d_v.binding, delta=delta, scale=scale,
                 shared_memory_bytes=ctx.shared_memory_bytes, max_workgroup_size=ctx.max_workgroup_size)


def _same_shape_floats(ctx: OpContext, names: Sequence[str]) -> list[TensorArg]:
    tensors = [ctx.tensor(i, name) for i, name in enumerate(names)]
    for tensor, name in zip(tensors, names):
        _check_float(ctx, tensor, name)
        if tensor.shape != tensors[0].shape:
            raise ctx.fail(f"{name} has shape {list(tensor.shape)}, {names[0]} has {list(tensors[0].shape)}")
    for position in range(len(ctx.outputs)):
        _check_output_shape(ctx, position, tensors[0].shape)
    return tensors


def _lower_swiglu(ctx: OpContext) -> list[Dispatch]:
    gate, up = _same_shape_floats(ctx, ("gate", "up"))
    if gate.numel == 0:
        return []
    return _call(ctx, "swiglu", numel=gate.numel, gate=gate.binding, up=up.binding, out=ctx.outputs[0].binding)


def _lower_swiglu_backward(ctx: OpContext) -> list[Dispatch]:
    d_h, gate, up = _same_shape_floats(ctx, ("d_h", "gate", "up"))
    if d_h.numel == 0:
        return []
    d_gate, d_up = ctx.outputs
    return _call(ctx, "swiglu_backward", numel=d_h.numel, d_h=d_h.binding, gate=gate.binding, up=up.binding,
                 d_gate=d_gate.binding, d_up=d_up.binding)


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


def copy_words(out: BufferBinding, source: BufferBinding, nbytes: int, *, label: str) -> list[Dispatch]:
    """A flat copy of `nbytes` (a multiple of 4) from `source` to `out`; copy.comp moves 32-bit words,
    so one kernel copies every 4-byte dtype."""
    if nbytes % 4:
        raise GraphLoweringError(f"{label}: cannot copy {nbytes} bytes, the copy kernel moves 32-bit words")
    return layout.plan_strided_copy(out, source, layout.StridedView.contiguous((nbytes // 4,)), label=label)


# ------------------------------------------------------------------------------------------------
# Transposes as strided views
# ------------------------------------------------------------------------------------------------

_TRANSPOSE_OPS = ("aten.permute_copy.default", "aten.t_copy.default", "aten.transpose_copy.int")


def transposed_view(name: str, params: Sequence[Any], source_view: layout.StridedView) -> layout.StridedView:
    """The view a transpose op's output is of its input's bytes. `params` are the op's decoded arguments
    after `self` (permute: dims; transpose: dim0, dim1; t: none); `source_view` is how the input is read."""
    if name == "aten.permute_copy.default":
        return source_view.permute(params[0])
    if name == "aten.t_copy.default":
        if source_view.rank > 2:
            raise layout.KernelArgumentError(
                f"aten.t_copy expects a tensor of rank <= 2, got shape {list(source_view.sizes)}")
        return source_view.transpose(0, 1) if source_view.rank == 2 else source_view
    if name == "aten.transpose_copy.int":
        return source_view.transpose(params[0], params[1])
    raise GraphLoweringError(f"{name} is not a transpose op")


def _lower_transpose(ctx: OpContext) -> list[Dispatch]:
    """A materialised transpose: one strided copy, reading the input through its own view (so a chain
    of transposes costs one copy at most)."""
    source = ctx.tensor(0, "self")
    try:
        view = transposed_view(ctx.op.name, ctx.args[1:], source.strided)
        return layout.plan_strided_copy(ctx.outputs[0].binding, source.binding, view, label=ctx.label)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the copy kernel refused it: {exc}") from exc


def _split_k_scratch(ctx: OpContext, batch: int, m: int, n: int, k: int) -> BufferBinding | None:
    """The split-K scratch the default GEMM plan of [batch, m, k] @ [batch, k, n] uses, or None when
    it would not split (kernels/matmul.py: skinny outputs over long reductions)."""
    nbytes = matmul.gemm_scratch_nbytes(batch, m, n, k)
    return ctx.scratch(nbytes, "split_k") if nbytes else None


def _float_matrices(ctx: OpContext, positions: Sequence[tuple[int, str]], rank: int) -> list[TensorArg]:
    tensors = [ctx.tensor(position, name) for position, name in positions]
    for tensor, (_, name) in zip(tensors, positions):
        _check_float(ctx, tensor, name)
        if len(tensor.shape) != rank:
            raise ctx.fail(f"{name} must be {rank}-D, got shape {list(tensor.shape)}")
    return tensors


def _lower_mm(ctx: OpContext) -> list[Dispatch]:
    """aten.mm through the GEMM's strided operands: a lazily transposed input costs nothing."""
    a, b = _float_matrices(ctx, ((0, "self"), (1, "mat2")), 2)
    if ctx.outputs[0].shape != (a.shape[0], b.shape[1]):
        raise ctx.fail(f"output has shape {list(ctx.outputs[0].shape)}, expected {[a.shape[0], b.shape[1]]}")
    try:
        scratch = _split_k_scratch(ctx, 1, a.shape[0], b.shape[1], a.shape[1])
        return matmul.plan_gemm(ctx.outputs[0].binding, a.binding, a.strided, b.binding, b.strided,
                                scratch=scratch, label=ctx.label)
    except (ValueError, TypeError) as exc:
        raise ctx.fail(f"the matmul kernel refused it: {exc}") from exc


def _lower_bmm(ctx: OpContext) -> list[Dispatch]:
    a, b = _float_matrices(ctx, ((0, "self"), (1, "mat2")), 3)
    scratch = _split_k_scratch(ctx, a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return _call(ctx, "aten.bmm.default", self=a.binding, self_shape=a.shape, self_dtype=a.dtype, mat2=b.binding,
                 mat2_shape=b.shape, mat2_dtype=b.dtype, out=ctx.outputs[0].binding, scratch=scratch)


def _lower_addmm(ctx: OpContext) -> list[Dispatch]:
    bias = ctx.tensor(0, "self")
    a, b = _float_matrices(ctx, ((1, "mat1"), (2, "mat2")), 2)
    scratch = _split_k_scratch(ctx, 1, a.shape[0], b.shape[1], a.shape[1])
    return _call(ctx, "aten.addmm.default", self=bias.binding, self_shape=bias.shape, self_dtype=bias.dtype,
                 mat1=a.binding, mat1_shape=a.shape, mat1_dtype=a.dtype, mat2=b.binding, mat2_shape=b.shape,
                 mat2_dtype=b.dtype, beta=ctx.args[3], alpha=ctx.args[4], out=ctx.outputs[0].binding,
                 scratch=scratch)


_VKTRAIN_LOWERINGS = {
    "vktrain.linear_q4gsw.default": OpLowering("linear_q4gsw", ("x", "weights", "scales", "group_size", "bias"),
                                               _lower_linear_q4gsw),
    "vktrain.linear_q4gsw_backward.default": OpLowering(
        "linear_q4gsw_backward", ("d_out", "weights", "scales", "group_size"), _lower_linear_q4gsw_backward),
    "vktrain.linear_dW.default": OpLowering("linear_dW", ("d_out", "x"), _lower_linear_dw),
    "vktrain.fused_ce.default": OpLowering("fused_ce", ("logits", "labels", "n_valid"), _lower_fused_ce,
                                           num_outputs=2),
    "vktrain.adamw.default": OpLowering(
        "adamw", ("param", "exp_avg", "exp_avg_sq", "grad", "hparams", "step"), _lower_adamw, num_outputs=3),
    "vktrain.q4gsw_requant.default": OpLowering("q4gsw_requant", ("latent", "scales", "group_size"),
                                                _lower_q4gsw_requant),
    "vktrain.rms_norm.default": OpLowering("rms_norm", ("x", "weight", "eps"), _lower_rms_norm, num_outputs=2),
    "vktrain.rms_norm_backward.default": OpLowering("rms_norm_backward", ("d_y", "x", "weight", "rstd"),
                                                    _lower_rms_norm_backward),
    "vktrain.rope.default": OpLowering("rope", ("x", "cos", "sin"), _lower_rope),
    "vktrain.causal_attention.default": OpLowering("causal_attention", ("q", "k", "v", "scale"),
                                                   _lower_causal_attention, num_outputs=2),
    "vktrain.causal_attention_backward.default": OpLowering(
        "causal_attention_backward", ("d_out", "q", "k", "v", "out", "lse", "scale"),
        _lower_causal_attention_backward, num_outputs=3),
    "vktrain.swiglu.default": OpLowering("swiglu", ("gate", "up"), _lower_swiglu),
    "vktrain.swiglu_backward.default": OpLowering("swiglu_backward", ("d_h", "gate", "up"), _lower_swiglu_backward,
                                                  num_outputs=2),
}

OP_LOWERINGS: dict[str, OpLowering] = {
    **{key: OpLowering(key, names, _aten_lowering(key)) for key, names in ATEN_SCHEMA_ARGS.items()},
    **{key: OpLowering(key, ATEN_SCHEMA_ARGS[key], _lower_transpose) for key in _TRANSPOSE_OPS},
    "aten.mm.default": OpLowering("aten.mm.default", ATEN_SCHEMA_ARGS["aten.mm.default"], _lower_mm),
    "aten.bmm.default": OpLowering("aten.bmm.default", ATEN_SCHEMA_ARGS["aten.bmm.default"], _lower_bmm),
    "aten.addmm.default": OpLowering("aten.addmm.default", ATEN_SCHEMA_ARGS["aten.addmm.default"], _lower_addmm),
    EMPTY: OpLowering(None, ("size", "dtype", "layout", "device", "pin_memory", "memory_format"), _lower_empty),
    EMPTY_PERMUTED: OpLowering(None, ("size", "physical_layout", "dtype", "layout", "device", "pin_memory"),
                               _lower_empty),
    **_VKTRAIN_LOWERINGS,
}


def _executable(lowering: OpLowering) -> bool:
    return lowering.kernel is None or lowering.kernel in KERNELS


def supported_ops() -> list[str]:
    """Graph op names this runtime can execute (a lowering exists and the kernel it needs is registered)."""
    return sorted(name for name, lowering in OP_LOWERINGS.items() if _executable(lowering))


def lowering_for(op: vk.OpCall, index: int) -> OpLowering:
    """The lowering of `op`, or GraphLoweringError("unsupported op <name>") naming what exists."""
    lowering = OP_LOWERINGS.get(op.name)
    if lowering is None or not _executable(lowering):
        raise GraphLoweringError(f"unsupported op {op.name} (op {index}): no Vulkan kernel implements it; "
                                 f"supported ops: {', '.join(supported_ops())}")
    if len(op.args) != len(lowering.arg_names):
        raise GraphLoweringError(
            f"op {index} ({op.name}) has {len(op.args)} arguments, its schema has {len(lowering.arg_names)} "
            f"({', '.join(lowering.arg_names)})")
    if len(op.outputs) != lowering.num_outputs:
        raise GraphLoweringError(f"op {index} ({op.name}) has {len(op.outputs)} outputs, expected "
                                 f"{lowering.num_outputs}")
    return lowering


def decode_scalar(value: vk.Value) -> Any:
    """A non-tensor graph value as the Python value a plan function takes."""
    if isinstance(value, vk.NullValue):
        return None
    if isinstance(value, (vk.IntValue, vk.DoubleValue, vk.BoolValue, vk.StringValue)):
        return value.value
    if isinstance(value, (vk.IntListValue, vk.DoubleListValue, vk.BoolListValue)):
        return tuple(value.items)
    raise GraphLoweringError(f"value of type {type(value).__name__} is not a scalar argument")


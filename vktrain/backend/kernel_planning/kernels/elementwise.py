"""Elementwise fp32 ops with N-d broadcasting: one kernel (elementwise.slang) for every unary/binary op.

The op is a specialization constant of `elementwise@ARITY=1` / `elementwise@ARITY=2`, so every op
shares two SPIR-V modules. Inputs are read through `StridedView`s (broadcast dims have stride 0, so no
operand is ever materialised at the output's shape); the output is contiguous. Dims that are
contiguous in every operand are merged first, so up to MAX_STRIDED_RANK (6) dims remain after
merging — any rank-6 broadcast, and far higher ranks in practice.

Same-shape contiguous operands (one merged dim of unit strides; numel and offsets multiples of 4, so
every vec4 is 16-byte aligned in its binding) take the `+VEC4` variants: vec4 loads and stores, no index
arithmetic, 4 vec4 per invocation, VEC4_WORKGROUP_SIZE invocations per workgroup (128 on a device profile
allowing fewer than 256: `max_workgroup_size`), the same per-element arithmetic (bit-identical results).
That is most of a training step's elementwise traffic
(residual adds, gradient sums, norm and SwiGLU products).

Over `binding_limit` (the max storage binding size) an op runs one dispatch per window of its output's flat
index space, each input bound by the elements its window reads (kernels/elementwise_windows.py): the same
per-element arithmetic, so the same bits; aligned windows of same-shape runs keep the VEC4 body.

Numerics (fp32; tests compare against torch eager in float64, 1e-5 relative):
* gelu uses erfc, so it keeps full relative accuracy for x << 0 where 1 + erf(x) cancels; the tanh
  approximation is computed as x * sigmoid(2u), which does not cancel either.
* tanh, erf, log and expm1 are evaluated with series where the usual formulas cancel (tanh, erf and
  expm1 near 0, log near 1), so they keep 1e-5 relative accuracy everywhere, not just an absolute one.
* exp, sigmoid, silu use a Cody-Waite range reduction (exp(a) = 2^n exp(r)), so their error does not
  grow with |a| the way a driver's exp2(a * log2 e) does.
* pow.Tensor_Scalar has exact forms for the exponents 0, 1, 2, 3, 0.5, -0.5, -1 (RMSNorm's x**2 is
  exact) and follows torch for negative bases (real result only for integral exponents, else NaN).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.backend.kernel_planning.kernels.layout import (
    MAX_STRIDED_RANK, BindingLimit, binding, broadcast_shapes, check_dtype, check_view_fits, coalesce_dims,
    elementwise_groups, fitted_workgroup, padded_innermost_first
)
from vktrain.serialization.strided_view import KernelArgumentError, StridedView, check_shape
from vktrain.backend.kernel_planning.kernels.elementwise_windows import (needs_windows, operand_span, split_windows,
                                                                  window_binding, window_offset)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

OP_SPEC_ID = 3
VEC4_WORKGROUP_SIZE = 256  # elementwise.slang's VEC4 WG (spec constant 0): fewer where a profile allows fewer
VEC4_FLOATS_PER_THREAD = 4 * 4  # its VEC4_PER_THREAD x 4
VEC4_ELEMENTS_PER_GROUP = VEC4_WORKGROUP_SIZE * VEC4_FLOATS_PER_THREAD  # at the default workgroup size

# The shader reads these codes from runtime_shaders/codes.glsl, generated from this table
# (python -m vktrain.backend.kernel_planning.kernels.shader_codes; a test fails when it is stale).
UNARY_OPS = {
    "add_scalar": 0,    # a + s0
    "mul_scalar": 1,    # a * s0
    "neg": 2,
    "relu": 3,
    "gelu": 4,
    "gelu_tanh": 5,
    "silu": 6,
    "sigmoid": 7,
    "exp": 8,
    "rsqrt": 9,
    "pow_scalar": 10,   # a ** s0
    "sqrt": 11,
    "rsub_scalar": 13,  # s0 - s1 * a
    "div_scalar": 14,   # a / s0
    "tanh": 15,
    "erf": 16,
    "log": 17,
    "reciprocal": 18,
    "abs": 19,
    "expm1": 20,
}
BINARY_OPS = {
    "add": 0,                  # a + s0 * b
    "sub": 1,                  # a - s0 * b
    "mul": 2,
    "div": 3,
    "threshold_backward": 4,   # grad = a, self = b, threshold = s0
    "gelu_backward": 5,        # grad = a, self = b
    "gelu_tanh_backward": 6,
    "silu_backward": 7,        # grad = a, self = b
    "sigmoid_backward": 8,     # grad = a, output = b
    "maximum": 9,
    "minimum": 10,
    "tanh_backward": 11,       # grad = a, output = b
    "pow": 12,                 # a ** b
}


def _pack(numel: int, rank: int, scalar0: float, scalar1: float, offsets: Sequence[int], sizes: Sequence[int],
          strides: Sequence[Sequence[int]], window_start: int = 0, out_offset: int = 0) -> bytes:
    a_offset, b_offset = (list(offsets) + [0])[:2]
    a_strides, b_strides = (list(strides) + [()])[:2]
    return pack_push(
        numel, rank, float(scalar0), float(scalar1), a_offset, b_offset,
        *padded_innermost_first(sizes, MAX_STRIDED_RANK, 1),
        *padded_innermost_first(a_strides, MAX_STRIDED_RANK, 0),
        *padded_innermost_first(b_strides, MAX_STRIDED_RANK, 0),
        window_start, out_offset)


def _merged(out_shape: tuple[int, ...], views: Sequence[StridedView], label: str):
    sizes, strides = coalesce_dims(out_shape, *(v.strides for v in views))
    if len(sizes) > MAX_STRIDED_RANK:
        raise KernelArgumentError(
            f"{label}: output shape {out_shape} with the inputs' strides needs {len(sizes)} dims after "
            f"merging contiguous ones; elementwise.slang supports at most {MAX_STRIDED_RANK}")
    return sizes, strides


def _shader_and_groups(arity: int, numel: int, sizes: Sequence[int], strides: Sequence[Sequence[int]],
                       offsets: Sequence[int], max_workgroup_size: int | None
                       ) -> tuple[str, int, tuple[int, int, int] | None]:
    """The VEC4 variant where every operand is one contiguous run of numel floats, 16-byte aligned
    (module docstring), with its local size; else the general one, a thread per element (64 lanes)."""
    runs = len(sizes) == 1 and all(s[0] == 1 for s in strides)
    if runs and numel % 4 == 0 and all(offset % 4 == 0 for offset in offsets):
        lanes = fitted_workgroup(VEC4_WORKGROUP_SIZE, max_workgroup_size)
        return f"elementwise@ARITY={arity}+VEC4", ceil_div(numel, lanes * VEC4_FLOATS_PER_THREAD), (lanes, 1, 1)
    return f"elementwise@ARITY={arity}", elementwise_groups(numel), None


def _plan(op_code: int, arity: int, out: Any, operands: Sequence[tuple[Any, StridedView]], out_shape: tuple[int, ...],
          scalar0: float, scalar1: float, label: str, binding_limit: BindingLimit | None,
          max_workgroup_size: int | None) -> list[Dispatch]:
    """One dispatch over the whole output, or (over `binding_limit`) one per window of its flat index space
    (kernels/elementwise_windows.py), each binding only the elements its window reads."""
    numel = math.prod(out_shape)
    full = [view.broadcast_to(out_shape) for _, view in operands]
    sizes, strides = _merged(out_shape, full, label)
    spec = {OP_SPEC_ID: op_code}
    if not needs_windows(binding_limit, [(out, numel)] + [(b, v.extent()) for b, v in operands]):
        offsets = [view.offset for view in full]
        push = _pack(numel, len(sizes), scalar0, scalar1, offsets, sizes, strides)
        shader, groups, local = _shader_and_groups(arity, numel, sizes, strides, offsets, max_workgroup_size)
        bindings = (binding(out, "w"), *(binding(buffer, "r") for buffer, _ in operands))
        return [Dispatch(shader, groups, bindings=bindings, push_constants=push, spec_constants=spec, local_size=local,
                         label=label)]
    names = ("input a", "input b") if arity == 2 else ("input",)

    def plan_window(begin: int, end: int) -> Dispatch:
        out_bound, out_offset = window_binding(out, begin, end, "w", binding_limit, label, "the output")
        bindings, offsets = [out_bound], []
        for (buffer, _), view, operand_strides, name in zip(operands, full, strides, names):
            lo, hi = operand_span(sizes, operand_strides, view.offset, begin, end)
            bound, skipped = window_binding(buffer, lo, hi, "r", binding_limit, label, name)
            bindings.append(bound)
            offsets.append(window_offset(view.offset, lo, skipped))
        count = end - begin
        push = _pack(count, len(sizes), scalar0, scalar1, offsets, sizes, strides, begin, out_offset)
        local_offsets = [(offset + begin) % 2**32 for offset in offsets] + [out_offset]  # where the window's runs start
        shader, groups, local = _shader_and_groups(arity, count, sizes, strides, local_offsets, max_workgroup_size)
        return Dispatch(shader, groups, bindings=tuple(bindings), push_constants=push, spec_constants=spec,
                        local_size=local, label=f"{label}.window{begin}")

    return split_windows(numel, binding_limit, plan_window)


def plan_unary(op: str, out: Any, a: Any, a_view: StridedView, *, scalar0: float = 0.0,
               scalar1: float = 0.0, label: str | None = None,
               binding_limit: BindingLimit | None = None,
               max_workgroup_size: int | None = None) -> list[Dispatch]:
    """out (contiguous, a_view.sizes) = op(a read through a_view); split over `binding_limit`."""
    if op not in UNARY_OPS:
        raise KernelArgumentError(f"unknown unary elementwise op {op!r}; known: {sorted(UNARY_OPS)}")
    label = label or op
    check_view_fits(a_view, None, f"{label} input")
    if a_view.numel == 0:
        return []
    return _plan(UNARY_OPS[op], 1, out, [(a, a_view)], a_view.sizes, scalar0, scalar1, label, binding_limit,
                 max_workgroup_size)


def plan_binary(op: str, out: Any, a: Any, a_view: StridedView, b: Any, b_view: StridedView, *,
                scalar0: float = 0.0, scalar1: float = 0.0, label: str | None = None,
                binding_limit: BindingLimit | None = None,
                max_workgroup_size: int | None = None) -> list[Dispatch]:
    """out (contiguous, broadcast shape of a and b) = op(a, b); split over `binding_limit`."""
    if op not in BINARY_OPS:
        raise KernelArgumentError(f"unknown binary elementwise op {op!r}; known: {sorted(BINARY_OPS)}")
    label = label or op
    out_shape = broadcast_shapes(a_view.sizes, b_view.sizes)
    check_view_fits(a_view, None, f"{label} input a")
    check_view_fits(b_view, None, f"{label} input b")
    if math.prod(out_shape) == 0:
        return []
    return _plan(BINARY_OPS[op], 2, out, [(a, a_view), (b, b_view)], out_shape, scalar0, scalar1, label,
                 binding_limit, max_workgroup_size)


# ------------------------------------------------------------------------------------------------
# aten ops (calling convention: see vktrain/backend/kernel_planning/kernels/layout.py). fp32 only.

def _float_operand(shape: Sequence[int], dtype: Any, what: str) -> StridedView:
    check_dtype(dtype, what)
    return StridedView.contiguous(check_shape(shape, what))


def _is_scalar_operand(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _number(value: Any, what: str) -> float:
    if not _is_scalar_operand(value):
        raise KernelArgumentError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _unary_plan(key: str, op: str, doc: str):
    def plan(*, out: Any, self: Any, self_shape: Sequence[int], self_dtype: Any = "float32",
             label: str = key, binding_limit: BindingLimit | None = None,
             max_workgroup_size: int | None = None) -> list[Dispatch]:
        return plan_unary(op, out, self, _float_operand(self_shape, self_dtype, f"{key} self"), label=label,
                          binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)

    plan.__name__ = plan.__qualname__ = "plan_" + key.split(".")[1]
    plan.__doc__ = f"{key}: {doc}"
    return register_kernel(key)(plan)


plan_neg = _unary_plan("aten.neg.default", "neg", "out = -self")
plan_relu = _unary_plan("aten.relu.default", "relu", "out = max(self, 0) (NaN propagates)")
plan_sigmoid = _unary_plan("aten.sigmoid.default", "sigmoid", "out = 1 / (1 + exp(-self))")
plan_silu = _unary_plan("aten.silu.default", "silu", "out = self * sigmoid(self)")
plan_exp = _unary_plan("aten.exp.default", "exp", "out = exp(self)")
plan_expm1 = _unary_plan("aten.expm1.default", "expm1", "out = exp(self) - 1, relatively accurate near 0")
plan_rsqrt = _unary_plan("aten.rsqrt.default", "rsqrt", "out = 1 / sqrt(self)")
plan_sqrt = _unary_plan("aten.sqrt.default", "sqrt", "out = sqrt(self)")
plan_tanh = _unary_plan("aten.tanh.default", "tanh", "out = tanh(self), relatively accurate near 0")
plan_erf = _unary_plan("aten.erf.default", "erf", "out = erf(self), relatively accurate near 0")
plan_log = _unary_plan("aten.log.default", "log", "out = log(self), relatively accurate near 1")
plan_reciprocal = _unary_plan("aten.reciprocal.default", "reciprocal", "out = 1 / self")
plan_abs = _unary_plan("aten.abs.default", "abs", "out = |self|")

GELU_APPROXIMATIONS = {"none": ("gelu", "gelu_backward"), "tanh": ("gelu_tanh", "gelu_tanh_backward")}


def _gelu_ops(approximate: Any, key: str) -> tuple[str, str]:
    try:
        return GELU_APPROXIMATIONS[approximate]
    except (KeyError, TypeError):
        raise KernelArgumentError(
            f"{key}: approximate={approximate!r} is not supported; expected one of "
            f"{sorted(GELU_APPROXIMATIONS)}") from None


@register_kernel("aten.gelu.default")
def plan_gelu(*, out: Any, self: Any, self_shape: Sequence[int], approximate: str = "none",
              self_dtype: Any = "float32", label: str = "aten.gelu.default",
              binding_limit: BindingLimit | None = None,
              max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.gelu: x * Phi(x) (approximate="none") or the tanh approximation (approximate="tanh")."""
    op, _ = _gelu_ops(approximate, "aten.gelu.default")
    return plan_unary(op, out, self, _float_operand(self_shape, self_dtype, "aten.gelu self"), label=label,
                      binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.pow.Tensor_Scalar")
def plan_pow_tensor_scalar(*, out: Any, self: Any, self_shape: Sequence[int], exponent: float,
                           self_dtype: Any = "float32", label: str = "aten.pow.Tensor_Scalar",
                           binding_limit: BindingLimit | None = None,
                           max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.pow.Tensor_Scalar: out = self ** exponent (a Python number)."""
    view = _float_operand(self_shape, self_dtype, "aten.pow self")
    return plan_unary("pow_scalar", out, self, view,
                      scalar0=_number(exponent, "aten.pow.Tensor_Scalar exponent"), label=label,
                      binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.mul.Scalar")
def plan_mul_scalar(*, out: Any, self: Any, self_shape: Sequence[int], other: float,
                    self_dtype: Any = "float32", label: str = "aten.mul.Scalar",
                    binding_limit: BindingLimit | None = None,
                    max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.mul.Scalar: out = self * other."""
    view = _float_operand(self_shape, self_dtype, "aten.mul.Scalar self")
    return plan_unary("mul_scalar", out, self, view, scalar0=_number(other, "aten.mul.Scalar other"), label=label,
                      binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.add.Scalar")
def plan_add_scalar(*, out: Any, self: Any, self_shape: Sequence[int], other: float, alpha: float = 1,
                    self_dtype: Any = "float32", label: str = "aten.add.Scalar",
                    binding_limit: BindingLimit | None = None,
                    max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.add.Scalar: out = self + alpha * other."""
    view = _float_operand(self_shape, self_dtype, "aten.add.Scalar self")
    shift = _number(alpha, "aten.add.Scalar alpha") * _number(other, "aten.add.Scalar other")
    return plan_unary("add_scalar", out, self, view, scalar0=shift, label=label, binding_limit=binding_limit,
                      max_workgroup_size=max_workgroup_size)


@register_kernel("aten.sub.Scalar")
def plan_sub_scalar(*, out: Any, self: Any, self_shape: Sequence[int], other: float, alpha: float = 1,
                    self_dtype: Any = "float32", label: str = "aten.sub.Scalar",
                    binding_limit: BindingLimit | None = None,
                    max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.sub.Scalar: out = self - alpha * other."""
    view = _float_operand(self_shape, self_dtype, "aten.sub.Scalar self")
    shift = _number(alpha, "aten.sub.Scalar alpha") * _number(other, "aten.sub.Scalar other")
    return plan_unary("add_scalar", out, self, view, scalar0=-shift, label=label, binding_limit=binding_limit,
                      max_workgroup_size=max_workgroup_size)


@register_kernel("aten.rsub.Scalar")
def plan_rsub_scalar(*, out: Any, self: Any, self_shape: Sequence[int], other: float, alpha: float = 1,
                     self_dtype: Any = "float32", label: str = "aten.rsub.Scalar",
                     binding_limit: BindingLimit | None = None,
                     max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.rsub.Scalar: out = other - alpha * self."""
    view = _float_operand(self_shape, self_dtype, "aten.rsub.Scalar self")
    return plan_unary("rsub_scalar", out, self, view, scalar0=_number(other, "aten.rsub.Scalar other"),
                      scalar1=_number(alpha, "aten.rsub.Scalar alpha"), label=label, binding_limit=binding_limit,
                      max_workgroup_size=max_workgroup_size)


@register_kernel("aten.div.Scalar")
def plan_div_scalar(*, out: Any, self: Any, self_shape: Sequence[int], other: float,
                    self_dtype: Any = "float32", label: str = "aten.div.Scalar",
                    binding_limit: BindingLimit | None = None,
                    max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.div.Scalar: out = self / other (true division)."""
    view = _float_operand(self_shape, self_dtype, "aten.div.Scalar self")
    return plan_unary("div_scalar", out, self, view, scalar0=_number(other, "aten.div.Scalar other"), label=label,
                      binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


def _binary_plan(key: str, op: str, doc: str, *, scalar_fallback: str | None = None):
    """A Tensor-Tensor op; `other` may also be a Python number (edge graphs keep some scalars inline),
    then `scalar_fallback` names the unary op taking it."""

    def plan(*, out: Any, self: Any, self_shape: Sequence[int], other: Any, other_shape: Sequence[int] | None = None,
             alpha: float = 1, self_dtype: Any = "float32", other_dtype: Any = "float32",
             label: str = key, binding_limit: BindingLimit | None = None,
             max_workgroup_size: int | None = None) -> list[Dispatch]:
        a_view = _float_operand(self_shape, self_dtype, f"{key} self")
        alpha_value = _number(alpha, f"{key} alpha")
        if alpha_value != 1.0 and op not in ("add", "sub"):
            raise KernelArgumentError(f"{key} takes no alpha, got alpha={alpha!r}")
        if _is_scalar_operand(other):
            if scalar_fallback is None:
                raise KernelArgumentError(f"{key}: other must be a tensor, got the number {other!r}")
            value = float(other)
            if op == "add":
                return plan_unary("add_scalar", out, self, a_view, scalar0=alpha_value * value, label=label,
                                  binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)
            if op == "sub":
                return plan_unary("add_scalar", out, self, a_view, scalar0=-alpha_value * value, label=label,
                                  binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)
            return plan_unary(scalar_fallback, out, self, a_view, scalar0=value, label=label,
                              binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)
        if other_shape is None:
            raise KernelArgumentError(f"{key}: other is a tensor but other_shape is missing")
        b_view = _float_operand(other_shape, other_dtype, f"{key} other")
        return plan_binary(op, out, self, a_view, other, b_view, scalar0=alpha_value, label=label,
                           binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)

    plan.__name__ = plan.__qualname__ = "plan_" + key.split(".")[1] + "_tensor"
    plan.__doc__ = f"{key}: {doc} (broadcasting; `other` may be a Python number)"
    return register_kernel(key)(plan)


plan_add_tensor = _binary_plan("aten.add.Tensor", "add", "out = self + alpha * other", scalar_fallback="add_scalar")
plan_sub_tensor = _binary_plan("aten.sub.Tensor", "sub", "out = self - alpha * other", scalar_fallback="add_scalar")
plan_mul_tensor = _binary_plan("aten.mul.Tensor", "mul", "out = self * other", scalar_fallback="mul_scalar")
plan_div_tensor = _binary_plan("aten.div.Tensor", "div", "out = self / other (true division)",
                               scalar_fallback="div_scalar")
plan_maximum = _binary_plan("aten.maximum.default", "maximum", "out = max(self, other), NaN propagates")
plan_minimum = _binary_plan("aten.minimum.default", "minimum", "out = min(self, other), NaN propagates")


@register_kernel("aten.pow.Tensor_Tensor")
def plan_pow_tensor_tensor(*, out: Any, self: Any, self_shape: Sequence[int], exponent: Any,
                           exponent_shape: Sequence[int], self_dtype: Any = "float32",
                           exponent_dtype: Any = "float32", label: str = "aten.pow.Tensor_Tensor",
                           binding_limit: BindingLimit | None = None,
                           max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.pow.Tensor_Tensor: out = self ** exponent, broadcasting."""
    a_view = _float_operand(self_shape, self_dtype, "aten.pow.Tensor_Tensor self")
    b_view = _float_operand(exponent_shape, exponent_dtype, "aten.pow.Tensor_Tensor exponent")
    return plan_binary("pow", out, self, a_view, exponent, b_view, label=label, binding_limit=binding_limit,
                       max_workgroup_size=max_workgroup_size)


@register_kernel("aten.silu_backward.default")
def plan_silu_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int], self: Any,
                       self_shape: Sequence[int], grad_output_dtype: Any = "float32", self_dtype: Any = "float32",
                       label: str = "aten.silu_backward.default",
                       binding_limit: BindingLimit | None = None,
                       max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.silu_backward: grad_output * sigmoid(self) * (1 + self * (1 - sigmoid(self)))."""
    key = "aten.silu_backward.default"
    g_view = _float_operand(grad_output_shape, grad_output_dtype, f"{key} grad_output")
    x_view = _float_operand(self_shape, self_dtype, f"{key} self")
    return plan_binary("silu_backward", out, grad_output, g_view, self, x_view, label=label,
                       binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.sigmoid_backward.default")
def plan_sigmoid_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int], output: Any,
                          output_shape: Sequence[int], grad_output_dtype: Any = "float32",
                          output_dtype: Any = "float32",
                          label: str = "aten.sigmoid_backward.default",
                          binding_limit: BindingLimit | None = None,
                          max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.sigmoid_backward: grad_output * output * (1 - output), `output` = sigmoid(x)."""
    key = "aten.sigmoid_backward.default"
    g_view = _float_operand(grad_output_shape, grad_output_dtype, f"{key} grad_output")
    y_view = _float_operand(output_shape, output_dtype, f"{key} output")
    return plan_binary("sigmoid_backward", out, grad_output, g_view, output, y_view, label=label,
                       binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.tanh_backward.default")
def plan_tanh_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int], output: Any,
                       output_shape: Sequence[int], grad_output_dtype: Any = "float32", output_dtype: Any = "float32",
                       label: str = "aten.tanh_backward.default",
                       binding_limit: BindingLimit | None = None,
                       max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.tanh_backward: grad_output * (1 - output^2), `output` = tanh(x)."""
    key = "aten.tanh_backward.default"
    g_view = _float_operand(grad_output_shape, grad_output_dtype, f"{key} grad_output")
    y_view = _float_operand(output_shape, output_dtype, f"{key} output")
    return plan_binary("tanh_backward", out, grad_output, g_view, output, y_view, label=label,
                       binding_limit=binding_limit, max_workgroup_size=max_workgroup_size)


@register_kernel("aten.threshold_backward.default")
def plan_threshold_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int], self: Any,
                            self_shape: Sequence[int], threshold: float, grad_output_dtype: Any = "float32",
                            self_dtype: Any = "float32",
                            label: str = "aten.threshold_backward.default",
                            binding_limit: BindingLimit | None = None,
                            max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.threshold_backward (relu's backward with threshold 0): self <= threshold ? 0 : grad_output."""
    key = "aten.threshold_backward.default"
    g_view = _float_operand(grad_output_shape, grad_output_dtype, f"{key} grad_output")
    x_view = _float_operand(self_shape, self_dtype, f"{key} self")
    return plan_binary("threshold_backward", out, grad_output, g_view, self, x_view,
                       scalar0=_number(threshold, f"{key} threshold"), label=label, binding_limit=binding_limit,
                       max_workgroup_size=max_workgroup_size)


@register_kernel("aten.gelu_backward.default")
def plan_gelu_backward(*, out: Any, grad_output: Any, grad_output_shape: Sequence[int], self: Any,
                       self_shape: Sequence[int], approximate: str = "none", grad_output_dtype: Any = "float32",
                       self_dtype: Any = "float32", label: str = "aten.gelu_backward.default",
                       binding_limit: BindingLimit | None = None,
                       max_workgroup_size: int | None = None) -> list[Dispatch]:
    """aten.gelu_backward: grad_output * gelu'(self) for approximate "none" or "tanh"."""
    key = "aten.gelu_backward.default"
    _, op = _gelu_ops(approximate, key)
    g_view = _float_operand(grad_output_shape, grad_output_dtype, f"{key} grad_output")
    x_view = _float_operand(self_shape, self_dtype, f"{key} self")
    return plan_binary(op, out, grad_output, g_view, self, x_view, label=label, binding_limit=binding_limit,
                       max_workgroup_size=max_workgroup_size)

"""Tensor-core GEMMs through VK_KHR_cooperative_matrix: plan functions for the coopmat kernels.

fp16 inputs, fp32 accumulation, fp32 in memory: activations (and dense B operands) are rounded to
fp16 while they are staged in shared memory; the 4-bit base is dequantized from its W_4X8 words
(docs/spec/w4x8.md) straight into fp16 tiles. Each output element is therefore
sum_k fp16(a_k) * fp16(b_k) accumulated in fp32, not the fp32 result of the SIMT kernels: callers
choose these kernels where that precision is acceptable (tests/test_kernels_coopmat.py states the
bound). Shaders: vktrain/runtime_shaders/coopmat_{linear_q4gsw,linear_q4gsw_backward,mm,absmax}.comp,
body coopmat_gemm.glsl.

Kernels (alternative plans of vktrain.linear_q4gsw(_backward).default and aten.mm.default, so not in the
one-plan-per-op registry; the op lowering takes them where this program's GemmRoute says so):
  coopmat_linear_q4gsw   y[M, N] = x[M, K] @ deq(W).T
  coopmat_mm             C[M, N] = A[M, K] @ B[K, N], or A @ B^T with B^T given as [N, K] (b_transposed),
                         A and B each scaled per tensor by a power of two before their fp16 rounding
                         (max |A|, max |B| from coopmat_absmax, the first dispatch); with an `addend`
                         D [M, N] (aten.addmm, beta = alpha = 1) C = A @ B + D, D added in fp32 to the
                         unscaled accumulators (the ADDEND variant)
  coopmat_linear_q4gsw_backward   d_x[M, K] = d_out[M, N] @ deq(W), d_out scaled per tensor by a power of
                         two before its fp16 rounding (max |d_out| from coopmat_absmax, the first dispatch)

They need a device whose `cooperative_matrix_properties` list 16x16x16 fp16 x fp16 + fp32 at subgroup
scope (`coopmat_supported`). Tiling: 4 subgroups per workgroup, a BN = 128 wide tile and BM = 128 or 64
rows (`tile_m`; default: 64 when 128-row tiles would leave the GPU short of workgroups). Push
constants (after the runtime's group-offset header): M, N, K, group_size (0 for mm), and the number of
per-workgroup maxima of |A| and |B| coopmat_absmax wrote for the operand scales (0 where unscaled).

Selection (docs/PRECISION.md): the program's blob lists the GEMM precision policies it allows
(`allowed_precisions`, metadata `gemm_precisions`); at load `select_gemm_route` picks, from the policy the
user asked for and the device's cooperative-matrix properties, the GemmRoute the executor hands every op
lowering: the 4-bit base GEMMs and aten.mm (`GemmRoute.dense_b_transposed` says which mm operands
these kernels read).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from vktrain.contract import (METADATA_GEMM_PRECISIONS, PRECISION_AUTO, PRECISION_CHOICES, PRECISION_FP16_TC,
                              PRECISION_FP32, PRECISIONS)
from vktrain.errors import VktrainError
from vktrain.quant import check_q4gsw_shapes
from vktrain.runtime.delegate.kernels.gemm_tuning import GPU_TUNING
from vktrain.runtime.delegate.kernels.layout import (
    MAX_ELEMENTS,
    KernelArgumentError,
    StridedView,
    binding,
)
from vktrain.runtime.vk.coopmat import EXTENSION_NAME, CooperativeMatrixShape, supports_shape
from vktrain.runtime.vk.schedule import Dispatch, ceil_div, pack_push

# The cooperative-matrix shape and types the shaders are written for.
FRAGMENT = (16, 16, 16)
INPUT_TYPE, ACCUMULATOR_TYPE = "float16", "float32"
EXTENSION_HINT = f"{EXTENSION_NAME} 16x16x16 {INPUT_TYPE}*{INPUT_TYPE}+{ACCUMULATOR_TYPE}"
TILE_N = 128
TILE_M_CHOICES = (128, 64)
DEFAULT_SUBGROUP_SIZE = 32  # the shaders' default SUBGROUP_SIZE define (NVIDIA; AMD RDNA may need 64)
# 128-row tiles when they give at least this many workgroups (about 2 per SM of a 132-SM H200), else 64:
# the faster tile for both kernels at all 12 Llama-3.2-1B shapes of bench/results/coopmat_h200.json.
TARGET_WORKGROUPS = 256
# A GEMM takes the tensor cores when its output has at least this many 64-row tiles (about one per SM of
# a 132-SM H200): each workgroup then takes about as long as at M = 512 (0.058 ms for K = 2048 in
# bench/results/coopmat_h200.json), while the SIMT kernels split K over the SMs at small M (0.043 ms at
# M = 128, N = 2048: 32 coopmat workgroups would be slower).
MIN_WORKGROUPS = 128
SUBGROUP_BASIC_BIT = 0x1  # VK_SUBGROUP_FEATURE_BASIC_BIT: what the emulated variant needs besides fp16
# lavapipe (llvmpipe's LP_MAX_TGSI_LOOP_ITERATIONS) gives each invocation 65535 loop iterations over all
# its loops together and silently cuts them short past that: the outputs it has not stored stay
# unwritten (the NaN seen before). The emulated variants' plans refuse a shape whose loop nest
# (emulated_loop_trips, the iterations the source asks for) exceeds half that: lavapipe counts more than
# the source's iterations (64-row tiles, subgroups of 8, LLVM 15: fine at K = 6400, cut at 6656, i.e.
# 315-327 per K step where the source runs 257).
LAVAPIPE_LOOP_LIMIT = 65535
EMULATED_LOOP_BUDGET = LAVAPIPE_LOOP_LIMIT // 2
BK = 32  # the shaders' reduction step


class PrecisionPolicyError(VktrainError, ValueError):
    """A GEMM precision policy the runtime does not know, the program does not allow, or cannot run."""


def allowed_precisions(metadata: Mapping[str, str], source: str = "the program") -> tuple[str, ...]:
    """The GEMM precision policies a blob allows (its metadata `gemm_precisions`, a JSON list). Blobs
    written before the policy existed do not record it: they allow fp32 only."""
    text = metadata.get(METADATA_GEMM_PRECISIONS)
    if text is None:
        return (PRECISION_FP32,)
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        listed = None
    if not isinstance(listed, list) or not listed or not all(p in PRECISIONS for p in listed):
        raise PrecisionPolicyError(f"{source}: blob metadata {METADATA_GEMM_PRECISIONS!r} is {text!r}; expected a "
                                   f"non-empty JSON list of {', '.join(PRECISIONS)}")
    return tuple(listed)


@dataclass(frozen=True)
class GemmRoute:
    """Which kernels a program's GEMMs run on this device, chosen once at load (`select_gemm_route`).

    `tensor_cores`: the 4-bit base GEMMs (forward, d_x) take the coopmat kernels where `takes_tensor_cores`;
    `emulate` runs its COOPMAT_EMULATE variant (the test path on devices without tensor cores);
    `reason` says why, for the reports (train's startup line); `fp32_tuning` is the tuning of the fp32
    GEMM kernels on this device (kernels/gemm_tuning.py)."""

    precision: str
    tensor_cores: bool
    reason: str
    emulate: bool = False
    subgroup_size: int = DEFAULT_SUBGROUP_SIZE
    min_workgroups: int = MIN_WORKGROUPS
    fp32_tuning: str = GPU_TUNING

    def takes_tensor_cores(self, M: int, N: int, reduction: int | None = None) -> bool:
        """Whether an M x N output goes to the coopmat kernels (enough tiles to pay, see MIN_WORKGROUPS).
        Emulated, also whether the emulated kernel can run its `reduction` on this device (lavapipe's
        loop budget): longer ones keep the fp32 kernels."""
        if not self.tensor_cores or ceil_div(M, min(TILE_M_CHOICES)) * ceil_div(N, TILE_N) < self.min_workgroups:
            return False
        return not (self.emulate and reduction is not None
                    and emulated_loop_trips(default_tile_m(M, N), reduction, self.subgroup_size) > EMULATED_LOOP_BUDGET)

    def dense_b_transposed(self, a: StridedView, b: StridedView) -> bool | None:
        """How coopmat_mm reads aten.mm's operands A [M, K] and B [K, N] on this route: False for B
        row-major, True for B a transposed view of a row-major [N, K] (a weight, the tied head); None
        when this mm keeps the fp32 kernel (too small, A not row-major, an offset view, or sizes the
        kernel does not take)."""
        (M, K), N = a.sizes, b.sizes[1]
        if not self.takes_tensor_cores(M, N, K) or K % 4 or N % 4 or a.offset or b.offset:
            return None
        if not a.is_contiguous:
            return None
        if b.is_contiguous:
            return False
        return True if b.strides == (1, K) else None

    @property
    def plan_options(self) -> dict:
        """The coopmat plans' device arguments on this route."""
        return dict(emulate=self.emulate, subgroup_size=self.subgroup_size)

    def describe(self) -> str:
        kernels = "tensor cores (fp16 inputs, fp32 accumulation)" if self.tensor_cores else "fp32 kernels"
        return (f"GEMM precision {self.precision}: {kernels}; {self.reason}; "
                f"fp32 kernels in their {self.fp32_tuning} tuning")


FP32_ROUTE = GemmRoute(PRECISION_FP32, False, "the fp32 policy")


def select_gemm_route(precision: str, allowed: tuple[str, ...], device: Any, *,
                      emulate: bool = False) -> GemmRoute:
    """The GemmRoute for the policy `precision` on `device` (a vktrain Device), for a program allowing
    `allowed`. fp16-tc takes the tensor cores where the device has the coopmat kernels' shape and types
    and falls back to the fp32 kernels (saying so) elsewhere. `emulate` (tests) pretends it has them and
    runs the emulated shaders, on every GEMM the route covers whatever its size. `auto` is fp16-tc where
    the program allows it and the device has the tensor-core kernels (or `emulate`), else fp32."""
    if precision not in PRECISION_CHOICES:
        raise PrecisionPolicyError(f"unknown GEMM precision {precision!r}; choose one of {', '.join(PRECISION_CHOICES)}")
    if precision == PRECISION_AUTO:
        fast = PRECISION_FP16_TC in allowed and (emulate or coopmat_supported(device.cooperative_matrix_properties))
        route = select_gemm_route(PRECISION_FP16_TC if fast else PRECISION_FP32, allowed, device, emulate=emulate)
        why = route.reason if fast else (f"{device.name} has no tensor-core kernels" if PRECISION_FP16_TC in allowed
                                         else f"the program allows only {', '.join(allowed)}")
        return dataclasses.replace(route, reason=f"auto -> {route.precision}: {why}")
    if precision not in allowed:
        raise PrecisionPolicyError(f"the program allows GEMM precision {', '.join(allowed)} (blob metadata "
                                   f"{METADATA_GEMM_PRECISIONS!r}), not {precision!r}")
    if precision == PRECISION_FP32:
        return FP32_ROUTE
    assert precision == PRECISION_FP16_TC
    if emulate:
        if "shaderFloat16" not in device.features or not device.subgroup_operations & SUBGROUP_BASIC_BIT:
            raise PrecisionPolicyError(f"{device.name} cannot run the emulated coopmat kernels: they need "
                                       f"shaderFloat16 and basic subgroup operations")
        return GemmRoute(precision, True, f"emulated on {device.name} (test path, no tensor cores used)",
                         emulate=True, subgroup_size=device.subgroup_size, min_workgroups=1)
    if not coopmat_supported(device.cooperative_matrix_properties):
        m, n, k = FRAGMENT
        return GemmRoute(precision, False, f"{device.name} lists no {m}x{n}x{k} {INPUT_TYPE} x {INPUT_TYPE} + "
                                           f"{ACCUMULATOR_TYPE} cooperative matrices ({EXTENSION_HINT}), so the "
                                           f"fp32 kernels run")
    return GemmRoute(precision, True, f"{device.name} has {EXTENSION_HINT}", subgroup_size=device.subgroup_size)


def coopmat_supported(properties: tuple[CooperativeMatrixShape, ...]) -> bool:
    """Whether a device with these cooperative-matrix properties (Device.cooperative_matrix_properties)
    can run the coopmat kernels."""
    m, n, k = FRAGMENT
    return supports_shape(properties, m=m, n=n, k=k, input_type=INPUT_TYPE, accumulator_type=ACCUMULATOR_TYPE)


def emulated_loop_trips(tile_m: int, reduction: int, subgroup_size: int) -> int:
    """Loop iterations one invocation of an emulated coopmat GEMM runs (coopmat_gemm.glsl with
    COOPMAT_EMULATE): per BK step its own trip plus 16 per emulated multiply-add, (BK / 16) x (tile_m / 32)
    x (TILE_N / 32) of them; then the edge stores, at most one loop of 256 / subgroup_size trips per
    accumulator of a subgroup."""
    fragments = (tile_m // 32) * (TILE_N // 32)
    per_step = 1 + (BK // FRAGMENT[2]) * fragments * FRAGMENT[2]
    return ceil_div(reduction, BK) * per_step + fragments * ceil_div(FRAGMENT[0] * FRAGMENT[1], subgroup_size)


def default_tile_m(M: int, N: int) -> int:
    """128-row tiles when the output has enough of them to fill a large GPU, else 64-row tiles."""
    return 128 if ceil_div(M, 128) * ceil_div(N, TILE_N) >= TARGET_WORKGROUPS else 64


def _check_positive(op: str, **dims: Any) -> None:
    for name, value in dims.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise KernelArgumentError(f"{op}: {name} must be an int >= 1, got {value!r}")


def _check_multiple_of_4(op: str, **dims: int) -> None:
    problems = [f"{name}={value}" for name, value in dims.items() if value % 4]
    if problems:
        raise KernelArgumentError(f"{op}: {', '.join(problems)} must be a multiple of 4 (vec4 rows, 16-byte "
                                  f"aligned matrix stores)")


def _check_range(op: str, M: int, N: int, K: int) -> None:
    largest = max(M * N, M * K, N * K)
    if largest > MAX_ELEMENTS:
        raise KernelArgumentError(f"{op}: shape M={M}, N={N}, K={K} has a tensor of {largest} elements; the "
                                  f"coopmat kernels index with 32 bits (at most {MAX_ELEMENTS})")


def _variant(shader: str, *, b_transposed: bool, tile_m: int, prefetch: bool, emulate: bool,
             subgroup_size: int, scale: str | None = None, addend: bool = False) -> str:
    """Shader name with its defines in the order the sources' `vktrain-variants:` lines use; `scale` is
    the operand-scale define (A_SCALE or AB_SCALE) or None."""
    defines = ([scale] if scale else []) + (["B_TRANSPOSED"] if b_transposed else []) \
        + (["BM=64"] if tile_m == 64 else []) \
        + (["PREFETCH"] if prefetch else []) + (["ADDEND"] if addend else []) \
        + (["COOPMAT_EMULATE"] if emulate else []) \
        + ([f"SUBGROUP_SIZE={subgroup_size}"] if subgroup_size != DEFAULT_SUBGROUP_SIZE else [])
    return shader + ("@" + "+".join(defines) if defines else "")


def _tiling(op: str, M: int, N: int, tile_m: int | None, subgroup_size: int, *, emulate: bool,
            reduction: int) -> int:
    if tile_m is None:
        tile_m = default_tile_m(M, N)
    if tile_m not in TILE_M_CHOICES:
        raise KernelArgumentError(f"{op}: tile_m must be one of {TILE_M_CHOICES}, got {tile_m!r}")
    if not isinstance(subgroup_size, int) or subgroup_size < 8 or subgroup_size & (subgroup_size - 1):
        raise KernelArgumentError(f"{op}: subgroup_size must be a power of two >= 8 (the device's subgroup "
                                  f"size), got {subgroup_size!r}")
    if emulate and emulated_loop_trips(tile_m, reduction, subgroup_size) > EMULATED_LOOP_BUDGET:
        raise KernelArgumentError(
            f"{op}: the emulated variant with {tile_m}-row tiles over a reduction of {reduction} runs "
            f"{emulated_loop_trips(tile_m, reduction, subgroup_size)} loop iterations per invocation, more than the "
            f"{EMULATED_LOOP_BUDGET} budgeted within lavapipe's limit of {LAVAPIPE_LOOP_LIMIT} (past it lavapipe cuts "
            f"loops short); use 64-row tiles or a shorter reduction")
    return tile_m


def plan_coopmat_linear_q4gsw(*, M: int, N: int, K: int, group_size: int, out: Any, x: Any, weights: Any,
                              scales: Any, tile_m: int | None = None, prefetch: bool | None = None,
                              emulate: bool = False, subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                              label: str = "coopmat_linear_q4gsw") -> list[Dispatch]:
    """y[M, N] = x[M, K] @ deq(W).T on tensor cores (fp16 inputs, fp32 accumulation).

    Buffers: out fp32 [M, N]; x fp32 [M, K]; weights W_4X8 uint32 (kernels.linear.prepack_weights);
    scales fp32 [G, N]. `tile_m` (128 or 64) and `prefetch` pick the shader variant; by default
    prefetch is on exactly with 64-row tiles (the fastest q4 variant at all 12 shapes of
    bench/results/coopmat_h200.json; coopmat_mm is fastest without it everywhere); `subgroup_size`
    must be the device's (Device.subgroup_size). `emulate` runs the same kernel with the
    cooperative-matrix operations done by plain arithmetic (any device; for tests, see the shader).
    """
    op = "coopmat_linear_q4gsw"
    _check_positive(op, M=M, N=N, K=K, group_size=group_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    _check_range(op, M, N, K)
    tile_m = _tiling(op, M, N, tile_m, subgroup_size, emulate=emulate, reduction=K)
    if prefetch is None:
        prefetch = tile_m == 64
    shader = _variant("coopmat_linear_q4gsw", b_transposed=False, tile_m=tile_m, prefetch=prefetch,
                      emulate=emulate, subgroup_size=subgroup_size)
    return [Dispatch(shader, groups=(ceil_div(N, TILE_N), ceil_div(M, tile_m), 1),
                     bindings=[binding(out, "w"), binding(x, "r"), binding(weights, "r"), binding(scales, "r")],
                     push_constants=pack_push(M, N, K, group_size, 0, 0), label=label)]


# coopmat_absmax.comp: workgroups of 256 threads, each reading at least 4 vec4 of its tensor; at most
# ABSMAX_MAX_PARTIALS workgroups (hence partial maxima) per tensor, which every GEMM workgroup reduces.
_ABSMAX_VECS_PER_GROUP = 256 * 4
ABSMAX_MAX_PARTIALS = 256


def absmax_partials(numel: int) -> int:
    """How many partial maxima coopmat_absmax writes for a tensor of numel floats."""
    return max(1, min(ceil_div(numel // 4, _ABSMAX_VECS_PER_GROUP), ABSMAX_MAX_PARTIALS))


def absmax_scratch_nbytes(*numels: int) -> int:
    """Scratch the operand scales of a coopmat GEMM take: the partial maxima of each scaled operand."""
    return 4 * sum(absmax_partials(n) for n in numels)


def _plan_absmax(absmax: Any, tensors: list[tuple[Any, int]], label: str) -> Dispatch:
    """One coopmat_absmax dispatch writing the partial maxima of |x| of one or two (x, numel) tensors
    into absmax, those of the first tensor first (numel % 4 == 0)."""
    (x0, numel0), (x1, numel1) = tensors[0], (tensors[1] if len(tensors) > 1 else (tensors[0][0], 0))
    groups0, groups1 = absmax_partials(numel0), absmax_partials(numel1) if numel1 else 0
    return Dispatch("coopmat_absmax", groups=(groups0 + groups1, 1, 1),
                    bindings=[binding(absmax, "w"), binding(x0, "r"), binding(x1, "r")],
                    push_constants=pack_push(numel0, numel1, groups0, groups1), label=label)


def takes_addend(bias: StridedView, out_shape: tuple[int, ...], beta: float, alpha: float) -> bool:
    """Whether coopmat_mm's ADDEND variant computes aten.addmm(bias, A, B, beta, alpha) into an output of
    `out_shape`: a bias of the output's shape, row-major, no view offset, and beta = alpha = 1 (the
    addend is added to the unscaled accumulators, nothing multiplied)."""
    return (bias.sizes == tuple(out_shape) and bias.is_contiguous and bias.offset == 0
            and float(beta) == 1.0 and float(alpha) == 1.0)


def plan_coopmat_mm(*, M: int, N: int, K: int, out: Any, a: Any, b: Any, absmax: Any, b_transposed: bool = False,
                    addend: Any = None, tile_m: int | None = None, prefetch: bool = False, emulate: bool = False,
                    subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                    label: str = "coopmat_mm") -> list[Dispatch]:
    """C[M, N] = A[M, K] @ B[K, N] on tensor cores (fp32 in memory, fp16 inputs, fp32 accumulation).

    Buffers: out fp32 [M, N]; a fp32 [M, K] row-major; b fp32 [K, N] row-major, or with b_transposed
    fp32 [N, K] row-major (C = A @ B^T: a linear layer's weight, the tied LM head); absmax
    absmax_scratch_nbytes(M * K, K * N) of scratch. K must be a multiple of 4 (rows are read as vec4) and so must N
    (the accumulators are stored with a row stride of N floats, which cooperative-matrix stores want
    16-byte aligned). Either operand may be a gradient (the head's d_h = d_logits @ W): each is scaled by
    the power of two that puts its largest magnitude in [2^14, 2^15) before its fp16 rounding, and the
    result back (exact). `addend` (fp32 [M, N] row-major, or None): C = A @ B + addend, the addend added
    to each unscaled accumulator in fp32 (one rounding, not contracted with the unscaling: the bits of the
    mm followed by an add). Dispatches: the partial maxima of |A| and |B|, the GEMM. `tile_m`, `prefetch`,
    `emulate`, `subgroup_size` as in plan_coopmat_linear_q4gsw.
    """
    op = "coopmat_mm"
    _check_positive(op, M=M, N=N, K=K)
    _check_multiple_of_4(op, K=K, N=N)
    _check_range(op, M, N, K)
    tile_m = _tiling(op, M, N, tile_m, subgroup_size, emulate=emulate, reduction=K)
    shader = _variant("coopmat_mm", b_transposed=bool(b_transposed), tile_m=tile_m, prefetch=prefetch,
                      emulate=emulate, subgroup_size=subgroup_size, scale="AB_SCALE", addend=addend is not None)
    bindings = [binding(out, "w"), binding(a, "r"), binding(b, "r"), binding(absmax, "r")]
    if addend is not None:
        bindings.append(binding(addend, "r"))
    return [_plan_absmax(absmax, [(a, M * K), (b, K * N)], f"{label}.absmax"),
            Dispatch(shader, groups=(ceil_div(N, TILE_N), ceil_div(M, tile_m), 1), bindings=bindings,
                     push_constants=pack_push(M, N, K, 0, absmax_partials(M * K), absmax_partials(K * N)),
                     label=label)]


def plan_coopmat_linear_q4gsw_backward(*, M: int, N: int, K: int, group_size: int, out: Any, d_out: Any,
                                       weights: Any, scales: Any, absmax: Any, tile_m: int | None = None,
                                       prefetch: bool | None = None, emulate: bool = False,
                                       subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                                       label: str = "coopmat_linear_q4gsw_backward") -> list[Dispatch]:
    """d_x[M, K] = d_out[M, N] @ deq(W) on tensor cores (fp16 inputs, fp32 accumulation).

    d_out is a gradient, whose values follow the loss divisor down to fp16's subnormals: it is scaled by
    the power of two that puts max |d_out| in [2^14, 2^15) before its fp16 rounding (and the result back,
    both exact). Dispatches: the partial maxima of |d_out| (into absmax, absmax_scratch_nbytes(M * N) of
    scratch), the GEMM.
    Buffers as plan_coopmat_linear_q4gsw's (out fp32 [M, K], d_out fp32 [M, N]); tiles along K.
    """
    op = "coopmat_linear_q4gsw_backward"
    _check_positive(op, M=M, N=N, K=K, group_size=group_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    _check_range(op, M, N, K)
    tile_m = _tiling(op, M, K, tile_m, subgroup_size, emulate=emulate, reduction=N)
    if prefetch is None:
        prefetch = tile_m == 64
    shader = _variant(op, b_transposed=False, tile_m=tile_m, prefetch=prefetch, emulate=emulate,
                      subgroup_size=subgroup_size, scale="A_SCALE")
    return [
        _plan_absmax(absmax, [(d_out, M * N)], f"{label}.absmax"),
        Dispatch(shader, groups=(ceil_div(K, TILE_N), ceil_div(M, tile_m), 1),
                 bindings=[binding(out, "w"), binding(d_out, "r"), binding(weights, "r"), binding(scales, "r"),
                           binding(absmax, "r")],
                 push_constants=pack_push(M, K, N, group_size, absmax_partials(M * N), 0), label=label)]

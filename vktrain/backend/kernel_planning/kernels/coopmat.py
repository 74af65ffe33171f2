"""Tensor-core GEMMs through VK_KHR_cooperative_matrix: plan functions for the coopmat kernels.

fp16 inputs, fp32 accumulation, fp32 in memory: activations (and dense B operands) are rounded to
fp16 while they are staged in shared memory; the 4-bit base is dequantized from its W_4X8 words
(docs/spec/w4x8.md) straight into fp16 tiles. Each output element is therefore
sum_k fp16(a_k) * fp16(b_k) accumulated in fp32, not the fp32 result of the SIMT kernels: callers
choose these kernels where that precision is acceptable (tests/test_kernels_coopmat.py states the
bound). Shaders: vktrain/runtime_shaders/coopmat_{linear_q4gsw,linear_q4gsw_backward,mm,absmax}.slang,
body coopmat_gemm.slangh (WebGPU: coopmat_gemm_wgsl.slangh).

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
  either q4gsw kernel with a `RankEpilogue` (RANK_EPILOGUE): C = base GEMM + hs[M, r] @ Bt[r, N], the rank
                         term summed in fp32 as matmul.slang sums aten.addmm's product (so the bits of the
                         base GEMM followed by that addmm: a LoRA linear's up-product in one dispatch;
                         the planner's rank_epilogue.py decides where)

They need a device whose `cooperative_matrix_properties` list 16x16x16 fp16 x fp16 + fp32 at subgroup
scope (`coopmat_supported`). Tiling (coopmat_tiling.py): a `CoopmatTiling` names one variant of the
shaders' body (workgroup tile, subgroup grid, reduction step BK, shared stages, register prefetch); `TILINGS` lists
those built ahead of time, and `default_tiling` picks one per kernel and shape from `DEFAULT_TILINGS`,
a table taken from the H200 sweep (bench/results/coopmat_h200.json). Push constants (after the
runtime's group-offset header): M, N, K, group_size (0 for mm), the number of per-workgroup maxima
of |A| and |B| coopmat_absmax wrote for the operand scales (0 where unscaled), and the split-K slice
length (0 unsplit).

Split-K: a small output over a long reduction (128 tokens: the base GEMMs, the head's d_h over the
vocabulary) would leave most of the GPU idle. Given a `scratch` (`split_k_scratch_nbytes`), each plan
cuts the reduction into `default_split_k` slices of whole BK steps (grid z), each slice's partial
product into scratch [slices, M, N], and linear_splitk_reduce.slang (the SIMT kernels' reduce) adds them
in a fixed order (bitwise reproducible, no atomics), then an addmm's addend (one fp32 rounding).

Selection (docs/PRECISION.md): the program's blob lists the GEMM precision policies it allows
(`allowed_precisions`, metadata `gemm_precisions`); at load `select_gemm_route` picks, from the policy the
user asked for and the device's cooperative-matrix properties, the GemmRoute the executor hands every op
lowering: the 4-bit base GEMMs and aten.mm (`GemmRoute.dense_b_transposed` says which mm operands
these kernels read). On the WebGPU runtime the same plans run f16 WGSL bodies of these kernels (no
tensor cores) in one tiling, WGSL_TILING (the WebGPU section below).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from vktrain.contract import (METADATA_GEMM_PRECISIONS, PRECISION_AUTO, PRECISION_CHOICES, PRECISION_FP16,
                              PRECISION_FP16_TC, PRECISION_FP32)
from vktrain.errors import PrecisionPolicyError
from vktrain.quant import check_q4gsw_shapes
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (
    EMULATED_LOOP_BUDGET,
    FRAGMENT,
    LAVAPIPE_LOOP_LIMIT,
    MIN_WORKGROUPS,
    SIZE_TILE_M,
    SIZE_TILE_N,
    SPLIT_TARGET_WORKGROUPS,
    STARVED_REDUCTION,
    CoopmatTiling,
    default_split_k,
    default_tiling,
    emulated_loop_trips,
    split_slice_length,
    workgroups,
)
from vktrain.backend.kernel_planning.kernels.gemm_tuning import GPU_TUNING
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_partials, plan_absmax as _plan_absmax, plan_splitk_reduce
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, StridedView
from vktrain.backend.kernel_planning.kernels.layout import binding
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.schedule import PlannedGemm
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.device_profile import (COOPMAT_EXTENSION, WEBGPU_DEVICE_TYPE, CoopmatShape, DeviceProfile,
                                                  supports_shape)

# The cooperative-matrix shape and types the shaders are written for.
INPUT_TYPE, ACCUMULATOR_TYPE = "float16", "float32"
EXTENSION_HINT = f"{COOPMAT_EXTENSION} 16x16x16 {INPUT_TYPE}*{INPUT_TYPE}+{ACCUMULATOR_TYPE}"
DEFAULT_SUBGROUP_SIZE = 32  # the shaders' default SUBGROUP_SIZE define (NVIDIA; AMD RDNA may need 64)
SUBGROUP_BASIC_BIT = 0x1  # VK_SUBGROUP_FEATURE_BASIC_BIT: what the emulated variant needs besides fp16




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
    # The device profile's split-K targets (coopmat_tiling.default_split_k); min_workgroups above is the
    # route's own gate (1 on the test paths), these stay the profile's so a test path splits as the device would.
    split_min_workgroups: int = MIN_WORKGROUPS
    split_target_workgroups: int = SPLIT_TARGET_WORKGROUPS
    fp32_tuning: str = GPU_TUNING
    wgsl: bool = False  # the WebGPU runtime's f16 WGSL kernels (no tensor cores), tiled by WGSL_TILING

    @property
    def fp16_simt(self) -> bool:
        """Whether the 4-bit base GEMMs (forward, d_x), and the mm `fp16_takes_mm` takes, run the fp32 kernels'
        FP16 variants (the fp16 policy on Vulkan: fp16 operands, fp32 products and sums, no tensor cores;
        kernels/linear.py, kernels/matmul.py)."""
        return self.precision == PRECISION_FP16 and not self.tensor_cores

    def fp16_takes_mm(self, M: int, N: int, reduction: int) -> bool:
        """Whether an aten.mm / addmm with an M x N output over `reduction` runs matmul.slang's FP16 variant on
        this route: the fp16 policy's size gate, fp16-tc's (at least min_workgroups 64 x 128 tiles, so that the
        operands' absmax pass pays; 1 on the test path) and a reduction longer than STARVED_REDUCTION (a shorter
        one is bandwidth-bound: the fp32 kernel reads the same bytes without the absmax pass), on operands it
        reads in place (matmul.fp16_reads_in_place)."""
        return (self.fp16_simt and reduction > STARVED_REDUCTION
                and ceil_div(M, SIZE_TILE_M) * ceil_div(N, SIZE_TILE_N) >= self.min_workgroups)

    @property
    def splits_reduction(self) -> bool:
        """Whether this route's kernels split a small output's reduction (split-K). The f16 WGSL kernels do
        not: they take the push block's k_slice as 0 only."""
        return not self.wgsl

    def takes_tensor_cores(self, M: int, N: int, reduction: int | None = None) -> bool:
        """Whether an M x N output goes to the coopmat kernels: enough tiles to pay (see MIN_WORKGROUPS),
        or, given its `reduction`, enough workgroups once split over K (see SPLIT_TARGET_WORKGROUPS).
        Emulated, also whether the emulated kernel can run its `reduction` on this device (lavapipe's
        loop budget): longer ones keep the fp32 kernels. A reduction of at most STARVED_REDUCTION (a LoRA
        rank) keeps the fp32 kernels on every route, the test path's included (coopmat_tiling.py says why)."""
        if not self.tensor_cores or (reduction is not None and reduction <= STARVED_REDUCTION):
            return False
        # One tiling table for every kernel's small outputs (DEFAULT_TILINGS' rows agree there).
        tiling = default_tiling("coopmat_mm", M, N, reduction or 0, emulate=self.emulate)
        if ceil_div(M, SIZE_TILE_M) * ceil_div(N, SIZE_TILE_N) < self.min_workgroups and (
                reduction is None or not self.splits_reduction
                or workgroups(tiling, M, N) * self._split_k(tiling, M, N, reduction) < self.min_workgroups):
            return False
        if not (self.emulate and reduction is not None):
            return True
        return emulated_loop_trips(tiling, reduction, self.subgroup_size) <= EMULATED_LOOP_BUDGET

    def _split_k(self, tiling: CoopmatTiling, M: int, N: int, reduction: int) -> int:
        return default_split_k(tiling, M, N, reduction, min_workgroups=self.split_min_workgroups,
                               target_workgroups=self.split_target_workgroups)

    def default_split_k(self, kernel: str, M: int, N: int, reduction: int) -> int:
        """Slices the default plan of `kernel` cuts an M x N output's reduction into on this route (1: none)."""
        if not self.splits_reduction:
            return 1
        return self._split_k(default_tiling(kernel, M, N, reduction, emulate=self.emulate), M, N, reduction)

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
        """The coopmat plans' device arguments on this route (on the WGSL route also its one tiling, which the
        coopmat GEMM plans take and coopmat attention, not run there, never sees)."""
        options = dict(emulate=self.emulate, subgroup_size=self.subgroup_size)
        return dict(options, tiling=WGSL_TILING) if self.wgsl else options

    def planned(self) -> PlannedGemm:
        """This route as the schedule records it (its reports are PlannedGemm's)."""
        return PlannedGemm(**dataclasses.asdict(self))

    @property
    def fp16_kernels(self) -> str:
        return self.planned().fp16_kernels

    def describe(self) -> str:
        return self.planned().describe()


FP32_ROUTE = GemmRoute(PRECISION_FP32, False, "the fp32 policy")


def select_gemm_route(precision: str, allowed: tuple[str, ...], device: Any, *,
                      emulate: bool = False, profile: DeviceProfile | None = None) -> GemmRoute:
    """The GemmRoute for the policy `precision` on `device` (a vktrain Device), for a program allowing
    `allowed`. fp16-tc takes the tensor cores where the device has the coopmat kernels' shape and types
    and falls back to the fp32 kernels (saying so) elsewhere. `emulate` (tests) pretends it has them and
    runs the emulated shaders, on every GEMM the route covers whatever its size. `auto` is fp16-tc where
    the program allows it and the device has the tensor-core kernels (or `emulate`), else fp16 where the
    program allows it, the device has shaderFloat16 and `profile` prefers it (DeviceProfile.prefers_fp16:
    the vendor table, serialization/device_profile.py), else fp32. fp16 runs the 4-bit base GEMMs and the
    large mm (`GemmRoute.fp16_takes_mm`; with `emulate` every mm of a reduction past STARVED_REDUCTION) on
    the fp32 kernels' FP16 variants where the device has shaderFloat16, else the fp32 route saying why. A route
    takes its size gate and split-K targets from `profile` (the device's DeviceProfile; default: the H200's
    numbers)."""
    route = _select_gemm_route(precision, allowed, device, emulate=emulate,
                               prefers_fp16=profile is not None and profile.prefers_fp16)
    if profile is None:
        return route
    split = dict(split_min_workgroups=profile.min_workgroups, split_target_workgroups=profile.split_k_target_workgroups)
    if route.tensor_cores and route.min_workgroups == MIN_WORKGROUPS:  # the device's gate, not a test path's 1
        split["min_workgroups"] = profile.min_workgroups
    return dataclasses.replace(route, **split)


def _select_gemm_route(precision: str, allowed: tuple[str, ...], device: Any, *, emulate: bool,
                       prefers_fp16: bool = False) -> GemmRoute:
    if precision not in PRECISION_CHOICES:
        raise PrecisionPolicyError(f"unknown GEMM precision {precision!r}; choose one of {', '.join(PRECISION_CHOICES)}")
    if getattr(device, "device_type", None) == WEBGPU_DEVICE_TYPE:
        return _select_webgpu_route(precision, allowed, device, emulate=emulate)
    if precision == PRECISION_AUTO:
        fast = PRECISION_FP16_TC in allowed and (emulate or coopmat_supported(device.cooperative_matrix_properties))
        if not fast and prefers_fp16 and PRECISION_FP16 in allowed and "shaderFloat16" in device.features:
            route = _select_gemm_route(PRECISION_FP16, allowed, device, emulate=emulate)
            return dataclasses.replace(route, reason=f"auto -> fp16: no tensor-core kernels, and the device profile "
                                                     f"prefers fp16 ({route.reason})")
        route = _select_gemm_route(PRECISION_FP16_TC if fast else PRECISION_FP32, allowed, device, emulate=emulate)
        why = route.reason if fast else (f"{device.name} has no tensor-core kernels" if PRECISION_FP16_TC in allowed
                                         else f"the program allows only {', '.join(allowed)}")
        return dataclasses.replace(route, reason=f"auto -> {route.precision}: {why}")
    if precision not in allowed:
        raise PrecisionPolicyError(f"the program allows GEMM precision {', '.join(allowed)} (blob metadata "
                                   f"{METADATA_GEMM_PRECISIONS!r}), not {precision!r}")
    if precision == PRECISION_FP32:
        return FP32_ROUTE
    if precision == PRECISION_FP16:
        if "shaderFloat16" not in device.features:
            return GemmRoute(PRECISION_FP32, False, f"fp16 asked, but {device.name} lacks shaderFloat16, so the fp32 "
                                                    f"kernels run")
        reason = f"{device.name} has shaderFloat16; no tensor cores used"
        if emulate:  # the test path: every mm the variant reads, whatever its output size (fp16_takes_mm)
            return GemmRoute(PRECISION_FP16, False, reason + "; every mm (test path)", min_workgroups=1)
        return GemmRoute(PRECISION_FP16, False, reason)
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


# ---- The WebGPU runtime's route: fp16-tc through f16 WGSL (vktrain/runtime_shaders/wgsl/coopmat_*.wgsl).
# WebGPU has no cooperative matrices; where the device's kernel features include shader-f16 the same
# Dispatches (names, bindings, push block, grid) run WGSL bodies with the contract's numerics: f16 operands
# (after the power-of-two scales) in f16 workgroup tiles, f32 products and sums. The WGSL serves one tiling,
# WGSL_TILING, for every kernel and shape (the plans' defaults depend on the SIMT width of a subgroup,
# which WGSL cannot promise): 64 x 128 tiles of C over BK = 32, 256 invocations with 12 KiB of tiles,
# within BROWSER_DEFAULT_LIMITS (tests/test_wgsl_f16.py checks it against the WGSL's declarations).
WGSL_TILING = CoopmatTiling(tile_m=64)
WGSL_F16_FEATURE = "shader-f16"


def _select_webgpu_route(precision: str, allowed: tuple[str, ...], device: Any, *, emulate: bool) -> GemmRoute:
    """select_gemm_route on a WebGPU device. fp16-tc runs the f16 WGSL kernels where the device's
    kernel_features include shader-f16, else falls back to fp32 saying so; `emulate` (tests) takes them on
    every GEMM the route covers whatever its size, as on Vulkan. `auto` stays fp32: on the H200 the f16 WGSL
    step is 1.07x / 1.21x slower than the fp32 WGSL one (docs/PRECISION.md, "On WebGPU")."""
    if precision == PRECISION_AUTO:
        route = _select_gemm_route(PRECISION_FP32, allowed, device, emulate=False)
        return dataclasses.replace(route, reason="auto -> fp32: WebGPU has no tensor cores (the f16 WGSL "
                                                 "kernels run only when --precision fp16-tc asks)")
    if precision not in allowed:
        raise PrecisionPolicyError(f"the program allows GEMM precision {', '.join(allowed)} (blob metadata "
                                   f"{METADATA_GEMM_PRECISIONS!r}), not {precision!r}")
    if precision == PRECISION_FP32:
        return FP32_ROUTE
    # fp16 has no SIMT variant in WGSL: it runs the f16 WGSL GEMMs, whose numerics (fp16 operands after
    # power-of-two scales, f32 products and sums) satisfy its bound (docs/PRECISION.md, "On WebGPU").
    if WGSL_F16_FEATURE not in device.kernel_features:
        why = "lacks it" if WGSL_F16_FEATURE not in device.features else "has it but its kernel features leave it out"
        return GemmRoute(precision, False, f"{device.name}: the f16 WGSL kernels need the WebGPU feature "
                                           f"{WGSL_F16_FEATURE}, which the device {why}, so the fp32 kernels run")
    reason = f"f16 WGSL, no tensor cores ({device.name} has {WGSL_F16_FEATURE})"
    if emulate:
        return GemmRoute(precision, True, reason + "; every GEMM (test path)", min_workgroups=1, wgsl=True)
    return GemmRoute(precision, True, reason, wgsl=True)


def coopmat_supported(properties: tuple[CoopmatShape, ...]) -> bool:
    """Whether a device with these cooperative-matrix properties (Device.cooperative_matrix_properties)
    can run the coopmat kernels."""
    m, n, k = FRAGMENT
    return supports_shape(properties, m=m, n=n, k=k, input_type=INPUT_TYPE, accumulator_type=ACCUMULATOR_TYPE)




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


def _variant(shader: str, tiling: CoopmatTiling, *, emulate: bool, subgroup_size: int,
             defines: tuple[str, ...] = (), addend: bool = False, rank: bool = False) -> str:
    """Shader name with its defines in the order the sources' `vktrain-variants:` lines use: the
    kernel's own `defines` (operand scale, B layout), the tiling's, ADDEND or RANK_EPILOGUE, then emulation
    and subgroup size."""
    names = list(defines) + tiling.defines + (["ADDEND"] if addend else []) + (["RANK_EPILOGUE"] if rank else []) \
        + (["COOPMAT_EMULATE"] if emulate else []) \
        + ([f"SUBGROUP_SIZE={subgroup_size}"] if subgroup_size != DEFAULT_SUBGROUP_SIZE else [])
    return shader + ("@" + "+".join(names) if names else "")


def _geometry(op: str, kernel: str, M: int, N: int, tiling: CoopmatTiling | None, subgroup_size: int, *,
              emulate: bool, reduction: int, scratch: Any, split_k: int | None,
              rank: int = 0) -> tuple[CoopmatTiling, int]:
    """The plan's tiling (default: `default_tiling`) and number of reduction slices (default with a
    scratch: `default_split_k`, else 1), checked; `rank`: that of a RankEpilogue (unsplit only)."""
    if tiling is None:
        tiling = default_tiling(kernel, M, N, reduction, emulate=emulate)
    if not isinstance(tiling, CoopmatTiling):
        raise KernelArgumentError(f"{op}: tiling must be a CoopmatTiling, got {tiling!r}")
    problems = tiling.problems()
    if problems:
        raise KernelArgumentError(f"{op}: tiling {tiling.name}: {'; '.join(problems)}")
    if not isinstance(subgroup_size, int) or subgroup_size < 8 or subgroup_size & (subgroup_size - 1):
        raise KernelArgumentError(f"{op}: subgroup_size must be a power of two >= 8 (the device's subgroup "
                                  f"size), got {subgroup_size!r}")
    if split_k is None:
        split_k = default_split_k(tiling, M, N, reduction) if scratch is not None else 1
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise KernelArgumentError(f"{op}: split_k must be an int >= 1, got {split_k!r}")
    if rank and split_k != 1:
        raise KernelArgumentError(f"{op}: a rank epilogue runs in an unsplit GEMM, got split_k={split_k}")
    if split_k > 1 and scratch is None:
        raise KernelArgumentError(f"{op}: split_k={split_k} needs a scratch buffer of {4 * split_k * M * N} bytes "
                                  f"(the slices' partial products of [{M}, {N}])")
    if split_k * M * N > MAX_ELEMENTS:
        raise KernelArgumentError(f"{op}: split_k={split_k} over a [{M}, {N}] output exceeds {MAX_ELEMENTS} "
                                  f"scratch elements (32-bit indices); use a smaller split_k")
    reduction = split_slice_length(tiling, reduction, split_k) if split_k > 1 else reduction
    if emulate and emulated_loop_trips(tiling, reduction, subgroup_size, rank) > EMULATED_LOOP_BUDGET:
        raise KernelArgumentError(
            f"{op}: the emulated variant with tiling {tiling.name} over a reduction of {reduction} runs "
            f"{emulated_loop_trips(tiling, reduction, subgroup_size, rank)} loop iterations per invocation, more than the "
            f"{EMULATED_LOOP_BUDGET} budgeted within lavapipe's limit of {LAVAPIPE_LOOP_LIMIT} (past it lavapipe cuts "
            f"loops short); use a tiling with fewer accumulators per subgroup or a shorter reduction")
    return tiling, split_k


def _gemm_dispatches(shader: str, tiling: CoopmatTiling, split_k: int, *, M: int, N: int, reduction: int,
                     out: Any, scratch: Any, inputs: list, push: tuple, addend: Any, label: str,
                     rank: "RankEpilogue | None" = None) -> list[Dispatch]:
    """The GEMM dispatch of a coopmat plan over an M x N output (`inputs`: its bindings after the output;
    `push`: its push constants before the slice length), and with split_k > 1 the reduce of its slices
    (which adds `addend`, whose shader then has no ADDEND). `rank` (unsplit): its bindings after `inputs`,
    its push constants after the slice length, its step form as specialization constant 3."""
    groups = (ceil_div(N, tiling.tile_n), ceil_div(M, tiling.tile_m), split_k)
    if rank is not None:
        return [Dispatch(shader, groups=groups, bindings=[binding(out, "w"), *inputs, *rank.bindings],
                         push_constants=pack_push(*push, 0, *rank.push), spec_constants={RANK_FMA_SPEC_ID: rank.fma},
                         label=label)]
    if split_k == 1:
        return [Dispatch(shader, groups=groups, bindings=[binding(out, "w"), *inputs],
                         push_constants=pack_push(*push, 0), label=label)]
    count4 = M * N // 4  # M * N % 4 == 0: every coopmat output has N % 4 == 0
    return [Dispatch(shader, groups=groups, bindings=[binding(scratch, "w"), *inputs],
                     push_constants=pack_push(*push, split_slice_length(tiling, reduction, split_k)),
                     label=f"{label}.split{split_k}"),
            plan_splitk_reduce(out=out, scratch=scratch, count4=count4, row_vec4s=count4 if addend is not None
                               else max(1, N // 4), split_k=split_k, bias=addend, label=f"{label}.reduce")]


RANK_FMA_SPEC_ID = 3  # coopmat_gemm.slangh's RANK_FMA


@dataclass(frozen=True)
class RankEpilogue:
    """A rank-r product added in a q4gsw kernel's epilogue (RANK_EPILOGUE, coopmat_gemm.slangh): the output
    becomes base + hs @ Bt, the rank term summed in fp32 exactly as matmul.slang's addmm(base, hs, Bt) (beta =
    alpha = 1) sums its product, so the dispatch computes the bits of the base GEMM followed by that addmm.
    `hs` [M, r] fp32 read as vec4 rows (`hs_view`: row-major, r, its row stride and offset multiples of 4),
    `bt` [r, N] fp32 through any strides (`bt_view`: a LoRA B^T is a transposed view of B [N, r], A [r, K]
    row-major); `fma`: the addmm's matmul body forms each step as fma(h, b, s) (its CPU body) rather than
    s + h * b (its GPU body)."""

    hs: Any
    hs_view: StridedView
    bt: Any
    bt_view: StridedView
    fma: bool = False

    @property
    def rank(self) -> int:
        return self.hs_view.sizes[1]

    def problems(self, M: int, N: int) -> list[str]:
        """What the kernel could not read of this epilogue for an M x N output; [] if nothing."""
        found = []
        (rows, r), bt = self.hs_view.sizes, self.bt_view
        if self.hs_view.rank != 2 or bt.rank != 2 or rows != M or bt.sizes != (r, N) or r < 1:
            found.append(f"hs {self.hs_view.sizes} and Bt {bt.sizes} are not [{M}, r] and [r, {N}]")
        elif (self.hs_view.strides[1] != 1 or r % 4 or self.hs_view.strides[0] % 4 or self.hs_view.offset % 4
              or self.hs_view.strides[0] < r):
            found.append(f"hs {self.hs_view} is not read as vec4 rows (row-major, rank, row stride and offset "
                         f"multiples of 4)")
        elif max(self.hs_view.extent(), bt.extent()) > MAX_ELEMENTS:
            found.append("hs or Bt reaches past 32-bit indices")
        return found

    @property
    def bindings(self) -> list:
        return [binding(self.hs, "r"), binding(self.bt, "r")]

    @property
    def push(self) -> tuple[int, ...]:
        """The push constants after the GEMM's (coopmat_gemm.slangh Params under RANK_EPILOGUE)."""
        return (self.rank, self.hs_view.offset, self.hs_view.strides[0], self.bt_view.offset, *self.bt_view.strides)


def _check_rank(op: str, rank: RankEpilogue | None, M: int, N: int) -> int:
    """The epilogue's rank (0 without one), checked."""
    if rank is None:
        return 0
    if not isinstance(rank, RankEpilogue):
        raise KernelArgumentError(f"{op}: rank_epilogue must be a RankEpilogue, got {rank!r}")
    problems = rank.problems(M, N)
    if problems:
        raise KernelArgumentError(f"{op}: rank epilogue: {'; '.join(problems)}")
    return rank.rank


def plan_coopmat_linear_q4gsw(*, M: int, N: int, K: int, group_size: int, out: Any, x: Any, weights: Any,
                              scales: Any, scratch: Any = None, split_k: int | None = None,
                              tiling: CoopmatTiling | None = None, emulate: bool = False,
                              subgroup_size: int = DEFAULT_SUBGROUP_SIZE, rank_epilogue: RankEpilogue | None = None,
                              label: str = "coopmat_linear_q4gsw") -> list[Dispatch]:
    """y[M, N] = x[M, K] @ deq(W).T on tensor cores (fp16 inputs, fp32 accumulation).

    Buffers: out fp32 [M, N]; x fp32 [M, K]; weights W_4X8 uint32 (kernels.linear.prepack_weights);
    scales fp32 [G, N]. `tiling` picks the shader variant (default: `default_tiling`); `subgroup_size`
    must be the device's (Device.subgroup_size). `emulate` runs the same kernel with the
    cooperative-matrix operations done by plain arithmetic (any device; for tests, see the shader).
    `scratch` (split_k_scratch_nbytes bytes, or 4 * split_k * M * N for an explicit `split_k`) lets the
    plan split the reduction (module docstring); `split_k` forces the number of slices. `rank_epilogue`:
    y = x @ deq(W).T + hs @ Bt (RankEpilogue), unsplit (a scratch is then not used).
    """
    op = "coopmat_linear_q4gsw"
    _check_positive(op, M=M, N=N, K=K, group_size=group_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    _check_range(op, M, N, K)
    rank = _check_rank(op, rank_epilogue, M, N)
    tiling, split_k = _geometry(op, op, M, N, tiling, subgroup_size, emulate=emulate, reduction=K,
                                scratch=None if rank else scratch, split_k=split_k, rank=rank)
    shader = _variant(op, tiling, emulate=emulate, subgroup_size=subgroup_size, rank=bool(rank))
    return _gemm_dispatches(shader, tiling, split_k, M=M, N=N, reduction=K, out=out, scratch=scratch,
                            inputs=[binding(x, "r"), binding(weights, "r"), binding(scales, "r")],
                            push=(M, N, K, group_size, 0, 0), addend=None, label=label, rank=rank_epilogue)


def takes_addend(bias: StridedView, out_shape: tuple[int, ...], beta: float, alpha: float) -> bool:
    """Whether coopmat_mm's ADDEND variant computes aten.addmm(bias, A, B, beta, alpha) into an output of
    `out_shape`: a bias of the output's shape, row-major, no view offset, and beta = alpha = 1 (the
    addend is added to the unscaled accumulators, nothing multiplied)."""
    return (bias.sizes == tuple(out_shape) and bias.is_contiguous and bias.offset == 0
            and float(beta) == 1.0 and float(alpha) == 1.0)


def plan_coopmat_mm(*, M: int, N: int, K: int, out: Any, a: Any, b: Any, absmax: Any, b_transposed: bool = False,
                    addend: Any = None, scratch: Any = None, split_k: int | None = None,
                    tiling: CoopmatTiling | None = None, emulate: bool = False,
                    subgroup_size: int = DEFAULT_SUBGROUP_SIZE, label: str = "coopmat_mm") -> list[Dispatch]:
    """C[M, N] = A[M, K] @ B[K, N] on tensor cores (fp32 in memory, fp16 inputs, fp32 accumulation).

    Buffers: out fp32 [M, N]; a fp32 [M, K] row-major; b fp32 [K, N] row-major, or with b_transposed
    fp32 [N, K] row-major (C = A @ B^T: a linear layer's weight, the tied LM head); absmax
    absmax_scratch_nbytes(M * K, K * N) of scratch. K must be a multiple of 4 (rows are read as vec4) and so must N
    (the accumulators are stored with a row stride of N floats, which cooperative-matrix stores want
    16-byte aligned). Either operand may be a gradient (the head's d_h = d_logits @ W): each is scaled by
    the power of two that puts its largest magnitude in [2^14, 2^15) before its fp16 rounding, and the
    result back (exact). `addend` (fp32 [M, N] row-major, or None): C = A @ B + addend, the addend added
    to each unscaled accumulator in fp32 (one rounding, not contracted with the unscaling: the bits of the
    mm followed by an add). Dispatches: the partial maxima of |A| and |B|, the GEMM (and, split, the
    reduce of its slices, which adds the addend). `tiling`, `emulate`, `subgroup_size`, `scratch`,
    `split_k` as in plan_coopmat_linear_q4gsw (the default tiling is that of coopmat_mm_b_transposed
    for b_transposed; with an addend the tilings of ADDEND_TILINGS are prebuilt).
    """
    op = "coopmat_mm"
    _check_positive(op, M=M, N=N, K=K)
    _check_multiple_of_4(op, K=K, N=N)
    _check_range(op, M, N, K)
    kernel = "coopmat_mm_b_transposed" if b_transposed else op
    tiling, split_k = _geometry(op, kernel, M, N, tiling, subgroup_size, emulate=emulate, reduction=K,
                                scratch=scratch, split_k=split_k)
    fused_addend = addend is not None and split_k == 1
    shader = _variant(op, tiling, emulate=emulate, subgroup_size=subgroup_size,
                      defines=("AB_SCALE",) + (("B_TRANSPOSED",) if b_transposed else ()), addend=fused_addend)
    inputs = [binding(a, "r"), binding(b, "r"), binding(absmax, "r")] + ([binding(addend, "r")] if fused_addend else [])
    return [_plan_absmax(absmax, [(a, M * K), (b, K * N)], f"{label}.absmax"),
            *_gemm_dispatches(shader, tiling, split_k, M=M, N=N, reduction=K, out=out, scratch=scratch, inputs=inputs,
                              push=(M, N, K, 0, absmax_partials(M * K), absmax_partials(K * N)),
                              addend=None if fused_addend else addend, label=label)]


def plan_coopmat_linear_q4gsw_backward(*, M: int, N: int, K: int, group_size: int, out: Any, d_out: Any,
                                       weights: Any, scales: Any, absmax: Any, scratch: Any = None,
                                       split_k: int | None = None, tiling: CoopmatTiling | None = None,
                                       emulate: bool = False,
                                       subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                                       rank_epilogue: RankEpilogue | None = None,
                                       label: str = "coopmat_linear_q4gsw_backward") -> list[Dispatch]:
    """d_x[M, K] = d_out[M, N] @ deq(W) on tensor cores (fp16 inputs, fp32 accumulation).

    d_out is a gradient, whose values follow the loss divisor down to fp16's subnormals: it is scaled by
    the power of two that puts max |d_out| in [2^14, 2^15) before its fp16 rounding (and the result back,
    both exact). Dispatches: the partial maxima of |d_out| (into absmax, absmax_scratch_nbytes(M * N) of
    scratch), the GEMM (and, split, the reduce of its slices).
    Buffers, `tiling`, `scratch`, `split_k` as plan_coopmat_linear_q4gsw's (out fp32 [M, K], d_out fp32
    [M, N]; the reduction runs along N); tiles along K. `rank_epilogue`: d_x = d_out @ deq(W) + hs @ Bt
    (RankEpilogue, Bt [r, K]; added after the unscaling), unsplit.
    """
    op = "coopmat_linear_q4gsw_backward"
    _check_positive(op, M=M, N=N, K=K, group_size=group_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    _check_range(op, M, N, K)
    rank = _check_rank(op, rank_epilogue, M, K)
    tiling, split_k = _geometry(op, op, M, K, tiling, subgroup_size, emulate=emulate, reduction=N,
                                scratch=None if rank else scratch, split_k=split_k, rank=rank)
    shader = _variant(op, tiling, emulate=emulate, subgroup_size=subgroup_size, defines=("A_SCALE",),
                      rank=bool(rank))
    return [_plan_absmax(absmax, [(d_out, M * N)], f"{label}.absmax"),
            *_gemm_dispatches(shader, tiling, split_k, M=M, N=K, reduction=N, out=out, scratch=scratch,
                              inputs=[binding(d_out, "r"), binding(weights, "r"), binding(scales, "r"),
                                      binding(absmax, "r")],
                              push=(M, K, N, group_size, absmax_partials(M * N), 0), addend=None, label=label,
                              rank=rank_epilogue)]

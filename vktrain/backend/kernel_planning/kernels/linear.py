"""The linear family: plan functions for linear_q4gsw, linear_q4gsw_backward and linear_dW.

Each plan function turns shapes and buffer handles (keys of the Program's buffer mapping, Buffer
objects or BufferBindings) into `Dispatch` records. Activations are fp32 and contiguous, leading
dimensions flattened into M by the caller; `weights` is the W_4X8 prepacked buffer
(`prepack_weights`), `scales` fp32 [G, N]. Semantics: docs/spec/training-ops.md; layouts:
docs/spec/w4x8.md.

Kernels (vktrain/runtime_shaders):
  linear_q4gsw(@HAS_BIAS)         tiled GEMM  y  = x @ deq(W).T (+ bias)   (body: linear_gemm.slangh)
  linear_q4gsw_backward           tiled GEMM  dx = d_out @ deq(W)
  linear_dw                       tiled GEMM  dW = d_out.T @ x
  linear_q4gsw_gemv(@HAS_BIAS)    M <= GEMV_MAX_M forward, one pass over W per GEMV_MAX_ROWS rows
  linear_q4gsw_gemv@BACKWARD      M <= GEMV_MAX_M backward
  linear_splitk_reduce(@HAS_BIAS) second pass of a split-K GEMM
  linear_q4gsw@CPU_REGISTER_TILES(+HAS_BIAS), linear_q4gsw_backward@CPU_REGISTER_TILES
                                  the register-tile bodies (linear_gemm_cpu.slangh) for every M on a CPU device
Push constants (after the runtime's group-offset header): M, N, K, group_size and a GemmPlacement
(`gemm_push`) for the GEMMs; M, N, K for the GEMVs, which take the group size as specialization constant 4
(a constant divisor).

Split-K. When the output has few tiles but the reduction is long (M = 512 x N = 2048 on a GPU with
a hundred-odd compute units; the thin dW of a LoRA adapter), the GEMMs can split the reduction over
`split_k` workgroups per tile, each writing a partial output into a caller-provided `scratch` buffer,
and a second dispatch adds the partials in a fixed order. Pass `scratch` (at least
`plan_scratch_nbytes(...)` bytes, or `split_k_scratch_nbytes(...)` for an explicit split_k) to let the
plan split; without it the plan never splits.

Device tuning (kernels/gemm_tuning.py). `tuning=CPU_TUNING` (the executor's choice on a CPU Vulkan
implementation) sends the forward and d_x GEMMs of every M, unless `tiles` or `split_k` force a kernel,
to the register-tile bodies: CPU_LANES invocations per workgroup, each owning CPU_ROWS rows x 4 columns,
no shared memory, no barrier, no split-K. dW keeps its shared-memory body (it has no CPU body: the LoRA
training step never computes a base weight's gradient).

Bindings over the limit (`binding_limit`, linear_q4gsw and linear_q4gsw_backward). W_4X8 keeps W's columns
contiguous, not its rows, so a W over the limit is cut into windows of K columns starting at multiples of
lcm(group_size, 16) (q4gsw_windows.py: each window's words and scales are a whole [N, kk] q4gsw weight),
and x / d_out / the output into windows of M rows when they are over it; every window's GEMM reads its
operands and writes C's rows through a GemmPlacement. The backward's K windows are windows of d_x's columns and the forward's M
windows of its rows: each sum is the unsplit one. The forward's K windows are windows of its reduction:
window 0 writes y's window, each later one runs the ACCUMULATE variant, which starts every output's sum
from the value y holds (one read_write binding, no alias) and adds the window's products in the unsplit
order (bias after the last window), so every output is the unsplit kernel's one chain of roundings: the
same bits (up to the sign of a zero sum). Windowed plans take the tiled GEMM, or the register-tile body
where the unsplit plan would (CPU_TUNING), never the GEMV (M <= GEMV_MAX_M: its slices of K are summed
across threads, so windows would reorder them) nor split-K (no scratch needed; an explicit split_k > 1
or GemvTiles is refused).

fp16 (the `fp16` GEMM precision policy, docs/PRECISION.md). `fp16=True` runs linear_q4gsw@FP16(+HAS_BIAS) /
linear_q4gsw_backward@FP16 at every M: the tiled body with fp16 shared tiles, fp32 products and sums
(linear_gemm.slangh), split-K as the fp32 body; never the GEMV, the register-tile bodies or windows (an op
over the binding limit keeps the fp32 kernels). d_x first runs coopmat_absmax over d_out (`plan_absmax`),
whose partial maxima give the power-of-two scale d_out is rounded under.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from vktrain.quant import check_q4gsw_shapes, pack_w4x8, padded_k, w4x8_num_words

from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.backend.kernel_planning.kernels import q4gsw_windows
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, check_tuning
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import (
    SHARED_MEMORY_LIMIT, BindingLimit, binding, exceeds, shader_variant, sub_binding
)
from vktrain.backend.kernel_planning.kernels.gemm_passes import (absmax_partials, absmax_scratch_nbytes, plan_absmax,
                                                                plan_splitk_reduce, split_k_scratch_nbytes)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel
from vktrain.backend.kernel_planning.kernels.linear_tiles import (
    GEMV_MAX_ROWS, GEMV_MAX_M, DEFAULT_SHARED_MEMORY_BYTES, FP16_SCALE_SHARED_BYTES, CPU_LANES, CPU_ROWS, CPU_MAX_LOOP_TRIPS,
    GemmTiles, GemvTiles, default_gemm_tiles, default_split_k, default_gemv_tiles, next_pow2)


@dataclass(frozen=True)
class GemmPlacement:
    """Where a GEMM's operands sit in their bindings, in elements: source row i (x / d_out) at a_offset +
    i * a_row_stride, C's row i at c_offset + i * c_row_stride, W's W_4X8 words from word w_offset, its
    scales from s_offset; a stride None is the contiguous one (the reduction's length / the output's
    columns). The bodies read vec4s and word pairs, so every value must be a multiple of 4."""

    a_offset: int = 0
    a_row_stride: int | None = None
    c_offset: int = 0
    c_row_stride: int | None = None
    w_offset: int = 0
    s_offset: int = 0


CONTIGUOUS = GemmPlacement()


def gemm_push(M: int, N: int, K: int, group_size: int, rows: int, cols: int, red: int,
              placement: GemmPlacement = CONTIGUOUS, label: str = "linear") -> bytes:
    """The push constants of the GEMMs (linear_gemm.slangh's block after the header), for an output
    [rows, cols] over a reduction of `red`."""
    a_row_stride = red if placement.a_row_stride is None else placement.a_row_stride
    c_row_stride = cols if placement.c_row_stride is None else placement.c_row_stride
    values = (placement.a_offset, a_row_stride, placement.c_offset, c_row_stride, placement.w_offset,
              placement.s_offset)
    given = [v for v in dataclasses.astuple(placement) if v is not None]  # the contiguous strides need not be
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 or v % 4 for v in given) \
            or a_row_stride < red or c_row_stride < cols:
        raise KernelArgumentError(f"{label}: {placement} must hold ints >= 0 that are multiples of 4, with row "
                                  f"strides >= the reduction {red} / the output's columns {cols}")
    if max(placement.a_offset + rows * a_row_stride, placement.c_offset + rows * c_row_stride) > MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: {placement} reaches past {MAX_ELEMENTS} elements (32-bit indices)")
    return pack_push(M, N, K, group_size, *values)


# ----------------------------------------------------------------------------------- weights
def prepack_weights(flat: np.ndarray, K: int) -> np.ndarray:
    """Flat q4gsw weights uint8 [N, Kp/2] -> the W_4X8 uint32 words the kernels read (vktrain.quant)."""
    flat = np.asarray(flat)
    if flat.ndim != 2:
        raise KernelArgumentError(f"flat weights must be 2-D uint8 [N, Kp/2], got shape {flat.shape}")
    return pack_w4x8(flat, K)


def weights_nbytes(N: int, K: int) -> int:
    """Bytes of the W_4X8 buffer of an [N, K] weight."""
    return 4 * w4x8_num_words(N, K)


# ----------------------------------------------------------------------------------- checks
def _check_positive(op: str, **dims: Any) -> None:
    for name, value in dims.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise KernelArgumentError(f"{op}: {name} must be an int >= 1, got {value!r}")


def _check_q4gsw(op: str, M: int, N: int, K: int, group_size: int) -> None:
    _check_positive(op, M=M, N=N, K=K, group_size=group_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    _check_index_range(op, M, N, K)


def _check_index_range(op: str, M: int, N: int, K: int) -> None:
    largest = max(M * N, M * K, N * K, padded_k(K) * N // 8)
    if largest > MAX_ELEMENTS:
        raise KernelArgumentError(f"{op}: shape M={M}, N={N}, K={K} has a tensor of {largest} elements; the "
                                  f"linear kernels index with 32 bits (at most {MAX_ELEMENTS})")


def _check_shared(op: str, tiles: GemmTiles | GemvTiles, shared_memory_bytes: int, fp16: bool = False) -> None:
    needed = tiles.shared_bytes // 2 + FP16_SCALE_SHARED_BYTES if fp16 else tiles.shared_bytes
    if needed > shared_memory_bytes:
        raise KernelArgumentError(f"{op}: {tiles}{' (FP16)' if fp16 else ''} needs {needed} bytes of "
                                  f"{SHARED_MEMORY_LIMIT}, more than the device's {shared_memory_bytes}; pick smaller tiles")


def plan_scratch_nbytes(op: str, *, M: int, N: int, K: int, group_size: int = 0, tuning: str = GPU_TUNING,
                        fp16: bool = False, gemm_tiles: GemmTiles | None = None) -> int:
    """Bytes of scratch the default plan of `op` uses when given one (0: it would not split).
    `group_size` (q4gsw ops), `tuning`, `fp16` and `gemm_tiles` as given to the plan; group_size 0 (not
    known) sizes the scratch for the tiled body, enough whichever body the plan then takes."""
    if not fp16 and _takes_cpu_body(op, N, K, group_size, None, None, tuning):
        return 0
    if op == "linear_q4gsw":
        rows, cols, red = M, N, K
    elif op == "linear_q4gsw_backward":
        rows, cols, red = M, K, N
    elif op == "linear_dW":
        rows, cols, red = N, K, M
    else:
        raise KernelArgumentError(f"plan_scratch_nbytes: unknown op {op!r} (linear_q4gsw, "
                                  f"linear_q4gsw_backward, linear_dW)")
    if op != "linear_dW" and M <= GEMV_MAX_M and not fp16:
        return 0
    tiles = gemm_tiles or default_gemm_tiles(rows, cols, can_split=True)
    return split_k_scratch_nbytes(rows, cols, default_split_k(rows, cols, red, tiles))


# ----------------------------------------------------------------------------------- GEMM plan
def _gemm_plan(op: str, shader: str, rows: int, cols: int, red: int, *, out: Any, inputs: list,
               push: bytes, bias: Any, tiles: GemmTiles | None, split_k: int | None, scratch: Any,
               shared_memory_bytes: int, label: str, accumulate: bool = False, fp16: bool = False,
               gemm_tiles: GemmTiles | None = None) -> list[Dispatch]:
    """Dispatches of one tiled GEMM (C [rows, cols], reduction `red`), split-K when asked or allowed;
    `accumulate` (forward, unsplit only): the ACCUMULATE variant, starting from what `out` holds; `fp16`:
    the FP16 variant (fp16 tiles); `gemm_tiles`: the device's tiles where `tiles` forces none."""
    if tiles is None:
        tiles = gemm_tiles or default_gemm_tiles(rows, cols, can_split=scratch is not None and split_k != 1, op=op)
    if not isinstance(tiles, GemmTiles):
        raise KernelArgumentError(f"{op}: tiles must be GemmTiles or GemvTiles, got {tiles!r}")
    _check_shared(op, tiles, shared_memory_bytes, fp16=fp16)
    if split_k is None:
        split_k = default_split_k(rows, cols, red, tiles) if scratch is not None else 1
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise KernelArgumentError(f"{op}: split_k must be an int >= 1, got {split_k!r}")
    if split_k > 1 and scratch is None:
        raise KernelArgumentError(
            f"{op}: split_k={split_k} needs a scratch buffer of split_k_scratch_nbytes({rows}, {cols}, "
            f"{split_k}) = {split_k_scratch_nbytes(rows, cols, split_k)} bytes")
    if split_k * rows * cols > MAX_ELEMENTS:
        raise KernelArgumentError(f"{op}: split_k={split_k} scratch of {split_k * rows * cols} elements "
                                  f"exceeds 32-bit indexing; use a smaller split_k")
    groups = (ceil_div(cols, tiles.bn), ceil_div(rows, tiles.bm), split_k)
    local = (tiles.threads_x, tiles.threads_y, 1)
    spec = {3: tiles.bk, 4: split_k}
    if split_k == 1:
        bindings = [binding(out, "rw" if accumulate else "w"), *inputs]
        bindings += [binding(bias, "r")] if bias is not None else []
        name = shader_variant(shader, ACCUMULATE=accumulate, HAS_BIAS=bias is not None, FP16=fp16)
        return [Dispatch(name, groups=groups, bindings=bindings, push_constants=push, spec_constants=spec,
                         local_size=local, label=label)]
    gemm = Dispatch(shader_variant(shader, FP16=fp16), groups=groups, bindings=[binding(scratch, "w"), *inputs], push_constants=push,
                    spec_constants=spec, local_size=local, label=f"{label}.split{split_k}")
    reduce = plan_splitk_reduce(out=out, scratch=scratch, count4=rows * cols // 4, row_vec4s=cols // 4,
                                split_k=split_k, bias=bias, label=f"{label}.reduce")
    return [gemm, reduce]


def _takes_cpu_body(op: str, N: int, K: int, group_size: int, tiles: Any, split_k: int | None,
                    tuning: str) -> bool:
    """Whether the default plan of `op` takes the register-tile body: CPU_TUNING, nothing forced, a
    reduction its loops can walk, and for d_x every workgroup's 4 * CPU_LANES columns in one group."""
    if check_tuning(tuning, f"{op}: tuning") != CPU_TUNING or tiles is not None or split_k not in (None, 1):
        return False
    if op == "linear_q4gsw":
        return K // 4 <= CPU_MAX_LOOP_TRIPS
    if op == "linear_q4gsw_backward":
        return ceil_div(N, 8) <= CPU_MAX_LOOP_TRIPS and group_size > 0 and group_size % (4 * CPU_LANES) == 0
    return False


def _cpu_gemm_plan(shader: str, rows: int, cols: int, *, out: Any, inputs: list, push: bytes, bias: Any,
                   label: str, accumulate: bool = False) -> list[Dispatch]:
    """The register-tile body (linear_gemm_cpu.slangh) over C [rows, cols]: lanes along the column quads."""
    bindings = [binding(out, "rw" if accumulate else "w"), *inputs] + ([binding(bias, "r")] if bias is not None else [])
    name = shader_variant(shader, CPU_REGISTER_TILES=True, ACCUMULATE=accumulate, HAS_BIAS=bias is not None)
    return [Dispatch(name, groups=(ceil_div(cols // 4, CPU_LANES), ceil_div(rows, CPU_ROWS), 1), bindings=bindings,
                     push_constants=push, local_size=(CPU_LANES, 1, 1), label=label)]


def _check_gemv_args(op: str, tiles: GemvTiles, split_k: int | None, shared_memory_bytes: int) -> None:
    if split_k not in (None, 1):
        raise KernelArgumentError(f"{op}: the GEMV path (GemvTiles) has no split_k, got split_k={split_k!r}")
    _check_shared(op, tiles, shared_memory_bytes)


def _check_fp16(op: str, tiles: Any, split_k: int | None, over_limit: bool) -> None:
    """The FP16 variant is one of the tiled body, unwindowed (the op lowering keeps ops over the binding
    limit on the fp32 kernels)."""
    if over_limit or isinstance(tiles, GemvTiles):
        why = "a binding over the limit (windows)" if over_limit else f"tiles={tiles!r}"
        raise KernelArgumentError(f"{op}: fp16 runs the tiled body's FP16 variant unwindowed; got {why}")


# ----------------------------------------------------------------------------------- plans
@register_kernel("vktrain.linear_q4gsw.default")
def plan_linear_q4gsw(*, M: int, N: int, K: int, group_size: int, out: Any, x: Any, weights: Any,
                      scales: Any, bias: Any = None, tiles: GemmTiles | GemvTiles | None = None,
                      split_k: int | None = None, scratch: Any = None,
                      shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES, tuning: str = GPU_TUNING,
                      binding_limit: BindingLimit | None = None, fp16: bool = False,
                      gemm_tiles: GemmTiles | None = None, max_workgroup_size: int | None = None,
                      label: str = "linear_q4gsw") -> list[Dispatch]:
    """y[M, N] = x[M, K] @ deq(W).T (+ bias[N]).

    Buffers: out fp32 [M, N]; x fp32 [M, K]; weights W_4X8 uint32 (`prepack_weights`); scales fp32
    [G, N]; bias fp32 [N] or None; scratch (optional) for split-K (module docstring). `tiles` forces
    a path and its tiling (GemvTiles -> GEMV kernel, GemmTiles -> tiled GEMM); by default
    M <= GEMV_MAX_M takes the GEMV kernel. `split_k` forces the number of reduction slices.
    `tuning` (kernels/gemm_tuning.py): CPU_TUNING takes the register-tile body (module docstring).
    `binding_limit`: bindings over it are cut into windows (module docstring, "Bindings over the limit").
    `fp16` (the fp16 GEMM precision policy): the tiled body's FP16 variant at every M (module docstring,
    "fp16"). `gemm_tiles`: the device's tiles for the tiled body (DeviceProfile.gemm_tiles; None: the
    default_gemm_tiles choice), windows over the binding limit included. `max_workgroup_size`: the device's
    invocations per workgroup, which the default GEMV tiles keep to.
    """
    op = "linear_q4gsw"
    _check_q4gsw(op, M, N, K, group_size)
    sizes = [4 * M * K, weights_nbytes(N, K), 4 * N * (K // group_size), 4 * M * N, 4 * N if bias is not None else 0]
    push = gemm_push(M, N, K, group_size, M, N, K)
    inputs = [binding(x, "r"), binding(weights, "r"), binding(scales, "r")]
    if fp16:
        _check_fp16(op, tiles, split_k, exceeds(binding_limit, sizes))
        return _gemm_plan(op, "linear_q4gsw", M, N, K, out=out, inputs=inputs, push=push, bias=bias, tiles=tiles,
                          split_k=split_k, scratch=scratch, shared_memory_bytes=shared_memory_bytes, label=label,
                          fp16=True, gemm_tiles=gemm_tiles)
    if exceeds(binding_limit, sizes):
        return _plan_windows(op, M, N, K, group_size, out=out, source=x, weights=weights, scales=scales, bias=bias,
                             tiles=tiles or gemm_tiles, split_k=split_k, shared_memory_bytes=shared_memory_bytes,
                             tuning=tuning, limit=binding_limit, label=label)
    if _takes_cpu_body(op, N, K, group_size, tiles, split_k, tuning):
        return _cpu_gemm_plan("linear_q4gsw", M, N, out=out, inputs=inputs, push=push, bias=bias, label=label)
    if tiles is None and M <= GEMV_MAX_M and split_k in (None, 1):
        tiles = default_gemv_tiles(min(M, GEMV_MAX_ROWS), K // 4, ceil_div(N // 4, 2), backward=False,
                                   shared_memory_bytes=shared_memory_bytes, max_workgroup_size=max_workgroup_size)
    if isinstance(tiles, GemvTiles):
        _check_gemv_args(op, tiles, split_k, shared_memory_bytes)
        bindings = [binding(out, "w"), *inputs] + ([binding(bias, "r")] if bias is not None else [])
        return [Dispatch(shader_variant("linear_q4gsw_gemv", HAS_BIAS=bias is not None),
                         groups=(ceil_div(ceil_div(N // 4, 2), tiles.wg_x), ceil_div(M, tiles.rows), 1),
                         bindings=bindings, push_constants=pack_push(M, N, K),
                         spec_constants={3: tiles.rows, 4: group_size},
                         local_size=(tiles.wg_x, tiles.wg_y, 1), label=label)]
    return _gemm_plan(op, "linear_q4gsw", M, N, K, out=out, inputs=inputs, push=push, bias=bias, tiles=tiles,
                      split_k=split_k, scratch=scratch, shared_memory_bytes=shared_memory_bytes, label=label,
                      gemm_tiles=gemm_tiles)


@register_kernel("vktrain.linear_q4gsw_backward.default")
def plan_linear_q4gsw_backward(*, M: int, N: int, K: int, group_size: int, out: Any, d_out: Any,
                               weights: Any, scales: Any, tiles: GemmTiles | GemvTiles | None = None,
                               split_k: int | None = None, scratch: Any = None,
                               shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES, tuning: str = GPU_TUNING,
                               binding_limit: BindingLimit | None = None, fp16: bool = False, absmax: Any = None,
                               gemm_tiles: GemmTiles | None = None, max_workgroup_size: int | None = None,
                               label: str = "linear_q4gsw_backward") -> list[Dispatch]:
    """d_x[M, K] = d_out[M, N] @ deq(W).

    Buffers: out fp32 [M, K]; d_out fp32 [M, N]; weights W_4X8 uint32; scales fp32 [G, N]; scratch
    (optional) for split-K. `tiles`, `split_k`, `tuning`, `binding_limit`, `gemm_tiles` and `max_workgroup_size`
    as in plan_linear_q4gsw. `fp16`: the FP16 variant, d_out scaled per tensor first (a coopmat_absmax dispatch
    into `absmax`, absmax_scratch_nbytes(M * N) bytes of scratch; module docstring, "fp16").
    """
    op = "linear_q4gsw_backward"
    _check_q4gsw(op, M, N, K, group_size)
    over = exceeds(binding_limit, [4 * M * N, weights_nbytes(N, K), 4 * N * (K // group_size), 4 * M * K])
    if fp16:
        _check_fp16(op, tiles, split_k, over)
        if absmax is None:
            raise KernelArgumentError(f"{op}: fp16 needs an absmax scratch of absmax_scratch_nbytes({M * N}) = "
                                      f"{absmax_scratch_nbytes(M * N)} bytes (d_out's partial maxima)")
        push = gemm_push(M, N, K, group_size, M, K, N) + pack_push(absmax_partials(M * N))
        inputs = [binding(d_out, "r"), binding(weights, "r"), binding(scales, "r"), binding(absmax, "r")]
        return [plan_absmax(absmax, [(d_out, M * N)], f"{label}.absmax"),
                *_gemm_plan(op, "linear_q4gsw_backward", M, K, N, out=out, inputs=inputs, push=push, bias=None,
                            tiles=tiles, split_k=split_k, scratch=scratch, shared_memory_bytes=shared_memory_bytes,
                            label=label, fp16=True, gemm_tiles=gemm_tiles)]
    if over:
        return _plan_windows(op, M, N, K, group_size, out=out, source=d_out, weights=weights, scales=scales,
                             bias=None, tiles=tiles or gemm_tiles, split_k=split_k,
                             shared_memory_bytes=shared_memory_bytes, tuning=tuning, limit=binding_limit, label=label)
    push = gemm_push(M, N, K, group_size, M, K, N)
    inputs = [binding(d_out, "r"), binding(weights, "r"), binding(scales, "r")]
    if _takes_cpu_body(op, N, K, group_size, tiles, split_k, tuning):
        return _cpu_gemm_plan("linear_q4gsw_backward", M, K, out=out, inputs=inputs, push=push, bias=None,
                              label=label)
    if tiles is None and M <= GEMV_MAX_M and split_k in (None, 1):
        tiles = default_gemv_tiles(min(M, GEMV_MAX_ROWS), ceil_div(N // 4, 2), K // 4, backward=True,
                                   shared_memory_bytes=shared_memory_bytes, max_workgroup_size=max_workgroup_size)
    if isinstance(tiles, GemvTiles):
        _check_gemv_args(op, tiles, split_k, shared_memory_bytes)
        return [Dispatch("linear_q4gsw_gemv@BACKWARD",
                         groups=(ceil_div(K // 4, tiles.wg_y), ceil_div(M, tiles.rows), 1),
                         bindings=[binding(out, "w"), *inputs], push_constants=pack_push(M, N, K),
                         spec_constants={3: tiles.rows, 4: group_size}, local_size=(tiles.wg_x, tiles.wg_y, 1),
                         label=label)]
    return _gemm_plan(op, "linear_q4gsw_backward", M, K, N, out=out, inputs=inputs, push=push, bias=None,
                      tiles=tiles, split_k=split_k, scratch=scratch, shared_memory_bytes=shared_memory_bytes,
                      label=label, gemm_tiles=gemm_tiles)


def _plan_windows(op: str, M: int, N: int, K: int, group_size: int, *, out: Any, source: Any, weights: Any,
                  scales: Any, bias: Any, tiles: Any, split_k: int | None, shared_memory_bytes: int, tuning: str,
                  limit: BindingLimit, label: str) -> list[Dispatch]:
    """linear_q4gsw (source x) or linear_q4gsw_backward (source d_out) over windows of K columns of W and M
    rows that each fit `limit` (module docstring, "Bindings over the limit")."""
    forward = op == "linear_q4gsw"
    if isinstance(tiles, GemvTiles) or split_k not in (None, 1):
        raise KernelArgumentError(f"{label}: a windowed {op} runs the GEMM bodies without split-K; got "
                                  f"tiles={tiles!r}, split_k={split_k!r}")
    cpu_body = _takes_cpu_body(op, N, K, group_size, tiles, split_k, tuning)  # the unsplit plan's body
    windows = q4gsw_windows.k_windows(N, K, group_size, limit)
    if windows is None:
        step = q4gsw_windows.k_window_step(group_size)
        raise limit.refusal(label, f"W [{N}, {K}] (group size {group_size}) in windows of {step} columns, one of "
                            f"which", weights_nbytes(N, step))
    source_row, out_row = (K, N) if forward else (N, K)
    whole_fits = not exceeds(limit, [4 * M * source_row, 4 * M * out_row])
    rows = q4gsw_windows.m_window_rows(M, max(source_row, out_row), whole_fits, limit)
    if rows == 0:
        raise limit.refusal(label, f"one row of {'x' if forward else 'd_out'} [{M}, {source_row}] / the output "
                            f"[{M}, {out_row}]", 4 * max(source_row, out_row))
    dispatches: list[Dispatch] = []
    for m in range(0, M, rows):
        mm = min(rows, M - m)
        for j, (k_begin, k_end) in enumerate(windows):
            kk = k_end - k_begin
            w_bound, w_skip = sub_binding(weights, *q4gsw_windows.words_byte_range(N, k_begin, k_end), "r",
                                          limit.alignment)
            s_bound, s_skip = sub_binding(scales, *q4gsw_windows.scales_byte_range(N, group_size, k_begin, k_end), "r",
                                          limit.alignment)
            offsets = dict(w_offset=w_skip // 4, s_offset=s_skip // 4)
            window_label = f"{label}.window{len(dispatches)}"
            if forward:  # x's rows m.., columns k_begin..; y's rows m.. (whole), summed over the windows of K
                a_bound, a_skip = sub_binding(source, 4 * (m * K + k_begin), 4 * ((m + mm - 1) * K + k_end), "r",
                                              limit.alignment)
                c_bound, c_skip = sub_binding(out, 4 * m * N, 4 * (m + mm) * N, "w", limit.alignment)
                placement = GemmPlacement(a_skip // 4, K, c_skip // 4, N, **offsets)
                push = gemm_push(mm, N, kk, group_size, mm, N, kk, placement, window_label)
                gemm = dict(out=c_bound, inputs=[a_bound, w_bound, s_bound], push=push,
                            bias=bias if j == len(windows) - 1 else None, label=window_label, accumulate=j > 0)
                cols, red = N, kk
            else:  # d_out's rows m.. (whole); d_x's rows m.., columns k_begin..
                a_bound, a_skip = sub_binding(source, 4 * m * N, 4 * (m + mm) * N, "r", limit.alignment)
                c_bound, c_skip = sub_binding(out, 4 * (m * K + k_begin), 4 * ((m + mm - 1) * K + k_end), "w",
                                              limit.alignment)
                placement = GemmPlacement(a_skip // 4, N, c_skip // 4, K, **offsets)
                push = gemm_push(mm, N, kk, group_size, mm, kk, N, placement, window_label)
                gemm = dict(out=c_bound, inputs=[a_bound, w_bound, s_bound], push=push, bias=None, label=window_label)
                cols, red = kk, N
            if cpu_body:
                dispatches += _cpu_gemm_plan(op, mm, cols, **gemm)
            else:
                dispatches += _gemm_plan(op, op, mm, cols, red, tiles=tiles or _window_tiles(op, mm, cols), split_k=1,
                                         scratch=None, shared_memory_bytes=shared_memory_bytes, **gemm)
    return dispatches


def _window_tiles(op: str, rows: int, cols: int) -> GemmTiles:
    """The default tiles with their height cut to a window of few rows (a large vocabulary's logits under a
    small limit: 12 rows of 20480 in 1 MiB), whose 64-row tiles would mostly compute rows past the window.
    Tiles change which thread computes an output, not its sum."""
    tiles = default_gemm_tiles(rows, cols, op=op)
    return GemmTiles(tiles.threads_x, min(tiles.threads_y, next_pow2(ceil_div(rows, 8))), tiles.bk)


@register_kernel("vktrain.linear_dW.default")
def plan_linear_dw(*, M: int, N: int, K: int, out: Any, d_out: Any, x: Any, tiles: GemmTiles | None = None,
                   split_k: int | None = None, scratch: Any = None,
                   shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES, tuning: str = GPU_TUNING,
                   gemm_tiles: GemmTiles | None = None, label: str = "linear_dW") -> list[Dispatch]:
    """dW[N, K] = d_out[M, N].T @ x[M, K] (dense fp32, reduction over M).

    Buffers: out fp32 [N, K]; d_out fp32 [M, N]; x fp32 [M, K]; scratch (optional) for split-K.
    Needs N % 4 == 0 and K % 4 == 0 (vec4 rows). Every `tuning` runs the shared-memory body; `gemm_tiles` as in
    plan_linear_q4gsw.
    """
    op = "linear_dW"
    check_tuning(tuning, f"{op}: tuning")
    _check_positive(op, M=M, N=N, K=K)
    problems = [f"{name}={value} must be a multiple of 4" for name, value in (("N", N), ("K", K)) if value % 4]
    if problems:
        raise KernelArgumentError(f"{op}: unsupported shape: " + "; ".join(problems))
    _check_index_range(op, M, N, K)
    if tiles is not None and not isinstance(tiles, GemmTiles):
        raise KernelArgumentError(f"{op}: has only the tiled GEMM kernel; tiles must be GemmTiles, got {tiles!r}")
    inputs = [binding(d_out, "r"), binding(x, "r")]
    return _gemm_plan(op, "linear_dw", N, K, M, out=out, inputs=inputs, push=gemm_push(M, N, K, 0, N, K, M), bias=None,
                      tiles=tiles, split_k=split_k, scratch=scratch, shared_memory_bytes=shared_memory_bytes,
                      label=label, gemm_tiles=gemm_tiles)

"""Dense fp32 GEMM for mm / bmm / addmm / baddbmm (matmul.slang), transposes expressed as strides.

`plan_gemm` computes C[b] = alpha * A[b] @ B[b] (+ beta * bias[b]) for views A [batch, M, K] and
B [batch, K, N] with any element strides (a transposed operand is a view whose last two strides are
swapped: t_copy / permute_copy feeding a mm need not be materialised) and a bias view broadcast to
[batch, M, N] (addmm's bias [N] or [M, N] reads in place with stride 0). C is contiguous unless
`c_row_stride` (elements between its rows, > N) and `c_offset` place it as a window of columns of a
wider matrix: C[b, m, n] is element c_offset + (b * M + m) * c_row_stride + n of `out` (how the executor
splits a head's logits over vocabulary windows whose weights fit a storage binding).

Tiling: 64 x 64 output tiles (256 threads), or 64 x 16 / 16 x 64 (64 threads) when the output's
N / M is <= 16 (the LoRA products of rank 16: a 64-wide tile would leave 3/4 of its threads idle);
32 x 64 (128 threads) for a 64 x 64 tile on a device allowing fewer than 256 invocations (`max_workgroup_size`:
the Vulkan-required 128 of the phone profiles), with the same bits;
4 x 4 outputs per thread, K steps of 16, partial tiles at the edges masked. When N % 4 == 0 a
thread's 4 columns are adjacent and each of its output rows is one vec4 store (the VEC4_C variant).
A grid over the device limit (batch > 65535, huge M) is split by the runtime.

Split-K. A skinny output (few tiles) over a long reduction (x[T, K] @ A^T[K, 16], the LoRA
gradients reducing over tokens) would leave most of a large GPU idle while a few workgroups loop
over K. Given a `scratch` buffer (`gemm_scratch_nbytes` bytes), the plan cuts K into slices of at
least MIN_SPLIT_SLICE so that about TARGET_THREADS threads run, writes each slice's partial product
into scratch [slices, batch, M, N], and adds the slices in a fixed order with a second dispatch
(linear_splitk_reduce.slang, shared with the linear family): bitwise reproducible, no atomics. A bias
of the output's own shape (contiguous, beta = 1: the addend the gemm_epilogue pass folds into addmm) is
added by the reduction after the slices, so the result is the bits of the mm followed by the add; any
other bias is added by slice 0. Without scratch the plan never splits.

Scale (`scale`: vktrain.mm_scaled, the gemm_scale pass's fold of aten.mul(mm, s)): out = fl(fl(A @ B) * s),
the sum rounded first, then one fp32 multiply by fp32(s), the bits of the mm followed by the mul. Unsplit the
kernel's alpha is s (alpha * acc after the whole sum); split, the slices keep alpha = 1 and the reduce
multiplies the sum of the slices. No bias, alpha 1, no windows (op_lowering plans those as the mm, then
gemm_passes.plan_scale_in_place).

Thin GEMMs (kernels/matmul_thin.py): on the GPU tuning a 2-D mm (or addmm with an addend of the output's
shape, beta = alpha = 1) with an output side of at most 16 beside a longer one, over a reduction of at least
128 (the LoRA products x @ A^T, d_y @ B, d_y^T @ u, d_u^T @ x), runs matmul_thin.slang where its large
operand has an aligned contiguous axis: read once in vec4, split over K with its own targets (the same
reduce pass), the same fp32 bound. A forced `tile` or `split_k` keeps the tiles.

Device tuning (kernels/gemm_tuning.py). With `tuning=CPU_TUNING` (the executor's choice on a CPU
Vulkan implementation) a GEMM whose tile is not forced runs matmul.slang's CPU_REGISTER_TILES variant
(body matmul_cpu.slangh, its variant choice kernels/matmul_cpu.py): workgroups of CPU_LANES invocations along N, each owning CPU_TM x CPU_TN outputs
in registers (CPU_TM by `cpu_tile_rows`), no shared memory, no barrier; the default plan then never
splits K (explicit `split_k` still works: the body reads the same slices).

Q8_0 B (`b_scales`, kernels/q8_0.py): B's storage is a frozen Q8_0 matrix, int8 codes (`b`) and float32
scales, dequantized as each element loads (matmul.slang's B_Q8_0 variants): the same tiles,
bodies and products as reading the float32 matrix they hold.

Bindings over the limit (`binding_limit`): a GEMM one of whose bindings would span more is cut into
windows of M rows, N columns and K steps that each fit (gemm_windows.py; 2-D only), e.g. logits = h @ W^T over
windows of W's vocabulary rows and the logits' rows (written through C's row stride), d_h =
d_logits @ W over windows of W's rows (K). M / N windows keep each sum whole and in order: the unsplit
bits. K windows add up through the bias epilogue (each GEMM's bias is the previous partial, beta 1),
alternating between C's window and one window of scratch so the last lands in C and no binding is both
read and written (WebGPU forbids that aliasing); the split-K reduce would need every slice's partial in
one (over-limit) binding. Each output is then w in-order partial sums added in order: at most K + w - 1
roundings per chain, |error| <= gamma_(K + w - 1) * sum_k |a_k b_k| (gamma_n = n u / (1 - n u), u = 2^-24),
the unsplit bound's form. Q8_0 windows start at a block with an aligned scale binding.

fp16 (the `fp16` GEMM precision policy, docs/PRECISION.md): `fp16=True` runs matmul.slang's FP16 variants
(the shared-memory body at every tuning, fp16 tiles, fp32 products and sums), A and B each scaled by a power
of two from their largest magnitudes (a coopmat_absmax dispatch into `absmax` first,
absmax_scratch_nbytes(M * K, K * N) bytes): 2-D operands only, each read in place from its whole binding
(offset 0, row-major or transposed), no Q8_0, no windows.

Accuracy: fp32 products accumulated in fp32 in k order within a slice; relative error ~ K * eps in
the worst case, ~ sqrt(K) * eps typically (tests: norm-relative 1e-4 against float64).
"""
from __future__ import annotations

import numbers
from typing import Any, Sequence

from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.backend.kernel_planning.kernels.gemm_tuning import GPU_TUNING
from vktrain.backend.kernel_planning.kernels import layout
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, StridedView, check_shape
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, binding, sub_binding, check_dtype, check_view_fits
from vktrain.backend.kernel_planning.kernels.gemm_windows import (bindings_fit, gemm_windows, q8_0_window, window_scratch_nbytes,
                                                           window_view)
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_partials, plan_absmax, plan_splitk_reduce
from vktrain.backend.kernel_planning.kernels.gemm_passes import split_k_scratch_nbytes as linear_split_k_scratch_nbytes
from vktrain.backend.kernel_planning.kernels.registry import register_kernel
from vktrain.backend.kernel_planning.kernels import matmul_thin
from vktrain.backend.kernel_planning.kernels.matmul_cpu import (CPU_LANES, CPU_TN, cpu_gemm_variant, cpu_tile_rows,
                                                                takes_cpu_body)

TILE_K = 16
MICRO_TILE = 4  # outputs per thread along M and along N
# (TILE_M, TILE_N) the shader is built for (matmul.slang's vktrain-variants).
GEMM_TILES = ((64, 64), (64, 16), (16, 64), (32, 64))
# A tile over a device's workgroup limit and the 128-thread tile the plan runs in its place: every output is
# one thread's sum over k in order whatever the tile, so the bits are the same (the split over K is the
# 64 x 64 tile's, see plan_gemm).
NARROW_TILES = {(64, 64): (32, 64)}
SKINNY_DIM = 16  # an output dim up to this takes the 16-wide tile along it
A_M_FASTEST_SPEC_ID = 3
B_K_FASTEST_SPEC_ID = 4

# Split-K targets: threads for a large GPU (512 workgroups of 256 = ~4 per SM of a 132-SM H200; the
# 64-thread skinny tiles get 4x as many workgroups); slices no shorter than MIN_SPLIT_SLICE (8 K
# steps, so the partial tile written and re-read costs <= ~20% of the operand traffic) and at most
# MAX_SPLIT_K of them (the reduction reads every slice's partial).
TARGET_THREADS = 512 * 256
MIN_SPLIT_SLICE = 128
MAX_SPLIT_K = 32


def _as_batched(view: StridedView, what: str) -> StridedView:
    if view.rank == 2:
        return view.unsqueeze(0)
    if view.rank == 3:
        return view
    raise KernelArgumentError(f"{what} must have rank 2 or 3 (got sizes {view.sizes})")


def default_gemm_tile(M: int, N: int) -> tuple[int, int]:
    """(TILE_M, TILE_N): 16 along an output dim <= SKINNY_DIM (the narrower one if both are), else 64 x 64."""
    if N <= SKINNY_DIM and (M > SKINNY_DIM or N <= M):
        return (64, 16)
    if M <= SKINNY_DIM:
        return (16, 64)
    return (64, 64)


def fitted_tile(tile: tuple[int, int], max_workgroup_size: int | None) -> tuple[int, int]:
    """`tile`, or its NARROW_TILES replacement on a device allowing fewer threads per workgroup."""
    if max_workgroup_size is not None and _tile_threads(tile) > max_workgroup_size:
        tile = NARROW_TILES.get(tile, tile)
    if max_workgroup_size is not None and _tile_threads(tile) > max_workgroup_size:
        raise KernelArgumentError(f"the GEMM tile {tile} needs {_tile_threads(tile)} invocations per workgroup, more "
                                  f"than the device's {max_workgroup_size}")
    return tile


def _check_tile(tile: Any, label: str) -> tuple[int, int]:
    if not isinstance(tile, (tuple, list)) or tuple(tile) not in GEMM_TILES:
        raise KernelArgumentError(f"{label}: tile must be one of {list(GEMM_TILES)} (TILE_M, TILE_N), got {tile!r}")
    return tuple(tile)


def _tile_threads(tile: tuple[int, int]) -> int:
    return (tile[0] // MICRO_TILE) * (tile[1] // MICRO_TILE)


def slice_length(K: int, split_k: int) -> int:
    """Reduction length of each of `split_k` slices: ceil(K / split_k) rounded up to whole K steps."""
    return ceil_div(ceil_div(K, split_k), TILE_K) * TILE_K


def default_split_k(batch: int, M: int, N: int, K: int, tile: tuple[int, int] | None = None) -> int:
    """Slices the default plan cuts K into when it has scratch (1: no split).

    Splits only outputs of fewer than TARGET_THREADS threads, with slices >= MIN_SPLIT_SLICE, at most
    MAX_SPLIT_K, and outputs of a multiple of 4 elements (the reduction adds vec4s). The count is
    trimmed so that no slice is empty.
    """
    tile = default_gemm_tile(M, N) if tile is None else tile
    outputs = batch * M * N
    if outputs == 0 or outputs % 4:
        return 1
    threads = batch * ceil_div(M, tile[0]) * ceil_div(N, tile[1]) * _tile_threads(tile)
    if threads >= TARGET_THREADS:
        return 1
    split_k = min(ceil_div(TARGET_THREADS, threads), K // MIN_SPLIT_SLICE, MAX_SPLIT_K)
    if split_k <= 1:
        return 1
    return ceil_div(K, slice_length(K, split_k))


def split_k_scratch_nbytes(batch: int, M: int, N: int, split_k: int) -> int:
    """Bytes of scratch a GEMM with output [batch, M, N] needs for `split_k` slices (0 when unsplit):
    the partials are laid out as for the linear family's GEMMs, whose reduce pass this plan shares."""
    return linear_split_k_scratch_nbytes(batch * M, N, split_k)


def gemm_scratch_nbytes(batch: int, M: int, N: int, K: int, tuning: str = GPU_TUNING,
                        binding_limit: BindingLimit | None = None, binding_sizes: Sequence[int] = ()) -> int:
    """Bytes of scratch the default plan of a [batch, M, K] @ [batch, K, N] GEMM uses when given one
    (0: it would not split, pass no scratch); at least window_scratch_nbytes when one of its bindings
    (`binding_sizes`, bytes) is over `binding_limit`."""
    if layout.exceeds(binding_limit, binding_sizes):
        return max(gemm_scratch_nbytes(batch, M, N, K, tuning), window_scratch_nbytes(batch * M, N, binding_limit))
    for name, value in (("batch", batch), ("M", M), ("N", N), ("K", K)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KernelArgumentError(f"gemm_scratch_nbytes: {name} must be an int >= 0, got {value!r}")
    if takes_cpu_body(K, None, tuning, "gemm_scratch_nbytes"):
        return 0
    thin = matmul_thin.thin_scratch_nbytes(M, N, K) if batch == 1 and tuning == GPU_TUNING else 0
    return max(thin, split_k_scratch_nbytes(batch, M, N, default_split_k(batch, M, N, K)))


def gemm_shader_name(tile: tuple[int, int], has_bias: bool, vec4_rows: bool) -> str:
    """The matmul.slang variant: `vec4_rows` (N % 4 == 0, so every output row starts 16-byte aligned)
    gives each thread 4 adjacent columns, stored as one vec4."""
    name = f"matmul@HAS_BIAS={int(has_bias)}"
    if tile != (64, 64):
        name += f"+TILE_M={tile[0]}+TILE_N={tile[1]}"
    return name + ("+VEC4_C" if vec4_rows else "")


def _check_split_k(split_k: Any, label: str) -> int:
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise KernelArgumentError(f"{label}: split_k must be an int >= 1, got {split_k!r}")
    return split_k


def _check_c_placement(c_offset: Any, c_row_stride: Any, batch: int, M: int, N: int, label: str) -> int:
    """C's row stride (N when not given), after checking that the placement holds C's rows apart and is
    addressable with 32-bit indices."""
    if isinstance(c_offset, bool) or not isinstance(c_offset, int) or c_offset < 0:
        raise KernelArgumentError(f"{label}: c_offset must be an int >= 0 (elements), got {c_offset!r}")
    if c_row_stride is None:
        c_row_stride = N
    if isinstance(c_row_stride, bool) or not isinstance(c_row_stride, int) or c_row_stride < N:
        raise KernelArgumentError(f"{label}: c_row_stride must be an int >= N = {N} (elements), got {c_row_stride!r}")
    if c_offset + batch * M * c_row_stride > MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: C at element {c_offset} with {batch * M} rows of stride {c_row_stride} "
                                  f"exceeds {MAX_ELEMENTS} elements (32-bit indices)")
    return c_row_stride


def plan_gemm(out: Any, a: Any, a_view: StridedView, b: Any, b_view: StridedView, *,
              bias: Any = None, bias_view: StridedView | None = None, alpha: float = 1.0, beta: float = 1.0,
              scratch: Any = None, split_k: int | None = None, tile: tuple[int, int] | None = None,
              tuning: str = GPU_TUNING, b_scales: Any = None, c_offset: int = 0, c_row_stride: int | None = None,
              binding_limit: BindingLimit | None = None, fp16: bool = False, absmax: Any = None,
              max_workgroup_size: int | None = None, scale: float | None = None, label: str = "gemm") -> list[Dispatch]:
    """out [batch, M, N] (or [M, N] when both operands are 2-D) = alpha * A @ B (+ beta * bias), or
    (A @ B) * scale (module docstring, "Scale").

    Operand views have rank 2 ([M, K] / [K, N]) or 3 ([batch, M, K] / [batch, K, N]); a 2-D operand
    or a batch of 1 broadcasts over the other's batch. The bias view must broadcast to the output.
    `scratch` (>= gemm_scratch_nbytes bytes, or split_k_scratch_nbytes for an explicit `split_k`)
    lets the plan split K (module docstring); `split_k` forces the number of slices (slices past K
    are empty and contribute zeros); `tile` forces one of GEMM_TILES (the shared-memory body whatever
    the `tuning`); `tuning` (kernels/gemm_tuning.py) picks the body otherwise (module docstring).
    `b_scales`: `b` holds Q8_0 codes and these their scales (module docstring).
    `c_offset` / `c_row_stride` (elements; default 0 / N) place C inside `out` (module docstring); a
    strided C is never split over K (the split-K reduce writes a contiguous output).
    `binding_limit`: an operand, the output or the bias over it is cut into windows (module docstring,
    "Bindings over the limit"); with windows of the reduction, `scratch` must hold
    window_scratch_nbytes(M, N, binding_limit) bytes.
    `fp16`, `absmax`: the FP16 variant (module docstring, "fp16"; fp16_reads_in_place says which operands).
    `max_workgroup_size`: the device's invocations per workgroup (None: 256 or more); a tile over it runs as its
    NARROW_TILES replacement, split over K as the tile it replaces.
    """
    if fp16:
        _check_fp16(a_view, b_view, b_scales, absmax, label)
    if scale is not None:
        scale = _scale_alone(scale, bias, alpha, label)
    if binding_limit is not None and not bindings_fit(a_view, b_view, bias_view, b_scales is not None, c_row_stride,
                                                         c_offset, binding_limit):
        if scratch is not None and not isinstance(scratch, BufferBinding):
            scratch = BufferBinding(scratch)
        if fp16:
            raise KernelArgumentError(f"{label}: fp16 has no windows; an operand over the binding limit keeps fp32")
        if scale is not None:
            raise KernelArgumentError(f"{label}: a scaled GEMM has no windows (the K windows' partials would be "
                                      f"scaled); plan the mm and multiply its product")
        return _plan_gemm_windows(out, a, a_view, b, b_view, bias, bias_view, alpha, beta, scratch, tile, tuning,
                                  b_scales, binding_limit, max_workgroup_size, label)
    A = _as_batched(a_view, f"{label}: A")
    B = _as_batched(b_view, f"{label}: B")
    batch_a, M, K = A.sizes
    batch_b, K_b, N = B.sizes
    if K != K_b:
        raise KernelArgumentError(
            f"{label}: inner dims differ: A {a_view.sizes} has K={K} but B {b_view.sizes} has K={K_b}")
    if batch_a != batch_b and 1 not in (batch_a, batch_b):
        raise KernelArgumentError(f"{label}: batch sizes {batch_a} and {batch_b} differ")
    batch = max(batch_a, batch_b)
    A = A.expand((batch, M, K))
    B = B.expand((batch, K, N))
    check_view_fits(A, None, f"{label}: A")
    check_view_fits(B, None, f"{label}: B")
    if batch * M * N > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{label}: the output [{batch}, {M}, {N}] has more than {MAX_ELEMENTS} elements (32-bit indices)")
    c_row_stride = _check_c_placement(c_offset, c_row_stride, batch, M, N, label)
    strided_c = c_offset != 0 or c_row_stride != N
    cpu_body = not fp16 and takes_cpu_body(K, tile, tuning, label)
    if batch * M * N and split_k is None and tile is None and not (fp16 or strided_c or b_scales is not None):
        thin = matmul_thin.plan_if_thin(out, a, A, b, B, bias, bias_view, alpha, beta, scratch, tuning,
                                        max_workgroup_size, label, scale=scale)
        if thin is not None:
            return thin
    tile = default_gemm_tile(M, N) if tile is None else _check_tile(tile, label)
    if split_k is None:
        split_k = default_split_k(batch, M, N, K, tile) if scratch is not None and not cpu_body and not strided_c else 1
    split_k = _check_split_k(split_k, label)
    tile = fitted_tile(tile, max_workgroup_size)  # after split-K's choice: the narrow tile splits K alike
    if split_k > 1 and strided_c:
        raise KernelArgumentError(f"{label}: split_k={split_k} needs a contiguous C (c_offset 0, c_row_stride N), "
                                  f"got c_offset={c_offset}, c_row_stride={c_row_stride}")
    if batch * M * N == 0:
        return []
    has_bias = bias is not None
    if has_bias != (bias_view is not None):
        raise KernelArgumentError(f"{label}: give both bias and bias_view, or neither")
    if has_bias:
        if bias_view.rank > 3:
            raise KernelArgumentError(f"{label}: bias must have rank <= 3, got sizes {bias_view.sizes}")
        try:
            bias_full = bias_view.expand((batch, M, N))
        except KernelArgumentError:
            raise KernelArgumentError(
                f"{label}: bias of sizes {bias_view.sizes} does not broadcast to the output "
                f"[{batch}, {M}, {N}]") from None
        check_view_fits(bias_full, None, f"{label}: bias")
        bias_strides, bias_offset = bias_full.strides, bias_full.offset
    else:
        bias_strides, bias_offset = (0, 0, 0), 0
    if split_k > 1:
        if scratch is None:
            raise KernelArgumentError(
                f"{label}: split_k={split_k} needs a scratch buffer of split_k_scratch_nbytes({batch}, {M}, {N}, "
                f"{split_k}) = {split_k_scratch_nbytes(batch, M, N, split_k)} bytes")
        if (batch * M * N) % 4:
            raise KernelArgumentError(
                f"{label}: split_k={split_k} needs an output of a multiple of 4 elements (the reduction adds "
                f"vec4s), got [{batch}, {M}, {N}]")
        if split_k * batch * M * N > MAX_ELEMENTS or split_k * slice_length(K, split_k) > MAX_ELEMENTS:
            raise KernelArgumentError(f"{label}: split_k={split_k} over [{batch}, {M}, {N}] with K={K} exceeds "
                                      f"32-bit indexing; use a smaller split_k")
    k_slice = slice_length(K, split_k) if split_k > 1 else K
    # The addend of a fused add(p, mm) is added once the slices are summed, as the add did.
    reduce_adds_bias = (split_k > 1 and has_bias and float(beta) == 1.0 and bias_view.is_contiguous
                        and bias_view.offset == 0 and bias_view.numel == batch * M * N)
    gemm_bias = has_bias and not reduce_adds_bias

    push = pack_push(
        M, N, K,
        A.offset, A.strides[0], A.strides[1], A.strides[2],
        B.offset, B.strides[0], B.strides[1], B.strides[2],
        bias_offset, *bias_strides,
        float(scale if scale is not None and split_k == 1 else alpha), float(beta),
        batch, k_slice, c_offset, c_row_stride,
        *((absmax_partials(M * K), absmax_partials(K * N)) if fp16 else ()))
    spec = {
        # Walk the tile along whichever dim is contiguous in memory so loads coalesce.
        A_M_FASTEST_SPEC_ID: bool(A.strides[1] == 1 and A.strides[2] != 1),
        B_K_FASTEST_SPEC_ID: bool(B.strides[1] == 1 and B.strides[2] != 1),
    }
    target = out if split_k == 1 else scratch
    bindings = [binding(target, "w"), binding(a, "r"), binding(b, "r")]
    if b_scales is not None:
        bindings.append(binding(b_scales, "r"))
    if gemm_bias:
        bindings.append(binding(bias, "r"))
    if fp16:
        bindings.append(binding(absmax, "r"))
    if cpu_body:
        shader, spec = cpu_gemm_variant(A, B, gemm_bias)
        groups = (ceil_div(N, CPU_LANES * CPU_TN), ceil_div(M, cpu_tile_rows(M)), split_k * batch)
    else:
        shader = gemm_shader_name(tile, gemm_bias, vec4_rows=N % 4 == 0 and c_row_stride % 4 == 0 and c_offset % 4 == 0)
        groups = (ceil_div(N, tile[1]), ceil_div(M, tile[0]), split_k * batch)
    if b_scales is not None:
        shader += "+B_Q8_0"
    scales = [plan_absmax(absmax, [(a, M * K), (b, K * N)], f"{label}.absmax")] if fp16 else []
    shader += "+FP16" if fp16 else ""
    gemm = Dispatch(shader, groups, bindings=tuple(bindings), push_constants=push, spec_constants=spec,
                    label=label if split_k == 1 else f"{label}.split{split_k}")
    if split_k == 1:
        return [*scales, gemm]
    count4 = batch * M * N // 4
    if reduce_adds_bias:  # bias[e % row_vec4s] with one "row" of the whole output: bias[e]
        return [*scales, gemm, plan_splitk_reduce(out=out, scratch=scratch, count4=count4, row_vec4s=count4,
                                                  split_k=split_k, bias=bias, label=f"{label}.reduce")]
    if scale is not None:  # the slices' sum, then the scale
        return [*scales, gemm, plan_splitk_reduce(out=out, scratch=scratch, count4=count4, row_vec4s=count4,
                                                  split_k=split_k, scale=scale, label=f"{label}.reduce")]
    # Slice 0 of the GEMM already added any bias, so the reduce has none (and never reads row_vec4s).
    reduce = plan_splitk_reduce(out=out, scratch=scratch, count4=count4, row_vec4s=max(1, N // 4),
                                split_k=split_k, label=f"{label}.reduce")
    return [*scales, gemm, reduce]


def _scale_alone(scale: Any, bias: Any, alpha: Any, label: str) -> float:
    """`scale` as a float, after checking that nothing else scales or adds (module docstring, "Scale")."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise KernelArgumentError(f"{label}: scale must be a real number, got {scale!r}")
    if bias is not None or float(alpha) != 1.0:
        raise KernelArgumentError(f"{label}: scale multiplies a plain product: no bias and alpha 1 (got "
                                  f"{'a bias' if bias is not None else 'no bias'}, alpha {alpha})")
    return float(scale)


def fp16_reads_in_place(a_view: StridedView, b_view: StridedView) -> bool:
    """Whether the FP16 variant takes A [M, K] and B [K, N]: 2-D, each the whole of its storage from element 0
    (row-major or transposed; its absmax pass reads the storage's first numel elements), numel a multiple of
    4 (the pass reads vec4s)."""
    def whole(view: StridedView) -> bool:
        rows, cols = view.sizes
        return view.offset == 0 and view.numel % 4 == 0 and view.strides in ((cols, 1), (1, rows))
    return a_view.rank == 2 and b_view.rank == 2 and whole(a_view) and whole(b_view)


def _check_fp16(a_view: StridedView, b_view: StridedView, b_scales: Any, absmax: Any, label: str) -> None:
    if b_scales is not None or not fp16_reads_in_place(a_view, b_view):
        raise KernelArgumentError(f"{label}: fp16 takes 2-D float32 operands read in place from element 0 "
                                  f"(row-major or transposed, numel a multiple of 4); got A {a_view}, B {b_view}"
                                  + (" and a Q8_0 B" if b_scales is not None else ""))
    if absmax is None:
        (M, K), N = a_view.sizes, b_view.sizes[1]
        raise KernelArgumentError(f"{label}: fp16 needs an absmax scratch of absmax_scratch_nbytes({M * K}, "
                                  f"{K * N}) bytes (the operands' partial maxima)")


def _plan_gemm_windows(out: Any, a: Any, a_view: StridedView, b: Any, b_view: StridedView, bias: Any,
                       bias_view: StridedView | None, alpha: float, beta: float, scratch: BufferBinding | None,
                       tile: Any, tuning: str, b_scales: Any, limit: BindingLimit, max_workgroup_size: int | None,
                       label: str) -> list[Dispatch]:
    """plan_gemm over windows that each fit `limit` (module docstring, "Bindings over the limit")."""
    if a_view.rank != 2 or b_view.rank != 2 or (bias_view is not None and bias_view.rank > 2):
        raise limit.refusal(label, f"a batched GEMM ({a_view.sizes} @ {b_view.sizes}) over the limit", 0)
    (M, K), N = a_view.sizes, b_view.sizes[1]
    bias_full = None if bias_view is None else bias_view.expand((M, N))
    rows, columns, steps = gemm_windows(a_view, b_view, bias_full, b_scales is not None, limit, label,
                                       tile_mn=GEMM_TILES[0][0], tile_k=TILE_K)
    k_windows = [(k, min(steps, K - k)) for k in range(0, K, steps)]
    if len(k_windows) > 1 and (scratch is None or scratch.size is not None and scratch.size < 4 * rows * columns):
        raise KernelArgumentError(f"{label}: windows of the reduction need a scratch buffer of window_scratch_nbytes("
                                  f"{M}, {N}, limit) = {window_scratch_nbytes(M, N, limit)} bytes")
    out_view = StridedView.contiguous((M, N))
    dispatches: list[Dispatch] = []
    for m in range(0, M, rows):
        mm = min(rows, M - m)
        for n in range(0, N, columns):
            nn = min(columns, N - n)
            c_bound, c_view = window_view(out, out_view, m, n, mm, nn, "w", limit)
            partial = sub_binding(scratch, 0, 4 * mm * nn, "w", limit.alignment)[0] if len(k_windows) > 1 else None
            previous = None  # (binding, view) of the last window's partial
            for j, (k, kk) in enumerate(k_windows):
                a_bound, a_window = window_view(a, a_view, m, k, mm, kk, "r", limit)
                if b_scales is None:
                    b_bound, b_window = window_view(b, b_view, k, n, kk, nn, "r", limit)
                    scales_bound = None
                else:
                    b_bound, scales_bound, b_window = q8_0_window(b, b_scales, b_view, k, n, kk, nn, limit, label)
                # The partials alternate between C's window and the scratch so that the last lands in C;
                # each adds the one before it through the bias epilogue (never reading what it writes).
                into_c = (len(k_windows) - 1 - j) % 2 == 0
                target, view = (c_bound, c_view) if into_c else (partial, StridedView.contiguous((mm, nn)))
                if previous is None and bias_full is not None:
                    window_bias, window_bias_view = window_view(bias, bias_full, m, n, mm, nn, "r", limit)
                    window_beta = beta
                elif previous is not None:
                    window_bias = BufferBinding(previous[0].buffer, previous[0].offset, previous[0].size, "r")
                    window_bias_view, window_beta = previous[1], 1.0
                else:
                    window_bias, window_bias_view, window_beta = None, None, beta
                dispatches += plan_gemm(
                    target, a_bound, a_window, b_bound, b_window, bias=window_bias, bias_view=window_bias_view,
                    alpha=alpha, beta=window_beta, tile=tile, tuning=tuning, b_scales=scales_bound,
                    c_offset=view.offset, c_row_stride=view.strides[0], max_workgroup_size=max_workgroup_size,
                    label=f"{label}.window{len(dispatches)}")
                previous = (target, view)
    return dispatches


# aten ops (calling convention: see layout.py). Inputs fp32 contiguous; out fp32 contiguous.

def _matrix(shape: Sequence[int], dtype: Any, rank: int, what: str) -> StridedView:
    check_dtype(dtype, what)
    shape = check_shape(shape, what)
    if len(shape) != rank:
        raise KernelArgumentError(f"{what} must have rank {rank}, got shape {shape}")
    return StridedView.contiguous(shape)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelArgumentError(f"{what} must be a real number, got {value!r}")
    return float(value)


@register_kernel("aten.mm.default")
def plan_mm(*, out: Any, self: Any, self_shape: Sequence[int], mat2: Any, mat2_shape: Sequence[int],
            self_dtype: Any = "float32", mat2_dtype: Any = "float32", scratch: Any = None,
            tuning: str = GPU_TUNING, max_workgroup_size: int | None = None,
            label: str = "aten.mm.default") -> list[Dispatch]:
    """aten.mm: out [M, N] = self [M, K] @ mat2 [K, N]. `scratch` (gemm_scratch_nbytes(1, M, N, K)
    bytes) enables split-K; `tuning` as in plan_gemm."""
    a = _matrix(self_shape, self_dtype, 2, "aten.mm self")
    b = _matrix(mat2_shape, mat2_dtype, 2, "aten.mm mat2")
    return plan_gemm(out, self, a, mat2, b, scratch=scratch, tuning=tuning, max_workgroup_size=max_workgroup_size,
                     label=label)


@register_kernel("vktrain.mm_scaled.default")
def plan_mm_scaled(*, out: Any, self: Any, self_shape: Sequence[int], mat2: Any, mat2_shape: Sequence[int],
                   scale: float, self_dtype: Any = "float32", mat2_dtype: Any = "float32", scratch: Any = None,
                   tuning: str = GPU_TUNING, max_workgroup_size: int | None = None,
                   label: str = "vktrain.mm_scaled.default") -> list[Dispatch]:
    """vktrain.mm_scaled: out [M, N] = (self [M, K] @ mat2 [K, N]) * scale, the product rounded first (module
    docstring, "Scale"). `scratch` (gemm_scratch_nbytes(1, M, N, K) bytes) enables split-K; `tuning` as in
    plan_gemm."""
    a = _matrix(self_shape, self_dtype, 2, "vktrain.mm_scaled self")
    b = _matrix(mat2_shape, mat2_dtype, 2, "vktrain.mm_scaled mat2")
    return plan_gemm(out, self, a, mat2, b, scale=_number(scale, "vktrain.mm_scaled scale"), scratch=scratch,
                     tuning=tuning, max_workgroup_size=max_workgroup_size, label=label)


@register_kernel("aten.bmm.default")
def plan_bmm(*, out: Any, self: Any, self_shape: Sequence[int], mat2: Any, mat2_shape: Sequence[int],
             self_dtype: Any = "float32", mat2_dtype: Any = "float32", scratch: Any = None,
             tuning: str = GPU_TUNING, max_workgroup_size: int | None = None,
             label: str = "aten.bmm.default") -> list[Dispatch]:
    """aten.bmm: out [B, M, N] = self [B, M, K] @ mat2 [B, K, N] (equal batch sizes, like torch).
    `scratch` (gemm_scratch_nbytes(B, M, N, K) bytes) enables split-K; `tuning` as in plan_gemm."""
    a = _matrix(self_shape, self_dtype, 3, "aten.bmm self")
    b = _matrix(mat2_shape, mat2_dtype, 3, "aten.bmm mat2")
    if a.sizes[0] != b.sizes[0]:
        raise KernelArgumentError(f"aten.bmm: batch sizes differ: self {a.sizes} vs mat2 {b.sizes}")
    return plan_gemm(out, self, a, mat2, b, scratch=scratch, tuning=tuning, max_workgroup_size=max_workgroup_size,
                     label=label)


@register_kernel("aten.addmm.default")
def plan_addmm(*, out: Any, self: Any, self_shape: Sequence[int], mat1: Any, mat1_shape: Sequence[int],
               mat2: Any, mat2_shape: Sequence[int], beta: float = 1, alpha: float = 1,
               self_dtype: Any = "float32", mat1_dtype: Any = "float32", mat2_dtype: Any = "float32",
               scratch: Any = None, tuning: str = GPU_TUNING, max_workgroup_size: int | None = None,
               label: str = "aten.addmm.default") -> list[Dispatch]:
    """aten.addmm: out [M, N] = beta * self + alpha * mat1 [M, K] @ mat2 [K, N]; self broadcasts to
    [M, N] ([N], [1, N], [M, 1], scalar...). beta == 0 ignores self entirely (NaN included).
    `scratch` (gemm_scratch_nbytes(1, M, N, K) bytes) enables split-K; `tuning` as in plan_gemm."""
    check_dtype(self_dtype, "aten.addmm self")
    bias = StridedView.contiguous(check_shape(self_shape, "aten.addmm self"))
    if bias.rank > 2:
        raise KernelArgumentError(f"aten.addmm: self must have rank <= 2, got shape {bias.sizes}")
    a = _matrix(mat1_shape, mat1_dtype, 2, "aten.addmm mat1")
    b = _matrix(mat2_shape, mat2_dtype, 2, "aten.addmm mat2")
    return plan_gemm(out, mat1, a, mat2, b, bias=self, bias_view=bias, alpha=_number(alpha, "aten.addmm alpha"),
                     beta=_number(beta, "aten.addmm beta"), scratch=scratch, tuning=tuning,
                     max_workgroup_size=max_workgroup_size, label=label)


@register_kernel("aten.baddbmm.default")
def plan_baddbmm(*, out: Any, self: Any, self_shape: Sequence[int], batch1: Any, batch1_shape: Sequence[int],
                 batch2: Any, batch2_shape: Sequence[int], beta: float = 1, alpha: float = 1,
                 self_dtype: Any = "float32", batch1_dtype: Any = "float32", batch2_dtype: Any = "float32",
                 max_workgroup_size: int | None = None, label: str = "aten.baddbmm.default") -> list[Dispatch]:
    """aten.baddbmm: out [B, M, N] = beta * self + alpha * batch1 @ batch2; self broadcasts."""
    check_dtype(self_dtype, "aten.baddbmm self")
    bias = StridedView.contiguous(check_shape(self_shape, "aten.baddbmm self"))
    a = _matrix(batch1_shape, batch1_dtype, 3, "aten.baddbmm batch1")
    b = _matrix(batch2_shape, batch2_dtype, 3, "aten.baddbmm batch2")
    if a.sizes[0] != b.sizes[0]:
        raise KernelArgumentError(f"aten.baddbmm: batch sizes differ: batch1 {a.sizes} vs batch2 {b.sizes}")
    return plan_gemm(out, batch1, a, batch2, b, bias=self, bias_view=bias,
                     alpha=_number(alpha, "aten.baddbmm alpha"), beta=_number(beta, "aten.baddbmm beta"),
                     max_workgroup_size=max_workgroup_size, label=label)


@register_kernel("aten.linear.default")
def plan_linear(*, out: Any, input: Any, input_shape: Sequence[int], weight: Any, weight_shape: Sequence[int],
                bias: Any = None, bias_shape: Sequence[int] | None = None, input_dtype: Any = "float32",
                weight_dtype: Any = "float32", bias_dtype: Any = "float32",
                max_workgroup_size: int | None = None, label: str = "aten.linear.default") -> list[Dispatch]:
    """aten.linear: out [..., N] = input [..., K] @ weight[N, K].T (+ bias [N]). The transpose is a
    stride swap read in place, never materialised."""
    check_dtype(input_dtype, "aten.linear input")
    input_shape = check_shape(input_shape, "aten.linear input")
    if not input_shape:
        raise KernelArgumentError("aten.linear: input must have at least one dim")
    w = _matrix(weight_shape, weight_dtype, 2, "aten.linear weight")
    n, k = w.sizes
    if input_shape[-1] != k:
        raise KernelArgumentError(
            f"aten.linear: input {input_shape} has last dim {input_shape[-1]} but weight {w.sizes} has K={k}")
    rows = StridedView.contiguous(input_shape).numel // k if k else 0
    a = StridedView.contiguous((rows, k))
    if bias is None:
        return plan_gemm(out, input, a, weight, w.transpose(0, 1), max_workgroup_size=max_workgroup_size, label=label)
    check_dtype(bias_dtype, "aten.linear bias")
    bias_view = StridedView.contiguous(check_shape(bias_shape if bias_shape is not None else (), "aten.linear bias"))
    if bias_view.sizes != (n,):
        raise KernelArgumentError(f"aten.linear: bias must have shape ({n},), got {bias_view.sizes}")
    return plan_gemm(out, input, a, weight, w.transpose(0, 1), bias=bias, bias_view=bias_view,
                     max_workgroup_size=max_workgroup_size, label=label)

"""Thin fp32 GEMMs (matmul_thin.slang): an mm one of whose output sides is at most THIN_R (a LoRA rank) over
a long reduction, bandwidth-bound: its large operand X is read once, in vec4, by 256-thread workgroups.

The step's LoRA products of this shape (rank r, T tokens): x @ A^T [T, r] and d_y @ B [T, r] (X's rows along
the reduction: the rows layout), d_y^T @ u [out, r] and d_u^T @ x [r, in] (the reduction over X's rows:
COLUMNS). `thin_layout` maps the views of aten.mm's A [M, K] @ B [K, N] onto the kernel's
out(p, r) = sum_k X(p, k) S(k, r): the thin side (N, else M, through out^T) is r, the other operand X, and
X's contiguous axis picks the layout; None where the kernel does not apply (matmul.py keeps its tiles).

matmul.plan_gemm takes it on the GPU tuning for a 2-D mm, an addmm whose addend has the output's shape
(beta = alpha = 1, what the gemm_epilogue pass folds: `addend`), or a vktrain.mm_scaled (the mm times a
scalar, what the gemm_scale pass folds: `scale`, multiplied into the whole sum, never into a slice); the CPU
tuning keeps its register-tile body (faster on lavapipe, which runs these kernels' barriers as separate
functions).

Split-K as matmul's: with a scratch (`thin_scratch_nbytes`), a reduction is cut into slices of whole chunks
until about TARGET_WORKGROUPS run, each slice's partial output into scratch [slices, M, N] and
linear_splitk_reduce adds them in a fixed order (bitwise reproducible).

Accuracy: every output is a sum of the K products in a fixed order (each thread's k in order, then the
threads' partials, then the slices): |error| <= gamma_K * sum_k |x_k s_k|, as matmul's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vktrain.serialization.dispatch import BufferBinding, Dispatch, ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError, StridedView
from vktrain.backend.kernel_planning.kernels.gemm_passes import plan_splitk_reduce
from vktrain.backend.kernel_planning.kernels.gemm_tuning import GPU_TUNING
from vktrain.backend.kernel_planning.kernels.layout import binding

THIN_R = 16  # the shader's THIN_R: the thin output side it holds in registers
THREADS = 256  # invocations per workgroup (the shader's THREADS)
# Per layout: output elements p a workgroup owns, and the reduction (k) one trip of its loop covers.
ROWS, COLUMNS = "rows", "columns"
P_PER_GROUP = {ROWS: 32, COLUMNS: 64}
CHUNK = {ROWS: 128, COLUMNS: 64}
# Shapes the planner sends here: a reduction of at least MIN_REDUCTION (one rows chunk: shorter ones are a
# few loads per thread and the tiles do as well) and an output side past THIN_R (both sides thin: a few
# hundred outputs, nothing to stream).
MIN_REDUCTION = 128
# Split-K targets: about TARGET_WORKGROUPS workgroups (two per SM of a 132-SM H100 / H200 at the kernel's
# ~100 registers per thread), slices of at least MIN_SPLIT_SLICE (one rows chunk, two COLUMNS chunks: the
# k / v gradients at 2048 tokens, 8 workgroups of 64 columns, still reach 128; the partials written and
# re-read stay <= 1/8 of X's bytes at 16 outputs per 128-long slice), at most MAX_SPLIT_K.
TARGET_WORKGROUPS = 256
MIN_SPLIT_SLICE = 128
MAX_SPLIT_K = 32
# lavapipe ends an invocation after 65535 loop trips (all loops together): the chunk loop is the only loop
# left after unrolling, so a slice may run at most MAX_CHUNKS chunks (half the limit, as the coopmat
# kernels' budget); a longer one keeps matmul's tiles.
MAX_CHUNKS = 65535 // 2


@dataclass(frozen=True)
class ThinLayout:
    """How matmul_thin.slang reads one mm: out(p, r) = sum_k X(p, k) S(k, r) for p < P, r < R, k < K.

    `x` / `s` say which mm operand ("a" or "b") is X and S; X's element (p, k) is x_offset + p * x_stride + k
    (ROWS) or x_offset + k * x_stride + p (COLUMNS); S's (k, r) s_offset + k * s_k_stride + r * s_r_stride;
    out(p, r) is p * c_p_stride + r * c_r_stride of the mm's row-major [M, N] output."""

    mode: str
    P: int
    R: int
    K: int
    x: str
    x_offset: int
    x_stride: int
    s: str
    s_offset: int
    s_k_stride: int
    s_r_stride: int
    c_p_stride: int
    c_r_stride: int

    def shader(self, addend: bool = False, scale: bool = False) -> str:
        """The matmul_thin.slang variant (in its `vktrain-variants:` order)."""
        defines = (["COLUMNS"] if self.mode == COLUMNS else []) + (["ADDEND"] if addend else []) \
            + (["SCALE"] if scale else [])
        return "matmul_thin" + ("@" + "+".join(defines) if defines else "")

    @property
    def workgroups(self) -> int:
        return ceil_div(self.P, P_PER_GROUP[self.mode])


def thin_layout(a_view: StridedView, b_view: StridedView) -> ThinLayout | None:
    """The ThinLayout of mm(A, B) for 2-D views A [M, K] and B [K, N] (a batch of 1 counts as 2-D), or None
    where the kernel does not apply: no output side of at most THIN_R beside one longer, a reduction shorter
    than MIN_REDUCTION, or the large operand without a contiguous axis whose vec4 are aligned (its offset and
    row stride multiples of 4, and K or P, whichever runs along its rows, too)."""
    a, b = _matrix(a_view), _matrix(b_view)
    if a is None or b is None:
        return None
    (M, K), N = a.sizes, b.sizes[1]
    if not thin_shape(M, N, K):
        return None
    if N <= THIN_R and M > THIN_R:  # out [M, N]: X = A (p = m), S = B
        P, R, big, small, big_name, small_name = M, N, a, b, "a", "b"
        p_stride, k_stride = a.strides
        s_k_stride, s_r_stride = b.strides
        c_p_stride, c_r_stride = N, 1
    else:  # out^T [N, M] = B^T A^T: X = B^T (p = n), S = A^T
        P, R, big, small, big_name, small_name = N, M, b, a, "b", "a"
        k_stride, p_stride = b.strides
        s_r_stride, s_k_stride = a.strides
        c_p_stride, c_r_stride = 1, N
    if k_stride == 1 and K % 4 == 0 and p_stride % 4 == 0 and big.offset % 4 == 0:
        mode, x_stride = ROWS, p_stride
    elif p_stride == 1 and P % 4 == 0 and k_stride % 4 == 0 and big.offset % 4 == 0:
        mode, x_stride = COLUMNS, k_stride
    else:
        return None
    return ThinLayout(mode, P, R, K, big_name, big.offset, x_stride, small_name, small.offset, s_k_stride, s_r_stride,
                      c_p_stride, c_r_stride)


def _matrix(view: StridedView) -> StridedView | None:
    if view.rank == 3 and view.sizes[0] == 1:
        return StridedView(view.sizes[1:], view.strides[1:], view.offset)
    return view if view.rank == 2 else None


def slice_length(layout: ThinLayout, split_k: int) -> int:
    """Reduction length of each of `split_k` slices: ceil(K / split_k) in whole chunks."""
    chunk = CHUNK[layout.mode]
    return ceil_div(ceil_div(layout.K, split_k), chunk) * chunk


def default_split_k(layout: ThinLayout) -> int:
    """Slices the default plan cuts the reduction into when it has scratch (module docstring; 1: none)."""
    split_k = min(ceil_div(TARGET_WORKGROUPS, layout.workgroups), layout.K // MIN_SPLIT_SLICE, MAX_SPLIT_K)
    if split_k <= 1 or (layout.P * layout.R) % 4:  # the reduce adds vec4s
        return 1
    return ceil_div(layout.K, slice_length(layout, split_k))


def runs_within_lavapipe_loops(layout: ThinLayout, split_k: int = 1) -> bool:
    """Whether each slice's chunk loop stays within MAX_CHUNKS trips."""
    return ceil_div(slice_length(layout, split_k) if split_k > 1 else layout.K, CHUNK[layout.mode]) <= MAX_CHUNKS


def thin_shape(M: int, N: int, K: int) -> bool:
    """Whether an [M, K] @ [K, N] mm has the sizes `thin_layout` takes (its strides decide the rest)."""
    return K >= MIN_REDUCTION and min(M, N) <= THIN_R < max(M, N)


def thin_scratch_nbytes(M: int, N: int, K: int) -> int:
    """Bytes of scratch the default plan of an [M, K] @ [K, N] mm this kernel takes uses when given one (0: it
    would not split or not take it): the larger of the two layouts' (the mm's strides pick one; the caller
    knows only sizes)."""
    if not thin_shape(M, N, K):
        return 0
    splits = [default_split_k(ThinLayout(mode, max(M, N), min(M, N), K, "a", 0, 0, "b", 0, 0, 0, 0, 0))
              for mode in (ROWS, COLUMNS)]
    return 0 if max(splits) == 1 else 4 * max(splits) * M * N


def plan_thin_gemm(out: Any, a: Any, b: Any, layout: ThinLayout, *, addend: Any = None, scale: float | None = None,
                   scratch: Any = None, split_k: int | None = None, label: str = "matmul_thin") -> list[Dispatch]:
    """out [M, N] (row-major) = A @ B (+ addend, row-major [M, N]: aten.addmm with beta = alpha = 1, added once
    the sum is whole, the bits of the mm followed by the add; or * scale: vktrain.mm_scaled, the sum multiplied
    by fp32(scale) once it is whole, the bits of the mm followed by aten.mul) through `layout` (thin_layout of
    the views of buffers `a`, `b`). `scratch` (at least 4 * split_k * M * N bytes: thin_scratch_nbytes for the
    default split) lets the plan split the reduction (`split_k` forces the count; slices past K are empty and
    add zeros); the reduce of the slices then adds the addend or multiplies by the scale."""
    if addend is not None and scale is not None:
        raise KernelArgumentError(f"{label}: an addend and a scale together (the kernel has one epilogue)")
    if split_k is None:
        split_k = default_split_k(layout) if scratch is not None else 1
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise KernelArgumentError(f"{label}: split_k must be an int >= 1, got {split_k!r}")
    outputs = layout.P * layout.R
    if split_k > 1 and (scratch is None or outputs % 4):
        raise KernelArgumentError(f"{label}: split_k={split_k} needs a scratch of {4 * split_k * outputs} bytes and "
                                  f"an output of a multiple of 4 elements (got {outputs})")
    if split_k * outputs > MAX_ELEMENTS or split_k * slice_length(layout, split_k) > MAX_ELEMENTS:
        raise KernelArgumentError(f"{label}: split_k={split_k} over {outputs} outputs exceeds 32-bit indexing")
    if not runs_within_lavapipe_loops(layout, split_k):
        raise KernelArgumentError(f"{label}: a slice of {layout.K if split_k == 1 else slice_length(layout, split_k)} "
                                  f"runs more than {MAX_CHUNKS} chunks of {CHUNK[layout.mode]} (lavapipe's loop "
                                  f"limit); split the reduction or use matmul's tiles")
    k_slice = slice_length(layout, split_k) if split_k > 1 else layout.K
    operands = {"a": a, "b": b}
    fused = addend is not None and split_k == 1
    scaled = scale is not None and split_k == 1  # split: the slices stay unscaled, the reduce scales their sum
    push = pack_push(layout.P, layout.R, layout.K, layout.x_offset, layout.x_stride, layout.s_offset,
                     layout.s_k_stride, layout.s_r_stride, int(layout.s_r_stride == 1), layout.c_p_stride,
                     layout.c_r_stride, k_slice, outputs, *([float(scale)] if scaled else []))
    target = out if split_k == 1 else scratch
    bindings = [binding(target, "w"), binding(operands[layout.x], "r"), binding(operands[layout.s], "r")]
    gemm = Dispatch(layout.shader(addend=fused, scale=scaled), groups=(layout.workgroups, 1, split_k),
                    bindings=tuple(bindings + ([binding(addend, "r")] if fused else [])),
                    push_constants=push, label=label if split_k == 1 else f"{label}.split{split_k}")
    if split_k == 1:
        return [gemm]
    # With an addend, the reduce's bias[e % row_vec4s] over one "row" of the whole output: addend[e].
    return [gemm, plan_splitk_reduce(out=out, scratch=scratch, count4=outputs // 4, row_vec4s=outputs // 4,
                                     split_k=split_k, bias=addend, scale=scale, label=f"{label}.reduce")]


def plan_if_thin(out: Any, a: Any, A: StridedView, b: Any, B: StridedView, bias: Any, bias_view: StridedView | None,
                 alpha: float, beta: float, scratch: Any, tuning: str, max_workgroup_size: int | None,
                 label: str, scale: float | None = None) -> list[Dispatch] | None:
    """This kernel's plan of a 2-D mm (or addmm with an addend of the output's shape, beta = alpha = 1; or an mm
    times `scale`, without a bias) on the GPU tuning where it takes the shape (a thin output over a long
    reduction, thin_layout) within lavapipe's loop budget; None: plan_gemm's tiles (kernels/matmul.py asks
    first)."""
    M, N = A.sizes[1], B.sizes[2]
    if (bias is None) != (bias_view is None):
        return None  # plan_gemm refuses it
    addend = bias_view is None or (bias_view.sizes in ((M, N), (1, M, N)) and bias_view.is_contiguous
                                   and bias_view.offset == 0 and float(beta) == 1.0)
    if (not addend or float(alpha) != 1.0 or A.sizes[0] != 1 or tuning != GPU_TUNING
            or (max_workgroup_size is not None and max_workgroup_size < THREADS)):
        return None
    layout = thin_layout(A, B)
    if layout is None:
        return None
    split_k = default_split_k(layout) if scratch is not None else 1
    sized = isinstance(scratch, BufferBinding) and scratch.size is not None
    if sized and scratch.size < 4 * split_k * layout.P * layout.R:
        split_k = 1  # a scratch sized for another plan's split
    if not runs_within_lavapipe_loops(layout, split_k):
        return None
    return plan_thin_gemm(out, a, b, layout, addend=bias, scale=scale, scratch=scratch, split_k=split_k, label=label)

"""Flash attention on tensor cores: plans of causal_attention and its backward under `fp16-tc`.

The same op contract as kernels/attention.py (its docstring: q [B, S, Hq, D], k / v [B, S, Hkv, D],
out, lse [B, Hq, S], GQA, the backward's delta scratch and outputs), computed with 16x16x16
cooperative matrices, fp16 inputs and fp32 accumulators (shaders coopmat_attention_fwd.slang,
coopmat_attention_bwd.slang, body coopmat_attention.slangh; SPIR-V only):
  forward   S = Q K^T and O += P V on tensor cores; masks, the online softmax and its rescaling in fp32
            through shared memory. One dispatch.
  backward  the fp32 kernels' delta pre-pass (attention_bwd_delta.slang), coopmat_absmax over d_out and v
            (the operand scales, below), then the DQ and DKV passes: S = Q K^T and dP = dO V^T on
            tensor cores, P and dS in fp32, dQ += dS K, dK += dS^T Q, dV += P^T dO on tensor cores.
            Deterministic like the fp32 kernels (each output written by one subgroup, no atomics).
Precision (docs/PRECISION.md, "Attention"): q, k, v rounded to fp16 while staged; d_out times the power
of two that puts max |d_out| in [2^14, 2^15) (a gradient: 1e-7 and below would be fp16 subnormals);
P in [0, 1] rounded to fp16; dS times 2^e_ds with e_ds from max |d_out| and max |v| so that the bound
|dS| <= 2 D max |d_out| max |v| stays below 2^15.

Device needs (besides the cooperative matrices): fp16 arithmetic, subgroup basic and shuffle operations
(the forward's row max and sum are xor-shuffle reductions over the 8 lanes of a row), a subgroup size
in [8, 128]; every GPU with the KHR extension has them, and so has lavapipe for the emulated variant.

Supported: D in SUPPORTED_HEAD_DIMS (16, 32, 64; D = 128 keeps the fp32 kernels, whose shared-memory
tiles fit it), any B, S >= 1, Hq % Hkv == 0. Tiling: a workgroup of ROW_BLOCKS subgroups owns 16
rows each (queries; keys for DKV) and streams tiles of STREAM_ROWS rows of the other side; 4 blocks
where the device's shared memory holds them, else 2 (`default_row_blocks`, chosen by measurement).

Routing: `takes_tensor_cores(route, ...)` says whether the op lowering sends an attention op here (the
GemmRoute of kernels/coopmat.py has the tensor cores, the head dim is supported, the tiles fit, and,
emulated, the loops fit lavapipe's budget); every other case keeps kernels/attention.py.
"""
from __future__ import annotations

from typing import Any

from vktrain.backend.kernel_planning.kernels.attention import check_problem, plan_backward_delta
from vktrain.backend.kernel_planning.kernels.coopmat import DEFAULT_SUBGROUP_SIZE, GemmRoute
from vktrain.backend.kernel_planning.kernels.gemm_passes import absmax_partials, plan_absmax as _plan_absmax
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import EMULATED_LOOP_BUDGET
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import binding
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push

SUPPORTED_HEAD_DIMS = (16, 32, 64)
TILE = 16
STREAM_ROWS = 32
ROW_BLOCK_CHOICES = (4, 2)  # preferred first: taller tiles re-read the streamed side fewer times
KERNELS = ("forward", "backward_dq", "backward_dkv")
# Products per streamed tile, in 16x16x16 multiply-adds per (16-row block, 16-column block of D, 16
# streamed rows): forward S and P V; DQ S, dP and dS K; DKV S^T, dP^T, P^T dO and dS^T Q.
_PRODUCTS = {"forward": 2, "backward_dq": 3, "backward_dkv": 4}


def shared_memory_nbytes(kernel: str, D: int, row_blocks: int) -> int:
    """Shared memory of one workgroup (the shaders' declarations): fp16 rows of D + 8 halves, fp16
    score rows of STREAM_ROWS + 8, the fp32 scratch (rows of STREAM_ROWS + 4), per-row statistics."""
    own = row_blocks * TILE
    head_row, score_row = 2 * (D + 8), 2 * (STREAM_ROWS + 8)
    scratch = own * (STREAM_ROWS + 4) * 4
    if kernel == "forward":
        return own * head_row + 2 * STREAM_ROWS * head_row + own * score_row + scratch + 3 * own * 4
    if kernel == "backward_dq":
        return 2 * own * head_row + 2 * STREAM_ROWS * head_row + own * score_row + scratch + 2 * own * 4 + 8
    if kernel == "backward_dkv":
        return (2 * own * head_row + 2 * STREAM_ROWS * head_row + 2 * own * score_row + scratch
                + 2 * STREAM_ROWS * 4 + 8)
    raise KernelArgumentError(f"unknown coopmat attention kernel {kernel!r}; expected one of {KERNELS}")


def emulated_loop_trips(kernel: str, *, S: int, group_heads: int, D: int, row_blocks: int,
                        subgroup_size: int) -> int:
    """An upper bound of the loop iterations one invocation of the COOPMAT_EMULATE variant runs (lavapipe
    cuts an invocation past 65535: kernels/coopmat.py). Per streamed tile: 16 per emulated multiply-add,
    the staging loops, the row loops of the scalar math (a lane per row over STREAM_ROWS columns), the
    element loops over 16 x 16 blocks; tiles: the whole sequence (times the group's heads for DKV)."""
    threads = row_blocks * subgroup_size
    d_frags, stream_frags = D // TILE, STREAM_ROWS // TILE
    rows_per_lane = ceil_div(TILE, subgroup_size)
    per_tile = (TILE * _PRODUCTS[kernel] * d_frags * stream_frags
                + 2 * ceil_div(STREAM_ROWS * D // 4, threads) + 2
                + 2 * rows_per_lane * (STREAM_ROWS + 1)
                + 2 * ceil_div(TILE * STREAM_ROWS // 4, subgroup_size)
                + d_frags * ceil_div(TILE * TILE, subgroup_size) + 8)
    tiles = ceil_div(S, STREAM_ROWS) * (group_heads if kernel == "backward_dkv" else 1)
    prologue = 2 * ceil_div(row_blocks * TILE * D // 4, threads) + 2 * d_frags * ceil_div(TILE * 4, subgroup_size) + 16
    return tiles * (per_tile + 1) + prologue


def default_row_blocks(kernel: str, D: int, *, shared_memory_bytes: int) -> int | None:
    """ROW_BLOCKS for a kernel: the first choice whose tiles fit `shared_memory_bytes`, None when none
    does. 4 blocks were faster than 2 at every measured shape on the H200, even where they leave the
    grid at 64 workgroups (DKV at 1 x 512: bench/results/coopmat_attention_h200.json)."""
    fitting = [r for r in ROW_BLOCK_CHOICES if shared_memory_nbytes(kernel, D, r) <= shared_memory_bytes]
    return fitting[0] if fitting else None


def _configuration(kernel: str, *, B: int, S: int, Hq: int, Hkv: int, D: int, shared_memory_bytes: int,
                   emulate: bool, subgroup_size: int, row_blocks: int | None = None) -> tuple[int | None, str]:
    """(ROW_BLOCKS, "") for a kernel on this problem (`row_blocks` if given, else the default), or
    (None, why not)."""
    if D not in SUPPORTED_HEAD_DIMS:
        return None, f"head dim D={D} (the tensor-core kernels take D in {SUPPORTED_HEAD_DIMS})"
    if row_blocks is None:
        row_blocks = default_row_blocks(kernel, D, shared_memory_bytes=shared_memory_bytes)
    elif row_blocks not in ROW_BLOCK_CHOICES:
        return None, f"row_blocks must be one of {ROW_BLOCK_CHOICES}, got {row_blocks!r}"
    need = shared_memory_nbytes(kernel, D, row_blocks or min(ROW_BLOCK_CHOICES))
    if row_blocks is None or need > shared_memory_bytes:
        return None, f"{kernel} tiles need {need} bytes of shared memory, the device has {shared_memory_bytes}"
    if emulate:
        trips = emulated_loop_trips(kernel, S=S, group_heads=Hq // Hkv, D=D, row_blocks=row_blocks,
                                    subgroup_size=subgroup_size)
        if trips > EMULATED_LOOP_BUDGET:
            return None, (f"the emulated {kernel} variant would run {trips} loop iterations per invocation at "
                          f"S={S}, more than the {EMULATED_LOOP_BUDGET} budgeted within lavapipe's limit")
    return row_blocks, ""


def takes_tensor_cores(route: GemmRoute, *, B: int, S: int, Hq: int, Hkv: int, D: int, shared_memory_bytes: int,
                       backward: bool) -> bool:
    """Whether the op lowering sends causal_attention (or, `backward`, its backward) to these kernels."""
    if not route.tensor_cores or route.wgsl:  # no f16 WGSL attention: on WebGPU only the GEMMs take fp16-tc
        return False
    kernels = ("backward_dq", "backward_dkv") if backward else ("forward",)
    return all(_configuration(kernel, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, shared_memory_bytes=shared_memory_bytes,
                              **route.plan_options)[0] is not None for kernel in kernels)


def _row_blocks(op: str, kernel: str, **problem: Any) -> int:
    row_blocks, problem_text = _configuration(kernel, **problem)
    if row_blocks is None:
        raise KernelArgumentError(f"{op}: {problem_text}")
    return row_blocks


def _check_subgroup_size(op: str, subgroup_size: Any) -> None:
    # The forward's softmax reduces a row over 8 lanes by xor shuffles, 16 rows over a subgroup.
    if (not isinstance(subgroup_size, int) or subgroup_size < 8 or subgroup_size > 128
            or subgroup_size & (subgroup_size - 1)):
        raise KernelArgumentError(f"{op}: subgroup_size must be a power of two in [8, 128] (the device's subgroup "
                                  f"size), got {subgroup_size!r}")


def variant_name(kernel: str, D: int, row_blocks: int, *, emulate: bool = False,
                 subgroup_size: int = DEFAULT_SUBGROUP_SIZE) -> str:
    """The shader variant a kernel runs, its defines in the order of the sources' `vktrain-variants:`."""
    shader, pass_define = {"forward": ("coopmat_attention_fwd", []), "backward_dq": ("coopmat_attention_bwd", ["DQ"]),
                           "backward_dkv": ("coopmat_attention_bwd", ["DKV"])}[kernel]
    defines = pass_define + [f"HEAD_DIM={D}", f"ROW_BLOCKS={row_blocks}", f"STREAM_ROWS={STREAM_ROWS}"]
    defines += (["COOPMAT_EMULATE"] if emulate else []) + (
        [f"SUBGROUP_SIZE={subgroup_size}"] if subgroup_size != DEFAULT_SUBGROUP_SIZE else [])
    return shader + "@" + "+".join(defines)


def plan_coopmat_causal_attention(*, B: int, S: int, Hq: int, Hkv: int, D: int, q: Any, k: Any, v: Any, out: Any,
                                  lse: Any, scale: float, shared_memory_bytes: int, emulate: bool = False,
                                  subgroup_size: int = DEFAULT_SUBGROUP_SIZE, row_blocks: int | None = None,
                                  label: str = "coopmat_causal_attention") -> list[Dispatch]:
    """(out, lse) = causal_attention(q, k, v, scale) on tensor cores; buffers as
    kernels.attention.plan_causal_attention's. `shared_memory_bytes`: the device's limit (picks the
    tiling); `subgroup_size`: the device's; `emulate`: the COOPMAT_EMULATE variant (tests);
    `row_blocks` overrides default_row_blocks."""
    op = "coopmat_causal_attention"
    check_problem(op, B, S, Hq, Hkv, D, scale)
    _check_subgroup_size(op, subgroup_size)
    row_blocks = _row_blocks(op, "forward", B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, shared_memory_bytes=shared_memory_bytes,
                             emulate=emulate, subgroup_size=subgroup_size, row_blocks=row_blocks)
    return [Dispatch(
        variant_name("forward", D, row_blocks, emulate=emulate, subgroup_size=subgroup_size),
        groups=(ceil_div(S, row_blocks * TILE), Hq, B),
        bindings=(binding(q, "r"), binding(k, "r"), binding(v, "r"), binding(out, "w"), binding(lse, "w")),
        push_constants=pack_push(S, Hq, Hkv, float(scale)), label=label)]


def backward_absmax_scratch_nbytes(B: int, S: int, Hq: int, Hkv: int, D: int) -> int:
    """Bytes of the backward's operand-scale scratch: the partial maxima of |d_out| and of |v|."""
    return 4 * (absmax_partials(B * S * Hq * D) + absmax_partials(B * S * Hkv * D))


def plan_coopmat_causal_attention_backward(*, B: int, S: int, Hq: int, Hkv: int, D: int, d_out: Any, q: Any,
                                           k: Any, v: Any, out: Any, lse: Any, d_q: Any, d_k: Any, d_v: Any,
                                           delta: Any, absmax: Any, scale: float, shared_memory_bytes: int,
                                           emulate: bool = False, subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                                           row_blocks: int | None = None,
                                           label: str = "coopmat_causal_attention_backward") -> list[Dispatch]:
    """(d_q, d_k, d_v) = causal_attention_backward(d_out, q, k, v, out, lse, scale) on tensor cores.

    Buffers as kernels.attention.plan_causal_attention_backward's, plus `absmax`:
    backward_absmax_scratch_nbytes(B, S, Hq, Hkv, D) bytes of scratch. Dispatches: delta, the partial
    maxima of |d_out| and |v| (one coopmat_absmax), DQ, DKV. `row_blocks` overrides the tiling of both passes."""
    op = "coopmat_causal_attention_backward"
    check_problem(op, B, S, Hq, Hkv, D, scale)
    _check_subgroup_size(op, subgroup_size)
    problem = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, shared_memory_bytes=shared_memory_bytes, emulate=emulate,
                   subgroup_size=subgroup_size, row_blocks=row_blocks)
    dq_blocks = _row_blocks(op, "backward_dq", **problem)
    dkv_blocks = _row_blocks(op, "backward_dkv", **problem)
    d_out_numel, v_numel = B * S * Hq * D, B * S * Hkv * D
    push = pack_push(S, Hq, Hkv, float(scale), absmax_partials(d_out_numel), absmax_partials(v_numel))
    inputs = (binding(d_out, "r"), binding(q, "r"), binding(k, "r"), binding(v, "r"), binding(lse, "r"),
              binding(delta, "r"), binding(absmax, "r"))
    variant = dict(emulate=emulate, subgroup_size=subgroup_size)
    return [
        plan_backward_delta(B=B, S=S, Hq=Hq, D=D, d_out=d_out, out=out, delta=delta, label=label),
        _plan_absmax(absmax, [(d_out, d_out_numel), (v, v_numel)], f"{label}.absmax"),
        Dispatch(variant_name("backward_dq", D, dq_blocks, **variant), groups=(ceil_div(S, dq_blocks * TILE), Hq, B),
                 bindings=inputs + (binding(d_q, "w"),), push_constants=push, label=f"{label}.dq"),
        Dispatch(variant_name("backward_dkv", D, dkv_blocks, **variant),
                 groups=(ceil_div(S, dkv_blocks * TILE), Hkv, B),
                 bindings=inputs + (binding(d_k, "w"), binding(d_v, "w")), push_constants=push, label=f"{label}.dkv"),
    ]

"""The attention family: causal_attention and causal_attention_backward (flash-style, GQA-aware).

Semantics (docs/CONTRACTS.md, "Transformer ops"): q [B, S, Hq, D], k/v [B, S, Hkv, D] as they leave the
projections (no permute), Hq % Hkv == 0, query head h reads kv head h // (Hq / Hkv);
    out = causal softmax(scale * q k^T) v       [B, S, Hq, D]
    lse = logsumexp of the scaled, masked scores [B, Hq, S] (natural log)
and the backward returns (d_q, d_k, d_v), d_k / d_v summed over the query heads of each kv head.
Supported: any B, S >= 1 (no multiple of a tile needed), any Hq, Hkv with Hq % Hkv == 0, head dim D in
SUPPORTED_HEAD_DIMS (16, 32, 64, 128), fp32, contiguous tensors.

No [heads, S, S] tensor ever exists: scores live as tiles in shared memory.

Packed documents: with `positions` (int32 [B, S], each token's position in its document) the kernels'
DOCUMENTS variants hide from query i the keys before i - positions[i] (its document's first token) and
skip the key tiles (query tiles for DKV) that no row of a tile can see; same dispatches otherwise.

Forward, one dispatch (vktrain/runtime_shaders/attention_fwd.slang): a workgroup per (tile of
`tiles.rows` queries, query head, batch); key/value tiles of `tiles.cols` rows stream through shared
memory up to the causal diagonal with an online softmax per query row. Writes out and lse.

Backward, three dispatches (attention_bwd_delta.slang, attention_bwd.slang @DQ and @DKV):
  delta  delta[b, h, i] = rowsum(d_out * out), one thread per row: the only extra memory the backward
         needs, `causal_attention_backward_scratch_nbytes(B, S, Hq)` = 4 * B * Hq * S bytes.
  DQ     a workgroup per (query tile, query head, batch) streams the key tiles up to the diagonal,
         recomputes P = exp(scale q k^T - lse) and dS = P * (d_out v^T - delta), accumulates
         d_q = scale * dS k in registers and writes its rows.
  DKV    a workgroup per (key tile, kv head, batch) streams, for each query head of the group in turn,
         the query tiles from the diagonal to the end, recomputes P and dS the same way and accumulates
         d_v = P^T d_out and d_k = scale * dS^T q in registers.
Every output element is written by exactly one thread that adds its terms in a fixed order: no float
atomics, so replays are bitwise identical (the price is computing P and dS twice, once per pass).
Parallelism: ceil(S / rows) * Hq * B workgroups for the forward and DQ, ceil(S / rows) * Hkv * B for
DKV; the heaviest tiles are dispatched first (last query tiles, first key tiles) to shorten the tail.

Memory: global, only `delta` (4 * B * Hq * S bytes) besides the inputs and outputs. Shared, per
workgroup (`shared_memory_nbytes`): [rows or cols, D] fp32 tiles (rows padded by a vec4) plus one or
two [rows, cols] score tiles (rows padded by a float); e.g. at D = 64, 32 KiB and a long sequence:
forward 32x32 tiles, 29.6 KiB; DQ and DKV 32x16, 27.6 and 29.9 KiB (shorter sequences get shorter row
tiles, see default_tiles). Registers: D / threads_per_row accumulators per output per thread (16 with
the default threads per row; DKV keeps two outputs). On WebGPU the kernels keep those per-thread
arrays in registers, 8 entries indexed by constants: tiles with D / 4 / threads_per_row or
cols / threads_per_row above 8 are refused when the WebGPU Program is built (their `vktrain-requires:`
lines); the defaults reach at most 4 and 8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vktrain.opdefs.vktrain_ops import ATTENTION_HEAD_DIMS
from vktrain.serialization.device_profile import H200_FP32_TARGET_WORKGROUPS
from vktrain.serialization.dispatch import Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import (
    SHARED_MEMORY_LIMIT, WORKGROUP_SIZE_LIMIT, binding, check_positive_ints
)
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

SUPPORTED_HEAD_DIMS = ATTENTION_HEAD_DIMS  # one definition, read by export too
# Vulkan guarantees 16 KiB of shared memory and 128 invocations per workgroup; lavapipe and most desktop
# GPUs give 32 KiB (NVIDIA 48 KiB). Pass the device's limits to use more.
DEFAULT_SHARED_MEMORY_BYTES = 32768
DEFAULT_MAX_WORKGROUP_SIZE = 128
DELTA_WORKGROUP_SIZE = 64
# Workgroups a default tiling tries to offer (the H200 profile's fp32_target_workgroups, about 2 per compute
# unit): below that, smaller row tiles trade extra re-reads of the streamed tiles (cached) for parallelism.
TARGET_WORKGROUPS = H200_FP32_TARGET_WORKGROUPS
MIN_FALLBACK_WORKGROUP_SIZE = 32

# attention_fwd.slang / attention_bwd.slang specialization constants.
HEAD_DIM_SPEC_ID = 3
ROWS_SPEC_ID = 4
COLS_SPEC_ID = 5
THREADS_PER_ROW_SPEC_ID = 6

# (rows, cols) tried in order, larger first: a taller row tile re-reads K/V (or Q/dO) from global
# memory fewer times; the first one that fits the device is used.
_TILE_PREFERENCE = ((32, 32), (32, 16), (16, 32), (16, 16), (16, 8), (8, 16), (8, 8), (4, 8), (8, 4), (4, 4))

_KERNELS = ("forward", "backward_dq", "backward_dkv")


@dataclass(frozen=True)
class AttentionTiles:
    """How one attention pass cuts the sequence.

    rows             sequence positions a workgroup owns (queries for forward / DQ, keys for DKV)
    cols             positions per tile streamed through shared memory (keys, or queries for DKV)
    threads_per_row  threads sharing an owned row; each holds D / threads_per_row output dims (as
                     vec4s: threads_per_row must divide D / 4) and computes cols / threads_per_row
                     scores per tile
    """

    rows: int
    cols: int
    threads_per_row: int

    @property
    def workgroup_size(self) -> int:
        return self.rows * self.threads_per_row


def default_threads_per_row(D: int) -> int:
    """Threads per row such that a thread keeps at most 16 accumulators per output (64 for DKV's two)."""
    return max(4, D // 16)


def shared_memory_nbytes(kernel: str, tiles: AttentionTiles, D: int) -> int:
    """Shared memory a pass uses: [rows or cols, D] fp32 tiles with rows padded by a vec4, plus the
    [rows, cols] score tiles with rows padded by a float."""
    stride = D + 4
    rows, cols = tiles.rows, tiles.cols
    scores = rows * (cols + 1)
    if kernel == "forward":       # Q tile, K and V tiles, scores
        floats = (rows + 2 * cols) * stride + scores
    elif kernel == "backward_dq":  # Q and dO tiles, K and V tiles, dS
        floats = (2 * rows + 2 * cols) * stride + scores
    elif kernel == "backward_dkv":  # K and V tiles, Q and dO tiles, P and dS, lse and delta
        floats = (2 * rows + 2 * cols) * stride + 2 * scores + 2 * cols
    else:
        raise KernelArgumentError(f"unknown attention kernel {kernel!r}; expected one of {_KERNELS}")
    return 4 * floats


def _tiles_problem(kernel: str, tiles: AttentionTiles, D: int, shared_memory_bytes: int,
                   max_workgroup_size: int) -> str | None:
    """Why `tiles` cannot run `kernel` at head dim D on this device, or None when they can."""
    for name in ("rows", "cols", "threads_per_row"):
        value = getattr(tiles, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"tiles.{name} must be an int >= 1, got {value!r}"
    if (D // 4) % tiles.threads_per_row or tiles.cols % tiles.threads_per_row:
        return (f"threads_per_row={tiles.threads_per_row} must divide D / 4 = {D // 4} (vec4s of a head "
                f"row) and cols={tiles.cols}")
    if tiles.workgroup_size > max_workgroup_size:
        return (f"rows * threads_per_row = {tiles.workgroup_size} threads exceed the device's "
                f"{WORKGROUP_SIZE_LIMIT} of {max_workgroup_size}")
    needed = shared_memory_nbytes(kernel, tiles, D)
    if needed > shared_memory_bytes:
        return f"needs {needed} bytes of {SHARED_MEMORY_LIMIT}; the device has {shared_memory_bytes}"
    return None


def _smallest_tiles_need(kernel: str, D: int) -> str:
    tiles = AttentionTiles(*_TILE_PREFERENCE[-1], default_threads_per_row(D))
    return (f"{tiles.rows}x{tiles.cols} tiles, need {shared_memory_nbytes(kernel, tiles, D)} bytes and "
            f"{tiles.workgroup_size} threads")


def default_tiles(kernel: str, D: int, *, S: int | None = None, heads_times_batch: int = 1,
                  shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
                  max_workgroup_size: int = DEFAULT_MAX_WORKGROUP_SIZE,
                  target_workgroups: int = TARGET_WORKGROUPS) -> AttentionTiles:
    """The tiles `kernel` ("forward", "backward_dq", "backward_dkv") runs with by default at head dim D.

    Among the configurations that fit the device, the first of the preference order (largest first)
    that still offers `target_workgroups` workgroups, ceil(S / rows) * heads_times_batch, to keep a large
    GPU busy; when none does (short sequences, few kv heads), the one offering the most. Without S the
    largest that fits.
    """
    threads = default_threads_per_row(D)
    fitting = [AttentionTiles(rows, cols, threads) for rows, cols in _TILE_PREFERENCE]
    fitting = [t for t in fitting if _tiles_problem(kernel, t, D, shared_memory_bytes, max_workgroup_size) is None]
    if not fitting:
        raise KernelArgumentError(
            f"causal_attention: no tile configuration of the {kernel} pass fits D={D} in the device's "
            f"{shared_memory_bytes} bytes of {SHARED_MEMORY_LIMIT} and {WORKGROUP_SIZE_LIMIT} of "
            f"{max_workgroup_size} threads (the smallest, {_smallest_tiles_need(kernel, D)})")
    if S is None:
        return fitting[0]

    def workgroups(tiles: AttentionTiles) -> int:
        return ceil_div(S, tiles.rows) * heads_times_batch

    for tiles in fitting:
        if workgroups(tiles) >= target_workgroups:
            return tiles
    # Not below a subgroup-sized workgroup (32 threads) for parallelism's sake, unless nothing else fits.
    candidates = [t for t in fitting if t.workgroup_size >= MIN_FALLBACK_WORKGROUP_SIZE] or fitting
    return max(candidates, key=workgroups)  # max() keeps the first (most preferred) of equal counts


def check_problem(op: str, B: int, S: int, Hq: int, Hkv: int, D: int, scale: Any) -> None:
    check_positive_ints(op, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    if D not in SUPPORTED_HEAD_DIMS:
        raise KernelArgumentError(
            f"{op}: head dim D={D} is not supported; the kernels support D in {SUPPORTED_HEAD_DIMS}")
    if Hq % Hkv:
        raise KernelArgumentError(
            f"{op}: Hq={Hq} query heads is not a multiple of Hkv={Hkv} key/value heads (GQA needs Hq % Hkv == 0)")
    if B * S * Hq * D > MAX_ELEMENTS:
        raise KernelArgumentError(
            f"{op}: q [B={B}, S={S}, Hq={Hq}, D={D}] has {B * S * Hq * D} elements; the kernels index with "
            f"32 bits (at most {MAX_ELEMENTS}): split the batch")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise KernelArgumentError(f"{op}: scale must be a finite float, got {scale!r}")


def _resolve_tiles(op: str, kernel: str, tiles: AttentionTiles | None, D: int, S: int, heads_times_batch: int,
                   shared_memory_bytes: int, max_workgroup_size: int) -> AttentionTiles:
    if tiles is None:
        return default_tiles(kernel, D, S=S, heads_times_batch=heads_times_batch,
                             shared_memory_bytes=shared_memory_bytes, max_workgroup_size=max_workgroup_size)
    if not isinstance(tiles, AttentionTiles):
        raise KernelArgumentError(f"{op}: tiles must be an AttentionTiles, got {tiles!r}")
    problem = _tiles_problem(kernel, tiles, D, shared_memory_bytes, max_workgroup_size)
    if problem:
        raise KernelArgumentError(f"{op}: {kernel} tiles {tiles}: {problem}")
    return tiles


def _spec(D: int, tiles: AttentionTiles) -> dict[int, int]:
    return {HEAD_DIM_SPEC_ID: D, ROWS_SPEC_ID: tiles.rows, COLS_SPEC_ID: tiles.cols,
            THREADS_PER_ROW_SPEC_ID: tiles.threads_per_row}


def _with_documents(shader: str, positions: Any) -> tuple[str, tuple]:
    """The shader's DOCUMENTS variant and the positions binding it adds, or the plain one and no binding."""
    if positions is None:
        return shader, ()
    return (f"{shader}+DOCUMENTS" if "@" in shader else f"{shader}@DOCUMENTS"), (binding(positions, "r"),)


def causal_attention_backward_scratch_nbytes(B: int, S: int, Hq: int) -> int:
    """Bytes of the `delta` scratch buffer the backward needs: fp32 [B, Hq, S]."""
    check_positive_ints("causal_attention_backward", B=B, S=S, Hq=Hq)
    return 4 * B * Hq * S


def plan_backward_delta(*, B: int, S: int, Hq: int, D: int, d_out: Any, out: Any, delta: Any,
                        label: str) -> Dispatch:
    """The backward's pre-pass (attention_bwd_delta.slang): delta = rowsum(d_out * out) [B, Hq, S], shared
    by these kernels and the tensor-core ones (kernels/coopmat_attention.py)."""
    rows = B * S * Hq
    return Dispatch("attention_bwd_delta", groups=(ceil_div(rows, DELTA_WORKGROUP_SIZE), 1, 1),
                    bindings=(binding(d_out, "r"), binding(out, "r"), binding(delta, "w")),
                    push_constants=pack_push(rows, S, Hq, D // 4), local_size=(DELTA_WORKGROUP_SIZE, 1, 1),
                    label=f"{label}.delta")


@register_kernel("vktrain.causal_attention.default")
def plan_causal_attention(*, B: int, S: int, Hq: int, Hkv: int, D: int, q: Any, k: Any, v: Any, out: Any,
                          lse: Any, scale: float, positions: Any = None, tiles: AttentionTiles | None = None,
                          shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
                          max_workgroup_size: int = DEFAULT_MAX_WORKGROUP_SIZE,
                          label: str = "causal_attention") -> list[Dispatch]:
    """Dispatches computing (out, lse) = causal_attention(q, k, v, scale).

    Buffers (keys of the Program's buffer mapping, Buffer objects or BufferBindings; 16-byte aligned):
      q    fp32 [B, S, Hq, D]     k, v  fp32 [B, S, Hkv, D]
      out  fp32 [B, S, Hq, D] (written)    lse  fp32 [B, Hq, S] (written)
      positions  int32 [B, S] or None: packed documents (module docstring)
    `tiles` overrides the default tiling (default_tiles("forward", D, S=S, ...)); `shared_memory_bytes` and
    `max_workgroup_size` are the device's limits the default must respect.
    """
    op = "causal_attention"
    check_problem(op, B, S, Hq, Hkv, D, scale)
    tiles = _resolve_tiles(op, "forward", tiles, D, S, Hq * B, shared_memory_bytes, max_workgroup_size)
    shader, documents = _with_documents("attention_fwd", positions)
    return [Dispatch(
        shader, groups=(ceil_div(S, tiles.rows), Hq, B),
        bindings=(binding(q, "r"), binding(k, "r"), binding(v, "r"), binding(out, "w"), binding(lse, "w"))
        + documents,
        push_constants=pack_push(S, Hq, Hkv, float(scale)), spec_constants=_spec(D, tiles),
        local_size=(tiles.workgroup_size, 1, 1), label=label)]


@register_kernel("vktrain.causal_attention_backward.default")
def plan_causal_attention_backward(*, B: int, S: int, Hq: int, Hkv: int, D: int, d_out: Any, q: Any, k: Any,
                                   v: Any, out: Any, lse: Any, d_q: Any, d_k: Any, d_v: Any, delta: Any,
                                   scale: float, positions: Any = None, dq_tiles: AttentionTiles | None = None,
                                   dkv_tiles: AttentionTiles | None = None,
                                   shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
                                   max_workgroup_size: int = DEFAULT_MAX_WORKGROUP_SIZE,
                                   label: str = "causal_attention_backward") -> list[Dispatch]:
    """Dispatches computing (d_q, d_k, d_v) = causal_attention_backward(d_out, q, k, v, out, lse, scale).

    Buffers: d_out, q, out fp32 [B, S, Hq, D]; k, v fp32 [B, S, Hkv, D]; lse fp32 [B, Hq, S] (the
    forward's); d_q fp32 [B, S, Hq, D], d_k, d_v fp32 [B, S, Hkv, D] (written, not overlapping the
    inputs); delta: scratch of `causal_attention_backward_scratch_nbytes(B, S, Hq)` bytes, overwritten;
    positions: int32 [B, S] or None, the forward's.
    `dq_tiles` / `dkv_tiles` override the tilings of the two main passes (rows = queries for DQ, keys
    for DKV).
    """
    op = "causal_attention_backward"
    check_problem(op, B, S, Hq, Hkv, D, scale)
    dq_tiles = _resolve_tiles(op, "backward_dq", dq_tiles, D, S, Hq * B, shared_memory_bytes, max_workgroup_size)
    dkv_tiles = _resolve_tiles(op, "backward_dkv", dkv_tiles, D, S, Hkv * B, shared_memory_bytes,
                               max_workgroup_size)
    push = pack_push(S, Hq, Hkv, float(scale))
    inputs = (binding(d_out, "r"), binding(q, "r"), binding(k, "r"), binding(v, "r"), binding(lse, "r"),
              binding(delta, "r"))
    dq_shader, documents = _with_documents("attention_bwd@DQ", positions)
    dkv_shader, _ = _with_documents("attention_bwd@DKV", positions)
    return [
        plan_backward_delta(B=B, S=S, Hq=Hq, D=D, d_out=d_out, out=out, delta=delta, label=label),
        Dispatch(dq_shader, groups=(ceil_div(S, dq_tiles.rows), Hq, B),
                 bindings=inputs + (binding(d_q, "w"),) + documents, push_constants=push,
                 spec_constants=_spec(D, dq_tiles), local_size=(dq_tiles.workgroup_size, 1, 1),
                 label=f"{label}.dq"),
        Dispatch(dkv_shader, groups=(ceil_div(S, dkv_tiles.rows), Hkv, B),
                 bindings=inputs + (binding(d_k, "w"), binding(d_v, "w")) + documents, push_constants=push,
                 spec_constants=_spec(D, dkv_tiles), local_size=(dkv_tiles.workgroup_size, 1, 1),
                 label=f"{label}.dkv"),
    ]

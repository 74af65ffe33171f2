"""Tile and split-K defaults of the linear family's kernels (kernels/linear.py): the GEMM and GEMV tilings,
their limits, and the default choices per shape. Plain data and arithmetic, so planners and benchmarks can ask
what a shape would get without planning it."""
from __future__ import annotations

from dataclasses import dataclass

from vktrain.serialization.device_profile import H200_FP32_TARGET_WORKGROUPS
from vktrain.serialization.dispatch import ceil_div
from vktrain.serialization.strided_view import KernelArgumentError

# M up to GEMV_MAX_M takes the GEMV kernels, each workgroup serving up to GEMV_MAX_ROWS rows (one pass
# over W per row group; the passes run concurrently and mostly hit the cache). Beyond it the tiled
# GEMM, whose 64-128-row tiles would be mostly idle at such M, does less work per output.
GEMV_MAX_ROWS = 4
GEMV_MAX_M = 8

# Shared-memory budget the default configurations stay under: Vulkan guarantees 16 KiB, lavapipe and
# most desktop GPUs give 32 KiB or more, NVIDIA 48 KiB.
DEFAULT_SHARED_MEMORY_BYTES = 32768

# Workgroups a dispatch should offer to fill a large GPU (the H200 profile's fp32_target_workgroups, about 2
# per compute unit).
TARGET_WORKGROUPS = H200_FP32_TARGET_WORKGROUPS
# Split-K never cuts the reduction into slices shorter than this (each slice amortizes its tile loads).
MIN_SPLIT_SLICE = 256
MAX_SPLIT_K = 32

# The FP16 variant's shared memory besides its (half-size) tiles: coopmat_scale.slangh's two maxima.
FP16_SCALE_SHARED_BYTES = 8

# The register-tile bodies (CPU_TUNING): a workgroup of CPU_LANES invocations = the 8 fp32 lanes of a
# 256-bit CPU vector (lavapipe on AVX2), each owning CPU_ROWS rows (linear_gemm_cpu.slangh's default) x 4
# columns of the output.
CPU_LANES = 8
CPU_ROWS = 8
# lavapipe ends an invocation after this many trips of one loop; the register-tile bodies walk K 4 at
# a time (forward) or N 8 at a time (d_x), so longer reductions keep the tiled body.
CPU_MAX_LOOP_TRIPS = 65535


@dataclass(frozen=True)
class GemmTiles:
    """Tiling of the GEMM kernels: a workgroup of threads_x * threads_y threads owns a
    (8 * threads_y) x (8 * threads_x) output tile and steps the reduction `bk` at a time."""

    threads_x: int = 16
    threads_y: int = 16
    bk: int = 16

    def __post_init__(self) -> None:
        for name in ("threads_x", "threads_y"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KernelArgumentError(f"GemmTiles.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.bk, int) or self.bk < 8 or self.bk % 8:
            raise KernelArgumentError(
                f"GemmTiles.bk must be a positive multiple of 8 (whole W_4X8 blocks), got {self.bk!r}")

    @property
    def bm(self) -> int:
        return 8 * self.threads_y

    @property
    def bn(self) -> int:
        return 8 * self.threads_x

    @property
    def shared_bytes(self) -> int:
        return 4 * self.bk * (self.bm + self.bn)


@dataclass(frozen=True)
class GemvTiles:
    """Tiling of the GEMV kernels: a workgroup of wg_x * wg_y threads (both powers of two) serves
    `rows` activation rows. Forward: wg_x output n8 columns x wg_y slices of K; backward: wg_x slices
    of N x wg_y output k4 columns."""

    wg_x: int = 4
    wg_y: int = 64
    rows: int = 1

    def __post_init__(self) -> None:
        for name in ("wg_x", "wg_y"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise KernelArgumentError(f"GemvTiles.{name} must be a power of two >= 1, got {value!r}")
        if not isinstance(self.rows, int) or self.rows < 1:
            raise KernelArgumentError(f"GemvTiles.rows must be an int >= 1, got {self.rows!r}")

    @property
    def shared_bytes(self) -> int:
        return 16 * self.wg_x * self.wg_y * self.rows * 2


# ----------------------------------------------------------------------------------- configs
def next_pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def prev_pow2(value: int) -> int:
    return 1 << max(0, value.bit_length() - 1)


# Reduction step per op: the H200 tiling sweep (bench/results/kernels_h200_llama-3.2-1b.json's older run)
# found bk = 8 faster for the forward 4-bit GEMM at every M >= 128 (6-10% at M >= 512); d_x and dW showed
# no consistent winner.
DEFAULT_BK = {"linear_q4gsw": 8}


def default_gemm_tiles(rows: int, cols: int, can_split: bool = False, op: str = "") -> GemmTiles:
    """128 x 128 tiles (8 x 8 outputs per thread). Without split-K, an output of few such tiles takes
    64-wide tiles along its short side instead, for more workgroups."""
    bk = DEFAULT_BK.get(op, 16)
    full = GemmTiles(16, 16, bk)
    if can_split or ceil_div(rows, full.bm) * ceil_div(cols, full.bn) >= TARGET_WORKGROUPS // 2:
        return full
    if rows <= cols:
        return GemmTiles(16, 8, bk)  # 64 x 128
    return GemmTiles(8, 16, bk)  # 128 x 64


DEFAULT_GEMM_THREADS = 256  # default_gemm_tiles' 16 x 16


def narrow_gemm_tiles(op: str, max_workgroup_size: int) -> GemmTiles:
    """Tiles for a device allowing fewer than DEFAULT_GEMM_THREADS invocations: 16 threads wide, as many rows
    of threads as it allows (64 x 128 outputs at Vulkan's guaranteed 128), the op's default bk. Tiles change
    which thread computes an output, not its sum."""
    return GemmTiles(16, max(1, min(16, max_workgroup_size // 16)), DEFAULT_BK.get(op, 16))


def default_split_k(rows: int, cols: int, reduction: int, tiles: GemmTiles) -> int:
    """Reduction slices per tile: enough for TARGET_WORKGROUPS workgroups, each slice >= MIN_SPLIT_SLICE."""
    tile_count = ceil_div(rows, tiles.bm) * ceil_div(cols, tiles.bn)
    if tile_count >= TARGET_WORKGROUPS:
        return 1
    wanted = ceil_div(TARGET_WORKGROUPS, tile_count)
    return max(1, min(wanted, reduction // MIN_SPLIT_SLICE, MAX_SPLIT_K))


def default_gemv_tiles(rows: int, reduction4: int, outputs: int, backward: bool,
                       shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
                       max_workgroup_size: int | None = None) -> GemvTiles:
    """A configuration that offers ~TARGET_WORKGROUPS workgroups of <= 256 threads, each thread reading a
    few 16-byte blocks. Forward: `outputs` = N8 output blocks along x, `reduction4` = K4 slices along
    y. Backward: `outputs` = K4 output columns along y, `reduction4` = N8 blocks along x (a subgroup
    then reads consecutive blocks of one k4-row)."""
    if backward:
        slices = max(1, min(128, next_pow2(ceil_div(reduction4, 8))))  # ~8 blocks per thread
        tiles = GemvTiles(wg_x=slices, wg_y=max(1, 256 // slices), rows=rows)
    else:
        # >= 2 columns: adjacent lanes then read adjacent 16-byte blocks, so every 32-byte memory
        # sector a subgroup touches is fully used.
        columns = min(next_pow2(outputs), max(2, min(4, prev_pow2(max(1, outputs // TARGET_WORKGROUPS)))))
        slices = max(1, min(256 // columns, next_pow2(ceil_div(reduction4, 4))))  # ~4 blocks per thread
        tiles = GemvTiles(wg_x=columns, wg_y=slices, rows=rows)
    # Partial sums take 32 bytes per thread and row: halve the workgroup until they fit, and until the device
    # runs it (`max_workgroup_size`: 128 on the phone profiles; fewer slices of K, summed in another order).
    while (tiles.shared_bytes > shared_memory_bytes or (max_workgroup_size is not None and
                                                        tiles.wg_x * tiles.wg_y > max_workgroup_size)) \
            and tiles.wg_x * tiles.wg_y > 1:
        if tiles.wg_y > 1:
            tiles = GemvTiles(tiles.wg_x, tiles.wg_y // 2, rows)
        else:
            tiles = GemvTiles(tiles.wg_x // 2, 1, rows)
    return tiles

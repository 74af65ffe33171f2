"""The coopmat GEMM kernels' tilings and split-K policy (kernels/coopmat.py plans them): CoopmatTiling
(one variant of coopmat_gemm.slangh's body), the variants built ahead of time, the default tiling per kernel
and shape from the H200 sweep, the size rule's constants, and how many slices a small output's reduction
is cut into. Torch-free facts of shapes only: no device, no dispatch."""
from __future__ import annotations

from dataclasses import dataclass

from vktrain.serialization.dispatch import ceil_div
from vktrain.serialization.device_profile import H200_MIN_WORKGROUPS, H200_SPLIT_K_TARGET_WORKGROUPS

# The cooperative-matrix shape the shaders are written for.
FRAGMENT = (16, 16, 16)
# Size measure of the route's rule below (not a tiling): outputs counted in tiles of 64 x 128.
SIZE_TILE_M, SIZE_TILE_N = 64, 128
# A GEMM takes the tensor cores unsplit when its output has at least MIN_WORKGROUPS 64 x 128 tiles, and a
# smaller one when split-K gives it that many workgroups (below). Both numbers are the device profile's
# (vktrain/serialization/device_profile.py, where the H200 measurement behind them is); these defaults are
# the H200's, and GemmRoute carries the profile's (select_gemm_route).
MIN_WORKGROUPS = H200_MIN_WORKGROUPS
# Split-K (module docstring): slices of at least MIN_SPLIT_SLICE until about SPLIT_TARGET_WORKGROUPS run,
# at most MAX_SPLIT_K (the reduce reads every partial); none for outputs narrower than SPLIT_MIN_SIDE (the
# rank-16 LoRA products: a 64 x 64 tile would idle most of its fragments).
SPLIT_TARGET_WORKGROUPS = H200_SPLIT_K_TARGET_WORKGROUPS
MIN_SPLIT_SLICE = 256
MAX_SPLIT_K = 16
SPLIT_MIN_SIDE = 64
# A GEMM whose reduction is at most STARVED_REDUCTION long (a LoRA rank: xa @ B^T, dxa @ A) keeps the fp32
# SIMT kernels whatever its output: it is bandwidth-bound (two reads of the operands, one write of the output
# per 2 * K flops), and on the tensor cores it would pay an absmax pass over both operands, their fp16
# rounding and a BK-deep reduction step that is mostly zero padding (H200 step profile, issue 30: the
# rank-16 ADDEND GEMMs and their absmax passes took 12 of the step's 101 ms).
STARVED_REDUCTION = 64
# lavapipe (llvmpipe's LP_MAX_TGSI_LOOP_ITERATIONS) gives each invocation 65535 loop iterations over all
# its loops together and silently cuts them short past that: the outputs it has not stored stay
# unwritten (the NaN seen before). The emulated variants' plans refuse a shape whose loop nest
# (emulated_loop_trips, the iterations the source asks for) exceeds half that: lavapipe counts more than
# the source's iterations (64-row tiles, subgroups of 8, LLVM 15: fine at K = 6400, cut at 6656, i.e.
# 315-327 per K step where the source runs 257).
LAVAPIPE_LOOP_LIMIT = 65535
EMULATED_LOOP_BUDGET = LAVAPIPE_LOOP_LIMIT // 2
# What every tiling must fit: the 48 KiB of shared memory a workgroup gets on NVIDIA GPUs (AMD RDNA3 and
# Intel Arc offer 64). lavapipe offers 32: the emulated route's default tilings fit that.
SHARED_MEMORY_BYTES = 48 * 1024


@dataclass(frozen=True)
class CoopmatTiling:
    """One tiling variant of coopmat_gemm.slangh: a tile_m x tile_n workgroup tile of C, computed by
    subgroups_m x subgroups_n subgroups of (tile_m / subgroups_m) x (tile_n / subgroups_n) each; the
    reduction advances `bk` per step through `stages` shared buffers (2: one barrier per step, the next
    step fetched before this one's products); `prefetch` (one stage only) issues the next step's global
    loads before the products. Defaults are the shaders' (no define)."""

    tile_m: int = 128
    tile_n: int = 128
    bk: int = 32
    stages: int = 1
    prefetch: bool = False
    subgroups_m: int = 2
    subgroups_n: int = 2

    @property
    def name(self) -> str:
        """Short name for reports and test ids, e.g. bm64+bk64+stages2."""
        parts = [f"bm{self.tile_m}"] + ([f"bn{self.tile_n}"] if self.tile_n != 128 else []) \
            + ([f"bk{self.bk}"] if self.bk != 32 else []) \
            + ([f"sg{self.subgroups_m}x{self.subgroups_n}"] if (self.subgroups_m, self.subgroups_n) != (2, 2) else []) \
            + ([f"stages{self.stages}"] if self.stages != 1 else []) + (["prefetch"] if self.prefetch else [])
        return "+".join(parts)

    @property
    def defines(self) -> list[str]:
        """The shader defines of this tiling, in the order the sources' `vktrain-variants:` lines use."""
        default = CoopmatTiling()
        pairs = (("BM", self.tile_m, default.tile_m), ("BN", self.tile_n, default.tile_n), ("BK", self.bk, default.bk),
                 ("SG_M", self.subgroups_m, default.subgroups_m), ("SG_N", self.subgroups_n, default.subgroups_n),
                 ("STAGES", self.stages, default.stages))
        return [f"{key}={value}" for key, value, base in pairs if value != base] + (["PREFETCH"] if self.prefetch else [])

    @property
    def subgroups(self) -> int:
        return self.subgroups_m * self.subgroups_n

    @property
    def fragments(self) -> int:
        """16 x 16 accumulators per subgroup."""
        return (self.tile_m // self.subgroups_m // FRAGMENT[0]) * (self.tile_n // self.subgroups_n // FRAGMENT[1])

    @property
    def shared_bytes(self) -> int:
        """Shared memory of the shader (coopmat_gemm.slangh's arrays), the larger of its two B layouts:
        fp16 tiles with a 16-byte row skew per stage, the 16 x 16 fp32 edge block of each subgroup, the
        two operand maxima."""
        a_tile = self.tile_m * (self.bk + 8)
        b_tile = max(self.tile_n * (self.bk + 8), self.bk * (self.tile_n + 8))
        return 2 * self.stages * (a_tile + b_tile) + 4 * self.subgroups * FRAGMENT[0] * FRAGMENT[1] + 8

    def problems(self) -> list[str]:
        """What the shader would refuse (its #error lines) or a workgroup could not hold; [] if none."""
        found = []
        if self.bk not in (32, 64):
            found.append(f"bk={self.bk} is not 32 or 64")
        if self.stages not in (1, 2) or (self.stages == 2 and self.prefetch):
            found.append(f"stages={self.stages} with prefetch={self.prefetch}: stages is 1 or 2, prefetch only with 1")
        if self.tile_m % (16 * self.subgroups_m) or self.tile_n % (16 * self.subgroups_n) or min(
                self.tile_m, self.tile_n, self.subgroups_m, self.subgroups_n) < 1:
            found.append(f"a {self.tile_m} x {self.tile_n} tile does not split into {self.subgroups_m} x "
                         f"{self.subgroups_n} subgroup tiles of whole 16 x 16 blocks")
        if self.shared_bytes > SHARED_MEMORY_BYTES:
            found.append(f"{self.shared_bytes} bytes of shared memory exceed {SHARED_MEMORY_BYTES}")
        return found


# The tilings built ahead of time (the shaders' `vktrain-variants:` lines list each for every kernel;
# tests/test_kernels_coopmat.py checks that they do).
TILINGS = (
    CoopmatTiling(),
    CoopmatTiling(tile_m=64),
    CoopmatTiling(prefetch=True),
    CoopmatTiling(tile_m=64, prefetch=True),
    CoopmatTiling(stages=2),
    CoopmatTiling(tile_m=64, stages=2),
    CoopmatTiling(bk=64),
    CoopmatTiling(tile_m=64, bk=64),
    CoopmatTiling(tile_m=64, bk=64, prefetch=True),
    CoopmatTiling(subgroups_m=4),
    CoopmatTiling(subgroups_n=4),
    CoopmatTiling(subgroups_m=4, prefetch=True),
    CoopmatTiling(subgroups_m=4, bk=64),
    CoopmatTiling(tile_m=256, subgroups_m=4),
    CoopmatTiling(tile_n=256, subgroups_n=4),
    CoopmatTiling(tile_m=256, subgroups_m=4, prefetch=True),
    CoopmatTiling(tile_n=256, subgroups_n=4, prefetch=True),
    CoopmatTiling(tile_m=64, tile_n=64, stages=2),
    CoopmatTiling(tile_m=64, tile_n=64, bk=64),
)
TILING_BY_NAME = {tiling.name: tiling for tiling in TILINGS}
KERNELS = ("coopmat_linear_q4gsw", "coopmat_linear_q4gsw_backward", "coopmat_mm", "coopmat_mm_b_transposed")
# kernel -> ((fewest 128 x 128 output tiles, shortest reduction, tiling name), ...): the first row whose
# tile count and reduction length the GEMM reaches gives its tiling (the last row takes every GEMM).
# From the H200 sweep (bench/results/coopmat_h200.json's newest run, the fastest tiling per kernel and
# shape): at M = 2048, K = N = 2048 (256 tiles) 128 x 128 tiles with BK = 64 (the d_x kernel: BK = 32, 3%
# apart), at M = 512 (64 tiles) 64 x 64 tiles with BK = 64, by 14-44% over the next tiling. Larger GEMMs
# take the 256-tile row unmeasured (the sweep stopped before them; the first version's sweep, the file's
# older run, had 128-row tiles fastest at every shape from 256 tiles on).
DEFAULT_TILINGS: dict[str, tuple[tuple[int, int, str], ...]] = {
    "coopmat_linear_q4gsw": ((256, 0, "bm128+bk64"), (0, 0, "bm64+bn64+bk64")),
    "coopmat_linear_q4gsw_backward": ((256, 0, "bm128"), (0, 0, "bm64+bn64+bk64")),
    "coopmat_mm": ((256, 0, "bm128+bk64"), (0, 0, "bm64+bn64+bk64")),
    "coopmat_mm_b_transposed": ((256, 0, "bm128+bk64"), (0, 0, "bm64+bn64+bk64")),
}
# The emulated route (lavapipe, 32 KiB of shared memory) takes the tiling of the first version.
EMULATED_DEFAULT_TILINGS = ((256, 0, "bm128"), (0, 0, "bm64"))
# coopmat_mm's ADDEND variant (aten.addmm) is built ahead of time for the default tilings of both B
# layouts, the emulated ones and the first version's four.
ADDEND_TILINGS = tuple(dict.fromkeys(
    [name for kernel in ("coopmat_mm", "coopmat_mm_b_transposed") for *_, name in DEFAULT_TILINGS[kernel]]
    + [name for *_, name in EMULATED_DEFAULT_TILINGS] + ["bm128+prefetch", "bm64+prefetch"]))

# The q4gsw kernels' RANK_EPILOGUE variant (a LoRA up-product added in the base GEMM's epilogue) is built ahead
# of time for their default tilings only (the emulated ones build on demand where a compiler is).
RANK_KERNELS = ("coopmat_linear_q4gsw", "coopmat_linear_q4gsw_backward")
RANK_TILINGS = {kernel: tuple(dict.fromkeys(name for *_, name in DEFAULT_TILINGS[kernel])) for kernel in RANK_KERNELS}


def emulated_loop_trips(tiling: CoopmatTiling, reduction: int, subgroup_size: int, rank: int = 0) -> int:
    """Loop iterations one invocation of an emulated coopmat GEMM runs (coopmat_gemm.slangh with
    COOPMAT_EMULATE): per BK step its own trip plus 16 per emulated multiply-add, (BK / 16) x the
    subgroup's 16 x 16 accumulators of them; then the edge stores, at most one loop of
    256 / subgroup_size trips per accumulator, or with a `rank` epilogue (RANK_EPILOGUE) its loop of
    rank / 4 trips per column a lane owns in each accumulator."""
    per_step = 1 + (tiling.bk // FRAGMENT[2]) * tiling.fragments * FRAGMENT[2]
    if rank:
        stores = tiling.fragments * max(1, FRAGMENT[1] // subgroup_size) * ceil_div(rank, 4)
    else:
        stores = tiling.fragments * ceil_div(FRAGMENT[0] * FRAGMENT[1], subgroup_size)
    return ceil_div(reduction, tiling.bk) * per_step + stores


def default_tiling(kernel: str, M: int, N: int, reduction: int, *, emulate: bool = False) -> CoopmatTiling:
    """The tiling `kernel` (one of KERNELS) runs an M x N output over `reduction` with: the first row of
    its DEFAULT_TILINGS (EMULATED_DEFAULT_TILINGS when emulated) whose count of 128 x 128 tiles and
    reduction length the GEMM reaches."""
    tiles = ceil_div(M, 128) * ceil_div(N, 128)
    rows = EMULATED_DEFAULT_TILINGS if emulate else DEFAULT_TILINGS[kernel]
    return TILING_BY_NAME[next(name for fewest, shortest, name in rows if tiles >= fewest and reduction >= shortest)]


def workgroups(tiling: CoopmatTiling, M: int, N: int) -> int:
    """Workgroup tiles of an M x N output."""
    return ceil_div(M, tiling.tile_m) * ceil_div(N, tiling.tile_n)


def split_slice_length(tiling: CoopmatTiling, reduction: int, split_k: int) -> int:
    """Reduction length of each of `split_k` slices: ceil(reduction / split_k) in whole BK steps."""
    return ceil_div(ceil_div(reduction, split_k), tiling.bk) * tiling.bk


def default_split_k(tiling: CoopmatTiling, M: int, N: int, reduction: int, *, min_workgroups: int = MIN_WORKGROUPS,
                    target_workgroups: int = SPLIT_TARGET_WORKGROUPS) -> int:
    """Slices a coopmat plan with scratch cuts the reduction into (1: no split; module docstring): enough
    for `target_workgroups` workgroups, slices >= MIN_SPLIT_SLICE, at most MAX_SPLIT_K, trimmed so that no
    slice is empty. Only outputs the route's size rule alone would keep off the tensor cores (fewer than
    `min_workgroups` tiles of SIZE_TILE_M x SIZE_TILE_N) are split, and none narrower than SPLIT_MIN_SIDE:
    the GEMMs of at least that size run as they were measured. The two targets are the device profile's
    (GemmRoute.default_split_k); the defaults are the H200's."""
    if ceil_div(M, SIZE_TILE_M) * ceil_div(N, SIZE_TILE_N) >= min_workgroups or min(M, N) < SPLIT_MIN_SIDE:
        return 1
    split_k = min(ceil_div(target_workgroups, workgroups(tiling, M, N)), reduction // MIN_SPLIT_SLICE,
                  MAX_SPLIT_K)
    if split_k <= 1:
        return 1
    return ceil_div(reduction, split_slice_length(tiling, reduction, split_k))


def split_k_scratch_nbytes(kernel: str, M: int, N: int, reduction: int, *, emulate: bool = False) -> int:
    """Bytes of scratch the default plan of `kernel` (one of KERNELS) over an M x N output uses when given
    one (0: it would not split, pass none): the partial products of its slices."""
    split_k = default_split_k(default_tiling(kernel, M, N, reduction, emulate=emulate), M, N, reduction)
    return 0 if split_k == 1 else 4 * split_k * M * N

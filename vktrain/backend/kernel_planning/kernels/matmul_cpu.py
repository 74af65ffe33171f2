"""matmul.slang's CPU_REGISTER_TILES body (matmul_cpu.slangh) on CPU Vulkan implementations (kernels/gemm_tuning.py
CPU_TUNING): whether a GEMM takes it, and which of its variants and specialization constants (pair loads, rows per
invocation) a pair of operand views gets. Cut from matmul.py, which plans the dispatch."""
from __future__ import annotations

from typing import Any

from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, check_tuning
from vktrain.serialization.strided_view import StridedView

B_N_PAIRS_SPEC_ID = 5  # the CPU body's B_PAIRS direction (matmul_cpu.slangh)

# The CPU_REGISTER_TILES body (matmul_cpu.slangh): a workgroup of CPU_LANES invocations (one subgroup: the
# 8 fp32 lanes of a 256-bit CPU vector), each owning CPU_TM rows x CPU_TN adjacent columns of C. CPU_TM
# is the largest of CPU_TM_CHOICES not above M (the first when M is smaller; rows past M are computed
# and dropped): each element of B a lane loads feeds CPU_TM products, and on lavapipe 64 rows ran the
# 64-token head and LoRA products 1.2-1.7x faster than 16. Its loop over K advances 2 * CPU_LANES steps
# at a time and lavapipe ends an invocation after 65535 trips of one loop, so a longer reduction keeps
# the shared-memory body.
CPU_LANES = 8
CPU_TM_CHOICES = (16, 32, 64)  # 16: the shader's default, the others its CPU_TM=... variants
CPU_TN = 2
CPU_MAX_K = 2 * CPU_LANES * 65535


def takes_cpu_body(K: int, tile: Any, tuning: str, label: str) -> bool:
    """Whether a GEMM takes the CPU_REGISTER_TILES body: CPU_TUNING, no forced tile, K within its loop."""
    return check_tuning(tuning, f"{label}: tuning") == CPU_TUNING and tile is None and K <= CPU_MAX_K


def _pairs(view: StridedView, contiguous_dim: int, length: int) -> bool:
    """Whether the CPU body may load `view` two floats at a time along `contiguous_dim`: stride 1 there,
    every other stride and the offset even (so each pair is 8-byte aligned), an even `length` along it."""
    others = [stride for dim, stride in enumerate(view.strides) if dim != contiguous_dim]
    return view.strides[contiguous_dim] == 1 and length % 2 == 0 and all(x % 2 == 0 for x in [view.offset, *others])


def cpu_tile_rows(M: int) -> int:
    """CPU_TM for an output of M rows: the largest of CPU_TM_CHOICES not above M, else the smallest."""
    return max([tm for tm in CPU_TM_CHOICES if tm <= M], default=CPU_TM_CHOICES[0])


def cpu_gemm_variant(A: StridedView, B: StridedView, has_bias: bool) -> tuple[str, dict[int, bool]]:
    """The CPU body's shader and specialization constants for batched views A [b, M, K], B [b, K, N]:
    64-bit pair loads of A along k, of B along n or else along k, wherever they are aligned, and
    cpu_tile_rows(M) rows per invocation."""
    M, K, N = A.sizes[1], A.sizes[2], B.sizes[2]
    b_n_pairs = _pairs(B, 2, N)
    a_pairs, b_pairs = _pairs(A, 2, K), b_n_pairs or _pairs(B, 1, K)
    tm = cpu_tile_rows(M)
    name = f"matmul@HAS_BIAS={int(has_bias)}+CPU_REGISTER_TILES" + ("+A_PAIRS" if a_pairs else "") \
        + ("+B_PAIRS" if b_pairs else "") + ("" if tm == CPU_TM_CHOICES[0] else f"+CPU_TM={tm}")
    return name, ({B_N_PAIRS_SPEC_ID: b_n_pairs} if b_pairs else {})


__all__ = ["B_N_PAIRS_SPEC_ID", "CPU_LANES", "CPU_MAX_K", "CPU_TM_CHOICES", "CPU_TN", "cpu_gemm_variant",
           "cpu_tile_rows", "takes_cpu_body"]

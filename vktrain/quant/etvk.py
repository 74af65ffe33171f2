"""Upstream ExecuTorch's (`et_vk`, executorch.backends.vulkan) packed q4gsw weights, as vktrain's flat layout.

What upstream does (executorch 1.5.1, read from its wheel):
- `patterns/weight_packing_utils.pack_4bit_weight_tensor(q [N, K] int8)`, used by the quantized-linear
  pattern fusion that produces `et_vk.linear_q4gsw`, pads K with q = 0 to a multiple of 8
  (`inner_dim_padding=8`; None: no padding) and packs byte j of row n as `(q[n, 2j+1] + 8) << 4 | (q[n, 2j] + 8)`.
- `custom_ops_lib.unpack_4bit_weight_tensor`, the CPU reference of `et_vk.linear_q4gsw`, reads the two
  nibbles back in that order, subtracts 8 and keeps the first K columns (K = x.shape[-1]).
- Scales are `[G, N]` (the pattern fusion transposes torchao's `[N, G]`; N padded to a multiple of 4,
  which vktrain's kernels require of N anyway, so no padding occurs in a shape vktrain accepts).

So upstream's bytes are vktrain's flat layout (docs/spec/w4x8.md: uint8 [N, Kp/2], even k in the low
nibble, code = q + 8, padding code 8) exactly when K is padded to a multiple of 8; the only
difference is the number of padding columns (none with `inner_dim_padding=None`, any with another
padding) and what the padding holds (upstream ignores it; vktrain's kernels need code 8 there).
`flat_from_etvk` converts, losslessly: the K codes of every row are kept bit for bit.
"""
from __future__ import annotations

import numpy as np

from vktrain.errors import VktrainError

from .q4gsw import CODE_ZERO, pack_flat


class EtvkLayoutError(VktrainError, ValueError):
    """Bytes that are not upstream's packed q4gsw weight for the given K."""


def etvk_packed_columns_ok(columns: int, K: int) -> bool:
    """Whether upstream's reference reads K codes out of `columns` packed bytes per row: it unpacks
    2 * columns codes and keeps the first K, so it needs 2 * columns >= K."""
    return 2 * columns >= K


def flat_from_etvk(packed: np.ndarray, K: int) -> np.ndarray:
    """Upstream's packed q4gsw weight uint8 [N, C] (2C >= K) -> vktrain's flat uint8 [N, Kp/2], padding code 8.

    Bytes equal to the input where upstream padded K to a multiple of 8 with q = 0 (its default)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim != 2:
        raise EtvkLayoutError(f"et_vk packed q4gsw weights must be uint8 [N, ceil(K/2)..], got {packed.dtype} "
                         f"{list(packed.shape)}")
    if not etvk_packed_columns_ok(packed.shape[1], K):
        raise EtvkLayoutError(f"et_vk packed q4gsw weights {list(packed.shape)} hold {2 * packed.shape[1]} codes per row, "
                         f"fewer than K={K} (expected at least {(K + 1) // 2} bytes per row)")
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.int16)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    flat = pack_flat(codes[:, :K] - CODE_ZERO)
    return flat


__all__ = ["EtvkLayoutError", "etvk_packed_columns_ok", "flat_from_etvk"]

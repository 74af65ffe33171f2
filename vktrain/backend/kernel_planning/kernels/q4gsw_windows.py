"""Window geometry of linear_q4gsw / linear_q4gsw_backward whose bindings exceed the device's storage-binding
limit (linear.py's "Bindings over the limit"): which windows of K columns of W and of M rows fit, and where
each window's W_4X8 words and scales start.

W_4X8 (docs/spec/w4x8.md) stores W [N, K] k4-row by k4-row, all N8 blocks of one k4 row together: rows of
W are not contiguous (a window of N rows spans nearly the whole buffer), columns are. The words of columns
[k0, k0 + kk) of W, k0 a multiple of 8, are exactly the W_4X8 words of the [N, kk] weight W[:, k0:k0+kk],
starting at word w4x8_num_words(N, k0) (the words of W[:, :k0]); its scales are rows k0 / gs .. of
scales [G, N]. So a window of K is a whole q4gsw weight to the kernels (bound from the aligned offset below
its first byte, the rest an element offset: GemmPlacement), and windows split K.
"""
from __future__ import annotations

import math

from vktrain.quant import w4x8_num_words
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit

# A window of K starts at a multiple of whole groups (its scale rows), of 8 columns (whole W_4X8 k4-row
# pairs: padded_k of a window is its own length) and of 16 (whole reduction steps of every default tiling,
# so the windowed kernels walk the same steps as the unsplit one).
WINDOW_K_MULTIPLE = 16


def k_window_step(group_size: int) -> int:
    """Columns of K every window of K starts at a multiple of."""
    return math.lcm(group_size, WINDOW_K_MULTIPLE)


def words_byte_range(N: int, k_begin: int, k_end: int) -> tuple[int, int]:
    """Bytes [begin, end) of W's W_4X8 buffer holding columns [k_begin, k_end) (k_begin a multiple of 8)."""
    begin = 4 * w4x8_num_words(N, k_begin)
    return begin, begin + 4 * w4x8_num_words(N, k_end - k_begin)


def scales_byte_range(N: int, group_size: int, k_begin: int, k_end: int) -> tuple[int, int]:
    """Bytes [begin, end) of scales [G, N] holding the groups of columns [k_begin, k_end) (whole groups)."""
    return 4 * N * (k_begin // group_size), 4 * N * (k_end // group_size)


def k_windows(N: int, K: int, group_size: int, limit: BindingLimit) -> list[tuple[int, int]] | None:
    """[begin, end) windows of K whose words and scales each fit `limit` from the aligned offset below their
    first byte (one window when W fits whole); None when not even one step (k_window_step) fits."""
    if limit.fits(4 * w4x8_num_words(N, K)) and limit.fits(4 * N * (K // group_size)):
        return [(0, K)]
    step = k_window_step(group_size)
    steps = min(limit.window_bytes // (4 * w4x8_num_words(N, step)),
                limit.window_bytes // (4 * N * (step // group_size)))
    if steps == 0:
        return None
    width = steps * step
    return [(begin, min(begin + width, K)) for begin in range(0, K, width)]


def m_window_rows(M: int, row_elements: int, whole_fits: bool, limit: BindingLimit) -> int:
    """Rows of M per window: M when the activations fit whole, else as many rows of `row_elements` floats
    (the longer of the source's and the output's rows) as a window may span (0: not one row)."""
    return M if whole_fits else min(M, limit.window_bytes // (4 * row_elements))

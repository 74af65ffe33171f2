"""Window geometry of a GEMM whose bindings exceed the device's storage-binding limit (matmul.py's
"Bindings over the limit"): which windows of M rows, N columns and K steps fit, and the binding and view
of one window of a float32 or Q8_0 operand. plan_gemm (matmul.py) dispatches over them."""
from __future__ import annotations

from typing import Any

from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit, sub_binding
from vktrain.serialization.strided_view import KernelArgumentError, StridedView
from vktrain.serialization.dispatch import BufferBinding
from vktrain.serialization.dispatch import ceil_div

MAX_GEMM_WINDOWS = 1 << 16  # dispatches one windowed GEMM may take (a limit this small is a mistake)


def window_elements(view: StridedView, rows: int, columns: int) -> int:
    """Elements a [rows, columns] window of the 2-D `view` spans, from its first to its last."""
    return 1 + (rows - 1) * view.strides[0] + (columns - 1) * view.strides[1]


def operand_budgets(q8_0: bool, limit: BindingLimit) -> tuple[int, int]:
    """Elements a window of a float32 operand / of B may span."""
    fp32 = limit.window_bytes // 4
    return fp32, (limit.max_bytes - limit.q8_0_window_start if q8_0 else fp32)


def bindings_fit(a_view: StridedView, b_view: StridedView, bias_view: StridedView | None, q8_0: bool,
                  c_row_stride: int | None, c_offset: int, limit: BindingLimit) -> bool:
    """Whether the unsplit GEMM binds no more than `limit` anywhere (whole 2-D operands as planned)."""
    M, N = a_view.sizes[-2], b_view.sizes[-1]
    batch = max(a_view.sizes[0] if a_view.rank == 3 else 1, b_view.sizes[0] if b_view.rank == 3 else 1)
    c_elements = c_offset + batch * M * (N if c_row_stride is None else c_row_stride)
    extents = [4 * a_view.extent(), b_view.extent() if q8_0 else 4 * b_view.extent(), 4 * c_elements]
    if bias_view is not None:
        extents.append(4 * bias_view.extent())
    return all(limit.fits(nbytes) for nbytes in extents)


def window_scratch_nbytes(M: int, N: int, limit: BindingLimit) -> int:
    """Scratch a windowed GEMM of output [M, N] needs when it splits the reduction (one output window)."""
    return min(4 * M * N, limit.window_bytes)


def gemm_windows(a_view: StridedView, b_view: StridedView, bias_view: StridedView | None, q8_0: bool,
                 limit: BindingLimit, label: str, *, tile_mn: int, tile_k: int) -> tuple[int, int, int]:
    """(rows of M, columns of N, steps of K) per window, the largest whose A, B, C (contiguous [M, N]) and
    bias windows each fit `limit`: each operand's window shrinks along its slower-varying dim first (W^T's
    vocabulary rows, the logits' rows, W's rows), then to whole tiles of the GEMM (`tile_mn` rows /
    columns, `tile_k` steps)."""
    (M, K), N = a_view.sizes, b_view.sizes[1]
    fp32_budget, b_budget = operand_budgets(q8_0, limit)
    window = {"m": M, "n": N, "k": K}
    operands = [(a_view, ("m", "k"), fp32_budget), (b_view, ("k", "n"), b_budget),
                (StridedView.contiguous((M, N)), ("m", "n"), fp32_budget)]
    if bias_view is not None:
        operands.append((bias_view, ("m", "n"), fp32_budget))
    for _ in range(2 * len(operands)):  # each pass only shrinks windows: a few passes settle it (checked below)
        settled = True
        for view, dims, budget in operands:
            if window_elements(view, window[dims[0]], window[dims[1]]) <= budget:
                continue
            settled = False
            slow, fast = (0, 1) if view.strides[0] >= view.strides[1] else (1, 0)
            room = budget - 1 - (window[dims[fast]] - 1) * view.strides[fast]
            if room >= 0:
                window[dims[slow]] = min(window[dims[slow]], room // view.strides[slow] + 1)
            else:
                window[dims[slow]] = 1
                window[dims[fast]] = (budget - 1) // view.strides[fast] + 1
        if settled:
            break
    for dim, step, whole in (("m", tile_mn, M), ("n", tile_mn, N), ("k", tile_k, K)):
        if step <= window[dim] < whole:
            window[dim] -= window[dim] % step
    count = ceil_div(M, window["m"]) * ceil_div(N, window["n"]) * ceil_div(K, window["k"])
    unfit = [view.sizes for view, dims, budget in operands if window_elements(view, *map(window.get, dims)) > budget]
    if count > MAX_GEMM_WINDOWS or unfit:
        raise limit.refusal(label, f"a [{M}, {K}] @ [{K}, {N}] GEMM in {count} windows (at most {MAX_GEMM_WINDOWS})",
                            max(4 * a_view.extent(), 4 * M * N))
    return window["m"], window["n"], window["k"]


def window_view(buffer: Any, view: StridedView, row: int, column: int, rows: int, columns: int, access: str,
                 limit: BindingLimit) -> tuple[BufferBinding, StridedView]:
    """The binding and view of the [rows, columns] window of a float32 2-D `view` at (row, column)."""
    first = view.offset + row * view.strides[0] + column * view.strides[1]
    span = window_elements(view, rows, columns)
    bound, skipped = sub_binding(buffer, 4 * first, 4 * (first + span), access, limit.alignment)
    return bound, StridedView((rows, columns), view.strides, skipped // 4)


def q8_0_window(codes: Any, scales: Any, view: StridedView, row: int, column: int, rows: int, columns: int,
                 limit: BindingLimit, label: str) -> tuple[BufferBinding, BufferBinding, StridedView]:
    """Codes binding, scales binding and view of a window of a Q8_0 B: both bindings start at the block of
    the window's first code, a multiple of limit.q8_0_window_start codes, so its element e's scale is scale e / 32."""
    first = view.offset + row * view.strides[0] + column * view.strides[1]
    end = first + window_elements(view, rows, columns)
    start = first - first % limit.q8_0_window_start
    codes_bound, codes_skip = sub_binding(codes, start, ceil_div(end, 4) * 4, "r", limit.alignment)
    scales_bound, scales_skip = sub_binding(scales, 4 * (start // Q8_0_BLOCK_VALUES),
                                            4 * ceil_div(end, Q8_0_BLOCK_VALUES), "r", limit.alignment)
    if codes_skip or scales_skip:
        raise KernelArgumentError(f"{label}: a Q8_0 B split into windows needs its codes and scales bound at offsets "
                                  f"aligned to {limit.alignment} bytes")
    return codes_bound, scales_bound, StridedView((rows, columns), view.strides, first - start)

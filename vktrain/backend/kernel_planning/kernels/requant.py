"""The requant family: q4gsw_requant, straight-through re-quantization of a latent weight.

    q = clamp(round_half_to_even(latent[n, k] / scales[k // group_size, n]), -8, 7); zero scale -> q = 0

Output layout: unlike the op library's CPU reference, which returns the flat uint8 [N, Kp/2] layout, the
GPU kernel writes the W_4X8 uint32 words (docs/spec/w4x8.md) that linear_q4gsw reads, so the result
feeds the next step's forward with no repacking. The codes are the same: `vktrain.quant.pack_w4x8`
maps the flat result to these words. Padding rows (n >= N when N % 8 == 4) and padding columns
(k >= K when K % 8 == 4) hold code 8, as pack_w4x8 writes them.

Rounding: roundEven of the fp32 quotient. Vulkan allows division 2.5 ulp from correctly rounded, so on
a GPU whose division is not correctly rounded a quotient within a few ulp of a .5 boundary may take
the neighbouring code (lavapipe divides correctly; power-of-two scales divide exactly everywhere).
"""
from __future__ import annotations

from typing import Any

from vktrain.quant import check_q4gsw_shapes, w4x8_num_words

from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.dispatch import ceil_div, pack_push
from vktrain.serialization.strided_view import MAX_ELEMENTS, KernelArgumentError
from vktrain.backend.kernel_planning.kernels.layout import binding, check_positive_ints
from vktrain.backend.kernel_planning.kernels.registry import register_kernel

DEFAULT_WORKGROUP_SIZE = 128  # Vulkan guarantees at least 128 invocations per workgroup


def requant_output_nbytes(N: int, K: int) -> int:
    """Bytes of the W_4X8 buffer q4gsw_requant writes for an [N, K] weight."""
    return 4 * w4x8_num_words(N, K)


@register_kernel("vktrain.q4gsw_requant.default")
def plan_q4gsw_requant(*, N: int, K: int, group_size: int, out: Any, latent: Any, scales: Any,
                       workgroup_size: int = DEFAULT_WORKGROUP_SIZE,
                       label: str = "q4gsw_requant") -> list[Dispatch]:
    """Dispatch re-quantizing latent [N, K] with scales [G, N] into W_4X8 words.

    Buffers (keys of the Program's buffer mapping, Buffer objects or BufferBindings):
      out     uint32 W_4X8 words, `requant_output_nbytes(N, K)` bytes (written)
      latent  fp32 [N, K], contiguous
      scales  fp32 [G, N], G = K // group_size
    """
    check_positive_ints("q4gsw_requant", N=N, K=K, group_size=group_size, workgroup_size=workgroup_size)
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as exc:
        raise KernelArgumentError(f"q4gsw_requant: {exc}") from None
    words = w4x8_num_words(N, K)
    # W_4X8 pads N to a multiple of 8, so for N % 8 == 4 it is larger than the flat [N, Kp/2] tensor the
    # op library returns: an output sized for the flat layout would be written past its end.
    if isinstance(out, BufferBinding) and out.size is not None and out.size < 4 * words:
        raise KernelArgumentError(
            f"q4gsw_requant: out binds {out.size} bytes but the W_4X8 words of an [N={N}, K={K}] weight take "
            f"{4 * words} (requant_output_nbytes); the flat uint8 [N, Kp/2] size is too small when N % 8 == 4")
    if max(N * K, words) > MAX_ELEMENTS:  # the shader indexes latent elements and output words with uint32
        raise KernelArgumentError(
            f"q4gsw_requant: weight [N={N}, K={K}] exceeds the kernel's 32-bit indexing "
            f"(at most {MAX_ELEMENTS} elements)")
    return [Dispatch(
        "q4gsw_requant", groups=(ceil_div(words, workgroup_size), 1, 1),
        bindings=(binding(latent, "r"), binding(scales, "r"), binding(out, "w")),
        push_constants=pack_push(N, K, group_size), local_size=(workgroup_size, 1, 1), label=label)]

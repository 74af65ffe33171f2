"""q4gsw quantization and weight layouts (numpy): the one source of truth.

Shaders, the serializer, the op library's CPU references and the tests all follow the functions here;
nothing else re-implements a layout. Spec: docs/spec/w4x8.md.
"""
from .q4gsw import (
    CODE_ZERO,
    QMAX,
    QMIN,
    SCALE_RULES,
    check_q4gsw_shapes,
    dequantize,
    num_groups,
    pack_flat,
    padded_k,
    quantize,
    requant,
    unpack_flat,
)
from .w4x8 import decode_w4x8_element, pack_w4x8, unpack_w4x8, w4x8_num_words

__all__ = [
    "CODE_ZERO", "QMAX", "QMIN", "SCALE_RULES", "check_q4gsw_shapes", "dequantize", "num_groups", "pack_flat",
    "padded_k", "quantize", "requant", "unpack_flat", "decode_w4x8_element", "pack_w4x8",
    "unpack_w4x8", "w4x8_num_words",
]

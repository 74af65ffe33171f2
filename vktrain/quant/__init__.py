"""q4gsw quantization and the weight layouts (numpy, q4gsw and Q8_0): the one source of truth.

Shaders, the serializer, the op library's CPU references and the tests all follow the functions here;
nothing else re-implements a layout. Specs: docs/spec/w4x8.md, docs/spec/q8_0.md.
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
from .q8_0 import (GGUF_Q8_0_BLOCK, Q8_0_BLOCK_VALUES, Q8_0_CODES_SUFFIX, Q8_0_SCALES_SUFFIX, dequantize_q8_0,
                   q8_0_device_arrays, q8_0_num_scales)
from .w4x8 import decode_w4x8_element, pack_w4x8, unpack_w4x8, w4x8_num_words

__all__ = [
    "CODE_ZERO", "QMAX", "QMIN", "SCALE_RULES", "check_q4gsw_shapes", "dequantize", "num_groups", "pack_flat",
    "padded_k", "quantize", "requant", "unpack_flat", "decode_w4x8_element", "pack_w4x8",
    "unpack_w4x8", "w4x8_num_words", "GGUF_Q8_0_BLOCK", "Q8_0_BLOCK_VALUES", "Q8_0_CODES_SUFFIX",
    "Q8_0_SCALES_SUFFIX", "dequantize_q8_0",
    "q8_0_device_arrays", "q8_0_num_scales",
]

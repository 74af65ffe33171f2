// Per-tensor operand scales of the tensor-core kernels (coopmat_gemm.glsl's A_SCALE / AB_SCALE,
// coopmat_attention_bwd.comp): an operand is multiplied by the power of two 2^e that puts its largest
// magnitude in [2^14, 2^15) before its fp16 rounding, and the result by the inverse (both exact).
// coopmat_absmax.slang wrote the per-workgroup maxima of |x| (as float bits: non-negative floats order
// like their bit patterns) of one or two operands; every workgroup reduces them itself.
// The includer declares first: NUM_THREADS (its workgroup size) and the buffer partial_absmax_bits[]
// (uint) holding the first operand's partials, then the second's.
#ifndef VKTRAIN_COOPMAT_SCALE_GLSL
#define VKTRAIN_COOPMAT_SCALE_GLSL

// The exponents are clamped to [-SCALE_EXPONENT_LIMIT, SCALE_EXPONENT_LIMIT] so that any product of two
// inverses is a normal fp32 number.
#define SCALE_EXPONENT_LIMIT 60

shared uint operand_absmax[2];  // max |first|, max |second| as float bits, reduced from the partials

// operand_absmax = the uint max of the partials (`first_partials` of the first operand, then
// `second_partials` of the second), by every thread of the workgroup; ends with a barrier.
void reduce_partials(uint first_partials, uint second_partials) {
    const uint tid = gl_LocalInvocationID.x;
    if (tid < 2u) operand_absmax[tid] = 0u;
    barrier();
    uint first_bits = 0u, second_bits = 0u;
    for (uint i = tid; i < first_partials; i += NUM_THREADS) first_bits = max(first_bits, partial_absmax_bits[i]);
    for (uint i = tid; i < second_partials; i += NUM_THREADS) {
        second_bits = max(second_bits, partial_absmax_bits[first_partials + i]);
    }
    atomicMax(operand_absmax[0], first_bits);
    atomicMax(operand_absmax[1], second_bits);
    barrier();
}

// The exponent e of the scale 2^e of an operand whose largest magnitude has these float bits: max * 2^e
// in [2^14, 2^15); 0 for an all-zero or non-finite operand (no scale: zeros stay zeros, inf and NaN
// propagate).
int scale_exponent(uint absmax_bits) {
    if (absmax_bits == 0u || absmax_bits >= 0x7f800000u) return 0;
    const int exponent = int(absmax_bits >> 23) - 127;  // floor(log2(max)); -127 for fp32 subnormals
    return clamp(14 - exponent, -SCALE_EXPONENT_LIMIT, SCALE_EXPONENT_LIMIT);
}

#endif

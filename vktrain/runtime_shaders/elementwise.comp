#version 450
// Elementwise unary and binary fp32 ops with N-d broadcasting (host module:
// vktrain/runtime/delegate/kernels/elementwise.py).
//
// Variants (#define): ARITY=1 (out = f(a)) or ARITY=2 (out = f(a, b)).
// The op is a specialization constant (OP, id 3), so one SPIR-V per arity serves every op and the
// driver folds the switch away when it builds the pipeline.
//
// The output is contiguous. Each input is addressed through per-dim element strides (0 on a
// broadcast dim) plus an element offset, so broadcasting, expanded views and transposed inputs all
// read in place. Dims are stored innermost first; the host merges dims that are contiguous in every
// operand, so `rank` is usually 1 or 2.
// VEC4 (with ARITY=1 or 2): every operand is the same contiguous run of `numel` floats (rank 1 after
// merging, unit strides), numel and the offsets multiples of 4: no index arithmetic, and each
// invocation applies the op to VEC4_PER_THREAD vec4s, WORKGROUP_SIZE vec4s apart (coalesced), one
// component at a time through the same functions, so the results are the scalar variant's bits.
// (The residual adds and SwiGLU / norm products of a training step: bound by memory bandwidth.)
// vktrain-variants: ARITY=1, ARITY=2, ARITY=1+VEC4, ARITY=2+VEC4
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "codes.glsl"

#ifndef ARITY
#define ARITY 2
#endif
#define MAX_RANK 6
#ifdef VEC4
#define WORKGROUP_SIZE 256
#define VEC4_PER_THREAD 4
#else
#define WORKGROUP_SIZE 64
#endif

layout(local_size_x = WORKGROUP_SIZE) in;

// Op codes: EW_UNARY_* / EW_BINARY_* of codes.glsl, generated from UNARY_OPS / BINARY_OPS in elementwise.py.
layout(constant_id = 3) const uint OP = 0;

#ifdef VEC4
#define ELEMENT vec4
#else
#define ELEMENT float
#endif
layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { ELEMENT out_data[]; };
layout(std430, set = 0, binding = 1) readonly buffer ABuffer { ELEMENT a_data[]; };
#if ARITY == 2
layout(std430, set = 0, binding = 2) readonly buffer BBuffer { ELEMENT b_data[]; };
#endif

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint numel;
    uint rank;
    float scalar0;   // alpha (add/sub), the scalar (mul.Scalar), threshold, exponent
    float scalar1;
    uint a_offset;
    uint b_offset;
    uint sizes[MAX_RANK];
    uint a_strides[MAX_RANK];
    uint b_strides[MAX_RANK];
    // A window of a split op (kernels/elementwise_windows.py): invocation i computes output element
    // window_start + i (its coordinates), stored at out_offset + i of the output binding; numel counts the window.
    uint window_start;
    uint out_offset;
} params;

const float SQRT1_2 = 0.70710678118654752;
const float INV_SQRT_2PI = 0.39894228040143268;
const float SQRT_2_OVER_PI = 0.79788456080286536;
const float GELU_TANH_COEFF = 0.044715;

// exp(a) without the error a plain exp() makes for large |a|: drivers evaluate exp2(a * log2(e)), and
// rounding that product costs ~|a| * 2^-24 relative (4e-6 at a = -60). Cody-Waite reduction instead:
// a = n ln2 + r with |r| <= ln2 / 2, ln2 split so that n * LN2_HI is exact; exp(a) = 2^n exp(r).
const float LOG2E = 1.4426950408889634;
const float LN2_HI = 0.693145751953125;        // 16 significant bits: n * LN2_HI exact for |n| < 256
const float LN2_LO = 1.428606765330187e-06;
float exp_accurate(float a) {
    if (isnan(a)) return a;
    if (a < -104.0) return 0.0;                 // below the smallest denormal
    if (a > 88.8) return uintBitsToFloat(0x7f800000u);
    float n = round(a * LOG2E);
    float r = fma(-n, LN2_LO, fma(-n, LN2_HI, a));
    // ldexp in two steps so that 2^n never overflows on its own for results near the denormal range.
    int half_n = int(n) / 2;
    return ldexp(ldexp(exp(r), half_n), int(n) - half_n);
}

// exp(-x * x / 2) with the square computed exactly: s keeps the top 12 bits of x so s * s is exact
// in fp32, and x * x = s * s + (x - s) * (x + s) with the small remainder in a second, tiny exponent.
// (Scaling x by 1/sqrt(2) first would round, and erfc's condition number 2 z^2 would amplify it.)
float exp_neg_half_square(float x) {
    float ax = abs(x);
    if (isinf(ax)) return 0.0;
    float s = uintBitsToFloat(floatBitsToUint(ax) & 0xfffff000u);
    return exp_accurate(-0.5 * (s * s)) * exp(-0.5 * (ax - s) * (ax + s));
}

// erfc(x / sqrt(2)) with fractional error ~1e-6 over the whole real line: the Chebyshev fit of
// Numerical Recipes' "erfcc" (fractional error < 1.2e-7), with exp(-z^2) evaluated exactly in x.
// Computing gelu as 0.5 * x * erfc(-x / sqrt(2)) instead of 0.5 * x * (1 + erf(...)) avoids the
// cancellation that makes 1 + erf lose all digits for x << 0.
float erfc_scaled(float x) {
    float z = abs(x) * SQRT1_2;
    float t = 1.0 / (1.0 + 0.5 * z);
    float poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
                 t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
                 t * (-0.82215223 + t * 0.17087277))))))));
    float r = t * exp_neg_half_square(x) * exp(poly);
    return x >= 0.0 ? r : 2.0 - r;
}

float sigmoid(float x) {
    return 1.0 / (1.0 + exp_accurate(-x));
}

// torch.pow(x, e). GLSL pow() is undefined for x < 0 and for x == 0 with e <= 0, and loses accuracy
// through exp2(e * log2(x)); common exponents get exact forms, the IEEE special cases are explicit.
float pow_real(float x, float e) {
    if (e == 2.0) return x * x;
    if (e == 1.0) return x;
    if (e == 0.0 || x == 1.0) return 1.0;       // also for NaN, as in IEEE pow and torch
    if (e == 3.0) return x * x * x;
    if (e == 0.5) return sqrt(x);
    if (e == -0.5) return inversesqrt(x);
    if (e == -1.0) return 1.0 / x;
    if (isnan(x) || isnan(e)) return uintBitsToFloat(0x7fc00000u);
    bool integral = floor(e) == e;
    bool odd = integral && mod(e, 2.0) == 1.0;
    if (x == 0.0) {                              // signed zero / infinity for odd integral powers
        if (e > 0.0) return odd ? x : 0.0;
        return odd ? 1.0 / x : uintBitsToFloat(0x7f800000u);
    }
    float magnitude = pow(abs(x), e);
    if (x > 0.0) return magnitude;
    if (!integral) return uintBitsToFloat(0x7fc00000u);  // negative base, fractional power
    return odd ? -magnitude : magnitude;
}

// erf(x): a Taylor series near 0, where 1 - erfc(x) would cancel, and 1 - erfc beyond
// (erfc(0.5) = 0.48, so the subtraction loses at most one bit there).
float erf_accurate(float x) {
    if (abs(x) < 0.5) {
        float z = x * x;
        // 2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1)), n <= 6: truncation < 1e-9 relative.
        float series = 1.0 + z * (-1.0 / 3.0 + z * (1.0 / 10.0 + z * (-1.0 / 42.0 + z * (1.0 / 216.0 +
                       z * (-1.0 / 1320.0 + z * (1.0 / 9360.0))))));
        return 1.1283791670955126 * x * series;
    }
    return 1.0 - erfc_scaled(x * 1.4142135623730951);
}

// tanh(x): its Taylor series for |x| < 0.4 (where (e^2x - 1) / (e^2x + 1) would cancel; the omitted
// x^15 term is < 1e-8 relative there), else 1 - 2 / (e^2|x| + 1) with the sign restored.
float tanh_accurate(float x) {
    float ax = abs(x);
    if (ax < 0.4) {
        float z = x * x;
        float series = 1.0 + z * (-1.0 / 3.0 + z * (2.0 / 15.0 + z * (-17.0 / 315.0 + z * (62.0 / 2835.0 +
                       z * (-1382.0 / 155925.0 + z * (21844.0 / 6081075.0))))));
        return x * series;
    }
    float t = 1.0 - 2.0 / (exp_accurate(2.0 * ax) + 1.0);
    return x < 0.0 ? -t : t;
}

// log(x) = k ln2 + log(m) with m in [sqrt(1/2), sqrt(2)), and log(m) = 2 atanh(s), s = (m-1)/(m+1),
// |s| < 0.172, as an odd series (terms beyond s^11 are < 1e-9 relative). m - 1 is exact (Sterbenz),
// so log stays relatively accurate near x = 1, where drivers' log() only promises 2^-21 absolute.
float log_accurate(float x) {
    if (isnan(x) || x < 0.0) return uintBitsToFloat(0x7fc00000u);
    if (x == 0.0) return uintBitsToFloat(0xff800000u);
    if (isinf(x)) return x;
    int k;
    int denormal_shift = 0;
    if (x < 1.17549435e-38) {                    // denormal: scale into the normal range exactly
        x *= 16777216.0;
        denormal_shift = 24;
    }
    float m = frexp(x, k);                       // x = m 2^k, m in [0.5, 1)
    k -= denormal_shift;
    if (m < 0.70710678118654752) {
        m *= 2.0;
        k -= 1;
    }
    float s = (m - 1.0) / (m + 1.0);
    float z = s * s;
    float log_m = 2.0 * s * (1.0 + z * (1.0 / 3.0 + z * (1.0 / 5.0 + z * (1.0 / 7.0 + z * (1.0 / 9.0 +
                  z * (1.0 / 11.0))))));
    float kf = float(k);
    return kf * LN2_HI + (kf * LN2_LO + log_m);
}

float gelu_erf_grad(float x) {
    return 0.5 * erfc_scaled(-x) + x * INV_SQRT_2PI * exp_neg_half_square(x);
}

// 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no cancellation for x << 0.
float gelu_tanh(float x) {
    float u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x);
    return x * sigmoid(2.0 * u);
}

float gelu_tanh_grad(float x) {
    float u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x);
    float du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_COEFF * x * x);
    float s = sigmoid(2.0 * u);
    return s + x * 2.0 * du * s * (1.0 - s);
}

#if ARITY == 1
float apply(float a) {
    switch (OP) {
        case EW_UNARY_ADD_SCALAR: return a + params.scalar0;            // add.Scalar (host folds alpha * other)
        case EW_UNARY_MUL_SCALAR: return a * params.scalar0;            // mul.Scalar
        case EW_UNARY_NEG: return -a;                            // neg
        case EW_UNARY_RELU: return a > 0.0 ? a : (isnan(a) ? a : 0.0);   // relu (propagates NaN like torch)
        case EW_UNARY_GELU: return 0.5 * a * erfc_scaled(-a);  // gelu, approximate="none"
        case EW_UNARY_GELU_TANH: return gelu_tanh(a);                  // gelu, approximate="tanh"
        case EW_UNARY_SILU: return a / (1.0 + exp_accurate(-a));  // silu
        case EW_UNARY_SIGMOID: return sigmoid(a);                    // sigmoid
        case EW_UNARY_EXP: return exp_accurate(a);               // exp
        case EW_UNARY_RSQRT: return inversesqrt(a);                // rsqrt
        case EW_UNARY_POW_SCALAR: return pow_real(a, params.scalar0);  // pow.Tensor_Scalar
        case EW_UNARY_SQRT: return sqrt(a);                      // sqrt
        case EW_UNARY_RSUB_SCALAR: return params.scalar0 - params.scalar1 * a;  // rsub.Scalar(other=s0, alpha=s1)
        case EW_UNARY_DIV_SCALAR: return a / params.scalar0;           // div.Scalar
        case EW_UNARY_TANH: return tanh_accurate(a);             // tanh
        case EW_UNARY_ERF: return erf_accurate(a);              // erf
        case EW_UNARY_LOG: return log_accurate(a);              // log
        case EW_UNARY_RECIPROCAL: return 1.0 / a;                      // reciprocal
        case EW_UNARY_ABS: return abs(a);                       // abs
        default: return uintBitsToFloat(0x7fc00000u);
    }
}
#else
float apply(float a, float b) {
    switch (OP) {
        case EW_BINARY_ADD: return a + params.scalar0 * b;        // add.Tensor (scalar0 = alpha)
        case EW_BINARY_SUB: return a - params.scalar0 * b;        // sub.Tensor (scalar0 = alpha)
        case EW_BINARY_MUL: return a * b;                         // mul.Tensor
        case EW_BINARY_DIV: return a / b;                         // div.Tensor (true division)
        case EW_BINARY_THRESHOLD_BACKWARD: return b <= params.scalar0 ? 0.0 : a; // threshold_backward(grad=a, self=b, threshold)
        case EW_BINARY_GELU_BACKWARD: return a * gelu_erf_grad(b);          // gelu_backward(grad=a, self=b), "none"
        case EW_BINARY_GELU_TANH_BACKWARD: return a * gelu_tanh_grad(b);         // gelu_backward(grad=a, self=b), "tanh"
        case EW_BINARY_SILU_BACKWARD: {                                     // silu_backward(grad=a, self=b)
            float s = sigmoid(b);
            return a * s * (1.0 + b * (1.0 - s));
        }
        case EW_BINARY_SIGMOID_BACKWARD: return a * b * (1.0 - b);             // sigmoid_backward(grad=a, output=b)
        case EW_BINARY_MAXIMUM: return max(a, b);                     // maximum (NaN handled below)
        case EW_BINARY_MINIMUM: return min(a, b);                    // minimum
        case EW_BINARY_TANH_BACKWARD: return a * (1.0 - b * b);            // tanh_backward(grad=a, output=b)
        case EW_BINARY_POW: return pow_real(a, b);               // pow.Tensor_Tensor
        default: return uintBitsToFloat(0x7fc00000u);
    }
}
#endif

#if ARITY == 2
float binary_result(float a, float b) {
    float result = apply(a, b);
    if ((OP == EW_BINARY_MAXIMUM || OP == EW_BINARY_MINIMUM) && (isnan(a) || isnan(b))) {
        result = uintBitsToFloat(0x7fc00000u);  // torch.maximum / minimum propagate NaN
    }
    return result;
}
#endif

#ifdef VEC4
void main() {
    const uint count4 = params.numel / 4u;
    const uint first = VKTRAIN_GLOBAL_GROUP_ID(params).x * (WORKGROUP_SIZE * VEC4_PER_THREAD) + gl_LocalInvocationID.x;
    [[unroll]] for (uint j = 0u; j < VEC4_PER_THREAD; ++j) {
        const uint v = first + j * WORKGROUP_SIZE;
        if (v < count4) {
            const vec4 a = a_data[(params.a_offset + params.window_start) / 4u + v];
#if ARITY == 2
            const vec4 b = b_data[(params.b_offset + params.window_start) / 4u + v];
            out_data[params.out_offset / 4u + v] = vec4(binary_result(a.x, b.x), binary_result(a.y, b.y),
                                                 binary_result(a.z, b.z), binary_result(a.w, b.w));
#else
            out_data[params.out_offset / 4u + v] = vec4(apply(a.x), apply(a.y), apply(a.z), apply(a.w));
#endif
        }
    }
}
#else
void main() {
    uint index = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (index >= params.numel) {
        return;
    }
    uint rest = params.window_start + index;
    uint a_index = params.a_offset;
#if ARITY == 2
    uint b_index = params.b_offset;
#endif
    // Unrolled over MAX_RANK with guards: index math without loop trips.
    [[unroll]] for (uint d = 0u; d < MAX_RANK; ++d) {
        if (d < params.rank) {
            uint size = params.sizes[d];
            uint coord = rest % size;
            rest /= size;
            a_index += coord * params.a_strides[d];
#if ARITY == 2
            b_index += coord * params.b_strides[d];
#endif
        }
    }
#if ARITY == 1
    out_data[params.out_offset + index] = apply(a_data[a_index]);
#else
    out_data[params.out_offset + index] = binary_result(a_data[a_index], b_data[b_index]);
#endif
}
#endif

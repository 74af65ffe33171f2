// Elementwise unary and binary fp32 ops with N-d broadcasting (GLSL reference: ../elementwise.comp, whose
// accurate exp / erfc / tanh / log / pow forms are mirrored here; host module: kernels/elementwise.py).
// ARITY=1: out = f(a); ARITY=2: out = f(a, b). The op is override OP (id 3): the EW_UNARY_* / EW_BINARY_*
// codes of ../codes.glsl (generated from UNARY_OPS / BINARY_OPS in elementwise.py), included below.
// Each input is addressed through per-dim element strides (0 on a broadcast dim) plus an element offset;
// the output is contiguous. VEC4: every operand one contiguous, 16-byte aligned run of numel floats,
// each invocation VEC4_PER_THREAD vec4s WORKGROUP_SIZE apart, per component through the same functions.
// vktrain-variants: ARITY=1, ARITY=2, ARITY=1+VEC4, ARITY=2+VEC4

#if VEC4
const WORKGROUP_SIZE = 256u;
const VEC4_PER_THREAD = 4u;
#else
const WORKGROUP_SIZE = 64u;
#endif
const MAX_RANK = 6u;

#include "codes.glsl"
@id(3) override OP: u32 = 0u;

#if VEC4
@group(0) @binding(0) var<storage, read_write> out_data: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> a_data: array<vec4<f32>>;
#else
@group(0) @binding(0) var<storage, read_write> out_data: array<f32>;
@group(0) @binding(1) var<storage, read> a_data: array<f32>;
#endif
// The GLSL's sizes[6], a_strides[6], b_strides[6] as scalars (dim 0 innermost).
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,
    rank: u32,
    scalar0: f32,  // alpha (add/sub), the scalar (mul.Scalar), threshold, exponent
    scalar1: f32,
    a_offset: u32,
    b_offset: u32,
    size0: u32, size1: u32, size2: u32, size3: u32, size4: u32, size5: u32,
    a_stride0: u32, a_stride1: u32, a_stride2: u32, a_stride3: u32, a_stride4: u32, a_stride5: u32,
    b_stride0: u32, b_stride1: u32, b_stride2: u32, b_stride3: u32, b_stride4: u32, b_stride5: u32,
    // A window of a split op: invocation i computes output element window_start + i, stored at out_offset + i.
    window_start: u32,
    out_offset: u32,
}
#if ARITY == 2
#if VEC4
@group(0) @binding(2) var<storage, read> b_data: array<vec4<f32>>;
#else
@group(0) @binding(2) var<storage, read> b_data: array<f32>;
#endif
@group(0) @binding(3) var<uniform> params: Params;
#else
@group(0) @binding(2) var<uniform> params: Params;
#endif
fn scalar0() -> f32 { return params.scalar0; }
fn scalar1() -> f32 { return params.scalar1; }

const SQRT1_2 = 0.70710678118654752;
const INV_SQRT_2PI = 0.39894228040143268;
const SQRT_2_OVER_PI = 0.79788456080286536;
const GELU_TANH_COEFF = 0.044715;
const LOG2E = 1.4426950408889634;
const LN2_HI = 0.693145751953125;   // 16 significant bits: n * LN2_HI exact for |n| < 256
const LN2_LO = 1.428606765330187e-06;

// NaN and infinity by their bits: WGSL lets a compiler assume neither occurs in float arithmetic.
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn is_inf(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }
fn nan() -> f32 { return bitcast<f32>(0x7fc00000u); }
fn pos_inf() -> f32 { return bitcast<f32>(0x7f800000u); }

// exp(a) with Cody-Waite reduction: a = n ln2 + r, exp(a) = 2^n exp(r) (a plain exp loses ~|a| ulp).
fn exp_accurate(a: f32) -> f32 {
    if (is_nan(a)) { return a; }
    if (a < -104.0) { return 0.0; }
    if (a > 88.8) { return pos_inf(); }
    let n = round(a * LOG2E);
    let r = fma(-n, LN2_LO, fma(-n, LN2_HI, a));
    let half_n = i32(n) / 2;
    return ldexp(ldexp(exp(r), half_n), i32(n) - half_n);
}

// exp(-x * x / 2) with the square split exactly (s keeps the top 12 bits of |x|).
fn exp_neg_half_square(x: f32) -> f32 {
    let ax = abs(x);
    if (is_inf(ax)) { return 0.0; }
    let s = bitcast<f32>(bitcast<u32>(ax) & 0xfffff000u);
    return exp_accurate(-0.5 * (s * s)) * exp(-0.5 * (ax - s) * (ax + s));
}

// erfc(x / sqrt(2)), fractional error ~1e-6 (Numerical Recipes' erfcc with the exact square above).
fn erfc_scaled(x: f32) -> f32 {
    let z = abs(x) * SQRT1_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
               t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
               t * (-0.82215223 + t * 0.17087277))))))));
    let r = t * exp_neg_half_square(x) * exp(poly);
    return select(2.0 - r, r, x >= 0.0);
}

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp_accurate(-x)); }

// torch.pow(x, e) with the IEEE special cases explicit (WGSL pow is undefined for x < 0).
fn pow_real(x: f32, e: f32) -> f32 {
    if (e == 2.0) { return x * x; }
    if (e == 1.0) { return x; }
    if (e == 0.0 || x == 1.0) { return 1.0; }
    if (e == 3.0) { return x * x * x; }
    if (e == 0.5) { return sqrt(x); }
    if (e == -0.5) { return inverseSqrt(x); }
    if (e == -1.0) { return 1.0 / x; }
    if (is_nan(x) || is_nan(e)) { return nan(); }
    let integral = floor(e) == e;
    let odd = integral && (e - 2.0 * floor(e * 0.5)) == 1.0;
    if (x == 0.0) {
        if (e > 0.0) { return select(0.0, x, odd); }
        return select(pos_inf(), 1.0 / x, odd);
    }
    let magnitude = pow(abs(x), e);
    if (x > 0.0) { return magnitude; }
    if (!integral) { return nan(); }
    return select(magnitude, -magnitude, odd);
}

// erf(x): Taylor series near 0, 1 - erfc beyond.
fn erf_accurate(x: f32) -> f32 {
    if (abs(x) < 0.5) {
        let z = x * x;
        let series = 1.0 + z * (-1.0 / 3.0 + z * (1.0 / 10.0 + z * (-1.0 / 42.0 + z * (1.0 / 216.0 +
                     z * (-1.0 / 1320.0 + z * (1.0 / 9360.0))))));
        return 1.1283791670955126 * x * series;
    }
    return 1.0 - erfc_scaled(x * 1.4142135623730951);
}

// tanh(x): Taylor series for |x| < 0.4, else 1 - 2 / (e^2|x| + 1) with the sign restored.
fn tanh_accurate(x: f32) -> f32 {
    let ax = abs(x);
    if (ax < 0.4) {
        let z = x * x;
        let series = 1.0 + z * (-1.0 / 3.0 + z * (2.0 / 15.0 + z * (-17.0 / 315.0 + z * (62.0 / 2835.0 +
                     z * (-1382.0 / 155925.0 + z * (21844.0 / 6081075.0))))));
        return x * series;
    }
    let t = 1.0 - 2.0 / (exp_accurate(2.0 * ax) + 1.0);
    return select(t, -t, x < 0.0);
}

// log(x) = k ln2 + 2 atanh((m - 1) / (m + 1)), m in [sqrt(1/2), sqrt(2)).
fn log_accurate(x_in: f32) -> f32 {
    var x = x_in;
    if (is_nan(x) || x < 0.0) { return nan(); }
    if (x == 0.0) { return -pos_inf(); }
    if (is_inf(x)) { return x; }
    var denormal_shift = 0;
    if (x < 1.17549435e-38) {
        x *= 16777216.0;
        denormal_shift = 24;
    }
    let parts = frexp(x);
    var m = parts.fract;
    var k = parts.exp - denormal_shift;
    if (m < 0.70710678118654752) {
        m *= 2.0;
        k -= 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    let log_m = 2.0 * s * (1.0 + z * (1.0 / 3.0 + z * (1.0 / 5.0 + z * (1.0 / 7.0 + z * (1.0 / 9.0 +
                z * (1.0 / 11.0))))));
    let kf = f32(k);
    return kf * LN2_HI + (kf * LN2_LO + log_m);
}

fn gelu_erf_grad(x: f32) -> f32 {
    return 0.5 * erfc_scaled(-x) + x * INV_SQRT_2PI * exp_neg_half_square(x);
}

fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x);
    return x * sigmoid(2.0 * u);
}

fn gelu_tanh_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_COEFF * x * x);
    let s = sigmoid(2.0 * u);
    return s + x * 2.0 * du * s * (1.0 - s);
}

#if ARITY == 2
fn apply(a: f32, b: f32) -> f32 {
    switch (OP) {
        case EW_BINARY_ADD: { return a + scalar0() * b; }                      // add.Tensor (scalar0 = alpha)
        case EW_BINARY_SUB: { return a - scalar0() * b; }                      // sub.Tensor
        case EW_BINARY_MUL: { return a * b; }                                  // mul.Tensor
        case EW_BINARY_DIV: { return a / b; }                                  // div.Tensor
        case EW_BINARY_THRESHOLD_BACKWARD: { return select(a, 0.0, b <= scalar0()); }         // threshold_backward(grad=a, self=b)
        case EW_BINARY_GELU_BACKWARD: { return a * gelu_erf_grad(b); }                   // gelu_backward, "none"
        case EW_BINARY_GELU_TANH_BACKWARD: { return a * gelu_tanh_grad(b); }                  // gelu_backward, "tanh"
        case EW_BINARY_SILU_BACKWARD: {                                                  // silu_backward(grad=a, self=b)
            let s = sigmoid(b);
            return a * s * (1.0 + b * (1.0 - s));
        }
        case EW_BINARY_SIGMOID_BACKWARD: { return a * b * (1.0 - b); }                      // sigmoid_backward(grad=a, output=b)
        case EW_BINARY_MAXIMUM: { return max(a, b); }                              // maximum (NaN below)
        case EW_BINARY_MINIMUM: { return min(a, b); }                             // minimum
        case EW_BINARY_TANH_BACKWARD: { return a * (1.0 - b * b); }                     // tanh_backward(grad=a, output=b)
        case EW_BINARY_POW: { return pow_real(a, b); }                        // pow.Tensor_Tensor
        default: { return nan(); }
    }
}
#else
fn apply(a: f32) -> f32 {
    switch (OP) {
        case EW_UNARY_ADD_SCALAR: { return a + scalar0(); }                          // add.Scalar
        case EW_UNARY_MUL_SCALAR: { return a * scalar0(); }                          // mul.Scalar
        case EW_UNARY_NEG: { return -a; }                                     // neg
        case EW_UNARY_RELU: { return select(select(0.0, a, is_nan(a)), a, a > 0.0); }  // relu (NaN propagates)
        case EW_UNARY_GELU: { return 0.5 * a * erfc_scaled(-a); }              // gelu, "none"
        case EW_UNARY_GELU_TANH: { return gelu_tanh(a); }                           // gelu, "tanh"
        case EW_UNARY_SILU: { return a / (1.0 + exp_accurate(-a)); }           // silu
        case EW_UNARY_SIGMOID: { return sigmoid(a); }                             // sigmoid
        case EW_UNARY_EXP: { return exp_accurate(a); }                        // exp
        case EW_UNARY_RSQRT: { return inverseSqrt(a); }                         // rsqrt
        case EW_UNARY_POW_SCALAR: { return pow_real(a, scalar0()); }                // pow.Tensor_Scalar
        case EW_UNARY_SQRT: { return sqrt(a); }                               // sqrt
        case EW_UNARY_RSUB_SCALAR: { return scalar0() - scalar1() * a; }             // rsub.Scalar(other=s0, alpha=s1)
        case EW_UNARY_DIV_SCALAR: { return a / scalar0(); }                         // div.Scalar
        case EW_UNARY_TANH: { return tanh_accurate(a); }                      // tanh
        case EW_UNARY_ERF: { return erf_accurate(a); }                       // erf
        case EW_UNARY_LOG: { return log_accurate(a); }                       // log
        case EW_UNARY_RECIPROCAL: { return 1.0 / a; }                               // reciprocal
        case EW_UNARY_ABS: { return abs(a); }                                // abs
        default: { return nan(); }
    }
}
#endif

#if ARITY == 2
fn binary_result(a: f32, b: f32) -> f32 {
    if ((OP == EW_BINARY_MAXIMUM || OP == EW_BINARY_MINIMUM) && (is_nan(a) || is_nan(b))) {
        return nan();  // torch.maximum / minimum propagate NaN
    }
    return apply(a, b);
}
#endif

#if VEC4
@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let count4 = params.numel / 4u;
    let first = (workgroup.x + params.vktrain_group_offset.x) * (WORKGROUP_SIZE * VEC4_PER_THREAD) + local.x;
    for (var j = 0u; j < VEC4_PER_THREAD; j++) {
        let v = first + j * WORKGROUP_SIZE;
        if (v < count4) {
            let a = a_data[(params.a_offset + params.window_start) / 4u + v];
#if ARITY == 2
            let b = b_data[(params.b_offset + params.window_start) / 4u + v];
            out_data[params.out_offset / 4u + v] = vec4<f32>(binary_result(a.x, b.x), binary_result(a.y, b.y),
                                                          binary_result(a.z, b.z), binary_result(a.w, b.w));
#else
            out_data[params.out_offset / 4u + v] = vec4<f32>(apply(a.x), apply(a.y), apply(a.z), apply(a.w));
#endif
        }
    }
}
#else
@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let index = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (index >= params.numel) {
        return;
    }
    let p = params;
    var sizes = array<u32, MAX_RANK>(p.size0, p.size1, p.size2, p.size3, p.size4, p.size5);
    var a_strides = array<u32, MAX_RANK>(p.a_stride0, p.a_stride1, p.a_stride2, p.a_stride3, p.a_stride4,
                                         p.a_stride5);
    var b_strides = array<u32, MAX_RANK>(p.b_stride0, p.b_stride1, p.b_stride2, p.b_stride3, p.b_stride4,
                                         p.b_stride5);
    var rest = p.window_start + index;
    var a_index = p.a_offset;
    var b_index = p.b_offset;
    for (var d = 0u; d < p.rank; d++) {
        let coord = rest % sizes[d];
        rest /= sizes[d];
        a_index += coord * a_strides[d];
        b_index += coord * b_strides[d];
    }
#if ARITY == 2
    let a = a_data[a_index];
    let b = b_data[b_index];
    var result = apply(a, b);
    if ((OP == EW_BINARY_MAXIMUM || OP == EW_BINARY_MINIMUM) && (is_nan(a) || is_nan(b))) {
        result = nan();  // torch.maximum / minimum propagate NaN
    }
    out_data[p.out_offset + index] = result;
#else
    out_data[p.out_offset + index] = apply(a_data[a_index]);
#endif
}
#endif

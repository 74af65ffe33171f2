// Strided fp32 sum / max reduction (GLSL reference: ../reduce.comp; host module: kernels/reduction.py):
//   out[o] = scale * sum_r in[in_offset + kept(o) + reduced(r)]   (REDUCE_OP 0, id 4)
//   out[o] = max_r in[in_offset + kept(o) + reduced(r)]           (REDUCE_OP 1; NaN propagates)
// kept(o) / reduced(r) decompose the flat output / reduction index over (out_sizes, out_strides) and
// (red_sizes, red_strides), element strides into the input, innermost dim first; scale = 1 for sum,
// 1 / count for mean. STRATEGY (id 3): 0 = one workgroup per output (strided per-thread sums, then a
// fixed tree), 1 = one thread per output (serial). Both orders depend only on the shapes.
// Per-thread sums are compensated (Kahan), as in the GLSL. WGSL has no `precise`, and compilers do
// simplify (total - acc) - corrected to 0 (lavapipe does), so the sum passes through `opaque` first.

const WORKGROUP_SIZE = 64u;
const MAX_RANK = 4u;
// Elements per loop trip, as eight explicit steps (accumulate_8): lavapipe ends an invocation after
// ~32768 loop trips (all loops together) and does not unroll a loop of this body; so a serial sum may
// take 256Ki elements and a workgroup's 16Mi.

@id(3) override STRATEGY: u32 = 0u;
@id(4) override REDUCE_OP: u32 = 0u;

// The GLSL's out_sizes[4], out_strides[4], red_sizes[4], red_strides[4] as scalars.
struct Params {
    vktrain_group_offset: vec4<u32>,
    out_numel: u32,
    red_numel: u32,
    out_rank: u32,
    red_rank: u32,
    in_offset: u32,
    scale: f32,
    out_size0: u32, out_size1: u32, out_size2: u32, out_size3: u32,
    out_stride0: u32, out_stride1: u32, out_stride2: u32, out_stride3: u32,
    red_size0: u32, red_size1: u32, red_size2: u32, red_size3: u32,
    red_stride0: u32, red_stride1: u32, red_stride2: u32, red_stride3: u32,
}

@group(0) @binding(0) var<storage, read_write> out_data: array<f32>;
@group(0) @binding(1) var<storage, read> in_data: array<f32>;
@group(0) @binding(2) var<uniform> params: Params;

var<workgroup> partials: array<f32, WORKGROUP_SIZE>;

fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn is_inf(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }

fn identity_value() -> f32 {
    return select(0.0, bitcast<f32>(0xff800000u), REDUCE_OP == 1u);  // -inf for max
}

// x, through an OR with the header's w word: 0 at run time (both runtimes write it so), unknown to the
// compiler, so no algebra sees through it.
fn opaque(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) | params.vktrain_group_offset.w);
}

// A running reduction: (sum, compensation) for sums, (max, unused) for max.
fn accumulate(state: vec2<f32>, value: f32) -> vec2<f32> {
    if (REDUCE_OP == 1u) {
        // torch.amax propagates NaN; WGSL max() may return either operand for NaN.
        if (is_nan(state.x) || is_nan(value)) {
            return vec2<f32>(bitcast<f32>(0x7fc00000u), 0.0);
        }
        return vec2<f32>(max(state.x, value), 0.0);
    }
    let corrected = value - state.y;
    let total = state.x + corrected;
    let lost = (opaque(total) - state.x) - corrected;
    return vec2<f32>(total, select(lost, 0.0, is_inf(total)));  // inf - inf would make the sum NaN
}

// The running reduction over elements first, first + step, ..., first + 7 step (those < red_numel).
fn accumulate_8(state_in: vec2<f32>, base: u32, first: u32, step: u32) -> vec2<f32> {
    var state = state_in;
    state = accumulate_element(state, base, first);
    state = accumulate_element(state, base, first + step);
    state = accumulate_element(state, base, first + 2u * step);
    state = accumulate_element(state, base, first + 3u * step);
    state = accumulate_element(state, base, first + 4u * step);
    state = accumulate_element(state, base, first + 5u * step);
    state = accumulate_element(state, base, first + 6u * step);
    state = accumulate_element(state, base, first + 7u * step);
    return state;
}

fn accumulate_element(state: vec2<f32>, base: u32, r: u32) -> vec2<f32> {
    if (r >= params.red_numel) {
        return state;
    }
    return accumulate(state, in_data[base + reduced_offset(r)]);
}

fn combine(a: f32, b: f32) -> f32 {
    if (REDUCE_OP == 1u) {
        if (is_nan(a) || is_nan(b)) {
            return bitcast<f32>(0x7fc00000u);
        }
        return max(a, b);
    }
    return a + b;
}

fn finish(acc: f32) -> f32 {
    return select(acc * params.scale, acc, REDUCE_OP == 1u);
}

fn kept_offset(o_in: u32) -> u32 {
    let p = params;
    var sizes = array<u32, MAX_RANK>(p.out_size0, p.out_size1, p.out_size2, p.out_size3);
    var strides = array<u32, MAX_RANK>(p.out_stride0, p.out_stride1, p.out_stride2, p.out_stride3);
    var o = o_in;
    var offset = p.in_offset;
    for (var d = 0u; d < p.out_rank; d++) {
        offset += (o % sizes[d]) * strides[d];
        o /= sizes[d];
    }
    return offset;
}

fn reduced_offset(r_in: u32) -> u32 {
    let p = params;
    if (p.red_rank == 1u) {
        return r_in * p.red_stride0;  // the common case after merging dims: no division
    }
    var sizes = array<u32, MAX_RANK>(p.red_size0, p.red_size1, p.red_size2, p.red_size3);
    var strides = array<u32, MAX_RANK>(p.red_stride0, p.red_stride1, p.red_stride2, p.red_stride3);
    var r = r_in;
    var offset = 0u;
    for (var d = 0u; d < p.red_rank; d++) {
        offset += (r % sizes[d]) * strides[d];
        r /= sizes[d];
    }
    return offset;
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tid = local.x;
    let group = workgroup.x + params.vktrain_group_offset.x;
    if (STRATEGY == 1u) {
        let o = group * WORKGROUP_SIZE + tid;
        if (o >= params.out_numel) {
            return;
        }
        let base = kept_offset(o);
        var state = vec2<f32>(identity_value(), 0.0);
        for (var r0 = 0u; r0 < params.red_numel; r0 += 8u) {
            state = accumulate_8(state, base, r0, 1u);
        }
        out_data[o] = finish(state.x);
        return;
    }
    let o = group;
    if (o >= params.out_numel) {
        return;  // uniform: the whole workgroup returns or none does
    }
    let base = kept_offset(o);
    var state = vec2<f32>(identity_value(), 0.0);
    for (var r0 = tid; r0 < params.red_numel; r0 += 8u * WORKGROUP_SIZE) {
        state = accumulate_8(state, base, r0, WORKGROUP_SIZE);
    }
    partials[tid] = state.x;
    workgroupBarrier();
    for (var half_size = WORKGROUP_SIZE / 2u; half_size > 0u; half_size >>= 1u) {
        if (tid < half_size) {
            partials[tid] = combine(partials[tid], partials[tid + half_size]);
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        out_data[o] = finish(partials[0]);
    }
}

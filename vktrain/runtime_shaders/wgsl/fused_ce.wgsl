// fused_ce, pass 1 of 2 (GLSL reference: ../fused_ce.comp; host module: kernels/cross_entropy.py). One
// workgroup per row of logits [R, V]:
//   row_loss[r] = ((max - row[label]) + log(sum exp(row - max))) / n_valid   (0 when the row is ignored)
//   dlogits[r]  = (softmax(row) - onehot(label)) / n_valid                   (0 when the row is ignored)
// A row is ignored when label < 0 or label >= V. Each thread keeps an online (max, sum) pair over a
// strided slice; a workgroup-memory tree merges the pairs in a fixed order. fused_ce_sum adds the rows.
// VEC4: rows as vec4s (V % 4 == 0). IN_PLACE: dlogits over the logits (one binding fewer; each thread
// overwrites only what it has read, and the label's logit is read before the first barrier).
// Local size (WG, 1, 1), WG a power of two.
// vktrain-variants: -, VEC4, IN_PLACE, VEC4+IN_PLACE

@id(0) override WG: u32 = 256u;

#if VEC4
alias Value = vec4<f32>;
const LANES = 4u;
#else
alias Value = f32;
const LANES = 1u;
#endif

struct Params {
    vktrain_group_offset: vec4<u32>,
    R: u32,               // rows of labels and row_loss
    V: u32,
    first_row: u32,       // the row group 0 takes (a window of the logits' rows; 0 unsplit)
    logits_offset: u32,   // element of that row's first logit in binding 0 (a multiple of 4 with VEC4)
    dlogits_offset: u32,  // likewise in the dlogits binding (= logits_offset with IN_PLACE)
}

#if IN_PLACE
@group(0) @binding(0) var<storage, read_write> logits: array<Value>;  // [R, V] -> dlogits
@group(0) @binding(1) var<storage, read> labels: array<i32>;
@group(0) @binding(2) var<storage, read> n_valid: f32;
@group(0) @binding(3) var<storage, read_write> row_loss: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;
fn store_dlogits(i: u32, value: Value) { logits[i] = value; }
#else
@group(0) @binding(0) var<storage, read> logits: array<Value>;
@group(0) @binding(1) var<storage, read> labels: array<i32>;
@group(0) @binding(2) var<storage, read> n_valid: f32;
@group(0) @binding(3) var<storage, read_write> dlogits: array<Value>;
@group(0) @binding(4) var<storage, read_write> row_loss: array<f32>;
@group(0) @binding(5) var<uniform> params: Params;
fn store_dlogits(i: u32, value: Value) { dlogits[i] = value; }
#endif

var<workgroup> s_max: array<f32, WG>;
var<workgroup> s_sum: array<f32, WG>;

fn neg_inf() -> f32 { return bitcast<f32>(0xff800000u); }

#if VEC4
fn largest(x: vec4<f32>) -> f32 { return max(max(x.x, x.y), max(x.z, x.w)); }
fn sum_exp(x: vec4<f32>, m: f32) -> f32 {
    let e = exp(x - m);
    return (e.x + e.y) + (e.z + e.w);
}
#else
fn largest(x: f32) -> f32 { return x; }
fn sum_exp(x: f32, m: f32) -> f32 { return exp(x - m); }
#endif

// (m, s) merged with (m_other, s_other); an empty side (max -inf, sum 0) is skipped (exp(-inf + inf) = NaN).
fn merge(m: f32, s: f32, m_other: f32, s_other: f32) -> vec2<f32> {
    if (m_other == neg_inf()) { return vec2<f32>(m, s); }
    if (m == neg_inf()) { return vec2<f32>(m_other, s_other); }
    let m_new = max(m, m_other);
    return vec2<f32>(m_new, s * exp(m - m_new) + s_other * exp(m_other - m_new));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let window_row = workgroup.x + params.vktrain_group_offset.x;
    let row = params.first_row + window_row;
    // Every early return is uniform over the workgroup (it depends on the row only).
    if (row >= params.R) {
        return;
    }
    let V = params.V;
    let row_values = V / LANES;
    let base = window_row * row_values + params.logits_offset / LANES;
    let d_base = window_row * row_values + params.dlogits_offset / LANES;
    let label = labels[row];
    if (label < 0 || u32(label) >= V) {
        for (var i = tid; i < row_values; i += WG) {
            store_dlogits(d_base + i, Value(0.0));
        }
        if (tid == 0u) {
            row_loss[row] = 0.0;
        }
        return;
    }
    let label_value = u32(label) / LANES;
#if VEC4
    let label_lane = u32(label) % 4u;
    let label_onehot = select(vec4<f32>(0.0), vec4<f32>(1.0), vec4<u32>(0u, 1u, 2u, 3u) == vec4<u32>(label_lane));
#else
    let label_onehot = 1.0;
#endif
    var label_logit = 0.0;  // read by thread 0 only, before any thread writes (IN_PLACE)
    if (tid == 0u) {
#if VEC4
        label_logit = logits[base + label_value][label_lane];
#else
        label_logit = logits[base + label_value];
#endif
    }

    var m = neg_inf();
    var s = 0.0;
    for (var i = tid; i < row_values; i += WG) {
        let x = logits[base + i];
        let x_max = largest(x);
        if (x_max > m) {
            s *= exp(m - x_max);  // on the first value exp(-inf) = 0 (and s is still 0)
            m = x_max;
        }
        if (m != neg_inf()) {
            s += sum_exp(x, m);
        }
    }
    s_max[tid] = m;
    s_sum[tid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            let merged = merge(s_max[tid], s_sum[tid], s_max[tid + stride], s_sum[tid + stride]);
            s_max[tid] = merged.x;
            s_sum[tid] = merged.y;
        }
        workgroupBarrier();
    }
    let row_max = s_max[0];
    let row_sum = s_sum[0];
    let divisor = n_valid;
    if (tid == 0u) {
        // (max - x[label]) + log(sum): no cancellation between two large numbers for huge logits.
        row_loss[row] = ((row_max - label_logit) + log(row_sum)) / divisor;
    }
    let inv_sum = 1.0 / row_sum;
    for (var i = tid; i < row_values; i += WG) {
        let p = exp(logits[base + i] - row_max) * inv_sum;
        store_dlogits(d_base + i, select(p, p - label_onehot, i == label_value) / divisor);
    }
}

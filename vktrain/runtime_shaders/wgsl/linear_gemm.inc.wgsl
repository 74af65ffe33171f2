// Tiled fp32 GEMM body shared by the linear family (GLSL reference: ../linear_gemm.glsl, GPU tuning),
// included by linear_q4gsw.wgsl, linear_q4gsw_backward.wgsl and linear_dw.wgsl after they `#define
// LINEAR_MODE`. Every mode computes C[i, j] = sum_r A[r, i] * B[r, j], C row-major [ROWS, COLS]:
//   LINEAR_MODE 0 (forward): y[M, N]  = x[M, K] @ deq(W).T    i = m, j = n, r = k    (+ bias[n])
//   LINEAR_MODE 1 (d_x):     dx[M, K] = d_out[M, N] @ deq(W)  i = m, j = k, r = n
//   LINEAR_MODE 2 (dW):      dW[N, K] = d_out[M, N].T @ x     i = n, j = k, r = m
// W is the W_4X8 prepacked buffer (docs/spec/w4x8.md), dequantized per tile into workgroup memory with
// scales [G, N]. A workgroup of THREADS_X x THREADS_Y threads (ids 0, 1) owns a BM x BN tile of C,
// BM = 8 THREADS_Y, BN = 8 THREADS_X; each thread an 8 x 8 block in two 4-row halves BM/2 apart and two
// 4-column halves BN/2 apart. The reduction advances BK (id 3) at a time. SPLIT_K (id 4) > 1: workgroup z
// = s sums its slice of the reduction (whole BK steps) into slice s of binding 0, a [SPLIT_K, ROWS, COLS]
// scratch that linear_splitk_reduce adds up. (The GLSL also prefetches the next step into registers; this
// body loads each step after the previous one's barrier.)

@id(0) override THREADS_X: u32 = 16u;
@id(1) override THREADS_Y: u32 = 16u;
@id(3) override BK: u32 = 16u;
@id(4) override SPLIT_K: u32 = 1u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    M: u32,           // rows of x / d_out (leading dims flattened)
    N: u32,           // out features
    K: u32,           // in features
    group_size: u32,  // q4gsw group size along K (unused by dW)
}

#if LINEAR_MODE == 0
@group(0) @binding(0) var<storage, read_write> c_out: array<vec4<f32>>;  // y
@group(0) @binding(1) var<storage, read> a_src: array<vec4<f32>>;        // x
@group(0) @binding(2) var<storage, read> w4x8: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
#if HAS_BIAS
@group(0) @binding(4) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(4) var<uniform> params: Params;
#endif
fn rows_total() -> u32 { return params.M; }
fn cols_total() -> u32 { return params.N; }
fn reduction_total() -> u32 { return params.K; }
#endif
#if LINEAR_MODE == 1
@group(0) @binding(0) var<storage, read_write> c_out: array<vec4<f32>>;  // dx
@group(0) @binding(1) var<storage, read> a_src: array<vec4<f32>>;        // d_out
@group(0) @binding(2) var<storage, read> w4x8: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;
fn rows_total() -> u32 { return params.M; }
fn cols_total() -> u32 { return params.K; }
fn reduction_total() -> u32 { return params.N; }
#endif
#if LINEAR_MODE == 2
@group(0) @binding(0) var<storage, read_write> c_out: array<vec4<f32>>;  // dW
@group(0) @binding(1) var<storage, read> a_src: array<vec4<f32>>;        // d_out
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> params: Params;
fn rows_total() -> u32 { return params.N; }
fn cols_total() -> u32 { return params.K; }
fn reduction_total() -> u32 { return params.M; }
#endif


// [r * (BM / 4) + i / 4] and [r * (BN / 4) + j / 4]: one reduction step per row, vec4s along the output.
var<workgroup> a_tile: array<vec4<f32>, BK * 2u * THREADS_Y>;
var<workgroup> b_tile: array<vec4<f32>, BK * 2u * THREADS_X>;

#if LINEAR_MODE != 2
fn n8_count() -> u32 { return (params.N / 4u + 1u) / 2u; }

// The scale of weight row n in group g; rows n >= N exist only as W_4X8 padding, so they scale by 0.
fn scale_at(g: u32, n: u32) -> f32 {
    if (n >= params.N) {
        return 0.0;
    }
    return scales[g * params.N + n];
}

// Codes of one W_4X8 word for the row pair (n, n + 1): byte t holds k = 4 k4 + t, low nibble row n.
fn decode_low(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xfu)) - 8.0;
}
fn decode_high(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(0xfu)) - 8.0;
}
#endif

// Loads of one reduction step into the workgroup tiles; values outside the matrices are zeros.
fn load_a(r0: u32, i0: u32, tid: u32) {
    let bm = 8u * THREADS_Y;
    let threads = THREADS_X * THREADS_Y;
    for (var v = tid; v < BK * bm / 4u; v += threads) {
#if LINEAR_MODE == 2
        // A[r = m, i = n] = d_out[m, n], read along i.
        let m = r0 + v / (bm / 4u);
        let n = i0 + 4u * (v % (bm / 4u));
        var value = vec4<f32>(0.0);
        if (m < params.M && n < params.N) {
            value = a_src[(m * params.N + n) / 4u];
        }
        a_tile[v] = value;
#else
        // A[r, i] = src[i, r]: BK/4 consecutive threads read BK contiguous floats of one source row.
        let red = reduction_total();
        let i = v / (BK / 4u);
        let r4 = v % (BK / 4u);
        let m = i0 + i;
        let r = r0 + 4u * r4;
        var value = vec4<f32>(0.0);
        if (m < params.M && r < red) {
            value = a_src[(m * red + r) / 4u];
        }
        for (var c = 0u; c < 4u; c++) {
            a_tile[(4u * r4 + c) * (bm / 4u) + i / 4u][i % 4u] = value[c];
        }
#endif
    }
}

#if LINEAR_MODE == 2
// B of dW: x[m, k] rows, read along j and stored as they are.
fn load_b(r0: u32, j0: u32, tid: u32) {
    let bn = 8u * THREADS_X;
    let threads = THREADS_X * THREADS_Y;
    for (var v = tid; v < BK * bn / 4u; v += threads) {
        let m = r0 + v / (bn / 4u);
        let k = j0 + 4u * (v % (bn / 4u));
        var value = vec4<f32>(0.0);
        if (m < params.M && k < params.K) {
            value = x[(m * params.K + k) / 4u];
        }
        b_tile[v] = value;
    }
}
#else
// B from W_4X8: one word = 4 consecutive k x the row pair (n, n + 1), scaled by those rows' scales.
//   forward: the tile spans BK/4 k4-rows of BN/8 blocks; d_x: BN/4 k4-rows of BK/8 blocks.
fn load_b(r0: u32, j0: u32, tid: u32) {
    let bn = 8u * THREADS_X;
    let threads = THREADS_X * THREADS_Y;
    let n8s = n8_count();
#if LINEAR_MODE == 0
    let words_per_k4 = bn / 2u;
    let words = (BK / 4u) * words_per_k4;
#else
    let words_per_k4 = BK / 2u;
    let words = (bn / 4u) * words_per_k4;
#endif
    for (var v = tid; v < words; v += threads) {
        let k4l = v / words_per_k4;
        let rest = v % words_per_k4;
#if LINEAR_MODE == 0
        let k4 = r0 / 4u + k4l;
        let n8 = j0 / 8u + rest / 4u;
#else
        let k4 = j0 / 4u + k4l;
        let n8 = r0 / 8u + rest / 4u;
#endif
        var word = 0u;
        var scale = vec2<f32>(0.0);
        if (4u * k4 < params.K && n8 < n8s) {
            let jw = rest % 4u;
            let g = (4u * k4) / params.group_size;
            let n = 8u * n8 + 2u * jw;
            word = w4x8[4u * (k4 * n8s + n8) + jw];
            scale = vec2<f32>(scale_at(g, n), scale_at(g, n + 1u));
        }
        let pair = 8u * (rest / 4u) + 2u * (rest % 4u);  // tile-local n of the even row
        let low = decode_low(word) * scale.x;    // row n, k = 4 k4 + 0..3
        let high = decode_high(word) * scale.y;  // row n + 1
#if LINEAR_MODE == 0
        // b_tile[k][n]: the pair is two adjacent floats of one vec4 (pair is even).
        for (var t = 0u; t < 4u; t++) {
            let index = (4u * k4l + t) * (bn / 4u) + pair / 4u;
            b_tile[index][pair % 4u] = low[t];
            b_tile[index][pair % 4u + 1u] = high[t];
        }
#else
        // b_tile[n][k]: each row of the pair takes one vec4 (4 consecutive k).
        b_tile[pair * (bn / 4u) + k4l] = low;
        b_tile[(pair + 1u) * (bn / 4u) + k4l] = high;
#endif
    }
}
#endif

@compute @workgroup_size(THREADS_X, THREADS_Y, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tx = local.x;
    let ty = local.y;
    let tid = ty * THREADS_X + tx;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let bm = 8u * THREADS_Y;
    let bn = 8u * THREADS_X;
    let i0 = group.y * bm;
    let j0 = group.x * bn;
    let rows = rows_total();
    let cols = cols_total();
    let red = reduction_total();
    if (i0 >= rows) {
        return;  // uniform across the workgroup
    }
    // This workgroup's reduction range; a slice may be empty (it then writes zeros).
    var r_begin = 0u;
    var r_end = red;
    if (SPLIT_K > 1u) {
        let slice = ((red + SPLIT_K - 1u) / SPLIT_K + BK - 1u) / BK * BK;
        r_begin = min(red, group.z * slice);
        r_end = min(red, r_begin + slice);
    }

    // acc[h * 4 + a][c]: row i0 + h BM/2 + 4 ty + a, columns j0 + c BN/2 + 4 tx .. +3.
    var acc: array<array<vec4<f32>, 2>, 8>;
    for (var r0 = r_begin; r0 < r_end; r0 += BK) {
        load_a(r0, i0, tid);
        load_b(r0, j0, tid);
        workgroupBarrier();
        for (var r = 0u; r < BK; r++) {
            let a_lo = a_tile[r * (bm / 4u) + ty];
            let a_hi = a_tile[r * (bm / 4u) + ty + bm / 8u];
            let b_lo = b_tile[r * (bn / 4u) + tx];
            let b_hi = b_tile[r * (bn / 4u) + tx + bn / 8u];
            for (var a = 0u; a < 4u; a++) {
                acc[a][0] += a_lo[a] * b_lo;
                acc[a][1] += a_lo[a] * b_hi;
                acc[4u + a][0] += a_hi[a] * b_lo;
                acc[4u + a][1] += a_hi[a] * b_hi;
            }
        }
        workgroupBarrier();
    }

    for (var h = 0u; h < 2u; h++) {
        for (var a = 0u; a < 4u; a++) {
            let i = i0 + h * (bm / 2u) + 4u * ty + a;
            if (i >= rows) {
                continue;
            }
            for (var c = 0u; c < 2u; c++) {
                let j = j0 + c * (bn / 2u) + 4u * tx;  // cols % 4 == 0: all 4 in or all out
                if (j >= cols) {
                    continue;
                }
                var value = acc[h * 4u + a][c];
                // Slice z of the split-K scratch, or C itself (z = 0) without split-K.
                let index = (group.z * rows * cols + i * cols + j) / 4u;
#if HAS_BIAS
                value += bias[j / 4u];  // the plan never combines HAS_BIAS with SPLIT_K > 1
#endif
                c_out[index] = value;
            }
        }
    }
}

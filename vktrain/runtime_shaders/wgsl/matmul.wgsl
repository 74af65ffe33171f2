// Dense fp32 tiled GEMM (GLSL reference: ../matmul.comp, GPU tuning; host module: kernels/matmul.py):
//   C[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n]  (+ beta * bias[b, m, n] with HAS_BIAS=1)
// A, B and bias are addressed through element strides (batch, row, column) plus an element offset; C[b, m, n]
// is element c_offset + (b M + m) c_m_stride + n (c_m_stride > N: a window of columns of a wider matrix). A workgroup of (TILE_M / 4) x (TILE_N / 4) threads computes a TILE_M x TILE_N
// tile of C, each thread a 4 x 4 micro-tile at rows ty + THREADS_M i and columns tx + THREADS_N j (VEC4_C,
// N, c_offset, c_m_stride % 4 == 0: 4 adjacent columns, stored as one vec4). K advances 16 at a time through workgroup memory.
// Split-K: group z = slice * batch + b; slice s reduces k in [s k_slice, min(K, (s + 1) k_slice)) into
// C + (s batch + b) M c_m_stride, which linear_splitk_reduce sums; only slice 0 adds the bias.
// A_M_FASTEST (id 3) / B_K_FASTEST (id 4) pick the order a workgroup walks a tile while loading it.
// B_Q8_0: B's storage is a frozen Q8_0 matrix (docs/spec/q8_0.md), int8 codes four to a word (binding 2)
// and a float32 scale per 32 (binding 3; the bias, if any, binding 4), dequantized as each element is
// loaded: the products and their order are the float32 variant's.
// vktrain-variants: HAS_BIAS=0, HAS_BIAS=1, HAS_BIAS=0+TILE_M=64+TILE_N=16, HAS_BIAS=1+TILE_M=64+TILE_N=16, HAS_BIAS=0+TILE_M=16+TILE_N=64, HAS_BIAS=1+TILE_M=16+TILE_N=64, HAS_BIAS=0+VEC4_C, HAS_BIAS=1+VEC4_C, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C
// vktrain-variants: HAS_BIAS=0+B_Q8_0, HAS_BIAS=0+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0
// vktrain-variants: HAS_BIAS=1+B_Q8_0, HAS_BIAS=1+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0

#if !TILE_M
const TILE_M = 64;
#endif
#if !TILE_N
const TILE_N = 64;
#endif
const TILE_K = 16u;
const MICRO_M = 4u;
const MICRO_N = 4u;
const THREADS_M = u32(TILE_M) / MICRO_M;
const THREADS_N = u32(TILE_N) / MICRO_N;
const THREADS = THREADS_M * THREADS_N;
const A_LOADS_PER_THREAD = u32(TILE_M) * TILE_K / THREADS;
const B_LOADS_PER_THREAD = u32(TILE_N) * TILE_K / THREADS;
const A_ROW = u32(TILE_M) + 1u;   // a_tile row length (one float of padding, as the GLSL)
#if VEC4_C
const B_ROW = u32(TILE_N) + 4u;   // b_tile row length in floats (one vec4 of padding)
#else
const B_ROW = u32(TILE_N) + 1u;
#endif

@id(3) override A_M_FASTEST: bool = false;
@id(4) override B_K_FASTEST: bool = false;

struct Params {
    vktrain_group_offset: vec4<u32>,
    M: u32,
    N: u32,
    K: u32,
    a_offset: u32,
    a_batch_stride: u32,
    a_m_stride: u32,
    a_k_stride: u32,
    b_offset: u32,
    b_batch_stride: u32,
    b_k_stride: u32,
    b_n_stride: u32,
    bias_offset: u32,
    bias_batch_stride: u32,
    bias_m_stride: u32,
    bias_n_stride: u32,
    alpha: f32,
    beta: f32,
    batch: u32,    // batches per slice: group z = slice * batch + b
    k_slice: u32,  // reduction length of one slice (a multiple of TILE_K, or >= K when unsplit)
    c_offset: u32,    // element of C[0, 0, 0] in binding 0
    c_m_stride: u32,  // elements between rows of C (>= N)
}

#if VEC4_C
@group(0) @binding(0) var<storage, read_write> c_data: array<vec4<f32>>;
#else
@group(0) @binding(0) var<storage, read_write> c_data: array<f32>;
#endif
@group(0) @binding(1) var<storage, read> a_data: array<f32>;
#if B_Q8_0
@group(0) @binding(2) var<storage, read> b_codes: array<u32>;   // element e: byte e % 4 of word e / 4
@group(0) @binding(3) var<storage, read> b_scales: array<f32>;  // element e: scale e / 32
#if HAS_BIAS
@group(0) @binding(4) var<storage, read> bias_data: array<f32>;
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(4) var<uniform> params: Params;
#endif

// Element e of B's storage: code * scale, exactly the float32 value the Q8_0 block holds.
fn b_at(e: u32) -> f32 {
    return f32(extractBits(bitcast<i32>(b_codes[e >> 2u]), 8u * (e & 3u), 8u)) * b_scales[e >> 5u];
}
#else
@group(0) @binding(2) var<storage, read> b_data: array<f32>;
#if HAS_BIAS
@group(0) @binding(3) var<storage, read> bias_data: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;
#else
@group(0) @binding(3) var<uniform> params: Params;
#endif

fn b_at(e: u32) -> f32 {
    return b_data[e];
}
#endif

var<workgroup> a_tile: array<f32, TILE_K * A_ROW>;  // [kk * A_ROW + mm]
var<workgroup> b_tile: array<f32, TILE_K * B_ROW>;  // [kk * B_ROW + nn]

alias Accumulators = array<array<f32, MICRO_N>, MICRO_M>;

// One reduction step kk of the tile in workgroup memory into the thread's micro-tile.
fn multiply_accumulate(kk: u32, tx: u32, ty: u32, acc: ptr<function, Accumulators>) {
    var a_frag: array<f32, MICRO_M>;
    var b_frag: array<f32, MICRO_N>;
    for (var i = 0u; i < MICRO_M; i++) {
        a_frag[i] = a_tile[kk * A_ROW + ty + i * THREADS_M];
    }
    for (var j = 0u; j < MICRO_N; j++) {
#if VEC4_C
        b_frag[j] = b_tile[kk * B_ROW + tx * MICRO_N + j];
#else
        b_frag[j] = b_tile[kk * B_ROW + tx + j * THREADS_N];
#endif
    }
    for (var i = 0u; i < MICRO_M; i++) {
        for (var j = 0u; j < MICRO_N; j++) {
            (*acc)[i][j] += a_frag[i] * b_frag[j];
        }
    }
}

#if HAS_BIAS
fn bias_at(batch: u32, m: u32, n: u32) -> f32 {
    return bias_data[params.bias_offset + batch * params.bias_batch_stride + m * params.bias_m_stride +
                     n * params.bias_n_stride];
}
#endif

@compute @workgroup_size(THREADS_N, THREADS_M, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tx = local.x;
    let ty = local.y;
    let tid = ty * THREADS_N + tx;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let slice = group.z / params.batch;
    let batch = group.z % params.batch;
    let k_begin = slice * params.k_slice;
    let k_end = min(params.K, k_begin + min(params.k_slice, params.K));  // min: no u32 overflow
    let tile_m0 = group.y * u32(TILE_M);
    let tile_n0 = group.x * u32(TILE_N);
    let a_base = params.a_offset + batch * params.a_batch_stride;
    let b_base = params.b_offset + batch * params.b_batch_stride;

    var acc: Accumulators;
    for (var k0 = k_begin; k0 < k_end; k0 += TILE_K) {
        for (var load = 0u; load < A_LOADS_PER_THREAD; load++) {
            let e = tid + load * THREADS;
            let mm = select(e / TILE_K, e % u32(TILE_M), A_M_FASTEST);
            let kk = select(e % TILE_K, e / u32(TILE_M), A_M_FASTEST);
            let m = tile_m0 + mm;
            let k = k0 + kk;
            var value = 0.0;
            if (m < params.M && k < k_end) {
                value = a_data[a_base + m * params.a_m_stride + k * params.a_k_stride];
            }
            a_tile[kk * A_ROW + mm] = value;
        }
        for (var load = 0u; load < B_LOADS_PER_THREAD; load++) {
            let e = tid + load * THREADS;
            let nn = select(e % u32(TILE_N), e / TILE_K, B_K_FASTEST);
            let kk = select(e / u32(TILE_N), e % TILE_K, B_K_FASTEST);
            let n = tile_n0 + nn;
            let k = k0 + kk;
            var value = 0.0;
            if (n < params.N && k < k_end) {
                value = b_at(b_base + k * params.b_k_stride + n * params.b_n_stride);
            }
            b_tile[kk * B_ROW + nn] = value;
        }
        workgroupBarrier();
        // Sixteen explicit steps, not a loop: lavapipe ends an invocation after 65535 loop trips and does
        // not unroll a loop of this body, which would cap K near 16 * 65535 / 17.
        multiply_accumulate(0u, tx, ty, &acc);
        multiply_accumulate(1u, tx, ty, &acc);
        multiply_accumulate(2u, tx, ty, &acc);
        multiply_accumulate(3u, tx, ty, &acc);
        multiply_accumulate(4u, tx, ty, &acc);
        multiply_accumulate(5u, tx, ty, &acc);
        multiply_accumulate(6u, tx, ty, &acc);
        multiply_accumulate(7u, tx, ty, &acc);
        multiply_accumulate(8u, tx, ty, &acc);
        multiply_accumulate(9u, tx, ty, &acc);
        multiply_accumulate(10u, tx, ty, &acc);
        multiply_accumulate(11u, tx, ty, &acc);
        multiply_accumulate(12u, tx, ty, &acc);
        multiply_accumulate(13u, tx, ty, &acc);
        multiply_accumulate(14u, tx, ty, &acc);
        multiply_accumulate(15u, tx, ty, &acc);
        workgroupBarrier();
    }

    let c_base = params.c_offset + group.z * params.M * params.c_m_stride;
    for (var i = 0u; i < MICRO_M; i++) {
        let m = tile_m0 + ty + i * THREADS_M;
        if (m >= params.M) {
            continue;
        }
#if VEC4_C
        // N, c_offset, c_m_stride % 4 == 0: the 4 columns are all inside the output or all outside, and
        // 16-byte aligned.
        let n0 = tile_n0 + tx * MICRO_N;
        if (n0 >= params.N) {
            continue;
        }
        var row = params.alpha * vec4<f32>(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
#if HAS_BIAS
        if (params.beta != 0.0 && slice == 0u) {
            for (var j = 0u; j < MICRO_N; j++) {
                row[j] += params.beta * bias_at(batch, m, n0 + j);
            }
        }
#endif
        c_data[(c_base + m * params.c_m_stride + n0) / 4u] = row;
#else
        for (var j = 0u; j < MICRO_N; j++) {
            let n = tile_n0 + tx + j * THREADS_N;
            if (n >= params.N) {
                continue;
            }
            var value = params.alpha * acc[i][j];
#if HAS_BIAS
            // beta == 0 ignores the bias entirely (even NaN / inf in it), as torch.addmm does.
            if (params.beta != 0.0 && slice == 0u) {
                value += params.beta * bias_at(batch, m, n);
            }
#endif
            c_data[c_base + m * params.c_m_stride + n] = value;
        }
#endif
    }
}

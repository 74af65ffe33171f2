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
// Register tiling for naga, which emits every loop as an unbounded `loop` that drivers do not unroll
// (see linear_gemm.inc.wgsl): the micro-tile is one `array<vec4<f32>, 4>` indexed by constants only
// ([i]: micro-row i, its 4 columns as one vec4), each K step is an explicit call, and each thread issues
// the global loads of a tile four at a time before storing them. Every output sums its products in the
// GLSL's order with one multiply and one add each, then alpha * acc (+ beta * bias): bit-identical to
// the GLSL where the compilers contract alike (they do on lavapipe). A and B are addressed through
// arbitrary element strides, so their global loads stay scalar, as in the GLSL.
// vktrain-variants: HAS_BIAS=0, HAS_BIAS=1, HAS_BIAS=0+TILE_M=64+TILE_N=16, HAS_BIAS=1+TILE_M=64+TILE_N=16, HAS_BIAS=0+TILE_M=16+TILE_N=64, HAS_BIAS=1+TILE_M=16+TILE_N=64, HAS_BIAS=0+VEC4_C, HAS_BIAS=1+VEC4_C, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C
// vktrain-variants: HAS_BIAS=0+B_Q8_0, HAS_BIAS=0+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0
// vktrain-variants: HAS_BIAS=1+B_Q8_0, HAS_BIAS=1+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0
// vktrain-variants: HAS_BIAS=0+TILE_M=32+TILE_N=64, HAS_BIAS=0+TILE_M=32+TILE_N=64+B_Q8_0, HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C, HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=32+TILE_N=64, HAS_BIAS=1+TILE_M=32+TILE_N=64+B_Q8_0, HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C, HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C+B_Q8_0

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
#if VEC4_C
const B_ROW4 = B_ROW / 4u;
var<workgroup> b_tile: array<vec4<f32>, TILE_K * B_ROW4>;  // [kk * B_ROW4 + nn / 4][nn % 4]
#else
var<workgroup> b_tile: array<f32, TILE_K * B_ROW>;  // [kk * B_ROW + nn]
#endif

const LOAD_CHUNK = 4u;  // global loads a thread issues together; divides A_ and B_LOADS_PER_THREAD
const_assert A_LOADS_PER_THREAD % LOAD_CHUNK == 0u && B_LOADS_PER_THREAD % LOAD_CHUNK == 0u;

alias MicroTile = array<vec4<f32>, 4>;  // [i]: micro-row i, columns j as components

// The place in the tiles of load number e of a thread's tile loads (the walk order the overrides pick).
fn a_place(e: u32) -> vec2<u32> {  // (mm, kk)
    return select(vec2<u32>(e / TILE_K, e % TILE_K), vec2<u32>(e % u32(TILE_M), e / u32(TILE_M)), A_M_FASTEST);
}
fn b_place(e: u32) -> vec2<u32> {  // (nn, kk)
    return select(vec2<u32>(e % u32(TILE_N), e / u32(TILE_N)), vec2<u32>(e / TILE_K, e % TILE_K), B_K_FASTEST);
}

struct Step {
    k0: u32,
    k_end: u32,
    tile_m0: u32,
    tile_n0: u32,
    a_base: u32,
    b_base: u32,
}

fn fetch_a(step: Step, e: u32) -> f32 {
    let place = a_place(e);
    let m = step.tile_m0 + place.x;
    let k = step.k0 + place.y;
    if (m < params.M && k < step.k_end) {
        return a_data[step.a_base + m * params.a_m_stride + k * params.a_k_stride];
    }
    return 0.0;
}

fn commit_a(e: u32, value: f32) {
    let place = a_place(e);
    a_tile[place.y * A_ROW + place.x] = value;
}

fn fetch_b(step: Step, e: u32) -> f32 {
    let place = b_place(e);
    let n = step.tile_n0 + place.x;
    let k = step.k0 + place.y;
    if (n < params.N && k < step.k_end) {
        return b_at(step.b_base + k * params.b_k_stride + n * params.b_n_stride);
    }
    return 0.0;
}

fn commit_b(e: u32, value: f32) {
    let place = b_place(e);
#if VEC4_C
    b_tile[place.y * B_ROW4 + place.x / 4u][place.x % 4u] = value;
#else
    b_tile[place.y * B_ROW + place.x] = value;
#endif
}

// Load l of each thread is element tid + l THREADS of the tile, LOAD_CHUNK loads in flight at a time.
fn load_tiles(step: Step, tid: u32) {
    for (var load = 0u; load < A_LOADS_PER_THREAD; load += LOAD_CHUNK) {
        let e = tid + load * THREADS;
        let value0 = fetch_a(step, e);
        let value1 = fetch_a(step, e + THREADS);
        let value2 = fetch_a(step, e + 2u * THREADS);
        let value3 = fetch_a(step, e + 3u * THREADS);
        commit_a(e, value0);
        commit_a(e + THREADS, value1);
        commit_a(e + 2u * THREADS, value2);
        commit_a(e + 3u * THREADS, value3);
    }
    for (var load = 0u; load < B_LOADS_PER_THREAD; load += LOAD_CHUNK) {
        let e = tid + load * THREADS;
        let value0 = fetch_b(step, e);
        let value1 = fetch_b(step, e + THREADS);
        let value2 = fetch_b(step, e + 2u * THREADS);
        let value3 = fetch_b(step, e + 3u * THREADS);
        commit_b(e, value0);
        commit_b(e + THREADS, value1);
        commit_b(e + 2u * THREADS, value2);
        commit_b(e + 3u * THREADS, value3);
    }
}

// One reduction step kk of the tiles in workgroup memory into the thread's micro-tile:
// acc[i][j] += a[i] * b[j] for the micro-tile's rows i and columns j.
fn multiply_accumulate(kk: u32, tx: u32, ty: u32, acc: ptr<function, MicroTile>) {
    let a_row = kk * A_ROW + ty;
    let a = vec4<f32>(a_tile[a_row], a_tile[a_row + THREADS_M], a_tile[a_row + 2u * THREADS_M],
                      a_tile[a_row + 3u * THREADS_M]);
#if VEC4_C
    let b = b_tile[kk * B_ROW4 + tx];
#else
    let b_row = kk * B_ROW + tx;
    let b = vec4<f32>(b_tile[b_row], b_tile[b_row + THREADS_N], b_tile[b_row + 2u * THREADS_N],
                      b_tile[b_row + 3u * THREADS_N]);
#endif
    (*acc)[0] += a.x * b;
    (*acc)[1] += a.y * b;
    (*acc)[2] += a.z * b;
    (*acc)[3] += a.w * b;
}

#if HAS_BIAS
fn bias_at(batch: u32, m: u32, n: u32) -> f32 {
    return bias_data[params.bias_offset + batch * params.bias_batch_stride + m * params.bias_m_stride +
                     n * params.bias_n_stride];
}
#endif

// Stores micro-row i (acc: its 4 columns), skipping what lies outside C.
fn store_row(i: u32, acc: vec4<f32>, tx: u32, ty: u32, step: Step, slice: u32, batch: u32, c_base: u32) {
    let m = step.tile_m0 + ty + i * THREADS_M;
    if (m >= params.M) {
        return;
    }
#if VEC4_C
    // N, c_offset, c_m_stride % 4 == 0: the 4 columns are all inside the output or all outside, and
    // 16-byte aligned.
    let n0 = step.tile_n0 + tx * MICRO_N;
    if (n0 >= params.N) {
        return;
    }
    var row = params.alpha * acc;
#if HAS_BIAS
    if (params.beta != 0.0 && slice == 0u) {
        row += params.beta * vec4<f32>(bias_at(batch, m, n0), bias_at(batch, m, n0 + 1u), bias_at(batch, m, n0 + 2u),
                                       bias_at(batch, m, n0 + 3u));
    }
#endif
    c_data[(c_base + m * params.c_m_stride + n0) / 4u] = row;
#else
    for (var j = 0u; j < MICRO_N; j++) {
        let n = step.tile_n0 + tx + j * THREADS_N;
        if (n >= params.N) {
            continue;
        }
        var value = params.alpha * acc[j];
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

@compute @workgroup_size(THREADS_N, THREADS_M, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tx = local.x;
    let ty = local.y;
    let tid = ty * THREADS_N + tx;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let slice = group.z / params.batch;
    let batch = group.z % params.batch;
    let k_begin = slice * params.k_slice;
    var step = Step(k_begin, min(params.K, k_begin + min(params.k_slice, params.K)),  // min: no u32 overflow
                    group.y * u32(TILE_M), group.x * u32(TILE_N),
                    params.a_offset + batch * params.a_batch_stride, params.b_offset + batch * params.b_batch_stride);

    var acc = MicroTile();
    for (; step.k0 < step.k_end; step.k0 += TILE_K) {
        load_tiles(step, tid);
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
    store_row(0u, acc[0], tx, ty, step, slice, batch, c_base);
    store_row(1u, acc[1], tx, ty, step, slice, batch, c_base);
    store_row(2u, acc[2], tx, ty, step, slice, batch, c_base);
    store_row(3u, acc[3], tx, ty, step, slice, batch, c_base);
}

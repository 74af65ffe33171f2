// The fp16-tc GEMM body in f16 WGSL (no tensor cores), included by coopmat_linear_q4gsw.wgsl,
// coopmat_linear_q4gsw_backward.wgsl and coopmat_mm.wgsl after they `#define COOPMAT_B` (how B is
// staged: 0 = deq(W).T, 1 = deq(W) (the base's d_x), 2 = B row-major [K, N], 3 = B^T given [N, K]).
// The GLSL it stands in for is ../coopmat_gemm.glsl: same Dispatch (shader name, bindings, push block
// M, N, K, group_size, a_partials, b_partials, k_slice = 0, grid (ceil(N / BN), ceil(M / BM))), same numerics:
//   * A (fp32 [M, K] row-major) and B are rounded to f16 as they are staged in workgroup memory, after the
//     power-of-two operand scales (A_SCALE: A's, AB_SCALE: A's and B's, from the partial maxima of
//     coopmat_absmax; exponent rule and clamp as the GLSL's scale_exponent); the 4-bit base is decoded
//     as (code - 8) * scale in f32, then rounded to f16;
//   * products of the f16 operands are formed in f32 (exact: 11 x 11 bits) and summed in f32, k ascending
//     (the order of the GLSL's COOPMAT_EMULATE path, so the two agree to the bit where they round the
//     operands alike);
//   * the sums are unscaled by the inverse power of two, then (ADDEND) the addend is added in f32.
// Workgroup memory holds f16 tiles (the gain over the fp32 WGSL GEMMs: half the tile traffic and
// footprint): A as [k][m] and B as [k][n], vec4<f16> along the output. One tiling, kernels/coopmat.py's
// WGSL_TILING: a 64 x 128 tile of C (the variant name's BM=64) over BK = 32 per step, 16 x 16 threads,
// each a 4 x 8 register block in f32 (rows 4 ty..4 ty+3, columns 4 tx..4 tx+3 and 64 + 4 tx..): 12 KiB
// of tiles, within a browser's 16 KiB. The plans' subgroup size (the SUBGROUP_SIZE define) does not
// exist here: the WebGPU route plans with the default one, no define.
// Register tiling for naga, which unrolls no loop (see linear_gemm.inc.wgsl): the block is two
// `array<vec4<f32>, 4>` indexed by constants only, each reduction step one call, each thread's share of
// a tile's loads explicit calls into structs of registers, fetched for the next step before this step's
// products (the GLSL's PREFETCH; one workgroup-memory stage).
enable f16;

const TILE_M = 64u;
const TILE_N = 128u;
const TILE_K = 32u;
const THREADS_X = 16u;  // along N
const THREADS_Y = 16u;  // along M
const THREADS = THREADS_X * THREADS_Y;
const M4 = TILE_M / 4u;  // vec4<f16> per row of a_tile
const N4 = TILE_N / 4u;  // vec4<f16> per row of b_tile
const SCALE_EXPONENT_LIMIT = 60;

struct Params {
    vktrain_group_offset: vec4<u32>,
    M: u32,
    N: u32,
    K: u32,
    group_size: u32,  // q4gsw group size (COOPMAT_B 0 and 1)
    a_partials: u32,  // A_SCALE / AB_SCALE: per-workgroup maxima of |A| in the partials buffer
    b_partials: u32,  // AB_SCALE: and of |B|, after those of A
    k_slice: u32,     // the GLSL's split-K slice length; always 0 here: the WGSL route never splits K
}

@group(0) @binding(0) var<storage, read_write> c_out: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> a_src: array<vec4<f32>>;
#if COOPMAT_B == 0
@group(0) @binding(2) var<storage, read> w4x8: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;
#endif
#if COOPMAT_B == 1
@group(0) @binding(2) var<storage, read> w4x8: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> partial_absmax_bits: array<u32>;  // A_SCALE
@group(0) @binding(5) var<uniform> params: Params;
#endif
#if DENSE_B
@group(0) @binding(2) var<storage, read> b_src: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> partial_absmax_bits: array<u32>;  // AB_SCALE
#if ADDEND
@group(0) @binding(4) var<storage, read> addend: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(4) var<uniform> params: Params;
#endif
#endif

var<workgroup> a_tile: array<vec4<f16>, TILE_K * M4>;  // [k][m]
var<workgroup> b_tile: array<vec4<f16>, TILE_K * N4>;  // [k][n]
var<private> a_scale: f32 = 1.0;  // 2^e with A_SCALE / AB_SCALE (set in main), else 1
var<private> b_scale: f32 = 1.0;  // the same for a dense B with AB_SCALE

#if COOPMAT_B != 0
var<workgroup> operand_absmax: array<atomic<u32>, 2>;  // max |A|, max |B| as float bits

// The exponent e of the scale 2^e that puts an operand whose largest magnitude has these float bits in
// [2^14, 2^15); 0 for an all-zero or non-finite operand (zeros stay zeros, inf and NaN propagate).
fn scale_exponent(absmax_bits: u32) -> i32 {
    if (absmax_bits == 0u || absmax_bits >= 0x7f800000u) {
        return 0;
    }
    let exponent = i32(absmax_bits >> 23u) - 127;
    return clamp(14 - exponent, -SCALE_EXPONENT_LIMIT, SCALE_EXPONENT_LIMIT);
}

// operand_absmax = the uint max of the partials (A's first, then B's), by every thread of the workgroup.
fn reduce_partials(tid: u32) {
    if (tid < 2u) {
        atomicStore(&operand_absmax[tid], 0u);
    }
    workgroupBarrier();
    var a_bits = 0u;
    var b_bits = 0u;
    for (var i = tid; i < params.a_partials; i += THREADS) {
        a_bits = max(a_bits, partial_absmax_bits[i]);
    }
    for (var i = tid; i < params.b_partials; i += THREADS) {
        b_bits = max(b_bits, partial_absmax_bits[params.a_partials + i]);
    }
    atomicMax(&operand_absmax[0], a_bits);
    atomicMax(&operand_absmax[1], b_bits);
    workgroupBarrier();
}
#endif

// ---- A: fp32 [M, K] row-major; item v of a step is the vec4 at row m0 + v / 8, columns k0 + 4 (v % 8).
// A step's loads are fetched into registers (two vec4 per thread) before the previous step's products,
// and committed (scaled, rounded to f16, stored as [k][m]) after them.
fn fetch_a(m0: u32, k0: u32, v: u32) -> vec4<f32> {
    let m = m0 + v / (TILE_K / 4u);
    let k = k0 + 4u * (v % (TILE_K / 4u));
    if (m < params.M && k < params.K) {
        return a_src[(m * params.K + k) / 4u];
    }
    return vec4<f32>(0.0);
}

fn commit_a(v: u32, value: vec4<f32>) {
    let ml = v / (TILE_K / 4u);
    let kl = 4u * (v % (TILE_K / 4u));
    let h = vec4<f16>(value * a_scale);
    let column = ml / 4u;
    let lane = ml % 4u;
    a_tile[kl * M4 + column][lane] = h.x;
    a_tile[(kl + 1u) * M4 + column][lane] = h.y;
    a_tile[(kl + 2u) * M4 + column][lane] = h.z;
    a_tile[(kl + 3u) * M4 + column][lane] = h.w;
}

struct StagedA {
    value0: vec4<f32>,
    value1: vec4<f32>,
}

fn fetch_a_tile(m0: u32, k0: u32, tid: u32) -> StagedA {
    return StagedA(fetch_a(m0, k0, tid), fetch_a(m0, k0, tid + THREADS));
}

fn commit_a_tile(tid: u32, staged: StagedA) {
    commit_a(tid, staged.value0);
    commit_a(tid + THREADS, staged.value1);
}

#if !DENSE_B
// ---- B from W_4X8 (docs/spec/w4x8.md): 16-byte block (k4, n8) holds k = 4 k4 .. 4 k4 + 3 of rows
// 8 n8 .. 8 n8 + 7; its word j, byte t: k = 4 k4 + t of row 8 n8 + 2 j (low nibble) and 8 n8 + 2 j + 1.
// The rows are the weight's N_w out features, its columns the K_w in features. A word outside the
// matrix is code 8 with zero scales, and a row past N_w has a zero scale: both decode to +0.
fn weight_rows() -> u32 {
#if COOPMAT_B == 0
    return params.N;
#else
    return params.K;  // d_x: the reduction runs along the out features
#endif
}

fn weight_cols() -> u32 {
#if COOPMAT_B == 0
    return params.K;
#else
    return params.N;
#endif
}

fn row_scale(g: u32, n: u32) -> f32 {
    if (n >= weight_rows()) {
        return 0.0;
    }
    return scales[g * weight_rows() + n];
}

fn decode_low(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xfu)) - 8.0;
}

fn decode_high(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(0xfu)) - 8.0;
}

// Word v of a step (512 words: two per thread). Forward (B[k][n] = deq(W)[n][k]): 8 k4-rows of 64 words
// (16 blocks of 4); d_x (B[r][j] = deq(W)[r][j], r along the rows of W): 32 k4-rows of 16 words.
fn words_per_k4() -> u32 {
#if COOPMAT_B == 0
    return TILE_N / 2u;
#else
    return TILE_K / 2u;
#endif
}

// The word's row of W (the low nibbles; row + 1 the high ones).
fn word_row(j0: u32, r0: u32, v: u32) -> u32 {
#if COOPMAT_B == 0
    let n8 = j0 / 8u + (v % words_per_k4()) / 4u;
#else
    let n8 = r0 / 8u + (v % words_per_k4()) / 4u;
#endif
    return 8u * n8 + 2u * (v % 4u);
}

struct StagedWord {
    word: u32,
    scale: vec2<f32>,  // of rows row, row + 1
}

fn fetch_b(j0: u32, r0: u32, v: u32) -> StagedWord {
#if COOPMAT_B == 0
    let k4 = r0 / 4u + v / words_per_k4();
#else
    let k4 = j0 / 4u + v / words_per_k4();
#endif
    let row = word_row(j0, r0, v);
    let n8s = (weight_rows() / 4u + 1u) / 2u;
    if (4u * k4 < weight_cols() && row / 8u < n8s) {
        let g = (4u * k4) / params.group_size;
        return StagedWord(w4x8[4u * (k4 * n8s + row / 8u) + v % 4u],
                          vec2<f32>(row_scale(g, row), row_scale(g, row + 1u)));
    }
    return StagedWord(0x88888888u, vec2<f32>(0.0));
}

fn commit_b(j0: u32, r0: u32, v: u32, staged: StagedWord) {
    let row = word_row(j0, r0, v);
    let low16 = vec4<f16>(decode_low(staged.word) * staged.scale.x);
    let high16 = vec4<f16>(decode_high(staged.word) * staged.scale.y);
#if COOPMAT_B == 0
    // b_tile[k][n]: the two rows are adjacent columns n, n + 1 of one vec4 (n even), 4 k-rows.
    let nl = row - j0;
    let first = 4u * (v / words_per_k4()) * N4 + nl / 4u;
    let lane = nl % 4u;
    b_tile[first][lane] = low16.x;
    b_tile[first][lane + 1u] = high16.x;
    b_tile[first + N4][lane] = low16.y;
    b_tile[first + N4][lane + 1u] = high16.y;
    b_tile[first + 2u * N4][lane] = low16.z;
    b_tile[first + 2u * N4][lane + 1u] = high16.z;
    b_tile[first + 3u * N4][lane] = low16.w;
    b_tile[first + 3u * N4][lane + 1u] = high16.w;
#else
    // b_tile[r][j]: each row of W is a reduction row, its 4 k the vec4 of 4 output columns.
    let rl = row - r0;
    let column = v / words_per_k4();
    b_tile[rl * N4 + column] = low16;
    b_tile[(rl + 1u) * N4 + column] = high16;
#endif
}

struct StagedB {
    word0: StagedWord,
    word1: StagedWord,
}

fn fetch_b_tile(j0: u32, r0: u32, tid: u32) -> StagedB {
    return StagedB(fetch_b(j0, r0, tid), fetch_b(j0, r0, tid + THREADS));
}

fn commit_b_tile(j0: u32, r0: u32, tid: u32, staged: StagedB) {
    commit_b(j0, r0, tid, staged.word0);
    commit_b(j0, r0, tid + THREADS, staged.word1);
}
#else
// ---- dense B, scaled by b_scale: 1024 vec4 per step (four per thread).
fn fetch_b(j0: u32, r0: u32, v: u32) -> vec4<f32> {
#if COOPMAT_B == 2
    // B [K, N] row-major: vec4 v is row r0 + v / 32, columns j0 + 4 (v % 32).
    let k = r0 + v / N4;
    let n = j0 + 4u * (v % N4);
    if (k < params.K && n < params.N) {
        return b_src[(k * params.N + n) / 4u];
    }
#else
    // B^T [N, K] row-major: vec4 v is row j0 + v / 8 of B^T, columns r0 + 4 (v % 8).
    let n = j0 + v / (TILE_K / 4u);
    let k = r0 + 4u * (v % (TILE_K / 4u));
    if (n < params.N && k < params.K) {
        return b_src[(n * params.K + k) / 4u];
    }
#endif
    return vec4<f32>(0.0);
}

fn commit_b(j0: u32, r0: u32, v: u32, value: vec4<f32>) {
    let h = vec4<f16>(value * b_scale);
#if COOPMAT_B == 2
    b_tile[v] = h;  // [k][n] as read
#else
    // B^T's row n, columns k .. k + 3 scattered into [k][n].
    let nl = v / (TILE_K / 4u);
    let kl = 4u * (v % (TILE_K / 4u));
    let column = nl / 4u;
    let lane = nl % 4u;
    b_tile[kl * N4 + column][lane] = h.x;
    b_tile[(kl + 1u) * N4 + column][lane] = h.y;
    b_tile[(kl + 2u) * N4 + column][lane] = h.z;
    b_tile[(kl + 3u) * N4 + column][lane] = h.w;
#endif
}

struct StagedB {
    value0: vec4<f32>,
    value1: vec4<f32>,
    value2: vec4<f32>,
    value3: vec4<f32>,
}

fn fetch_b_tile(j0: u32, r0: u32, tid: u32) -> StagedB {
    return StagedB(fetch_b(j0, r0, tid), fetch_b(j0, r0, tid + THREADS), fetch_b(j0, r0, tid + 2u * THREADS),
                   fetch_b(j0, r0, tid + 3u * THREADS));
}

fn commit_b_tile(j0: u32, r0: u32, tid: u32, staged: StagedB) {
    commit_b(j0, r0, tid, staged.value0);
    commit_b(j0, r0, tid + THREADS, staged.value1);
    commit_b(j0, r0, tid + 2u * THREADS, staged.value2);
    commit_b(j0, r0, tid + 3u * THREADS, staged.value3);
}
#endif

// ---- the register block: Block[a] is row 4 ty + a, 4 columns.
alias Block = array<vec4<f32>, 4>;

fn rank1(block: ptr<function, Block>, column: vec4<f32>, row: vec4<f32>) {
    (*block)[0] += column.x * row;
    (*block)[1] += column.y * row;
    (*block)[2] += column.z * row;
    (*block)[3] += column.w * row;
}

// Reduction step k of the tiles: the f16 operands widened to f32 (so each product is exact), then summed.
fn multiply_step(k: u32, tx: u32, ty: u32, lo: ptr<function, Block>, hi: ptr<function, Block>) {
    let a = vec4<f32>(a_tile[k * M4 + ty]);
    rank1(lo, a, vec4<f32>(b_tile[k * N4 + tx]));
    rank1(hi, a, vec4<f32>(b_tile[k * N4 + tx + THREADS_X]));
}

// Row i of C at columns j .. j + 3 (N % 4 == 0: all four inside or all outside), unscaled, + the addend.
fn store_row(i: u32, j: u32, value: vec4<f32>, inverse_scale: f32) {
    if (i >= params.M || j >= params.N) {
        return;
    }
    let index = (i * params.N + j) / 4u;
    let unscaled = value * inverse_scale;  // a power of two: exact
#if ADDEND
    c_out[index] = unscaled + addend[index];
#else
    c_out[index] = unscaled;
#endif
}

fn store_block(i: u32, j: u32, block: Block, inverse_scale: f32) {
    store_row(i, j, block[0], inverse_scale);
    store_row(i + 1u, j, block[1], inverse_scale);
    store_row(i + 2u, j, block[2], inverse_scale);
    store_row(i + 3u, j, block[3], inverse_scale);
}

@compute @workgroup_size(THREADS_X, THREADS_Y, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tx = local.x;
    let ty = local.y;
    let tid = ty * THREADS_X + tx;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let m0 = group.y * TILE_M;
    let n0 = group.x * TILE_N;
    var exponent = 0;  // of the product of the operand scales, undone before the store
#if A_SCALE
    reduce_partials(tid);
    let a_exponent = scale_exponent(atomicLoad(&operand_absmax[0]));
    a_scale = ldexp(1.0, a_exponent);
    exponent += a_exponent;
#endif
#if AB_SCALE
    reduce_partials(tid);
    let a_exponent = scale_exponent(atomicLoad(&operand_absmax[0]));
    let b_exponent = scale_exponent(atomicLoad(&operand_absmax[1]));
    a_scale = ldexp(1.0, a_exponent);
    b_scale = ldexp(1.0, b_exponent);
    exponent += a_exponent + b_exponent;
#endif

    var lo = Block();  // columns n0 + 4 tx ..
    var hi = Block();  // columns n0 + 64 + 4 tx ..
    // The next step's global loads are issued before this step's products (their latency behind them).
    var a_next = fetch_a_tile(m0, 0u, tid);
    var b_next = fetch_b_tile(n0, 0u, tid);
    for (var k0 = 0u; k0 < params.K; k0 += TILE_K) {
        commit_a_tile(tid, a_next);
        commit_b_tile(n0, k0, tid, b_next);
        workgroupBarrier();
        if (k0 + TILE_K < params.K) {
            a_next = fetch_a_tile(m0, k0 + TILE_K, tid);
            b_next = fetch_b_tile(n0, k0 + TILE_K, tid);
        }
        for (var k = 0u; k < TILE_K; k += 8u) {
            multiply_step(k, tx, ty, &lo, &hi);
            multiply_step(k + 1u, tx, ty, &lo, &hi);
            multiply_step(k + 2u, tx, ty, &lo, &hi);
            multiply_step(k + 3u, tx, ty, &lo, &hi);
            multiply_step(k + 4u, tx, ty, &lo, &hi);
            multiply_step(k + 5u, tx, ty, &lo, &hi);
            multiply_step(k + 6u, tx, ty, &lo, &hi);
            multiply_step(k + 7u, tx, ty, &lo, &hi);
        }
        workgroupBarrier();
    }

    let inverse_scale = ldexp(1.0, -exponent);
    let i = m0 + 4u * ty;
    let j = n0 + 4u * tx;
    store_block(i, j, lo, inverse_scale);
    store_block(i, j + TILE_N / 2u, hi, inverse_scale);
}

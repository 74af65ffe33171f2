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
// scratch that linear_splitk_reduce adds up.
//
// Placement (forward, d_x; one window of a GEMM split over storage bindings, kernels/linear.py
// `GemmPlacement`): source row i starts at element a_offset + i a_row_stride of binding 1, C's row i at
// c_offset + i c_row_stride of binding 0, the W_4X8 words at word w_offset of binding 2, the scales at
// element s_offset of binding 3. ACCUMULATE (forward): each output's sum starts from the value
// binding 0 holds (the previous window of K's partial) instead of 0: the unsplit products, in order.
//
// Register tiling for naga: wgpu's compiler emits every WGSL loop as an unbounded `loop` with an
// added trip counter, which GPU drivers do not unroll, and a private array indexed by a loop variable
// then lives in (slow, per-thread) memory. So no hot loop here indexes a private array: the 8 x 8 block
// is four `array<vec4<f32>, 4>` accumulators indexed by constants only, each reduction step is one
// call of `multiply_step` (eight explicit calls per trip of the reduction loop, BK being a multiple of
// 8), and the global loads of a step are issued LOAD_CHUNK at a time before any is stored (and, where a
// thread's share of a tile is one such chunk, as with the default tiles, issued before the previous
// step's arithmetic, as the GLSL prefetches them). Each
// accumulator element sums its products in the GLSL's order (r ascending, one multiply and one add per
// product), so the results equal the GLSL's wherever the two compilers contract alike (bit-identical on
// lavapipe). Larger shares (small test tiles) are not prefetched: that would need per-thread staging
// sized by the overrides, which WGSL has no unrolled arrays for.

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
    a_offset: u32,    // placement (above; dW's inputs ignore it)
    a_row_stride: u32,
    c_offset: u32,
    c_row_stride: u32,
    w_offset: u32,
    s_offset: u32,
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

const LOAD_CHUNK = 4u;  // global loads a thread issues together (explicit, as naga unrolls nothing)

#if LINEAR_MODE != 2
fn n8_count() -> u32 { return (params.N / 4u + 1u) / 2u; }

// The scale of weight row n in group g; rows n >= N exist only as W_4X8 padding, so they scale by 0.
fn scale_at(g: u32, n: u32) -> f32 {
    if (n >= params.N) {
        return 0.0;
    }
    return scales[params.s_offset + g * params.N + n];
}

// Codes of one W_4X8 word for the row pair (n, n + 1): byte t holds k = 4 k4 + t, low nibble row n.
fn decode_low(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xfu)) - 8.0;
}
fn decode_high(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(0xfu)) - 8.0;
}
#endif

// ---- the A tile: BK x BM values as vec4s; dW reads them along i, the other modes along r (transposed).
fn a_vecs() -> u32 { return BK * 2u * THREADS_Y; }

// Element v of the A tile of the step at r0 (zero outside the matrix or past the tile).
fn fetch_a(r0: u32, i0: u32, v: u32) -> vec4<f32> {
    if (v >= a_vecs()) {
        return vec4<f32>(0.0);
    }
#if LINEAR_MODE == 2
    // A[r = m, i = n] = d_out[m, n], read along i.
    let bm4 = 2u * THREADS_Y;
    let m = r0 + v / bm4;
    let n = i0 + 4u * (v % bm4);
    if (m < params.M && n < params.N) {
        return a_src[(m * params.N + n) / 4u];
    }
#else
    // A[r, i] = src[i, r]: BK/4 consecutive threads read BK contiguous floats of one source row.
    let red = reduction_total();
    let m = i0 + v / (BK / 4u);
    let r = r0 + 4u * (v % (BK / 4u));
    if (m < params.M && r < red) {
        return a_src[(params.a_offset + m * params.a_row_stride + r) / 4u];
    }
#endif
    return vec4<f32>(0.0);
}

fn commit_a(v: u32, value: vec4<f32>) {
    if (v >= a_vecs()) {
        return;
    }
#if LINEAR_MODE == 2
    a_tile[v] = value;
#else
    let bm4 = 2u * THREADS_Y;
    let i = v / (BK / 4u);
    let r = 4u * (v % (BK / 4u));
    a_tile[r * bm4 + i / 4u][i % 4u] = value.x;
    a_tile[(r + 1u) * bm4 + i / 4u][i % 4u] = value.y;
    a_tile[(r + 2u) * bm4 + i / 4u][i % 4u] = value.z;
    a_tile[(r + 3u) * bm4 + i / 4u][i % 4u] = value.w;
#endif
}

// LOAD_CHUNK loads of A (elements first, first + threads, ...): all fetched, then all stored.
struct ChunkA {
    value0: vec4<f32>,
    value1: vec4<f32>,
    value2: vec4<f32>,
    value3: vec4<f32>,
}

fn fetch_a_chunk(r0: u32, i0: u32, first: u32) -> ChunkA {
    let threads = THREADS_X * THREADS_Y;
    return ChunkA(fetch_a(r0, i0, first), fetch_a(r0, i0, first + threads), fetch_a(r0, i0, first + 2u * threads),
                  fetch_a(r0, i0, first + 3u * threads));
}

fn commit_a_chunk(first: u32, chunk: ChunkA) {
    let threads = THREADS_X * THREADS_Y;
    commit_a(first, chunk.value0);
    commit_a(first + threads, chunk.value1);
    commit_a(first + 2u * threads, chunk.value2);
    commit_a(first + 3u * threads, chunk.value3);
}

fn load_a(r0: u32, i0: u32, tid: u32) {
    for (var v = tid; v < a_vecs(); v += LOAD_CHUNK * THREADS_X * THREADS_Y) {
        commit_a_chunk(v, fetch_a_chunk(r0, i0, v));
    }
}

// ---- the B tile.
#if LINEAR_MODE == 2
// B of dW: x[m, k] rows, read along j and stored as they are.
fn b_items() -> u32 { return BK * 2u * THREADS_X; }

alias Staged = vec4<f32>;

fn fetch_b(r0: u32, j0: u32, v: u32) -> Staged {
    let bn4 = 2u * THREADS_X;
    let m = r0 + v / bn4;
    let k = j0 + 4u * (v % bn4);
    if (v < b_items() && m < params.M && k < params.K) {
        return x[(m * params.K + k) / 4u];
    }
    return vec4<f32>(0.0);
}

fn commit_b(v: u32, value: Staged) {
    if (v < b_items()) {
        b_tile[v] = value;
    }
}
#else
// B from W_4X8: one word = 4 consecutive k x the row pair (n, n + 1), scaled by those rows' scales
// (0 for words outside the matrix, so they decode to 0 whatever the word holds).
//   forward: the tile spans BK/4 k4-rows of BN/8 blocks; d_x: BN/4 k4-rows of BK/8 blocks.
#if LINEAR_MODE == 0
fn b_words_per_k4() -> u32 { return 4u * THREADS_X; }  // BN / 2
fn b_items() -> u32 { return (BK / 4u) * b_words_per_k4(); }
#else
fn b_words_per_k4() -> u32 { return BK / 2u; }
fn b_items() -> u32 { return 2u * THREADS_X * b_words_per_k4(); }  // BN / 4 k4-rows
#endif

struct Staged {
    word: u32,
    scale: vec2<f32>,
}

fn fetch_b(r0: u32, j0: u32, v: u32) -> Staged {
    var staged = Staged(0u, vec2<f32>(0.0));
    if (v >= b_items()) {
        return staged;
    }
    let k4l = v / b_words_per_k4();
    let rest = v % b_words_per_k4();
#if LINEAR_MODE == 0
    let k4 = r0 / 4u + k4l;
    let n8 = j0 / 8u + rest / 4u;
#else
    let k4 = j0 / 4u + k4l;
    let n8 = r0 / 8u + rest / 4u;
#endif
    let n8s = n8_count();
    if (4u * k4 < params.K && n8 < n8s) {
        let jw = rest % 4u;
        let g = (4u * k4) / params.group_size;
        let n = 8u * n8 + 2u * jw;
        staged.word = w4x8[params.w_offset + 4u * (k4 * n8s + n8) + jw];
        staged.scale = vec2<f32>(scale_at(g, n), scale_at(g, n + 1u));
    }
    return staged;
}

fn commit_b(v: u32, staged: Staged) {
    if (v >= b_items()) {
        return;
    }
    let bn4 = 2u * THREADS_X;
    let k4l = v / b_words_per_k4();
    let rest = v % b_words_per_k4();
    let pair = 8u * (rest / 4u) + 2u * (rest % 4u);  // tile-local n of the even row
    let low = decode_low(staged.word) * staged.scale.x;    // row n, k = 4 k4 + 0..3
    let high = decode_high(staged.word) * staged.scale.y;  // row n + 1
#if LINEAR_MODE == 0
    // b_tile[k][n]: the pair is two adjacent floats of one vec4 (pair is even).
    let column = pair / 4u;
    let lane = pair % 4u;
    let first = 4u * k4l * bn4 + column;
    b_tile[first][lane] = low.x;
    b_tile[first][lane + 1u] = high.x;
    b_tile[first + bn4][lane] = low.y;
    b_tile[first + bn4][lane + 1u] = high.y;
    b_tile[first + 2u * bn4][lane] = low.z;
    b_tile[first + 2u * bn4][lane + 1u] = high.z;
    b_tile[first + 3u * bn4][lane] = low.w;
    b_tile[first + 3u * bn4][lane + 1u] = high.w;
#else
    // b_tile[n][k]: each row of the pair takes one vec4 (4 consecutive k).
    b_tile[pair * bn4 + k4l] = low;
    b_tile[(pair + 1u) * bn4 + k4l] = high;
#endif
}
#endif

struct ChunkB {
    staged0: Staged,
    staged1: Staged,
    staged2: Staged,
    staged3: Staged,
}

fn fetch_b_chunk(r0: u32, j0: u32, first: u32) -> ChunkB {
    let threads = THREADS_X * THREADS_Y;
    return ChunkB(fetch_b(r0, j0, first), fetch_b(r0, j0, first + threads), fetch_b(r0, j0, first + 2u * threads),
                  fetch_b(r0, j0, first + 3u * threads));
}

fn commit_b_chunk(first: u32, chunk: ChunkB) {
    let threads = THREADS_X * THREADS_Y;
    commit_b(first, chunk.staged0);
    commit_b(first + threads, chunk.staged1);
    commit_b(first + 2u * threads, chunk.staged2);
    commit_b(first + 3u * threads, chunk.staged3);
}

fn load_b(r0: u32, j0: u32, tid: u32) {
    for (var v = tid; v < b_items(); v += LOAD_CHUNK * THREADS_X * THREADS_Y) {
        commit_b_chunk(v, fetch_b_chunk(r0, j0, v));
    }
}

// ---- the register block: rows 4 ty + 0..3 (+ BM/2 for the high half) x columns 4 tx + 0..3 (+ BN/2).
alias Block = array<vec4<f32>, 4>;  // [a]: one row of 4 columns

// block[a] += column[a] * row: four rows of one outer-product update.
fn rank1(block: ptr<function, Block>, column: vec4<f32>, row: vec4<f32>) {
    (*block)[0] += column.x * row;
    (*block)[1] += column.y * row;
    (*block)[2] += column.z * row;
    (*block)[3] += column.w * row;
}

// Reduction step r of the tiles in workgroup memory into the thread's four blocks
// (lo_lo: rows low half x columns low half, lo_hi, hi_lo, hi_hi).
fn multiply_step(r: u32, tx: u32, ty: u32, lo_lo: ptr<function, Block>, lo_hi: ptr<function, Block>,
                 hi_lo: ptr<function, Block>, hi_hi: ptr<function, Block>) {
    let bm4 = 2u * THREADS_Y;
    let bn4 = 2u * THREADS_X;
    let a_lo = a_tile[r * bm4 + ty];
    let a_hi = a_tile[r * bm4 + ty + THREADS_Y];
    let b_lo = b_tile[r * bn4 + tx];
    let b_hi = b_tile[r * bn4 + tx + THREADS_X];
    rank1(lo_lo, a_lo, b_lo);
    rank1(lo_hi, a_lo, b_hi);
    rank1(hi_lo, a_hi, b_lo);
    rank1(hi_hi, a_hi, b_hi);
}

// Stores row i (skipped past the output) at columns j .. j+3 (cols % 4 == 0: all 4 in or all out).
fn store_row(i: u32, j: u32, z: u32, value: vec4<f32>) {
    let rows = rows_total();
    let cols = cols_total();
    if (i >= rows || j >= cols) {
        return;
    }
    // Slice z of the split-K scratch (contiguous: c_row_stride = cols), or C itself (z = 0).
    let index = (params.c_offset + (z * rows + i) * params.c_row_stride + j) / 4u;
#if HAS_BIAS
    c_out[index] = value + bias[j / 4u];  // the plan never combines HAS_BIAS with SPLIT_K > 1
#else
    c_out[index] = value;
#endif
}

#if LINEAR_MODE == 0
#if ACCUMULATE
// Row i's columns j .. j+3 of what C holds (0 past the output): where an ACCUMULATE sum starts.
fn load_row(i: u32, j: u32) -> vec4<f32> {
    if (i >= rows_total() || j >= cols_total()) {
        return vec4<f32>(0.0);
    }
    return c_out[(params.c_offset + i * params.c_row_stride + j) / 4u];
}

fn load_block(i: u32, j: u32) -> Block {
    return Block(load_row(i, j), load_row(i + 1u, j), load_row(i + 2u, j), load_row(i + 3u, j));
}
#endif
#endif

fn store_block(i: u32, j: u32, z: u32, block: Block) {
    store_row(i, j, z, block[0]);
    store_row(i + 1u, j, z, block[1]);
    store_row(i + 2u, j, z, block[2]);
    store_row(i + 3u, j, z, block[3]);
}

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
    let red = reduction_total();
    if (i0 >= rows_total()) {
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

    var lo_lo = Block();
    var lo_hi = Block();
    var hi_lo = Block();
    var hi_hi = Block();
#if LINEAR_MODE == 0
#if ACCUMULATE
    lo_lo = load_block(i0 + 4u * ty, j0 + 4u * tx);
    lo_hi = load_block(i0 + 4u * ty, j0 + 4u * tx + bn / 2u);
    hi_lo = load_block(i0 + 4u * ty + bm / 2u, j0 + 4u * tx);
    hi_hi = load_block(i0 + 4u * ty + bm / 2u, j0 + 4u * tx + bn / 2u);
#endif
#endif
    // Where a thread's share of each tile is one chunk (the default tiles), the next step's loads are
    // issued before this step's arithmetic, as in the GLSL; larger shares load after the barrier.
    let threads = THREADS_X * THREADS_Y;
    let prefetch = a_vecs() <= LOAD_CHUNK * threads && b_items() <= LOAD_CHUNK * threads;
    var a_next = ChunkA();
    var b_next = ChunkB();
    if (prefetch) {
        a_next = fetch_a_chunk(r_begin, i0, tid);
        b_next = fetch_b_chunk(r_begin, j0, tid);
    }
    for (var r0 = r_begin; r0 < r_end; r0 += BK) {
        if (prefetch) {
            commit_a_chunk(tid, a_next);
            commit_b_chunk(tid, b_next);
        } else {
            load_a(r0, i0, tid);
            load_b(r0, j0, tid);
        }
        workgroupBarrier();
        if (prefetch && r0 + BK < r_end) {  // the next step's global loads overlap this step's arithmetic
            a_next = fetch_a_chunk(r0 + BK, i0, tid);
            b_next = fetch_b_chunk(r0 + BK, j0, tid);
        }
        for (var r = 0u; r < BK; r += 8u) {  // BK % 8 == 0 (GemmTiles)
            multiply_step(r, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 1u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 2u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 3u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 4u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 5u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 6u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
            multiply_step(r + 7u, tx, ty, &lo_lo, &lo_hi, &hi_lo, &hi_hi);
        }
        workgroupBarrier();
    }

    let i_lo = i0 + 4u * ty;
    let j_lo = j0 + 4u * tx;
    store_block(i_lo, j_lo, group.z, lo_lo);
    store_block(i_lo, j_lo + bn / 2u, group.z, lo_hi);
    store_block(i_lo + bm / 2u, j_lo, group.z, hi_lo);
    store_block(i_lo + bm / 2u, j_lo + bn / 2u, group.z, hi_hi);
}

// Causal self-attention backward, flash-style (GLSL reference: ../attention_bwd.comp; host module:
// kernels/attention.py). Inputs as attention_fwd plus d_out, lse [B, Hq, S] and delta [B, Hq, S]
// (attention_bwd_delta). With P recomputed from lse:
//   P_ij = exp(scale q_i . k_j - lse_i) (j <= i, else 0);  dS_ij = P_ij (d_out_i . v_j - delta_i)
//   d_q_i = scale sum_j dS_ij k_j;  d_k_j = scale sum_{group heads} sum_i dS_ij q_i;
//   d_v_j = sum_{group heads} sum_i P_ij d_out_i
//   DQ   one workgroup per (ROWS queries, query head, batch); streams key tiles [0, last query].
//   DKV  one workgroup per (ROWS keys, kv head, batch); streams, per query head of the group in order,
//        the query tiles from the diagonal on, accumulating d_k and d_v in a fixed order (no atomics).
// Thread (row r, lane t): scores of row r against streamed rows t, t + TPR, ...; output vec4s t, t + TPR, ...
// Registers as in attention_fwd.wgsl: the per-thread arrays (Scores, Chunks) are indexed by constants
// only, each entry guarded by its count, the loops over the head dim and the streamed rows take
// STEPS_PER_TRIP explicit steps a trip, and every entry adds its terms in the GLSL's order.
// DOCUMENTS (packed documents, as attention_fwd.wgsl): positions [B, S] i32 after the outputs (binding 7
// for DQ, 8 for DKV); P_ij = 0 unless document_start(i) <= j. DQ skips the key tiles before its first
// query's document; DKV stops at the first query tile whose first query's document starts after the key
// tile's last key.
// vktrain-variants: DQ, DKV, DQ+DOCUMENTS, DKV+DOCUMENTS

@id(0) override WG: u32 = 64u;    // ROWS * TPR
@id(3) override D: u32 = 64u;     // head dim, a multiple of 4 TPR
@id(4) override ROWS: u32 = 16u;  // rows a workgroup owns (queries for DQ, keys for DKV)
@id(5) override COLS: u32 = 16u;  // rows per streamed tile, a multiple of TPR
@id(6) override TPR: u32 = 4u;    // threads per owned row

const MAX_CHUNKS = 8u;  // D / 4 / TPR at D = 128, TPR = 4 (the plans' largest is 4)
const MAX_COLS = 8u;    // COLS / TPR at COLS = 32, TPR = 4
// The WebGPU runtime refuses, at load, a dispatch whose overrides break these (reflect.py):
// vktrain-requires: D / 4u / TPR <= MAX_CHUNKS -- gradient vec4s per thread, registers dq / dk / dv
// vktrain-requires: COLS / TPR <= MAX_COLS -- scores per thread and tile, registers dot_qk / dot_dov

const STEPS_PER_TRIP = 4u;  // explicit calls per trip of the unrolled loops

alias Chunks = array<vec4<f32>, MAX_CHUNKS>;  // [i]: gradient vec4 lane + TPR i of the thread's row
alias Scores = array<f32, MAX_COLS>;          // [j]: against streamed row lane + TPR j of the tile

// The thread's two dot products per streamed row: q . k (the score, unscaled) and d_out . v.
struct Dots {
    qk: Scores,
    dov: Scores,
}

struct Params {
    vktrain_group_offset: vec4<u32>,
    S: u32,
    Hq: u32,
    Hkv: u32,
    scale: f32,
}

@group(0) @binding(0) var<storage, read> d_out: array<vec4<f32>>;  // [B, S, Hq, D]
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;      // [B, S, Hq, D]
@group(0) @binding(2) var<storage, read> k: array<vec4<f32>>;      // [B, S, Hkv, D]
@group(0) @binding(3) var<storage, read> v: array<vec4<f32>>;      // [B, S, Hkv, D]
@group(0) @binding(4) var<storage, read> lse: array<f32>;          // [B, Hq, S]
@group(0) @binding(5) var<storage, read> delta: array<f32>;        // [B, Hq, S]
#if DQ
@group(0) @binding(6) var<storage, read_write> d_q: array<vec4<f32>>;  // [B, S, Hq, D]
#if DOCUMENTS
@group(0) @binding(7) var<storage, read> positions: array<i32>;        // [B, S]
@group(0) @binding(8) var<uniform> params: Params;
#else
@group(0) @binding(7) var<uniform> params: Params;
#endif
#else
@group(0) @binding(6) var<storage, read_write> d_k: array<vec4<f32>>;  // [B, S, Hkv, D]
@group(0) @binding(7) var<storage, read_write> d_v: array<vec4<f32>>;  // [B, S, Hkv, D]
#if DOCUMENTS
@group(0) @binding(8) var<storage, read> positions: array<i32>;        // [B, S]
@group(0) @binding(9) var<uniform> params: Params;
#else
@group(0) @binding(8) var<uniform> params: Params;
#endif
#endif

#if DOCUMENTS
// The first key query `query` (< S) of batch row b sees: its document's first token, clamped to the row.
fn document_start(b: u32, query: u32) -> u32 {
    return query - u32(clamp(positions[b * params.S + query], 0, i32(query)));
}
#else
fn document_start(b: u32, query: u32) -> u32 { return 0u; }
#endif

fn source_index(seq: u32, b: u32, head: u32, heads: u32, col4: u32) -> u32 {
    return ((b * params.S + seq) * heads + head) * (D / 4u) + col4;
}

fn chunk_count() -> u32 { return D / 4u / TPR; }
fn col_count() -> u32 { return COLS / TPR; }

#if DQ
var<workgroup> q_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> do_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> k_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> v_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> ds_tile: array<f32, ROWS * (COLS + 1u)>;

// One d4 step of the thread's dots against key rows at + j TPR rows.
fn score_step(dots: ptr<function, Dots>, q_value: vec4<f32>, do_value: vec4<f32>, at: u32) {
    let dot_qk = &(*dots).qk;
    let dot_dov = &(*dots).dov;
    let step = TPR * (D / 4u + 1u);
    (*dot_qk)[0] += dot(q_value, k_tile[at]);
    (*dot_dov)[0] += dot(do_value, v_tile[at]);
    if (col_count() > 1u) {
        (*dot_qk)[1] += dot(q_value, k_tile[at + step]);
        (*dot_dov)[1] += dot(do_value, v_tile[at + step]);
    }
    if (col_count() > 2u) {
        (*dot_qk)[2] += dot(q_value, k_tile[at + 2u * step]);
        (*dot_dov)[2] += dot(do_value, v_tile[at + 2u * step]);
    }
    if (col_count() > 3u) {
        (*dot_qk)[3] += dot(q_value, k_tile[at + 3u * step]);
        (*dot_dov)[3] += dot(do_value, v_tile[at + 3u * step]);
    }
    if (col_count() > 4u) {
        (*dot_qk)[4] += dot(q_value, k_tile[at + 4u * step]);
        (*dot_dov)[4] += dot(do_value, v_tile[at + 4u * step]);
    }
    if (col_count() > 5u) {
        (*dot_qk)[5] += dot(q_value, k_tile[at + 5u * step]);
        (*dot_dov)[5] += dot(do_value, v_tile[at + 5u * step]);
    }
    if (col_count() > 6u) {
        (*dot_qk)[6] += dot(q_value, k_tile[at + 6u * step]);
        (*dot_dov)[6] += dot(do_value, v_tile[at + 6u * step]);
    }
    if (col_count() > 7u) {
        (*dot_qk)[7] += dot(q_value, k_tile[at + 7u * step]);
        (*dot_dov)[7] += dot(do_value, v_tile[at + 7u * step]);
    }
}

// The row's statistics, for dS of the thread's keys.
struct Row {
    query: u32,
    valid: bool,  // the query is inside the sequence
    lse: f32,
    delta: f32,
    first_key: u32,  // its document's first token (0 without documents)
}

// dS of query row.query against key `key` into ds_tile[at]; 0 where masked.
fn store_ds(at: u32, key: u32, row: Row, dot_qk: f32, dot_dov: f32) {
    var ds = 0.0;
    if (row.valid && key <= row.query && key >= row.first_key) {  // key <= query < S: inside the sequence
        let p = exp(dot_qk * params.scale - row.lse);
        ds = p * (dot_dov - row.delta);
    }
    ds_tile[at] = ds;
}

// The thread's dots against the key tile: the owned row's q_tile / do_tile[row_at ..] against
// k_tile / v_tile rows col_at + j TPR rows, d4 ascending.
fn score_tile(row_at: u32, col_at: u32) -> Dots {
    var dots = Dots();
    let steps = D / 4u;
    let unrolled = steps / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var d4 = 0u; d4 < unrolled; d4 += STEPS_PER_TRIP) {
        score_step(&dots, q_tile[row_at + d4], do_tile[row_at + d4], col_at + d4);
        score_step(&dots, q_tile[row_at + d4 + 1u], do_tile[row_at + d4 + 1u], col_at + d4 + 1u);
        score_step(&dots, q_tile[row_at + d4 + 2u], do_tile[row_at + d4 + 2u], col_at + d4 + 2u);
        score_step(&dots, q_tile[row_at + d4 + 3u], do_tile[row_at + d4 + 3u], col_at + d4 + 3u);
    }
    for (var d4 = unrolled; d4 < steps; d4++) {
        score_step(&dots, q_tile[row_at + d4], do_tile[row_at + d4], col_at + d4);
    }
    return dots;
}

// dS of the thread's keys key + j TPR (tile columns at + j TPR).
fn store_ds_row(at: u32, key: u32, row: Row, dots: Dots) {
    let dot_qk = dots.qk;
    let dot_dov = dots.dov;
    store_ds(at, key, row, dot_qk[0], dot_dov[0]);
    if (col_count() > 1u) { store_ds(at + TPR, key + TPR, row, dot_qk[1], dot_dov[1]); }
    if (col_count() > 2u) { store_ds(at + 2u * TPR, key + 2u * TPR, row, dot_qk[2], dot_dov[2]); }
    if (col_count() > 3u) { store_ds(at + 3u * TPR, key + 3u * TPR, row, dot_qk[3], dot_dov[3]); }
    if (col_count() > 4u) { store_ds(at + 4u * TPR, key + 4u * TPR, row, dot_qk[4], dot_dov[4]); }
    if (col_count() > 5u) { store_ds(at + 5u * TPR, key + 5u * TPR, row, dot_qk[5], dot_dov[5]); }
    if (col_count() > 6u) { store_ds(at + 6u * TPR, key + 6u * TPR, row, dot_qk[6], dot_dov[6]); }
    if (col_count() > 7u) { store_ds(at + 7u * TPR, key + 7u * TPR, row, dot_qk[7], dot_dov[7]); }
}

// dq[i] += ds * k_tile[at + TPR i]: one key row into the thread's d_q vec4s.
fn add_key(dq: ptr<function, Chunks>, ds: f32, at: u32) {
    (*dq)[0] += ds * k_tile[at];
    if (chunk_count() > 1u) { (*dq)[1] += ds * k_tile[at + TPR]; }
    if (chunk_count() > 2u) { (*dq)[2] += ds * k_tile[at + 2u * TPR]; }
    if (chunk_count() > 3u) { (*dq)[3] += ds * k_tile[at + 3u * TPR]; }
    if (chunk_count() > 4u) { (*dq)[4] += ds * k_tile[at + 4u * TPR]; }
    if (chunk_count() > 5u) { (*dq)[5] += ds * k_tile[at + 5u * TPR]; }
    if (chunk_count() > 6u) { (*dq)[6] += ds * k_tile[at + 6u * TPR]; }
    if (chunk_count() > 7u) { (*dq)[7] += ds * k_tile[at + 7u * TPR]; }
}

// The key tile's rows, ascending, into dq (dS of row s_at in ds_tile).
fn add_tile(dq: ptr<function, Chunks>, s_at: u32, k_at: u32) {
    let stride = D / 4u + 1u;
    let unrolled = COLS / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var c = 0u; c < unrolled; c += STEPS_PER_TRIP) {
        add_key(dq, ds_tile[s_at + c], k_at + c * stride);
        add_key(dq, ds_tile[s_at + c + 1u], k_at + (c + 1u) * stride);
        add_key(dq, ds_tile[s_at + c + 2u], k_at + (c + 2u) * stride);
        add_key(dq, ds_tile[s_at + c + 3u], k_at + (c + 3u) * stride);
    }
    for (var c = unrolled; c < COLS; c++) {
        add_key(dq, ds_tile[s_at + c], k_at + c * stride);
    }
}

fn store_dq(dq: Chunks, at: u32) {
    d_q[at] = dq[0] * params.scale;
    if (chunk_count() > 1u) { d_q[at + TPR] = dq[1] * params.scale; }
    if (chunk_count() > 2u) { d_q[at + 2u * TPR] = dq[2] * params.scale; }
    if (chunk_count() > 3u) { d_q[at + 3u * TPR] = dq[3] * params.scale; }
    if (chunk_count() > 4u) { d_q[at + 4u * TPR] = dq[4] * params.scale; }
    if (chunk_count() > 5u) { d_q[at + 5u * TPR] = dq[5] * params.scale; }
    if (chunk_count() > 6u) { d_q[at + 6u * TPR] = dq[6] * params.scale; }
    if (chunk_count() > 7u) { d_q[at + 7u * TPR] = dq[7] * params.scale; }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = COLS + 1u;
    let group = workgroup + params.vktrain_group_offset.xyz;
    // Heaviest tiles (the last queries, which see the most keys) first.
    let q_tiles = (params.S + ROWS - 1u) / ROWS;
    let q_start = (q_tiles - 1u - group.x) * ROWS;
    let head = group.y;
    let b = group.z;
    let kv_head = head / (params.Hq / params.Hkv);
    let row = tid / TPR;
    let lane = tid % TPR;
    let query = q_start + row;
    let q_end = min(q_start + ROWS, params.S);

    for (var idx = tid; idx < ROWS * d4s; idx += WG) {
        let seq = q_start + idx / d4s;
        var q_value = vec4<f32>(0.0);
        var do_value = vec4<f32>(0.0);
        if (seq < params.S) {
            let index = source_index(seq, b, head, params.Hq, idx % d4s);
            q_value = q[index];
            do_value = d_out[index];
        }
        q_tile[(idx / d4s) * stride + idx % d4s] = q_value;
        do_tile[(idx / d4s) * stride + idx % d4s] = do_value;
    }
    let valid_query = query < params.S;
    let stat_index = (b * params.Hq + head) * params.S + min(query, params.S - 1u);
    var first_key = query;
    if (valid_query) {
        first_key = document_start(b, query);
    }
    let stats = Row(query, valid_query, select(0.0, lse[stat_index], valid_query),
                    select(0.0, delta[stat_index], valid_query), first_key);
    let k_begin = document_start(b, q_start) / COLS * COLS;  // uniform: the tile's earliest document start

    var dq = Chunks();
    for (var k_start = k_begin; k_start < q_end; k_start += COLS) {
        workgroupBarrier();  // the previous K / V / dS tiles are consumed
        for (var idx = tid; idx < COLS * d4s; idx += WG) {
            let seq = k_start + idx / d4s;
            var k_value = vec4<f32>(0.0);
            var v_value = vec4<f32>(0.0);
            if (seq < params.S) {
                let index = source_index(seq, b, kv_head, params.Hkv, idx % d4s);
                k_value = k[index];
                v_value = v[index];
            }
            k_tile[(idx / d4s) * stride + idx % d4s] = k_value;
            v_tile[(idx / d4s) * stride + idx % d4s] = v_value;
        }
        workgroupBarrier();

        store_ds_row(row * score_stride + lane, k_start + lane, stats, score_tile(row * stride, lane * stride));
        workgroupBarrier();

        add_tile(&dq, row * score_stride, lane);
    }

    if (valid_query) {
        store_dq(dq, source_index(query, b, head, params.Hq, lane));
    }
}
#else
var<workgroup> k_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> v_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> q_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> do_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> p_tile: array<f32, ROWS * (COLS + 1u)>;
var<workgroup> ds_tile: array<f32, ROWS * (COLS + 1u)>;
var<workgroup> lse_tile: array<f32, COLS>;
var<workgroup> delta_tile: array<f32, COLS>;
var<private> b_row: u32;  // the workgroup's batch row (store_p_ds reads its queries' document starts)

// One d4 step of the thread's dots against query rows at + j TPR rows.
fn score_step(dots: ptr<function, Dots>, k_value: vec4<f32>, v_value: vec4<f32>, at: u32) {
    let dot_qk = &(*dots).qk;
    let dot_dov = &(*dots).dov;
    let step = TPR * (D / 4u + 1u);
    (*dot_qk)[0] += dot(q_tile[at], k_value);
    (*dot_dov)[0] += dot(do_tile[at], v_value);
    if (col_count() > 1u) {
        (*dot_qk)[1] += dot(q_tile[at + step], k_value);
        (*dot_dov)[1] += dot(do_tile[at + step], v_value);
    }
    if (col_count() > 2u) {
        (*dot_qk)[2] += dot(q_tile[at + 2u * step], k_value);
        (*dot_dov)[2] += dot(do_tile[at + 2u * step], v_value);
    }
    if (col_count() > 3u) {
        (*dot_qk)[3] += dot(q_tile[at + 3u * step], k_value);
        (*dot_dov)[3] += dot(do_tile[at + 3u * step], v_value);
    }
    if (col_count() > 4u) {
        (*dot_qk)[4] += dot(q_tile[at + 4u * step], k_value);
        (*dot_dov)[4] += dot(do_tile[at + 4u * step], v_value);
    }
    if (col_count() > 5u) {
        (*dot_qk)[5] += dot(q_tile[at + 5u * step], k_value);
        (*dot_dov)[5] += dot(do_tile[at + 5u * step], v_value);
    }
    if (col_count() > 6u) {
        (*dot_qk)[6] += dot(q_tile[at + 6u * step], k_value);
        (*dot_dov)[6] += dot(do_tile[at + 6u * step], v_value);
    }
    if (col_count() > 7u) {
        (*dot_qk)[7] += dot(q_tile[at + 7u * step], k_value);
        (*dot_dov)[7] += dot(do_tile[at + 7u * step], v_value);
    }
}

// P and dS of key `key` (valid: inside the sequence) against query q_start + col into p_tile /
// ds_tile[at]; 0 where masked.
fn store_p_ds(at: u32, col: u32, q_start: u32, key: u32, valid_key: bool, dot_qk: f32, dot_dov: f32) {
    let query = q_start + col;
    var p = 0.0;
    var ds = 0.0;
    if (valid_key && key <= query && query < params.S && key >= document_start(b_row, query)) {
        p = exp(dot_qk * params.scale - lse_tile[col]);
        ds = p * (dot_dov - delta_tile[col]);
    }
    p_tile[at] = p;
    ds_tile[at] = ds;
}

// The thread's dots against the query tile: the owned row's k_tile / v_tile[row_at ..] against
// q_tile / do_tile rows col_at + j TPR rows, d4 ascending.
fn score_tile(row_at: u32, col_at: u32) -> Dots {
    var dots = Dots();
    let steps = D / 4u;
    let unrolled = steps / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var d4 = 0u; d4 < unrolled; d4 += STEPS_PER_TRIP) {
        score_step(&dots, k_tile[row_at + d4], v_tile[row_at + d4], col_at + d4);
        score_step(&dots, k_tile[row_at + d4 + 1u], v_tile[row_at + d4 + 1u], col_at + d4 + 1u);
        score_step(&dots, k_tile[row_at + d4 + 2u], v_tile[row_at + d4 + 2u], col_at + d4 + 2u);
        score_step(&dots, k_tile[row_at + d4 + 3u], v_tile[row_at + d4 + 3u], col_at + d4 + 3u);
    }
    for (var d4 = unrolled; d4 < steps; d4++) {
        score_step(&dots, k_tile[row_at + d4], v_tile[row_at + d4], col_at + d4);
    }
    return dots;
}

// P and dS of the thread's queries q_start + col + j TPR (tile columns at + j TPR).
fn store_p_ds_row(at: u32, col: u32, q_start: u32, key: u32, valid_key: bool, dots: Dots) {
    let dot_qk = dots.qk;
    let dot_dov = dots.dov;
    store_p_ds(at, col, q_start, key, valid_key, dot_qk[0], dot_dov[0]);
    if (col_count() > 1u) { store_p_ds(at + TPR, col + TPR, q_start, key, valid_key, dot_qk[1], dot_dov[1]); }
    if (col_count() > 2u) {
        store_p_ds(at + 2u * TPR, col + 2u * TPR, q_start, key, valid_key, dot_qk[2], dot_dov[2]);
    }
    if (col_count() > 3u) {
        store_p_ds(at + 3u * TPR, col + 3u * TPR, q_start, key, valid_key, dot_qk[3], dot_dov[3]);
    }
    if (col_count() > 4u) {
        store_p_ds(at + 4u * TPR, col + 4u * TPR, q_start, key, valid_key, dot_qk[4], dot_dov[4]);
    }
    if (col_count() > 5u) {
        store_p_ds(at + 5u * TPR, col + 5u * TPR, q_start, key, valid_key, dot_qk[5], dot_dov[5]);
    }
    if (col_count() > 6u) {
        store_p_ds(at + 6u * TPR, col + 6u * TPR, q_start, key, valid_key, dot_qk[6], dot_dov[6]);
    }
    if (col_count() > 7u) {
        store_p_ds(at + 7u * TPR, col + 7u * TPR, q_start, key, valid_key, dot_qk[7], dot_dov[7]);
    }
}

// dv[i] += p * do_tile[at + TPR i], dk[i] += ds * q_tile[at + TPR i]: one query row into the thread's
// gradient vec4s.
fn add_query(dk: ptr<function, Chunks>, dv: ptr<function, Chunks>, p: f32, ds: f32, at: u32) {
    (*dv)[0] += p * do_tile[at];
    (*dk)[0] += ds * q_tile[at];
    if (chunk_count() > 1u) {
        (*dv)[1] += p * do_tile[at + TPR];
        (*dk)[1] += ds * q_tile[at + TPR];
    }
    if (chunk_count() > 2u) {
        (*dv)[2] += p * do_tile[at + 2u * TPR];
        (*dk)[2] += ds * q_tile[at + 2u * TPR];
    }
    if (chunk_count() > 3u) {
        (*dv)[3] += p * do_tile[at + 3u * TPR];
        (*dk)[3] += ds * q_tile[at + 3u * TPR];
    }
    if (chunk_count() > 4u) {
        (*dv)[4] += p * do_tile[at + 4u * TPR];
        (*dk)[4] += ds * q_tile[at + 4u * TPR];
    }
    if (chunk_count() > 5u) {
        (*dv)[5] += p * do_tile[at + 5u * TPR];
        (*dk)[5] += ds * q_tile[at + 5u * TPR];
    }
    if (chunk_count() > 6u) {
        (*dv)[6] += p * do_tile[at + 6u * TPR];
        (*dk)[6] += ds * q_tile[at + 6u * TPR];
    }
    if (chunk_count() > 7u) {
        (*dv)[7] += p * do_tile[at + 7u * TPR];
        (*dk)[7] += ds * q_tile[at + 7u * TPR];
    }
}

// The query tile's rows, ascending, into dk and dv (P and dS of row s_at in p_tile / ds_tile).
fn add_tile(dk: ptr<function, Chunks>, dv: ptr<function, Chunks>, s_at: u32, q_at: u32) {
    let stride = D / 4u + 1u;
    let unrolled = COLS / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var c = 0u; c < unrolled; c += STEPS_PER_TRIP) {
        add_query(dk, dv, p_tile[s_at + c], ds_tile[s_at + c], q_at + c * stride);
        add_query(dk, dv, p_tile[s_at + c + 1u], ds_tile[s_at + c + 1u], q_at + (c + 1u) * stride);
        add_query(dk, dv, p_tile[s_at + c + 2u], ds_tile[s_at + c + 2u], q_at + (c + 2u) * stride);
        add_query(dk, dv, p_tile[s_at + c + 3u], ds_tile[s_at + c + 3u], q_at + (c + 3u) * stride);
    }
    for (var c = unrolled; c < COLS; c++) {
        add_query(dk, dv, p_tile[s_at + c], ds_tile[s_at + c], q_at + c * stride);
    }
}

// d_k = scale dk and d_v = dv at vec4s at + TPR i.
fn store_dkv(dk: Chunks, dv: Chunks, at: u32) {
    d_k[at] = dk[0] * params.scale;
    d_v[at] = dv[0];
    if (chunk_count() > 1u) {
        d_k[at + TPR] = dk[1] * params.scale;
        d_v[at + TPR] = dv[1];
    }
    if (chunk_count() > 2u) {
        d_k[at + 2u * TPR] = dk[2] * params.scale;
        d_v[at + 2u * TPR] = dv[2];
    }
    if (chunk_count() > 3u) {
        d_k[at + 3u * TPR] = dk[3] * params.scale;
        d_v[at + 3u * TPR] = dv[3];
    }
    if (chunk_count() > 4u) {
        d_k[at + 4u * TPR] = dk[4] * params.scale;
        d_v[at + 4u * TPR] = dv[4];
    }
    if (chunk_count() > 5u) {
        d_k[at + 5u * TPR] = dk[5] * params.scale;
        d_v[at + 5u * TPR] = dv[5];
    }
    if (chunk_count() > 6u) {
        d_k[at + 6u * TPR] = dk[6] * params.scale;
        d_v[at + 6u * TPR] = dv[6];
    }
    if (chunk_count() > 7u) {
        d_k[at + 7u * TPR] = dk[7] * params.scale;
        d_v[at + 7u * TPR] = dv[7];
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = COLS + 1u;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let k_start = group.x * ROWS;  // the first keys see the most queries and start first
    let kv_head = group.y;
    let b = group.z;
    let group_heads = params.Hq / params.Hkv;
    b_row = b;
    let row = tid / TPR;
    let lane = tid % TPR;
    let key = k_start + row;
    let valid_key = key < params.S;
    // The first query tile that can see any key of this tile: the one holding query k_start.
    let first_q_start = (k_start / COLS) * COLS;

    for (var idx = tid; idx < ROWS * d4s; idx += WG) {
        let seq = k_start + idx / d4s;
        var k_value = vec4<f32>(0.0);
        var v_value = vec4<f32>(0.0);
        if (seq < params.S) {
            let index = source_index(seq, b, kv_head, params.Hkv, idx % d4s);
            k_value = k[index];
            v_value = v[index];
        }
        k_tile[(idx / d4s) * stride + idx % d4s] = k_value;
        v_tile[(idx / d4s) * stride + idx % d4s] = v_value;
    }

    var dk = Chunks();
    var dv = Chunks();
    for (var g = 0u; g < group_heads; g++) {
        let head = kv_head * group_heads + g;
        for (var q_start = first_q_start; q_start < params.S; q_start += COLS) {
            // Uniform: this and every later query tile start their documents after the key tile's last
            // key, so they see none of its keys (never true without documents).
            if (document_start(b, q_start) >= k_start + ROWS) {
                break;
            }
            workgroupBarrier();  // the previous Q / dO / P / dS tiles are consumed
            for (var idx = tid; idx < COLS * d4s; idx += WG) {
                let seq = q_start + idx / d4s;
                var q_value = vec4<f32>(0.0);
                var do_value = vec4<f32>(0.0);
                if (seq < params.S) {
                    let index = source_index(seq, b, head, params.Hq, idx % d4s);
                    q_value = q[index];
                    do_value = d_out[index];
                }
                q_tile[(idx / d4s) * stride + idx % d4s] = q_value;
                do_tile[(idx / d4s) * stride + idx % d4s] = do_value;
            }
            for (var c = tid; c < COLS; c += WG) {
                let query = q_start + c;
                let stat_index = (b * params.Hq + head) * params.S + min(query, params.S - 1u);
                lse_tile[c] = select(0.0, lse[stat_index], query < params.S);
                delta_tile[c] = select(0.0, delta[stat_index], query < params.S);
            }
            workgroupBarrier();

            store_p_ds_row(row * score_stride + lane, lane, q_start, key, valid_key,
                           score_tile(row * stride, lane * stride));
            workgroupBarrier();

            add_tile(&dk, &dv, row * score_stride, lane);
        }
    }

    if (valid_key) {
        store_dkv(dk, dv, source_index(key, b, kv_head, params.Hkv, lane));
    }
}
#endif

// Causal self-attention forward, flash-style (GLSL reference: ../attention_fwd.comp; host module:
// kernels/attention.py). q [B, S, Hq, D], k/v [B, S, Hkv, D]; GQA: query head h reads kv head h / (Hq / Hkv).
//   out[b, i, h] = sum_{j <= i} softmax_j(scale q_i . k_j) v_j      [B, S, Hq, D]
//   lse[b, h, i] = log sum_{j <= i} exp(scale q_i . k_j)             [B, Hq, S]
// One workgroup owns BQ queries of one (batch, query head), TPR threads per query row; key / value tiles of
// BK rows stream through workgroup memory up to the tile's last query with an online softmax per row.
// Thread (row r, lane t) scores keys t, t + TPR, ... of a tile and owns output vec4s t, t + TPR, ...
//
// Registers: the thread's scores (Scores) and output vec4s (Chunks) are per-thread arrays indexed by
// constants only, each entry guarded by its count (key_count(), chunk_count(): overrides, so the guards
// fold when the pipeline is built): naga emits no unrolled loops, and an array indexed by a loop
// variable lives in per-thread memory (see linear_gemm.inc.wgsl). The loops over the head dim and the
// tile's keys take STEPS_PER_TRIP explicit steps a trip (the rest one by one) for the same reason. Every
// entry adds its terms in the GLSL's order (scores: d4 ascending; outputs: keys ascending after each
// tile's rescale), so the results are the GLSL's wherever the two compilers contract alike
// (bit-identical on lavapipe).
//
// DOCUMENTS (packed documents): positions [B, S] (i32, binding 5) holds each token's position in its
// document; query i sees keys document_start(i) = i - positions[i] .. i only, and the key tiles before the
// tile's first query's document are skipped (document starts never decrease along a row).
// vktrain-variants: -, DOCUMENTS

@id(0) override WG: u32 = 64u;   // BQ * TPR
@id(3) override D: u32 = 64u;    // head dim, a multiple of 4 TPR
@id(4) override BQ: u32 = 16u;   // queries per workgroup
@id(5) override BK: u32 = 16u;   // keys per tile, a multiple of TPR
@id(6) override TPR: u32 = 4u;   // threads per query row

const MAX_CHUNKS = 8u;  // D / 4 / TPR at D = 128, TPR = 4 (the plans' largest is 4: D = 128 takes TPR = 8)
const MAX_KEYS = 8u;    // BK / TPR at BK = 32, TPR = 4
// The WebGPU runtime refuses, at load, a dispatch whose overrides break these (reflect.py):
// vktrain-requires: D / 4u / TPR <= MAX_CHUNKS -- output vec4s per thread, registers Chunks
// vktrain-requires: BK / TPR <= MAX_KEYS -- keys scored per thread, registers Scores
// Masked scores and the running max before the first key: finite, and exp(MASKED - m) underflows to 0.
const MASKED = -3.402823466e38;

const STEPS_PER_TRIP = 4u;  // explicit calls per trip of the unrolled loops

alias Chunks = array<vec4<f32>, MAX_CHUNKS>;  // [i]: output vec4 lane + TPR i of the thread's row
alias Scores = array<f32, MAX_KEYS>;          // [j]: the score of key lane + TPR j of the tile

struct Params {
    vktrain_group_offset: vec4<u32>,
    S: u32,       // sequence length
    Hq: u32,      // query heads
    Hkv: u32,     // key/value heads (divides Hq)
    scale: f32,   // score scale, usually 1 / sqrt(D)
}

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out_: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;
#if DOCUMENTS
@group(0) @binding(5) var<storage, read> positions: array<i32>;  // [B, S]
@group(0) @binding(6) var<uniform> params: Params;

// The first key query `query` (< S) of batch row b sees: its document's first token, clamped to the row.
fn document_start(b: u32, query: u32) -> u32 {
    return query - u32(clamp(positions[b * params.S + query], 0, i32(query)));
}
#else
@group(0) @binding(5) var<uniform> params: Params;

fn document_start(b: u32, query: u32) -> u32 { return 0u; }
#endif

// Tiles [row * (D / 4 + 1) + d4]: rows padded by one vec4 (as the GLSL); scores [row * (BK + 1) + col].
var<workgroup> q_tile: array<vec4<f32>, BQ * (D / 4u + 1u)>;
var<workgroup> k_tile: array<vec4<f32>, BK * (D / 4u + 1u)>;
var<workgroup> v_tile: array<vec4<f32>, BK * (D / 4u + 1u)>;
var<workgroup> s_tile: array<f32, BQ * (BK + 1u)>;

fn chunk_count() -> u32 { return D / 4u / TPR; }
fn key_count() -> u32 { return BK / TPR; }

// Vec4 col4 of position seq of head `head` (of `heads`) of batch b in a [B, S, heads, D] buffer.
fn source_index(seq: u32, b: u32, head: u32, heads: u32, col4: u32) -> u32 {
    return ((b * params.S + seq) * heads + head) * (D / 4u) + col4;
}

// scores[j] += q_value . k_tile[at + j TPR rows]: one d4 step of the thread's keys.
fn score_step(scores: ptr<function, Scores>, q_value: vec4<f32>, at: u32) {
    let step = TPR * (D / 4u + 1u);
    (*scores)[0] += dot(q_value, k_tile[at]);
    if (key_count() > 1u) { (*scores)[1] += dot(q_value, k_tile[at + step]); }
    if (key_count() > 2u) { (*scores)[2] += dot(q_value, k_tile[at + 2u * step]); }
    if (key_count() > 3u) { (*scores)[3] += dot(q_value, k_tile[at + 3u * step]); }
    if (key_count() > 4u) { (*scores)[4] += dot(q_value, k_tile[at + 4u * step]); }
    if (key_count() > 5u) { (*scores)[5] += dot(q_value, k_tile[at + 5u * step]); }
    if (key_count() > 6u) { (*scores)[6] += dot(q_value, k_tile[at + 6u * step]); }
    if (key_count() > 7u) { (*scores)[7] += dot(q_value, k_tile[at + 7u * step]); }
}

// The scores of the thread's keys (k_start + lane + TPR j) for query `query`, masked, into s_tile.
fn store_score(at: u32, key: u32, query: u32, first_key: u32, score: f32) {
    // Masked: in the future of the query, past the sequence, or before the query's document.
    s_tile[at] = select(MASKED, score * params.scale, key <= query && key < params.S && key >= first_key);
}

fn store_scores(scores: Scores, at: u32, key: u32, query: u32, first_key: u32) {
    store_score(at, key, query, first_key, scores[0]);
    if (key_count() > 1u) { store_score(at + TPR, key + TPR, query, first_key, scores[1]); }
    if (key_count() > 2u) { store_score(at + 2u * TPR, key + 2u * TPR, query, first_key, scores[2]); }
    if (key_count() > 3u) { store_score(at + 3u * TPR, key + 3u * TPR, query, first_key, scores[3]); }
    if (key_count() > 4u) { store_score(at + 4u * TPR, key + 4u * TPR, query, first_key, scores[4]); }
    if (key_count() > 5u) { store_score(at + 5u * TPR, key + 5u * TPR, query, first_key, scores[5]); }
    if (key_count() > 6u) { store_score(at + 6u * TPR, key + 6u * TPR, query, first_key, scores[6]); }
    if (key_count() > 7u) { store_score(at + 7u * TPR, key + 7u * TPR, query, first_key, scores[7]); }
}

fn rescale(o: ptr<function, Chunks>, correction: f32) {
    (*o)[0] *= correction;
    if (chunk_count() > 1u) { (*o)[1] *= correction; }
    if (chunk_count() > 2u) { (*o)[2] *= correction; }
    if (chunk_count() > 3u) { (*o)[3] *= correction; }
    if (chunk_count() > 4u) { (*o)[4] *= correction; }
    if (chunk_count() > 5u) { (*o)[5] *= correction; }
    if (chunk_count() > 6u) { (*o)[6] *= correction; }
    if (chunk_count() > 7u) { (*o)[7] *= correction; }
}

// o[i] += p * v_tile[at + TPR i]: one key's value row into the thread's output vec4s.
fn add_value(o: ptr<function, Chunks>, p: f32, at: u32) {
    (*o)[0] += p * v_tile[at];
    if (chunk_count() > 1u) { (*o)[1] += p * v_tile[at + TPR]; }
    if (chunk_count() > 2u) { (*o)[2] += p * v_tile[at + 2u * TPR]; }
    if (chunk_count() > 3u) { (*o)[3] += p * v_tile[at + 3u * TPR]; }
    if (chunk_count() > 4u) { (*o)[4] += p * v_tile[at + 4u * TPR]; }
    if (chunk_count() > 5u) { (*o)[5] += p * v_tile[at + 5u * TPR]; }
    if (chunk_count() > 6u) { (*o)[6] += p * v_tile[at + 6u * TPR]; }
    if (chunk_count() > 7u) { (*o)[7] += p * v_tile[at + 7u * TPR]; }
}

// out_[at + TPR i] = o[i] / l.
fn store_output(o: Chunks, l: f32, at: u32) {
    out_[at] = o[0] / l;
    if (chunk_count() > 1u) { out_[at + TPR] = o[1] / l; }
    if (chunk_count() > 2u) { out_[at + 2u * TPR] = o[2] / l; }
    if (chunk_count() > 3u) { out_[at + 3u * TPR] = o[3] / l; }
    if (chunk_count() > 4u) { out_[at + 4u * TPR] = o[4] / l; }
    if (chunk_count() > 5u) { out_[at + 5u * TPR] = o[5] / l; }
    if (chunk_count() > 6u) { out_[at + 6u * TPR] = o[6] / l; }
    if (chunk_count() > 7u) { out_[at + 7u * TPR] = o[7] / l; }
}

// The thread's scores against the key tile: q_tile[q_at ..] . k_tile rows k_at + j TPR rows, unscaled.
fn score_tile(q_at: u32, k_at: u32) -> Scores {
    var scores = Scores();
    let steps = D / 4u;
    let unrolled = steps / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var d4 = 0u; d4 < unrolled; d4 += STEPS_PER_TRIP) {
        score_step(&scores, q_tile[q_at + d4], k_at + d4);
        score_step(&scores, q_tile[q_at + d4 + 1u], k_at + d4 + 1u);
        score_step(&scores, q_tile[q_at + d4 + 2u], k_at + d4 + 2u);
        score_step(&scores, q_tile[q_at + d4 + 3u], k_at + d4 + 3u);
    }
    for (var d4 = unrolled; d4 < steps; d4++) {
        score_step(&scores, q_tile[q_at + d4], k_at + d4);
    }
    return scores;
}

// The largest of the BK scores s_tile[s_at ..] (MASKED when all are).
fn tile_max(s_at: u32) -> f32 {
    var largest = MASKED;
    let unrolled = BK / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var c = 0u; c < unrolled; c += STEPS_PER_TRIP) {
        largest = max(largest, s_tile[s_at + c]);
        largest = max(largest, s_tile[s_at + c + 1u]);
        largest = max(largest, s_tile[s_at + c + 2u]);
        largest = max(largest, s_tile[s_at + c + 3u]);
    }
    for (var c = unrolled; c < BK; c++) {
        largest = max(largest, s_tile[s_at + c]);
    }
    return largest;
}

// Key c of the tile into the row's softmax sum l and output vec4s o (score s_tile[s_at + c]).
fn fold_key(o: ptr<function, Chunks>, l: ptr<function, f32>, m_new: f32, s_at: u32, v_at: u32, c: u32) {
    let p = exp(s_tile[s_at + c] - m_new);  // masked scores: exp(~-FLT_MAX) = 0
    *l += p;
    add_value(o, p, v_at + c * (D / 4u + 1u));
}

// The tile's keys, ascending, into l and o (already rescaled to the running max m_new).
fn fold_tile(o: ptr<function, Chunks>, l: ptr<function, f32>, m_new: f32, s_at: u32, v_at: u32) {
    let unrolled = BK / STEPS_PER_TRIP * STEPS_PER_TRIP;
    for (var c = 0u; c < unrolled; c += STEPS_PER_TRIP) {
        fold_key(o, l, m_new, s_at, v_at, c);
        fold_key(o, l, m_new, s_at, v_at, c + 1u);
        fold_key(o, l, m_new, s_at, v_at, c + 2u);
        fold_key(o, l, m_new, s_at, v_at, c + 3u);
    }
    for (var c = unrolled; c < BK; c++) {
        fold_key(o, l, m_new, s_at, v_at, c);
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = BK + 1u;
    let group = workgroup + params.vktrain_group_offset.xyz;
    // Tiles in reverse: the last query tiles see the most keys and start first.
    let q_tiles = (params.S + BQ - 1u) / BQ;
    let q_start = (q_tiles - 1u - group.x) * BQ;
    let head = group.y;
    let b = group.z;
    let kv_head = head / (params.Hq / params.Hkv);
    let row = tid / TPR;
    let lane = tid % TPR;
    let query = q_start + row;
    let q_end = min(q_start + BQ, params.S);  // keys [0, q_end) are visible to the tile
    var first_key = query;  // a row past the sequence stores nothing
    if (query < params.S) {
        first_key = document_start(b, query);
    }
    let k_begin = document_start(b, q_start) / BK * BK;  // uniform: the tile's earliest document start

    for (var idx = tid; idx < BQ * d4s; idx += WG) {
        let seq = q_start + idx / d4s;
        var value = vec4<f32>(0.0);
        if (seq < params.S) {
            value = q[source_index(seq, b, head, params.Hq, idx % d4s)];
        }
        q_tile[(idx / d4s) * stride + idx % d4s] = value;
    }

    var o = Chunks();
    var m = MASKED;  // running max of the row's scores
    var l = 0.0;     // running sum of exp(score - m)
    for (var k_start = k_begin; k_start < q_end; k_start += BK) {
        workgroupBarrier();  // every thread is done with the previous tiles
        for (var idx = tid; idx < BK * d4s; idx += WG) {
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

        let scores = score_tile(row * stride, lane * stride);
        store_scores(scores, row * score_stride + lane, k_start + lane, query, first_key);
        workgroupBarrier();

        let largest = tile_max(row * score_stride);
        // A tile wholly outside a row's keys adds nothing.
        if (largest != MASKED) {
            let m_new = max(m, largest);
            let correction = exp(m - m_new);  // 0 on the row's first keys (m = MASKED)
            l *= correction;
            rescale(&o, correction);
            fold_tile(&o, &l, m_new, row * score_stride, lane);
            m = m_new;
        }
    }

    if (query < params.S) {
        // Every query sees at least itself, so l >= 1.
        store_output(o, l, source_index(query, b, head, params.Hq, lane));
        if (lane == 0u) {
            lse[(b * params.Hq + head) * params.S + query] = m + log(l);
        }
    }
}

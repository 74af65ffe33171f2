// Causal self-attention forward, flash-style (GLSL reference: ../attention_fwd.comp; host module:
// kernels/attention.py). q [B, S, Hq, D], k/v [B, S, Hkv, D]; GQA: query head h reads kv head h / (Hq / Hkv).
//   out[b, i, h] = sum_{j <= i} softmax_j(scale q_i . k_j) v_j      [B, S, Hq, D]
//   lse[b, h, i] = log sum_{j <= i} exp(scale q_i . k_j)             [B, Hq, S]
// One workgroup owns BQ queries of one (batch, query head), TPR threads per query row; key / value tiles of
// BK rows stream through workgroup memory up to the tile's last query with an online softmax per row.
// Thread (row r, lane t) scores keys t, t + TPR, ... of a tile and owns output vec4s t, t + TPR, ...
// Workgroup arrays take their sizes from the overrides; per-thread arrays cannot (WGSL), so they have
// MAX_CHUNKS / MAX_KEYS entries of which the first D / 4 / TPR and BK / TPR are used.

@id(0) override WG: u32 = 64u;   // BQ * TPR
@id(3) override D: u32 = 64u;    // head dim, a multiple of 4 TPR
@id(4) override BQ: u32 = 16u;   // queries per workgroup
@id(5) override BK: u32 = 16u;   // keys per tile, a multiple of TPR
@id(6) override TPR: u32 = 4u;   // threads per query row

const MAX_CHUNKS = 32u;  // D / 4 / TPR at D = 128, TPR = 1
const MAX_KEYS = 32u;    // BK / TPR at BK = 32, TPR = 1
// The WebGPU runtime refuses, at load, a dispatch whose overrides break these (reflect.py):
// vktrain-requires: D / 4u / TPR <= MAX_CHUNKS -- output vec4s per thread, array o
// vktrain-requires: BK / TPR <= MAX_KEYS -- keys scored per thread, array dot_qk
// Masked scores and the running max before the first key: finite, and exp(MASKED - m) underflows to 0.
const MASKED = -3.402823466e38;

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
@group(0) @binding(5) var<uniform> params: Params;

// Tiles [row * (D / 4 + 1) + d4]: rows padded by one vec4 (as the GLSL); scores [row * (BK + 1) + col].
var<workgroup> q_tile: array<vec4<f32>, BQ * (D / 4u + 1u)>;
var<workgroup> k_tile: array<vec4<f32>, BK * (D / 4u + 1u)>;
var<workgroup> v_tile: array<vec4<f32>, BK * (D / 4u + 1u)>;
var<workgroup> s_tile: array<f32, BQ * (BK + 1u)>;

// Positions [start, start + rows) of head `head` (of `heads`) of batch b; past the sequence: zeros.
fn source_index(seq: u32, b: u32, head: u32, heads: u32, col4: u32) -> u32 {
    return ((b * params.S + seq) * heads + head) * (D / 4u) + col4;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = BK + 1u;
    let chunks = d4s / TPR;
    let keys_per_thread = BK / TPR;
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

    for (var idx = tid; idx < BQ * d4s; idx += WG) {
        let seq = q_start + idx / d4s;
        var value = vec4<f32>(0.0);
        if (seq < params.S) {
            value = q[source_index(seq, b, head, params.Hq, idx % d4s)];
        }
        q_tile[(idx / d4s) * stride + idx % d4s] = value;
    }

    var o: array<vec4<f32>, MAX_CHUNKS>;
    var m = MASKED;  // running max of the row's scores
    var l = 0.0;     // running sum of exp(score - m)
    for (var k_start = 0u; k_start < q_end; k_start += BK) {
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

        // Zeroed explicitly: a declaration inside a loop is not re-initialized on every trip by every
        // WGSL compiler (naga hoists it).
        var dot_qk: array<f32, MAX_KEYS>;
        for (var j = 0u; j < keys_per_thread; j++) {
            dot_qk[j] = 0.0;
        }
        for (var d4 = 0u; d4 < d4s; d4++) {
            let q_value = q_tile[row * stride + d4];
            for (var j = 0u; j < keys_per_thread; j++) {
                dot_qk[j] += dot(q_value, k_tile[(lane + TPR * j) * stride + d4]);
            }
        }
        for (var j = 0u; j < keys_per_thread; j++) {
            let col = lane + TPR * j;
            let key = k_start + col;
            // Masked: in the future of the query or past the sequence.
            s_tile[row * score_stride + col] = select(MASKED, dot_qk[j] * params.scale, key <= query && key < params.S);
        }
        workgroupBarrier();

        var tile_max = MASKED;
        for (var c = 0u; c < BK; c++) {
            tile_max = max(tile_max, s_tile[row * score_stride + c]);
        }
        // Every row sees key 0 in the first tile; a later tile wholly past its diagonal adds nothing.
        if (tile_max != MASKED) {
            let m_new = max(m, tile_max);
            let correction = exp(m - m_new);  // 0 on the row's first keys (m = MASKED)
            l *= correction;
            for (var i = 0u; i < chunks; i++) {
                o[i] *= correction;
            }
            for (var c = 0u; c < BK; c++) {
                let p = exp(s_tile[row * score_stride + c] - m_new);
                l += p;
                for (var i = 0u; i < chunks; i++) {
                    o[i] += p * v_tile[c * stride + lane + TPR * i];
                }
            }
            m = m_new;
        }
    }

    if (query < params.S) {
        // Every query sees at least key 0, so l >= 1.
        for (var i = 0u; i < chunks; i++) {
            out_[source_index(query, b, head, params.Hq, lane + TPR * i)] = o[i] / l;
        }
        if (lane == 0u) {
            lse[(b * params.Hq + head) * params.S + query] = m + log(l);
        }
    }
}

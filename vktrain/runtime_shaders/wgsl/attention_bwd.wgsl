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
// Per-thread arrays have MAX_CHUNKS / MAX_COLS entries (WGSL sizes them by constants only).
// vktrain-variants: DQ, DKV

@id(0) override WG: u32 = 64u;    // ROWS * TPR
@id(3) override D: u32 = 64u;     // head dim, a multiple of 4 TPR
@id(4) override ROWS: u32 = 16u;  // rows a workgroup owns (queries for DQ, keys for DKV)
@id(5) override COLS: u32 = 16u;  // rows per streamed tile, a multiple of TPR
@id(6) override TPR: u32 = 4u;    // threads per owned row

const MAX_CHUNKS = 32u;  // D / 4 / TPR at D = 128, TPR = 1
const MAX_COLS = 32u;    // COLS / TPR at COLS = 32, TPR = 1
// The WebGPU runtime refuses, at load, a dispatch whose overrides break these (reflect.py):
// vktrain-requires: D / 4u / TPR <= MAX_CHUNKS -- gradient vec4s per thread, arrays dq / dk / dv
// vktrain-requires: COLS / TPR <= MAX_COLS -- scores per thread and tile, arrays dot_qk / dot_dov

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
@group(0) @binding(7) var<uniform> params: Params;
#else
@group(0) @binding(6) var<storage, read_write> d_k: array<vec4<f32>>;  // [B, S, Hkv, D]
@group(0) @binding(7) var<storage, read_write> d_v: array<vec4<f32>>;  // [B, S, Hkv, D]
@group(0) @binding(8) var<uniform> params: Params;
#endif

fn source_index(seq: u32, b: u32, head: u32, heads: u32, col4: u32) -> u32 {
    return ((b * params.S + seq) * heads + head) * (D / 4u) + col4;
}

#if DQ
var<workgroup> q_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> do_tile: array<vec4<f32>, ROWS * (D / 4u + 1u)>;
var<workgroup> k_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> v_tile: array<vec4<f32>, COLS * (D / 4u + 1u)>;
var<workgroup> ds_tile: array<f32, ROWS * (COLS + 1u)>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = COLS + 1u;
    let chunks = d4s / TPR;
    let cols_per_thread = COLS / TPR;
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
    let row_lse = select(0.0, lse[stat_index], valid_query);
    let row_delta = select(0.0, delta[stat_index], valid_query);

    var dq: array<vec4<f32>, MAX_CHUNKS>;
    for (var k_start = 0u; k_start < q_end; k_start += COLS) {
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

        // Zeroed explicitly: a declaration inside a loop is not re-initialized on every trip by every
        // WGSL compiler (naga hoists it).
        var dot_qk: array<f32, MAX_COLS>;
        var dot_dov: array<f32, MAX_COLS>;
        for (var j = 0u; j < cols_per_thread; j++) {
            dot_qk[j] = 0.0;
            dot_dov[j] = 0.0;
        }
        for (var d4 = 0u; d4 < d4s; d4++) {
            let q_value = q_tile[row * stride + d4];
            let do_value = do_tile[row * stride + d4];
            for (var j = 0u; j < cols_per_thread; j++) {
                let col = lane + TPR * j;
                dot_qk[j] += dot(q_value, k_tile[col * stride + d4]);
                dot_dov[j] += dot(do_value, v_tile[col * stride + d4]);
            }
        }
        for (var j = 0u; j < cols_per_thread; j++) {
            let col = lane + TPR * j;
            let key = k_start + col;
            var ds = 0.0;
            if (valid_query && key <= query) {  // key <= query < S: inside the sequence
                let p = exp(dot_qk[j] * params.scale - row_lse);
                ds = p * (dot_dov[j] - row_delta);
            }
            ds_tile[row * score_stride + col] = ds;
        }
        workgroupBarrier();

        for (var c = 0u; c < COLS; c++) {
            let ds = ds_tile[row * score_stride + c];
            for (var i = 0u; i < chunks; i++) {
                dq[i] += ds * k_tile[c * stride + lane + TPR * i];
            }
        }
    }

    if (valid_query) {
        for (var i = 0u; i < chunks; i++) {
            d_q[source_index(query, b, head, params.Hq, lane + TPR * i)] = dq[i] * params.scale;
        }
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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let d4s = D / 4u;
    let stride = d4s + 1u;
    let score_stride = COLS + 1u;
    let chunks = d4s / TPR;
    let cols_per_thread = COLS / TPR;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let k_start = group.x * ROWS;  // the first keys see the most queries and start first
    let kv_head = group.y;
    let b = group.z;
    let group_heads = params.Hq / params.Hkv;
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

    var dk: array<vec4<f32>, MAX_CHUNKS>;
    var dv: array<vec4<f32>, MAX_CHUNKS>;
    for (var g = 0u; g < group_heads; g++) {
        let head = kv_head * group_heads + g;
        for (var q_start = first_q_start; q_start < params.S; q_start += COLS) {
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

            var dot_qk: array<f32, MAX_COLS>;  // zeroed explicitly (see the DQ pass)
            var dot_dov: array<f32, MAX_COLS>;
            for (var j = 0u; j < cols_per_thread; j++) {
                dot_qk[j] = 0.0;
                dot_dov[j] = 0.0;
            }
            for (var d4 = 0u; d4 < d4s; d4++) {
                let k_value = k_tile[row * stride + d4];
                let v_value = v_tile[row * stride + d4];
                for (var j = 0u; j < cols_per_thread; j++) {
                    let col = lane + TPR * j;
                    dot_qk[j] += dot(q_tile[col * stride + d4], k_value);
                    dot_dov[j] += dot(do_tile[col * stride + d4], v_value);
                }
            }
            for (var j = 0u; j < cols_per_thread; j++) {
                let col = lane + TPR * j;
                let query = q_start + col;
                var p = 0.0;
                var ds = 0.0;
                if (valid_key && key <= query && query < params.S) {
                    p = exp(dot_qk[j] * params.scale - lse_tile[col]);
                    ds = p * (dot_dov[j] - delta_tile[col]);
                }
                p_tile[row * score_stride + col] = p;
                ds_tile[row * score_stride + col] = ds;
            }
            workgroupBarrier();

            for (var c = 0u; c < COLS; c++) {
                let p = p_tile[row * score_stride + c];
                let ds = ds_tile[row * score_stride + c];
                for (var i = 0u; i < chunks; i++) {
                    let chunk = lane + TPR * i;
                    dv[i] += p * do_tile[c * stride + chunk];
                    dk[i] += ds * q_tile[c * stride + chunk];
                }
            }
        }
    }

    if (valid_key) {
        for (var i = 0u; i < chunks; i++) {
            let index = source_index(key, b, kv_head, params.Hkv, lane + TPR * i);
            d_k[index] = dk[i] * params.scale;
            d_v[index] = dv[i];
        }
    }
}
#endif

// Attention of L queries over a KV cache (GLSL reference: ../cached_attention.comp; host module:
// kernels/kv_cache.py): q [B, L, Hq, D], k/v cache [B, C, Hkv, D], input_pos int32 [L]; query l attends
// to cache rows 0 .. input_pos[l]; query head h reads kv head h / (Hq / Hkv). out [B, L, Hq, D].
// One workgroup of TILE threads per (b, l, h): each thread scores one key of a tile into workgroup
// memory, then every thread folds the tile into a running (max, sum, accumulator) for its output dims
// d = t, t + TILE, ... (online softmax). D <= TILE * MAX_DIMS_PER_THREAD.
// Registers: the accumulators are one vec4, component i for dim t + i TILE, each indexed by a constant
// (an array indexed by a loop variable would live in per-thread memory: naga unrolls nothing), and add
// their terms in the GLSL's order.

const TILE = 64u;
const MAX_DIMS_PER_THREAD = 4u;
const MAX_D = TILE * MAX_DIMS_PER_THREAD;

struct Params {
    vktrain_group_offset: vec4<u32>,
    rows: u32,          // L
    q_heads: u32,       // Hq
    kv_heads: u32,      // Hkv
    head_dim: u32,      // D
    cache_length: u32,  // C
    scale: f32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read> v_cache: array<f32>;
@group(0) @binding(3) var<storage, read> input_pos: array<i32>;
@group(0) @binding(4) var<storage, read_write> out_: array<f32>;
@group(0) @binding(5) var<uniform> params: Params;

var<workgroup> q_row: array<f32, MAX_D>;
var<workgroup> scores: array<f32, TILE>;
var<workgroup> key_count: u32;

// v_cache[base + dims], 0 for the dims past the head (component by component: constant indices).
fn value_row(base: u32, dims: vec4<u32>, inside: vec4<bool>) -> vec4<f32> {
    var row = vec4<f32>(0.0);
    if (inside.x) { row.x = v_cache[base + dims.x]; }
    if (inside.y) { row.y = v_cache[base + dims.y]; }
    if (inside.z) { row.z = v_cache[base + dims.z]; }
    if (inside.w) { row.w = v_cache[base + dims.w]; }
    return row;
}

@compute @workgroup_size(TILE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let group = workgroup.x + params.vktrain_group_offset.x;  // (b * L + l) * Hq + h
    let t = local.x;
    let head = group % params.q_heads;
    let row = group / params.q_heads;  // b * L + l
    let batch = row / params.rows;
    let kv_head = head / (params.q_heads / params.kv_heads);
    let D = params.head_dim;
    for (var d = t; d < D; d += TILE) {
        q_row[d] = q[group * D + d];
    }
    if (t == 0u) {
        // Keys 0 .. position; a position outside the cache (refused by the host) reads at most the cache.
        let position = input_pos[row % params.rows];
        key_count = select(min(u32(position) + 1u, params.cache_length), 0u, position < 0);
    }
    let keys = workgroupUniformLoad(&key_count);  // a barrier, and uniform: the loop below has barriers

    var running_max = -3.402823466e38;
    var running_sum = 0.0;
    var acc = vec4<f32>(0.0);  // MAX_DIMS_PER_THREAD components
    // Dims t + i TILE; those past the head accumulate zeros (value_row) and are never stored.
    let dims = vec4<u32>(t, t + TILE, t + 2u * TILE, t + 3u * TILE);
    let inside = dims < vec4<u32>(D);
    let kv_stride = params.kv_heads * D;  // floats between consecutive cache rows
    let kv_base = batch * params.cache_length * kv_stride + kv_head * D;
    for (var first = 0u; first < keys; first += TILE) {
        let key = first + t;
        var score = 0.0;
        if (key < keys) {
            let base = kv_base + key * kv_stride;
            for (var d = 0u; d < D; d++) {
                score += q_row[d] * k_cache[base + d];
            }
            score *= params.scale;
        }
        scores[t] = score;
        workgroupBarrier();
        let tile_keys = min(TILE, keys - first);
        var tile_max = scores[0];
        for (var j = 1u; j < tile_keys; j++) {
            tile_max = max(tile_max, scores[j]);
        }
        let new_max = max(running_max, tile_max);
        let correction = exp(running_max - new_max);
        running_sum *= correction;
        acc *= correction;
        for (var j = 0u; j < tile_keys; j++) {
            let p = exp(scores[j] - new_max);
            running_sum += p;
            let base = kv_base + (first + j) * kv_stride;
            acc += p * value_row(base, dims, inside);
        }
        running_max = new_max;
        workgroupBarrier();  // every thread has read this tile's scores before the next overwrites them
    }
    let result = select(acc / running_sum, vec4<f32>(0.0), keys == 0u);
    if (inside.x) { out_[group * D + dims.x] = result.x; }
    if (inside.y) { out_[group * D + dims.y] = result.y; }
    if (inside.z) { out_[group * D + dims.z] = result.z; }
    if (inside.w) { out_[group * D + dims.w] = result.w; }
}

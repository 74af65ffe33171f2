// KV-cache write at runtime positions (GLSL reference: ../kv_cache_update.comp; host module:
// kernels/kv_cache.py): cache [B, C, Hkv, D], new [B, L, Hkv, D], input_pos int32 [L];
// out = cache with out[b, input_pos[l]] = new[b, l]. "-": out[i] = cache[i] (raw 32-bit words);
// SCATTER: one thread per element of new writes it to its row of out (dispatched after the copy).
// A position outside [0, C) writes nothing (the host refuses such positions; a kernel cannot raise).
// vktrain-variants: -, SCATTER

const WORKGROUP_SIZE = 64u;

@group(0) @binding(0) var<storage, read_write> out_words: array<u32>;
#if SCATTER
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,         // B * L * Hkv * D
    rows: u32,          // L
    row_words: u32,     // Hkv * D
    cache_length: u32,  // C
}
@group(0) @binding(1) var<storage, read> new_words: array<u32>;
@group(0) @binding(2) var<storage, read> input_pos: array<i32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let t = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (t >= params.numel) {
        return;
    }
    let row = t / params.row_words;  // b * L + l
    let element = t % params.row_words;
    let position = input_pos[row % params.rows];
    if (position < 0 || u32(position) >= params.cache_length) {
        return;
    }
    let batch = row / params.rows;
    out_words[(batch * params.cache_length + u32(position)) * params.row_words + element] = new_words[t];
}
#else
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,  // B * C * Hkv * D
}
@group(0) @binding(1) var<storage, read> cache_words: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let t = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (t < params.numel) {
        out_words[t] = cache_words[t];
    }
}
#endif

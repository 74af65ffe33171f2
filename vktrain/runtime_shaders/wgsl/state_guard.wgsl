// The training loop's device-side guard of the mutable state, the WGSL of ../state_guard.comp (host
// module: vktrain/runtime/delegate/state_guard.py). Plain: backup[i] = state[i] for `numel` 32-bit
// words, flag[0] |= 1 when a word holds a NaN or an infinity (`check` 1 = fp32 words, 2 = two fp16
// halves per word, 0 = none). ANY: out[0] = the OR of flags[k * stride], k < count (one work group).
// vktrain-variants: -, ANY

const WORKGROUP_SIZE = 64u;

#if ANY
struct Params {
    vktrain_group_offset: vec4<u32>,
    count: u32,
    stride: u32,  // words between two flags
}
@group(0) @binding(0) var<storage, read_write> out_words: array<u32>;
@group(0) @binding(1) var<storage, read> flags: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

var<workgroup> partials: array<u32, WORKGROUP_SIZE>;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(local_invocation_id) local: vec3<u32>) {
    let tid = local.x;
    var acc = 0u;
    for (var k = tid; k < params.count; k += WORKGROUP_SIZE) {
        acc |= flags[k * params.stride];
    }
    partials[tid] = acc;
    workgroupBarrier();
    if (tid == 0u) {
        var any_set = 0u;
        for (var i = 0u; i < WORKGROUP_SIZE; i++) {
            any_set |= partials[i];
        }
        out_words[0] = any_set;
    }
}
#else
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,  // 32-bit words
    check: u32,
}
@group(0) @binding(0) var<storage, read_write> backup_words: array<u32>;
@group(0) @binding(1) var<storage, read> state_words: array<u32>;
@group(0) @binding(2) var<storage, read_write> flag: array<atomic<u32>>;
@group(0) @binding(3) var<uniform> params: Params;

fn non_finite(word: u32) -> bool {
    if (params.check == 1u) {
        return (word & 0x7f800000u) == 0x7f800000u;
    }
    if (params.check == 2u) {
        return (word & 0x7c00u) == 0x7c00u || (word & 0x7c000000u) == 0x7c000000u;
    }
    return false;
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let index = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (index >= params.numel) {
        return;
    }
    let word = state_words[index];
    backup_words[index] = word;
    if (non_finite(word)) {
        atomicOr(&flag[0], 1u);
    }
}
#endif

// Embedding lookup and its deterministic dense backward (GLSL reference: ../embedding.comp; host module:
// kernels/embedding.py). Indices are int32.
//   BACKWARD=0: out[i, c] = weight[indices[i], c]; an index outside [0, num_weights) writes a NaN row.
//               Binding 2 may hold a window of the table, rows [row_begin, row_end): only its indices gather.
//   BACKWARD=1: grad_weight[v, c] = sum over i with indices[i] == v of grad_out[i, c], in increasing i
//               (0 for v == padding_idx; divided by the count when scale_grad_by_freq). Workgroup
//               (v, column block) keeps COLUMNS_PER_THREAD columns per thread and scans the indices
//               staged through workgroup memory: no atomics, a fixed order, bitwise reproducible.
// vktrain-variants: BACKWARD=0, BACKWARD=1

const WORKGROUP_SIZE = 64u;
const COLUMNS_PER_THREAD = 4u;
const COLUMNS_PER_GROUP = WORKGROUP_SIZE * COLUMNS_PER_THREAD;
// lavapipe ends an invocation after 65535 loop trips and does not unroll the scan over the staged
// indices, so it takes them sixteen explicit steps at a time (scan_16): 5 trips per 64 indices, ~800K
// indices in all.

struct Params {
    vktrain_group_offset: vec4<u32>,
    num_indices: u32,
    dim: u32,
    num_weights: u32,
    padding_idx: i32,         // backward only; -1 (or any out-of-range value) = none
    scale_grad_by_freq: u32,  // backward only; 0 or 1
    row_begin: u32,           // forward only: binding 2 holds table rows [row_begin, row_end) (a window of a
    row_end: u32,             // table over the max storage binding size); 0, num_weights unsplit
}

@group(0) @binding(0) var<storage, read_write> out_data: array<f32>;
@group(0) @binding(1) var<storage, read> indices: array<i32>;
#if BACKWARD
@group(0) @binding(2) var<storage, read> grad_out: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

var<workgroup> staged_indices: array<i32, WORKGROUP_SIZE>;

alias Columns = array<f32, COLUMNS_PER_THREAD>;  // a thread's columns first_column + k * WORKGROUP_SIZE

// Staged indices j0 .. j0 + 15 of the chunk at `start`, in order: each equal to row v adds its gradient
// row to acc (the same branch for every thread). Returns how many matched.
fn scan_16(j0: u32, v: u32, start: u32, first_column: u32, acc: ptr<function, Columns>) -> u32 {
    var matched = 0u;
    matched += scan_one(j0, v, start, first_column, acc);
    matched += scan_one(j0 + 1u, v, start, first_column, acc);
    matched += scan_one(j0 + 2u, v, start, first_column, acc);
    matched += scan_one(j0 + 3u, v, start, first_column, acc);
    matched += scan_one(j0 + 4u, v, start, first_column, acc);
    matched += scan_one(j0 + 5u, v, start, first_column, acc);
    matched += scan_one(j0 + 6u, v, start, first_column, acc);
    matched += scan_one(j0 + 7u, v, start, first_column, acc);
    matched += scan_one(j0 + 8u, v, start, first_column, acc);
    matched += scan_one(j0 + 9u, v, start, first_column, acc);
    matched += scan_one(j0 + 10u, v, start, first_column, acc);
    matched += scan_one(j0 + 11u, v, start, first_column, acc);
    matched += scan_one(j0 + 12u, v, start, first_column, acc);
    matched += scan_one(j0 + 13u, v, start, first_column, acc);
    matched += scan_one(j0 + 14u, v, start, first_column, acc);
    matched += scan_one(j0 + 15u, v, start, first_column, acc);
    return matched;
}

fn scan_one(j: u32, v: u32, start: u32, first_column: u32, acc: ptr<function, Columns>) -> u32 {
    if (staged_indices[j] != i32(v)) {  // padding slots past num_indices hold -1: no row
        return 0u;
    }
    let grad_row = (start + j) * params.dim;
    add_column(acc, 0u, grad_row, first_column);
    add_column(acc, 1u, grad_row, first_column);
    add_column(acc, 2u, grad_row, first_column);
    add_column(acc, 3u, grad_row, first_column);
    return 1u;
}

fn add_column(acc: ptr<function, Columns>, k: u32, grad_row: u32, first_column: u32) {
    let c = first_column + k * WORKGROUP_SIZE;
    if (c < params.dim) {
        (*acc)[k] += grad_out[grad_row + c];
    }
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tid = local.x;
    let group = workgroup + params.vktrain_group_offset.xyz;
    let v = group.x;  // uniform: the whole workgroup returns or none does
    if (v >= params.num_weights) {
        return;
    }
    let row = v * params.dim;
    let first_column = group.y * COLUMNS_PER_GROUP + tid;
    var acc: Columns;
    var count = 0u;
    if (i32(v) != params.padding_idx) {
        for (var start = 0u; start < params.num_indices; start += WORKGROUP_SIZE) {
            let i = start + tid;
            staged_indices[tid] = select(-1, indices[min(i, params.num_indices - 1u)], i < params.num_indices);
            workgroupBarrier();
            for (var j0 = 0u; j0 < WORKGROUP_SIZE; j0 += 16u) {
                count += scan_16(j0, v, start, first_column, &acc);
            }
            workgroupBarrier();  // staged_indices is overwritten by the next chunk
        }
    }
    let divisor = select(1.0, f32(count), params.scale_grad_by_freq != 0u && count > 1u);
    for (var k = 0u; k < COLUMNS_PER_THREAD; k++) {
        let c = first_column + k * WORKGROUP_SIZE;
        if (c < params.dim) {
            out_data[row + c] = acc[k] / divisor;
        }
    }
}
#else
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let e = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (e >= params.num_indices * params.dim) {
        return;
    }
    let i = e / params.dim;
    let c = e - i * params.dim;
    let index = indices[i];
    if (index < 0 || u32(index) >= params.num_weights) {
        if (params.row_begin == 0u) {  // the window of row 0 writes the NaN row
            out_data[e] = bitcast<f32>(0x7fc00000u);
        }
    } else if (u32(index) >= params.row_begin && u32(index) < params.row_end) {  // in this window
        out_data[e] = weight[(u32(index) - params.row_begin) * params.dim + c];
    }
}
#endif

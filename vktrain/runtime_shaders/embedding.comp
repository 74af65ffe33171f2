#version 450
// Embedding lookup and its deterministic dense backward (host module:
// vktrain/runtime/delegate/kernels/embedding.py). Indices are int32 on the GPU (the runner converts int64).
//
// Variants (#define):
//   BACKWARD=0: out[i, c] = weight[indices[i], c] for i < num_indices, c < dim. An index outside
//               [0, num_weights) writes NaN for the whole row (a GPU cannot raise; NaN makes the
//               bad input visible in the loss instead of silently reading another row). Binding 2
//               may hold a window of the table, rows [row_begin, row_end): only indices in it are gathered.
//   BACKWARD=1: grad_weight[v, c] = sum over i with indices[i] == v of grad_out[i, c], in increasing
//               i; zero for v == padding_idx; divided by the number of such i when
//               scale_grad_by_freq. Work group (v, column block) keeps COLUMNS_PER_THREAD columns of
//               row v per thread in registers and scans all indices, staged through shared memory
//               (a uniform branch per index): no atomics, a fixed summation order, so two runs are
//               bitwise identical, and each output element is written once.
//               Indices outside [0, num_weights) match no row. The scan over the staged indices
//               is unrolled by UNROLL: lavapipe ends an invocation after 65535 loop trips (5 per 64
//               indices here), which allows ~800K indices.
// vktrain-variants: BACKWARD=0, BACKWARD=1
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#ifndef BACKWARD
#define BACKWARD 0
#endif
#define WORKGROUP_SIZE 64u
#define COLUMNS_PER_THREAD 4u
#define COLUMNS_PER_GROUP (WORKGROUP_SIZE * COLUMNS_PER_THREAD)
#define UNROLL 16u

layout(local_size_x = WORKGROUP_SIZE) in;

layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { float out_data[]; };
layout(std430, set = 0, binding = 1) readonly buffer IndexBuffer { int indices[]; };
#if BACKWARD
layout(std430, set = 0, binding = 2) readonly buffer GradBuffer { float grad_out[]; };
#else
layout(std430, set = 0, binding = 2) readonly buffer WeightBuffer { float weight[]; };
#endif

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint num_indices;
    uint dim;
    uint num_weights;
    int padding_idx;         // backward only; -1 (or any out-of-range value) = none
    uint scale_grad_by_freq; // backward only; 0 or 1
    uint row_begin;          // forward only: binding 2 holds table rows [row_begin, row_end) (a window of a
    uint row_end;            // table over the max storage binding size); 0, num_weights unsplit
} params;

#if BACKWARD
shared int staged_indices[WORKGROUP_SIZE];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(params);
    uint v = group.x;  // uniform: the whole group returns or none does, so barriers stay legal
    if (v >= params.num_weights) {
        return;
    }
    uint row = v * params.dim;
    uint first_column = group.y * COLUMNS_PER_GROUP + tid;  // columns first_column + k * WORKGROUP_SIZE

    float acc[COLUMNS_PER_THREAD];
    [[unroll]] for (uint k = 0u; k < COLUMNS_PER_THREAD; ++k) {
        acc[k] = 0.0;
    }
    uint count = 0u;
    if (int(v) != params.padding_idx) {  // uniform
        for (uint start = 0u; start < params.num_indices; start += WORKGROUP_SIZE) {
            uint i = start + tid;
            staged_indices[tid] = i < params.num_indices ? indices[i] : -1;
            barrier();
            for (uint j0 = 0u; j0 < WORKGROUP_SIZE; j0 += UNROLL) {
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                    uint j = j0 + u;
                    // Uniform branch: every thread reads the same staged index. Padding slots past
                    // num_indices hold -1, which matches no row.
                    if (staged_indices[j] == int(v)) {
                        ++count;
                        uint grad_row = (start + j) * params.dim;
                        [[unroll]] for (uint k = 0u; k < COLUMNS_PER_THREAD; ++k) {
                            uint c = first_column + k * WORKGROUP_SIZE;
                            if (c < params.dim) {
                                acc[k] += grad_out[grad_row + c];
                            }
                        }
                    }
                }
            }
            barrier();  // staged_indices is overwritten by the next chunk
        }
    }
    float divisor = (params.scale_grad_by_freq != 0u && count > 1u) ? float(count) : 1.0;
    [[unroll]] for (uint k = 0u; k < COLUMNS_PER_THREAD; ++k) {
        uint c = first_column + k * WORKGROUP_SIZE;
        if (c < params.dim) {
            out_data[row + c] = acc[k] / divisor;
        }
    }
}
#else
void main() {
    uint e = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (e >= params.num_indices * params.dim) {
        return;
    }
    uint i = e / params.dim;
    uint c = e - i * params.dim;
    int index = indices[i];
    if (index < 0 || uint(index) >= params.num_weights) {
        if (params.row_begin == 0u) {  // the window of row 0 writes the NaN row
            out_data[e] = uintBitsToFloat(0x7fc00000u);
        }
    } else if (uint(index) >= params.row_begin && uint(index) < params.row_end) {  // in this window
        out_data[e] = weight[(uint(index) - params.row_begin) * params.dim + c];
    }
}
#endif

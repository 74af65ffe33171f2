#version 450
// Strided fp32 sum / max reduction (host module: vktrain/runtime/delegate/kernels/reduction.py).
//
// out[o] = scale * sum_r in[in_offset + kept(o) + reduced(r)]      (REDUCE_OP 0, id 4)
// out[o] = max_r in[in_offset + kept(o) + reduced(r)]              (REDUCE_OP 1; NaN propagates)
// where kept(o) / reduced(r) decompose the flat output index o and the flat reduction index r over
// (out_sizes, out_strides) and (red_sizes, red_strides): element strides into the input, innermost
// dim first. Any set of reduced dims (not only trailing ones) is expressed this way without a
// permute. scale = 1 for sum, 1 / count for mean. The output is contiguous.
//
// STRATEGY (specialization constant id 3):
//   0 = one workgroup per output: each thread sums a strided slice of the reduction serially, then
//       a fixed-shape tree in shared memory combines the 64 partials (for long reductions).
//   1 = one thread per output, serial loop (for short reductions, or many outputs whose reads
//       coalesce across neighbouring threads, e.g. column sums of a row-major matrix).
// Both orders depend only on the shapes, never on timing: two runs are bitwise identical.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define MAX_RANK 4
#define WORKGROUP_SIZE 64u
// Elements per loop trip. Besides keeping more loads in flight, unrolling matters on lavapipe: it
// silently ends any invocation after ~32768 loop trips (all loops together; a guard against hangs),
// which with UNROLL 8 still allows 256Ki elements per serial sum and 16Mi per workgroup sum.
#define UNROLL 8u

layout(local_size_x = WORKGROUP_SIZE) in;

layout(constant_id = 3) const uint STRATEGY = 0;
layout(constant_id = 4) const uint REDUCE_OP = 0;

layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { float out_data[]; };
layout(std430, set = 0, binding = 1) readonly buffer InBuffer { float in_data[]; };

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint out_numel;
    uint red_numel;
    uint out_rank;
    uint red_rank;
    uint in_offset;
    float scale;
    uint out_sizes[MAX_RANK];
    uint out_strides[MAX_RANK];
    uint red_sizes[MAX_RANK];
    uint red_strides[MAX_RANK];
} params;

shared float partials[WORKGROUP_SIZE];

float identity_value() {
    return REDUCE_OP == 1u ? uintBitsToFloat(0xff800000u) : 0.0;  // -inf for max
}

// One step of a per-thread running reduction. Sums are compensated (Kahan): `compensation` carries
// the low-order bits the running sum lost, so a thread's serial sum of n terms errs by ~2 eps instead
// of ~n eps, for the cost of 3 more adds in a memory-bound loop. `precise` keeps the compiler from
// fusing or reassociating the compensation away.
void accumulate(inout float acc, inout float compensation, float value) {
    if (REDUCE_OP == 1u) {
        // torch.amax propagates NaN; GLSL max() may return either operand for NaN.
        acc = (isnan(acc) || isnan(value)) ? uintBitsToFloat(0x7fc00000u) : max(acc, value);
        return;
    }
    precise float corrected = value - compensation;
    precise float total = acc + corrected;
    precise float lost = (total - acc) - corrected;
    compensation = isinf(total) ? 0.0 : lost;  // inf - inf would turn an infinite sum into NaN
    acc = total;
}

// Combines two per-thread partials in the shared-memory tree.
float combine(float a, float b) {
    if (REDUCE_OP == 1u) {
        return (isnan(a) || isnan(b)) ? uintBitsToFloat(0x7fc00000u) : max(a, b);
    }
    return a + b;
}

float finish(float acc) {
    return REDUCE_OP == 1u ? acc : acc * params.scale;
}

// Index decomposition, fully unrolled over MAX_RANK with guards: no loop trips per element.
uint kept_offset(uint o) {
    uint offset = params.in_offset;
    [[unroll]] for (uint d = 0u; d < MAX_RANK; ++d) {
        if (d < params.out_rank) {
            uint size = params.out_sizes[d];
            offset += (o % size) * params.out_strides[d];
            o /= size;
        }
    }
    return offset;
}

uint reduced_offset(uint r) {
    if (params.red_rank == 1u) {
        return r * params.red_strides[0];  // the common case after merging dims: no division
    }
    uint offset = 0u;
    [[unroll]] for (uint d = 0u; d < MAX_RANK; ++d) {
        if (d < params.red_rank) {
            uint size = params.red_sizes[d];
            offset += (r % size) * params.red_strides[d];
            r /= size;
        }
    }
    return offset;
}

void serial_sum_per_thread() {
    uint o = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (o >= params.out_numel) {
        return;
    }
    uint base = kept_offset(o);
    float acc = identity_value();
    float compensation = 0.0;
    for (uint r0 = 0u; r0 < params.red_numel; r0 += UNROLL) {
        [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
            uint r = r0 + u;
            if (r < params.red_numel) {
                accumulate(acc, compensation, in_data[base + reduced_offset(r)]);
            }
        }
    }
    out_data[o] = finish(acc);
}

void tree_sum_per_group() {
    uint tid = gl_LocalInvocationID.x;
    uint o = VKTRAIN_GLOBAL_GROUP_ID(params).x;
    if (o >= params.out_numel) {
        return;  // uniform: the whole group returns or none does, so barriers stay legal
    }
    uint base = kept_offset(o);
    float acc = identity_value();
    float compensation = 0.0;
    for (uint r0 = tid; r0 < params.red_numel; r0 += WORKGROUP_SIZE * UNROLL) {
        [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
            uint r = r0 + u * WORKGROUP_SIZE;
            if (r < params.red_numel) {
                accumulate(acc, compensation, in_data[base + reduced_offset(r)]);
            }
        }
    }
    partials[tid] = acc;
    barrier();
    for (uint half_size = WORKGROUP_SIZE / 2u; half_size > 0u; half_size >>= 1) {
        if (tid < half_size) {
            partials[tid] = combine(partials[tid], partials[tid + half_size]);
        }
        barrier();
    }
    if (tid == 0u) {
        out_data[o] = finish(partials[0]);
    }
}

void main() {
    if (STRATEGY == 1u) {
        serial_sum_per_thread();
    } else {
        tree_sum_per_group();
    }
}

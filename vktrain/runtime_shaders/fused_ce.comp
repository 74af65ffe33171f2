#version 450
// fused_ce, pass 1 of 2 (host module: vktrain/runtime/delegate/kernels/cross_entropy.py). One workgroup per row
// of logits [R, V]:
//   row_loss[r] = (logsumexp(row) - row[label]) / n_valid      (0 when the row is ignored)
//   dlogits[r]  = (softmax(row) - onehot(label)) / n_valid      (all 0 when the row is ignored)
// A row is ignored when label < 0 (the caller's mask) or label >= V. The op library refuses labels >= V
// on the CPU; the kernel cannot raise, so it treats them as ignored and never reads out of bounds.
// Ignored rows never divide by n_valid, so a batch with every row ignored gives 0 even for n_valid = 0.
// fused_ce_sum.comp then adds the R row losses in a fixed order (no float atomics): bitwise reproducible.
//
// Softmax statistics: each thread keeps an online (max, sum of exp(x - max)) pair over a strided slice
// of the row, and a shared-memory tree merges the pairs in a fixed order. The row is read twice
// (statistics, then gradient) rather than three times (max, sum, gradient).
//
// A window of rows (the runtime splits logits over the device's max storage binding size into windows):
// group g takes row first_row + g of labels / row_loss, its logits from element logits_offset + g V of
// binding 0; unsplit, first_row and the offsets are 0.
//
// Variants: VEC4 reads and writes a row as vec4s (needs V % 4 == 0, so every row starts 16-byte
// aligned); the plain source works on single floats for any V. IN_PLACE writes dlogits over the logits
// (one binding fewer, no second [R, V] buffer): safe because each thread overwrites only elements it has
// just read, and the label's logit is read before the first barrier, before any thread writes.
// vktrain-variants: -, VEC4, IN_PLACE, VEC4+IN_PLACE
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;  // (WG, 1, 1), WG a power of two: the tree halves it

#ifdef VEC4
#define VALUE vec4
#define LANES 4u
#else
#define VALUE float
#define LANES 1u
#endif

#ifdef IN_PLACE
layout(std430, set = 0, binding = 0) buffer Logits { VALUE logits[]; };             // [R, V] -> dlogits
#define dlogits logits
#else
layout(std430, set = 0, binding = 0) readonly buffer Logits { VALUE logits[]; };    // [R, V]
#endif
layout(std430, set = 0, binding = 1) readonly buffer Labels { int labels[]; };      // [R]
layout(std430, set = 0, binding = 2) readonly buffer NValid { float n_valid; };     // scalar
#ifdef IN_PLACE
layout(std430, set = 0, binding = 3) writeonly buffer RowLoss { float row_loss[]; }; // [R]
#else
layout(std430, set = 0, binding = 3) writeonly buffer DLogits { VALUE dlogits[]; }; // [R, V]
layout(std430, set = 0, binding = 4) writeonly buffer RowLoss { float row_loss[]; }; // [R]
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint R;               // rows of labels and row_loss
  uint V;               // classes per row
  uint first_row;       // the row of labels / row_loss that group 0 takes (a window of the logits' rows)
  uint logits_offset;   // element of that row's first logit in binding 0 (a multiple of 4 with VEC4)
  uint dlogits_offset;  // likewise in the dlogits binding (= logits_offset with IN_PLACE)
} pc;

shared float s_max[gl_WorkGroupSize.x];
shared float s_sum[gl_WorkGroupSize.x];

const float NEG_INF = -1.0 / 0.0;

// Merge (m_other, s_other) into (m, s). An empty side (max -inf, sum 0) is skipped: exp(-inf - -inf)
// would be NaN.
void merge(inout float m, inout float s, float m_other, float s_other) {
  if (m_other == NEG_INF) return;
  if (m == NEG_INF) {
    m = m_other;
    s = s_other;
    return;
  }
  const float m_new = max(m, m_other);
  s = s * exp(m - m_new) + s_other * exp(m_other - m_new);
  m = m_new;
}

// Largest component, and the sum of exp(x - m) over the components (x one float or one vec4).
float largest(float x) { return x; }
float largest(vec4 x) { return max(max(x.x, x.y), max(x.z, x.w)); }
float sum_exp(float x, float m) { return exp(x - m); }
float sum_exp(vec4 x, float m) {
  const vec4 e = exp(x - m);
  return (e.x + e.y) + (e.z + e.w);
}

void main() {
  const uint window_row = VKTRAIN_GLOBAL_GROUP_ID(pc).x;
  const uint row = pc.first_row + window_row;
  // Every early return below is uniform over the workgroup (it depends on the row only), so no
  // barrier is reached by part of a workgroup.
  if (row >= pc.R) return;
  const uint V = pc.V;
  const uint row_values = V / LANES;  // VALUEs per row
  const uint tid = gl_LocalInvocationID.x;
  const uint WG = gl_WorkGroupSize.x;
  const uint base = window_row * row_values + pc.logits_offset / LANES;
  const uint d_base = window_row * row_values + pc.dlogits_offset / LANES;
  const int label = labels[row];

  if (label < 0 || uint(label) >= V) {
    for (uint i = tid; i < row_values; i += WG) dlogits[d_base + i] = VALUE(0.0);
    if (tid == 0) row_loss[row] = 0.0;
    return;
  }
  const uint label_value = uint(label) / LANES;  // the VALUE holding the label's logit
#ifdef VEC4
  const uint label_lane = uint(label) % 4u;
  const vec4 label_onehot = vec4(equal(uvec4(0u, 1u, 2u, 3u), uvec4(label_lane)));
#else
  const float label_onehot = 1.0;
#endif

  float label_logit = 0.0;  // read by thread 0 only, before any thread writes (see IN_PLACE)
  if (tid == 0) {
#ifdef VEC4
    label_logit = logits[base + label_value][label_lane];
#else
    label_logit = logits[base + label_value];
#endif
  }

  float m = NEG_INF;
  float s = 0.0;
  for (uint i = tid; i < row_values; i += WG) {
    const VALUE x = logits[base + i];
    const float x_max = largest(x);
    if (x_max > m) {
      s *= exp(m - x_max);  // on the first value exp(-inf) = 0 (and s is still 0)
      m = x_max;
    }
    if (m != NEG_INF) s += sum_exp(x, m);  // while m is -inf every x so far is -inf: adds nothing
  }
  s_max[tid] = m;
  s_sum[tid] = s;
  barrier();
  for (uint stride = WG / 2; stride > 0; stride /= 2) {
    if (tid < stride) {
      float m_a = s_max[tid];
      float s_a = s_sum[tid];
      merge(m_a, s_a, s_max[tid + stride], s_sum[tid + stride]);
      s_max[tid] = m_a;
      s_sum[tid] = s_a;
    }
    barrier();
  }
  const float row_max = s_max[0];
  const float row_sum = s_sum[0];
  const float divisor = n_valid;

  if (tid == 0) {
    // (max - x[label]) + log(sum) rather than logsumexp - x[label]: with logits ~1e4 the latter
    // subtracts two nearly equal large numbers and loses the small loss to cancellation.
    row_loss[row] = ((row_max - label_logit) + log(row_sum)) / divisor;
  }
  const float inv_sum = 1.0 / row_sum;
  for (uint i = tid; i < row_values; i += WG) {
    const VALUE p = exp(logits[base + i] - row_max) * inv_sum;
    dlogits[d_base + i] = (i == label_value ? p - label_onehot : p) / divisor;
  }
}

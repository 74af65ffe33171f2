#version 450
// One AdamW step, in place over the resident optimizer state (host module:
// vktrain/runtime/delegate/kernels/optimizer.py). torch.optim.AdamW's update:
//   p *= 1 - lr * wd
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + (1 - b2) * g * g
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The hyper-parameters [lr, b1, b2, eps, wd] and the step t (1 on the first update) are read from device
// buffers the host rewrites before each replay, so one recording serves every step and any schedule.
//
// Variants: VEC4 updates vec4s (the body of a tensor); the plain source single floats (the 1-3 element
// tail, or a tensor smaller than a vec4). Elements [first, count) of the variant's unit are updated, so
// the tail dispatch binds the same whole buffers as the body. Threads stride over the elements (the host
// caps the number of workgroups), so the per-workgroup bias-correction work below is paid by a bounded
// number of workgroups however large the tensor.
// vktrain-variants: -, VEC4
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "codes.glsl"

#ifdef VEC4
#define VALUE vec4
#else
#define VALUE float
#endif

VKTRAIN_LOCAL_SIZE_FROM_SPEC;

layout(std430, set = 0, binding = 0) buffer Param { VALUE param[]; };
layout(std430, set = 0, binding = 1) buffer ExpAvg { VALUE exp_avg[]; };
layout(std430, set = 0, binding = 2) buffer ExpAvgSq { VALUE exp_avg_sq[]; };
layout(std430, set = 0, binding = 3) readonly buffer Grad { VALUE grad[]; };
layout(std430, set = 0, binding = 4) readonly buffer HParams { float hparams[HPARAM_COUNT]; };  // codes.glsl: contract.HPARAM_NAMES
layout(std430, set = 0, binding = 5) readonly buffer Step { float step; };          // t, whole number >= 1

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint first;   // first element to update, in VALUE units
  uint count;   // one past the last element, in VALUE units
  uint stride;  // threads in the whole dispatch (groups * local size)
} pc;

// ---- 1 - beta^t without cancellation ------------------------------------------------------------
// For beta2 = 0.999 and small t, 1 - beta2^t is ~1e-3, so a few-ulp error in an fp32 pow() (Vulkan
// does not bound pow tightly) would grow ~1000x in the subtraction. beta^t is computed instead by
// binary exponentiation in float-float arithmetic (hi + lo, ~44 significant bits) with Dekker's exact
// product, which needs only correctly rounded fp32 add and mul (guaranteed by Vulkan) and no fma.
// `precise` keeps the compiler from contracting or reassociating the error terms away.

vec2 split(float a) {  // Veltkamp: a = hi + lo, each half with at most 12 significant bits
  precise float c = 4097.0 * a;
  precise float hi = c - (c - a);
  precise float lo = a - hi;
  return vec2(hi, lo);
}

vec2 ff_mul(vec2 x, vec2 y) {  // (x.x + x.y) * (y.x + y.y), renormalised
  const vec2 xs = split(x.x);
  const vec2 ys = split(y.x);
  precise float p = x.x * y.x;
  precise float p_error = ((xs.x * ys.x - p) + xs.x * ys.y + xs.y * ys.x) + xs.y * ys.y;  // exact
  precise float tail = p_error + (x.x * y.y + x.y * y.x);
  precise float hi = p + tail;
  precise float lo = tail - (hi - p);
  return vec2(hi, lo);
}

float one_minus_pow(float beta, uint t) {
  vec2 result = vec2(1.0, 0.0);
  vec2 power = vec2(beta, 0.0);
  while (t > 0u) {
    if ((t & 1u) != 0u) result = ff_mul(result, power);
    power = ff_mul(power, power);
    t >>= 1;
  }
  precise float bias_correction = (1.0 - result.x) - result.y;  // 1 - hi is exact for hi in [0.5, 1]
  return bias_correction;
}

// Per-step scalars, computed once per workgroup and shared. The two bias corrections are serial chains
// of float-float products: the first and the last thread (different subgroups on most GPUs) each
// compute one, so the rest of the workgroup waits for one chain, not two.
shared float s_decay;      // 1 - lr * wd
shared float s_step_size;  // lr / (1 - b1^t)
shared float s_bc2_sqrt;   // sqrt(1 - b2^t)

void main() {
  const uint lid = gl_LocalInvocationIndex;
  // The host writes a whole number; rounding guards against a value a hair below it.
  const uint t = uint(round(step));
  if (lid == 0) {
    const float lr = hparams[HPARAM_LR];
    s_decay = 1.0 - lr * hparams[HPARAM_WEIGHT_DECAY];
    s_step_size = lr / one_minus_pow(hparams[HPARAM_BETA1], t);
  }
  if (lid == gl_WorkGroupSize.x - 1) s_bc2_sqrt = sqrt(one_minus_pow(hparams[HPARAM_BETA2], t));
  barrier();  // reached by every thread: the bounds checks come after it

  const float b1 = hparams[HPARAM_BETA1];
  const float b2 = hparams[HPARAM_BETA2];
  const float eps = hparams[HPARAM_EPS];
  const float decay = s_decay;
  const float step_size = s_step_size;
  const float bc2_sqrt = s_bc2_sqrt;
  for (uint i = pc.first + VKTRAIN_GLOBAL_INVOCATION_ID(pc).x; i < pc.count; i += pc.stride) {
    const VALUE g = grad[i];
    const VALUE m = b1 * exp_avg[i] + (1.0 - b1) * g;
    const VALUE v = b2 * exp_avg_sq[i] + (1.0 - b2) * (g * g);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const VALUE decayed = param[i] * decay;
    param[i] = decayed - step_size * (m / (sqrt(v) / bc2_sqrt + eps));
  }
}

// One AdamW step, in place over the resident optimizer state (GLSL reference: ../adamw.comp; host module:
// kernels/optimizer.py). torch.optim.AdamW's update:
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// hparams [lr, b1, b2, eps, wd] and the step t (1 on the first update) are device buffers the host
// rewrites before each run. VEC4 updates vec4s (a tensor's body), the plain source single floats (the
// tail); elements [first, count) of the variant's unit are updated, threads striding by `stride`.
// vktrain-variants: -, VEC4

#include "codes.glsl"

@id(0) override WG: u32 = 64u;

#if VEC4
alias Value = vec4<f32>;
#else
alias Value = f32;
#endif

struct Params {
    vktrain_group_offset: vec4<u32>,
    first: u32,   // first element to update, in Value units
    count: u32,   // one past the last element, in Value units
    stride: u32,  // threads in the whole dispatch (groups * local size)
}

@group(0) @binding(0) var<storage, read_write> param: array<Value>;
@group(0) @binding(1) var<storage, read_write> exp_avg: array<Value>;
@group(0) @binding(2) var<storage, read_write> exp_avg_sq: array<Value>;
@group(0) @binding(3) var<storage, read> grad: array<Value>;
@group(0) @binding(4) var<storage, read> hparams: array<f32, HPARAM_COUNT>;
@group(0) @binding(5) var<storage, read> step: f32;  // t, a whole number >= 1
@group(0) @binding(6) var<uniform> params: Params;

// ---- 1 - beta^t without cancellation ------------------------------------------------------------
// For beta2 = 0.999 and small t, 1 - beta2^t is ~1e-3, so an ulp-scale error in beta^t would grow ~1000x
// in the subtraction. The GLSL computes beta^t in float-float arithmetic, which needs `precise` (no
// contraction or reassociation); WGSL has no such guarantee, so this kernel uses only forms whose
// accuracy survives any such compiler freedom: 1 - beta^t = -expm1(t log(beta)), with log(beta) =
// log1p(-(1 - beta)) (1 - beta is exact for beta >= 1/2) as the series 2 atanh(s), and expm1 as its
// Taylor series while |t log(beta)| <= 1/2 (beyond it 1 - exp has nothing to cancel). A few ulp in all.

fn log_beta(beta: f32) -> f32 {
    if (beta < 0.5) {
        return log(beta);  // WGSL: 3 ulp outside [0.5, 2]
    }
    let x = 1.0 - beta;          // exact (Sterbenz)
    let s = -x / (2.0 - x);      // log1p(-x) = 2 atanh(s), |s| <= 1/3
    let z = s * s;
    var series = 1.0 / 21.0;
    for (var n = 19.0; n > 0.0; n -= 2.0) {
        series = 1.0 / n + z * series;
    }
    return 2.0 * s * series;
}

fn one_minus_pow(beta: f32, t: u32) -> f32 {
    if (beta <= 0.0) {
        return 1.0;  // beta^t = 0 for t >= 1 (torch's betas lie in [0, 1))
    }
    let y = f32(t) * log_beta(beta);
    if (y < -0.5) {
        return 1.0 - exp(y);
    }
    // -expm1(y) = -(y + y^2/2! + ... + y^12/12!), nested; the dropped terms are < 1e-13 relative.
    var series = 1.0;
    for (var n = 12.0; n > 1.0; n -= 1.0) {
        series = 1.0 + y / n * series;
    }
    return -y * series;
}

// Per-step scalars, computed once per workgroup: the two bias corrections by different threads.
var<workgroup> s_decay: f32;      // 1 - lr * wd
var<workgroup> s_step_size: f32;  // lr / (1 - b1^t)
var<workgroup> s_bc2_sqrt: f32;   // sqrt(1 - b2^t)

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // The host writes a whole number; rounding guards against a value a hair below it.
    let t = u32(round(step));
    if (lid == 0u) {
        let lr = hparams[HPARAM_LR];
        s_decay = 1.0 - lr * hparams[HPARAM_WEIGHT_DECAY];
        s_step_size = lr / one_minus_pow(hparams[HPARAM_BETA1], t);
    }
    if (lid == WG - 1u) {
        s_bc2_sqrt = sqrt(one_minus_pow(hparams[HPARAM_BETA2], t));
    }
    workgroupBarrier();

    let b1 = hparams[HPARAM_BETA1];
    let b2 = hparams[HPARAM_BETA2];
    let eps = hparams[HPARAM_EPS];
    let decay = s_decay;
    let step_size = s_step_size;
    let bc2_sqrt = s_bc2_sqrt;
    let first_thread = (workgroup.x + params.vktrain_group_offset.x) * WG + lid;
    for (var i = params.first + first_thread; i < params.count; i += params.stride) {
        let g = grad[i];
        let m = b1 * exp_avg[i] + (1.0 - b1) * g;
        let v = b2 * exp_avg_sq[i] + (1.0 - b2) * (g * g);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        let decayed = param[i] * decay;
        param[i] = decayed - step_size * (m / (sqrt(v) / bc2_sqrt + eps));
    }
}

// SwiGLU, elementwise (GLSL reference: ../swiglu.comp; host module: kernels/swiglu.py), sig = sigmoid(gate):
//   forward:  h = gate * sig * up
//   BACKWARD: d_gate = d_h * up * sig * (1 + gate * (1 - sig)),  d_up = d_h * gate * sig
// sigmoid from e = exp(-|g|) <= 1 (never overflows; keeps relative accuracy for g << 0).
// VEC4 moves vec4s (count % 4 == 0); the plain source single floats.
// vktrain-variants: -, VEC4, BACKWARD, VEC4+BACKWARD

@id(0) override WG: u32 = 64u;

#if VEC4
alias Value = vec4<f32>;
#else
alias Value = f32;
#endif

struct Params {
    vktrain_group_offset: vec4<u32>,
    count: u32,  // Values (floats or vec4s)
}

#if BACKWARD
@group(0) @binding(0) var<storage, read> d_h: array<Value>;
@group(0) @binding(1) var<storage, read> gate: array<Value>;
@group(0) @binding(2) var<storage, read> up: array<Value>;
@group(0) @binding(3) var<storage, read_write> d_gate: array<Value>;
@group(0) @binding(4) var<storage, read_write> d_up: array<Value>;
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(0) var<storage, read> gate: array<Value>;
@group(0) @binding(1) var<storage, read> up: array<Value>;
@group(0) @binding(2) var<storage, read_write> h: array<Value>;
@group(0) @binding(3) var<uniform> params: Params;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let i = (workgroup.x + params.vktrain_group_offset.x) * WG + local.x;
    if (i >= params.count) {
        return;
    }
    let g = gate[i];
    let e = exp(-abs(g));
    let positive_sig = 1.0 / (1.0 + e);
    let sig = select(e * positive_sig, positive_sig, g >= Value(0.0));
#if BACKWARD
    let dh = d_h[i];
    let u = up[i];
    d_gate[i] = dh * u * sig * (1.0 + g * (1.0 - sig));
    d_up[i] = dh * (g * sig);
#else
    h[i] = g * sig * up[i];
#endif
}

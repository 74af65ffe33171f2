"""Definitions of vktrain's own ops (torch.library namespace `vktrain`; docs/CONTRACTS.md).

Each entry: the functional schema (the `.out` overload is derived from it), the dtypes of its tensor
arguments, and the shape function. The CPU references (vktrain/ops) add value checks that need the
data (NaN latents, labels >= V, hyper-parameter ranges); everything decidable from shapes, dtypes and
scalars is here, once.
"""
from __future__ import annotations

from vktrain import contract
from vktrain.opdefs.core import (Call, DtypeRefusal, OpDef, Refusal, TensorMeta, last_dim, rank, same_dtype,
                                 same_shape)
from vktrain.opdefs.schema import Schema
from vktrain.quant import check_q4gsw_shapes, padded_k

NAMESPACE = "vktrain"
# The CPU references also take float64 (gradcheck); GPU kernels implement float32.
FLOAT = ("float32", "float64")
INDEX = ("int64", "int32")


def _q4gsw_shapes(n: int, k: int, group_size: int) -> None:
    try:
        check_q4gsw_shapes(n, k, group_size)
    except ValueError as exc:
        raise Refusal(str(exc)) from None


def _q4gsw_weights(call: Call) -> tuple[int, int, int]:
    """(N, K, group_size) of flat q4gsw `weights` [N, Kp/2] with `scales` [G, N] (K = G * group_size)."""
    weights = rank(call, "weights", 2, "[N, Kp/2] (flat q4gsw codes, two per byte)")
    scales = rank(call, "scales", 2, "[G, N] (one scale per group and output feature)")
    group_size = call.integer("group_size")
    num_groups, n = scales.shape
    if num_groups == 0:
        raise Refusal(f"scales must have at least one group (shape [G, N] with G >= 1), got {scales.shape}")
    k = num_groups * group_size
    _q4gsw_shapes(n, k, group_size)
    expected = (n, padded_k(k) // 2)
    if weights.shape != expected:
        raise Refusal(
            f"weights shape {weights.shape} does not match scales {scales.shape} with group_size={group_size}: "
            f"expected flat uint8 [N, Kp/2] = {list(expected)} (N={n}, K=G*group_size={k}, Kp={padded_k(k)})")
    return n, k, group_size


def q4gsw_weight_dims(weights: TensorMeta, scales: TensorMeta, group_size: int) -> tuple[int, int]:
    """(N, K) of a flat q4gsw weight and its scales (dtypes included); raises Refusal."""
    call = Call("q4gsw", {"weights": weights, "scales": scales, "group_size": group_size})
    for name, dtype in (("weights", "uint8"), ("scales", "float32")):
        if call.tensor(name).dtype != dtype:
            raise DtypeRefusal(f"{name} must have dtype {dtype}, got {call.tensor(name).dtype}")
    n, k, _ = _q4gsw_weights(call)
    return n, k


def _q4gsw_linear_output(call: Call, x_name: str) -> TensorMeta:
    """The output [..., N] of the q4gsw base linear of input `x_name` [..., K] and optional `bias` [N]."""
    n, k, _ = _q4gsw_weights(call)
    x = last_dim(call, x_name, k, "K = in features = G * group_size")
    bias = call.optional_tensor("bias")
    if bias is not None:
        same_dtype(call, "bias", x_name)
        if bias.shape != (n,):
            raise Refusal(f"bias must have shape [N] = [{n}], got {bias.shape}")
    return TensorMeta(x.shape[:-1] + (n,), x.dtype)


def _linear_q4gsw(call: Call) -> tuple[TensorMeta, ...]:
    return (_q4gsw_linear_output(call, "x"),)


def _linear_q4gsw_backward(call: Call) -> tuple[TensorMeta, ...]:
    n, k, _ = _q4gsw_weights(call)
    d_out = last_dim(call, "d_out", n, "N = out features")
    return (TensorMeta(d_out.shape[:-1] + (k,), d_out.dtype),)


def _lora_linear_input(call: Call) -> int:
    """N of a LoRA linear: adapter input `x` [..., K] (rank >= 2), lora_A [r, K], lora_B [N, r], and
    the q4gsw base `weights` / `scales` of N outputs."""
    n, k, _ = _q4gsw_weights(call)
    x = last_dim(call, "x", k, "K = in features = G * group_size")
    if len(x.shape) < 2:
        raise Refusal(f"x must have at least 2 dims [..., M, K] (rows, in features), got shape {x.shape}")
    lora_a = rank(call, "lora_A", 2, "[r, K] (the adapter's down projection)")
    same_dtype(call, "lora_A", "x")
    if lora_a.shape[1] != k or lora_a.shape[0] < 1:
        raise Refusal(f"lora_A must have shape [r, K] with r >= 1 and K = {k}, got {lora_a.shape}")
    r = lora_a.shape[0]
    rank(call, "lora_B", 2, "[N, r] (the adapter's up projection)")
    same_dtype(call, "lora_B", "x")
    if call.tensor("lora_B").shape != (n, r):
        raise Refusal(f"lora_B must have shape [N, r] = [{n}, {r}] (N of the base weight, r of lora_A), "
                      f"got {call.tensor('lora_B').shape}")
    call.real("scaling", "the adapter's factor alpha / r")
    return n


def _lora_linear_q4gsw(call: Call) -> tuple[TensorMeta, ...]:
    _lora_linear_input(call)
    same_dtype(call, "base_x", "x")
    same_shape(call, "base_x", "x")
    return (_q4gsw_linear_output(call, "base_x"),)


def _lora_linear_q4gsw_backward(call: Call) -> tuple[TensorMeta, ...]:
    n = _lora_linear_input(call)
    x = call.tensor("x")
    d_out = last_dim(call, "d_out", n, "N = out features")
    same_dtype(call, "d_out", "x")
    if d_out.shape[:-1] != x.shape[:-1]:
        raise Refusal(f"d_out {d_out.shape} and x {x.shape} must share their leading (row) dims: "
                      f"expected d_out [..., N] and x [..., K] with the same ...")
    return x, call.tensor("lora_A"), call.tensor("lora_B"), x


def _linear_dw(call: Call) -> tuple[TensorMeta, ...]:
    d_out, x = call.tensor("d_out"), call.tensor("x")
    same_dtype(call, "x", "d_out")
    if not d_out.shape or not x.shape:
        raise Refusal(f"d_out [..., N] and x [..., K] must have at least 1 dim, got {d_out.shape} and {x.shape}")
    if d_out.shape[:-1] != x.shape[:-1]:
        raise Refusal(f"d_out {d_out.shape} and x {x.shape} must share their leading (row) dims: "
                      f"expected d_out [..., N] and x [..., K] with the same ...")
    return (TensorMeta((d_out.shape[-1], x.shape[-1]), d_out.dtype),)


def _q4gsw_requant(call: Call) -> tuple[TensorMeta, ...]:
    latent = rank(call, "latent", 2, "[N, K] (the float latent weight)")
    scales = rank(call, "scales", 2, "[G, N] (one scale per group and output feature)")
    group_size = call.integer("group_size")
    n, k = latent.shape
    _q4gsw_shapes(n, k, group_size)
    expected_scales = (k // group_size, n)
    if scales.shape != expected_scales:
        raise Refusal(f"scales must have shape [G, N] = {list(expected_scales)} for latent [N, K] = [{n}, {k}] and "
                      f"group_size={group_size}, got {scales.shape}")
    return (TensorMeta((n, padded_k(k) // 2), "uint8"),)


def _fused_ce(call: Call) -> tuple[TensorMeta, ...]:
    logits = rank(call, "logits", 2, "[R, V] (rows, vocabulary)")
    labels = rank(call, "labels", 1, "[R] (one class index per row, < 0 = ignored)")
    rank(call, "n_valid", 0, "[] (a float32 scalar tensor: the loss divisor)")
    rows, vocab = logits.shape
    if vocab < 1:
        raise Refusal(f"logits must have at least one class (V >= 1), got shape {logits.shape}")
    if labels.shape[0] != rows:
        raise Refusal(f"labels must have shape [R] = [{rows}] to match logits {logits.shape}, got {labels.shape}")
    return TensorMeta((), logits.dtype), TensorMeta(logits.shape, logits.dtype)


def _adamw(call: Call) -> tuple[TensorMeta, ...]:
    param = call.tensor("param")
    for name in ("exp_avg", "exp_avg_sq", "grad"):
        tensor = call.tensor(name)
        if tensor != param:
            raise Refusal(f"{name} must match param ({param.dtype} {param.shape}), got {tensor.dtype} {tensor.shape}")
    hparams = call.tensor("hparams")
    if hparams.shape != (len(contract.HPARAM_NAMES),):
        raise Refusal(f"hparams must have shape [{len(contract.HPARAM_NAMES)}] = [{', '.join(contract.HPARAM_NAMES)}], "
                      f"got {hparams.shape}")
    rank(call, "step", 0, "[] (a float32 scalar: the step number t after increment, 1 on the first update)")
    return param, param, param


def _rms_norm_input(call: Call) -> TensorMeta:
    x = call.tensor("x")
    same_dtype(call, "weight", "x")
    if not x.shape:
        raise Refusal(f"x must have at least 1 dim [..., D] (normalised over the last), got shape {x.shape}")
    rank(call, "weight", 1, f"[D] = [{x.shape[-1]}] (one gain per feature of x's last dim)")
    weight = call.tensor("weight")
    if weight.shape[0] != x.shape[-1]:
        raise Refusal(f"weight must have shape [D] = [{x.shape[-1]}] to match x {x.shape}, got {weight.shape}")
    return x


def _rms_norm(call: Call) -> tuple[TensorMeta, ...]:
    x = _rms_norm_input(call)
    what = "added to mean(x^2) before the square root"
    if call.real("eps", what) < 0:
        raise Refusal(f"eps must be >= 0 ({what}), got {call.args['eps']}")
    return x, TensorMeta(x.shape[:-1] + (1,), x.dtype)


def _rms_norm_backward(call: Call) -> tuple[TensorMeta, ...]:
    x = _rms_norm_input(call)
    for name in ("d_y", "rstd"):
        same_dtype(call, name, "x")
    same_shape(call, "d_y", "x")
    expected = x.shape[:-1] + (1,)
    if call.tensor("rstd").shape != expected:
        raise Refusal(f"rstd must have shape [..., 1] = {list(expected)} (rms_norm's second output for x {x.shape}), "
                      f"got {call.tensor('rstd').shape}")
    return (x,)


def _rope(call: Call) -> tuple[TensorMeta, ...]:
    x = rank(call, "x", 4, "[B, S, H, D] (batch, sequence, heads, head dim)")
    batch, seq_len, _, head_dim = x.shape
    if head_dim % 2 != 0:
        raise Refusal(f"x's head dim D must be even (rope rotates the pairs (i, i + D/2)), got D={head_dim}")
    # [S, D/2]: one angle per position, shared by the batch rows; [B, S, D/2]: per token (packed documents,
    # whose positions restart at each document start).
    shapes = ((seq_len, head_dim // 2), (batch, seq_len, head_dim // 2))
    for name in ("cos", "sin"):
        same_dtype(call, name, "x")
        if call.tensor(name).shape not in shapes:
            raise Refusal(f"{name} must have shape [S, D/2] = [{seq_len}, {head_dim // 2}] or [B, S, D/2] = "
                          f"[{batch}, {seq_len}, {head_dim // 2}] for x [B, S, H, D] = {list(x.shape)}, got "
                          f"{call.tensor(name).shape}")
    if call.tensor("cos").shape != call.tensor("sin").shape:
        raise Refusal(f"cos {call.tensor('cos').shape} and sin {call.tensor('sin').shape} must have one shape")
    return (x,)


# The head dims the runtime's fp32 attention kernels are built for (spec constant D); `vktrain export` refuses
# others up front. Not checked here: the CPU reference ops take any even D.
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)


def _attention_inputs(call: Call) -> tuple[int, int, int, int]:
    """(B, S, Hq, Hkv) of q [B, S, Hq, D] and k = v [B, S, Hkv, D]."""
    for name in ("q", "k", "v"):
        rank(call, name, 4, f"[B, S, {'Hq' if name == 'q' else 'Hkv'}, D] (batch, sequence, heads, head dim)")
    same_dtype(call, "k", "q")
    same_dtype(call, "v", "q")
    same_shape(call, "v", "k")
    q, k = call.tensor("q"), call.tensor("k")
    batch, seq_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq_len, head_dim):
        raise Refusal(f"k and v must have shape [B, S, Hkv, D] with B, S, D of q {q.shape}, got {k.shape}")
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise Refusal(f"the number of query heads must be a multiple of the number of kv heads (grouped-query "
                      f"attention), got Hq={q_heads} (q {q.shape}) and Hkv={kv_heads} (k {k.shape})")
    call.real("scale", "the factor applied to q k^T, usually 1/sqrt(D)")
    positions = call.optional_tensor("positions")
    if positions is not None and positions.shape != (batch, seq_len):
        raise Refusal(f"positions must have shape [B, S] = {[batch, seq_len]} (each token's position in its "
                      f"document), got {positions.shape}")
    return batch, seq_len, q_heads, kv_heads


def _causal_attention(call: Call) -> tuple[TensorMeta, ...]:
    batch, seq_len, q_heads, _ = _attention_inputs(call)
    q = call.tensor("q")
    return q, TensorMeta((batch, q_heads, seq_len), q.dtype)


def _causal_attention_backward(call: Call) -> tuple[TensorMeta, ...]:
    batch, seq_len, q_heads, _ = _attention_inputs(call)
    for name in ("d_out", "out"):
        same_dtype(call, name, "q")
        same_shape(call, name, "q")
    same_dtype(call, "lse", "q")
    if call.tensor("lse").shape != (batch, q_heads, seq_len):
        raise Refusal(f"lse must have shape [B, Hq, S] = {[batch, q_heads, seq_len]} (causal_attention's second "
                      f"output for q {call.tensor('q').shape}), got {call.tensor('lse').shape}")
    return call.tensor("q"), call.tensor("k"), call.tensor("v")


def _swiglu(call: Call) -> tuple[TensorMeta, ...]:
    same_dtype(call, "up", "gate")
    same_shape(call, "up", "gate")
    return (call.tensor("gate"),)


def _swiglu_backward(call: Call) -> tuple[TensorMeta, ...]:
    _swiglu(call)
    same_dtype(call, "d_h", "gate")
    same_shape(call, "d_h", "gate")
    return call.tensor("gate"), call.tensor("gate")


def _define(schema: str, shape_function, **arg_dtypes: tuple[str, ...]) -> OpDef:
    return OpDef(Schema.parse(NAMESPACE, schema), shape_function, arg_dtypes)


_F32 = ("float32",)
VKTRAIN_OPS = (
    _define("linear_q4gsw(Tensor x, Tensor weights, Tensor scales, int group_size, Tensor? bias=None) -> Tensor",
            _linear_q4gsw, weights=("uint8",), scales=_F32, x=FLOAT, bias=FLOAT),
    _define("linear_q4gsw_backward(Tensor d_out, Tensor weights, Tensor scales, int group_size) -> Tensor",
            _linear_q4gsw_backward, weights=("uint8",), scales=_F32, d_out=FLOAT),
    _define("linear_dW(Tensor d_out, Tensor x) -> Tensor", _linear_dw, d_out=FLOAT, x=FLOAT),
    _define("lora_linear_q4gsw(Tensor x, Tensor lora_A, Tensor lora_B, float scaling, Tensor base_x, "
            "Tensor weights, Tensor scales, int group_size, Tensor? bias=None) -> Tensor", _lora_linear_q4gsw,
            x=FLOAT, lora_A=FLOAT, lora_B=FLOAT, base_x=FLOAT, weights=("uint8",), scales=_F32, bias=FLOAT),
    _define("lora_linear_q4gsw_backward(Tensor d_out, Tensor x, Tensor lora_A, Tensor lora_B, float scaling, "
            "Tensor weights, Tensor scales, int group_size) -> (Tensor d_x, Tensor d_lora_A, Tensor d_lora_B, "
            "Tensor d_base_x)", _lora_linear_q4gsw_backward,
            d_out=FLOAT, x=FLOAT, lora_A=FLOAT, lora_B=FLOAT, weights=("uint8",), scales=_F32),
    _define("q4gsw_requant(Tensor latent, Tensor scales, int group_size) -> Tensor", _q4gsw_requant,
            latent=_F32, scales=_F32),
    _define("fused_ce(Tensor logits, Tensor labels, Tensor n_valid) -> (Tensor loss, Tensor dlogits)", _fused_ce,
            logits=FLOAT, labels=INDEX, n_valid=_F32),
    _define("adamw(Tensor param, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, Tensor hparams, Tensor step) "
            "-> (Tensor param, Tensor exp_avg, Tensor exp_avg_sq)", _adamw, param=FLOAT, hparams=_F32, step=_F32),
    _define("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)", _rms_norm,
            x=FLOAT, weight=FLOAT),
    _define("rms_norm_backward(Tensor d_y, Tensor x, Tensor weight, Tensor rstd) -> Tensor", _rms_norm_backward,
            x=FLOAT, weight=FLOAT, d_y=FLOAT, rstd=FLOAT),
    _define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", _rope, x=FLOAT, cos=FLOAT, sin=FLOAT),
    # positions (packed documents): query i sees keys j with i - positions[i] <= j <= i, its own document.
    _define("causal_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? positions=None) -> "
            "(Tensor out, Tensor lse)", _causal_attention, q=FLOAT, k=FLOAT, v=FLOAT, positions=INDEX),
    _define("causal_attention_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "float scale, Tensor? positions=None) -> (Tensor d_q, Tensor d_k, Tensor d_v)",
            _causal_attention_backward, q=FLOAT, k=FLOAT, v=FLOAT, d_out=FLOAT, out=FLOAT, lse=FLOAT,
            positions=INDEX),
    _define("swiglu(Tensor gate, Tensor up) -> Tensor", _swiglu, gate=FLOAT, up=FLOAT),
    _define("swiglu_backward(Tensor d_h, Tensor gate, Tensor up) -> (Tensor d_gate, Tensor d_up)", _swiglu_backward,
            gate=FLOAT, up=FLOAT, d_h=FLOAT),
)

__all__ = ["FLOAT", "INDEX", "NAMESPACE", "VKTRAIN_OPS", "q4gsw_weight_dims"]

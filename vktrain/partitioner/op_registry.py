"""Which ops the vktrain Vulkan backend accepts, and on what terms: one OpFeatures record per op.

Each record is registered with `@register_op(<op key>, ...)` on a function that returns it. The op key is
`<namespace>.<name>.<overload>` (e.g. `aten.mm.default`, `vktrain.linear_q4gsw.default`); edge-dialect
ops map to the key of the aten/vktrain op they wrap (see `op_key`). The same key names the op in the
delegate blob's op chain, so the runtime dispatches on it.

`OpFeatures.check(node, program)` returns None when the node can be lowered, else the refusal reason:
unsupported dtype of an argument or output, symbolic shapes, a shape the kernel cannot take (q4gsw:
N % 4, K % 4, group_size % 4, K % group_size), or a prepacked argument that is not a constant.

The registry accepts only what the runtime can execute: `register_op` refuses a key that
`vktrain.runtime.delegate.op_lowering.supported_ops()` lacks, so the partitioner never delegates an op the GPU
cannot run (an unregistered op is refused with its reason and stays outside the delegate). The dtypes
the records accept are the kernels' (float32 math, int32/int64 indices; 32-bit words for copies).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from vktrain.quant import check_q4gsw_shapes, padded_k
from vktrain.runtime.delegate.op_lowering import supported_ops as runtime_supported_ops

FLOAT = frozenset({torch.float32})
INDEX = frozenset({torch.int64, torch.int32})
BOOL = frozenset({torch.bool})
UINT8 = frozenset({torch.uint8})
ANY = FLOAT | INDEX | BOOL | UINT8
# What the runtime's copy and fill kernels move: 32-bit words (int64 lives on the GPU as int32).
WORDS = FLOAT | INDEX

# Ops kept whole instead of being decomposed into core ATen (by the joint-graph export and by to_edge):
# the runtime runs each as one fused kernel, where the decomposition would cost several passes.
PRESERVED_OPS = (
    torch.ops.aten.threshold_backward.default,   # ReLU backward (else le + scalar_tensor + where)
    torch.ops.aten.gelu_backward.default,        # else erf, exp and six multiplications
    torch.ops.aten.silu.default,                 # else sigmoid + mul
    torch.ops.aten.silu_backward.default,        # else sigmoid, full_like, sub, add, 3 mul
    torch.ops.aten.sigmoid_backward.default,
    torch.ops.aten.tanh_backward.default,
    torch.ops.aten.embedding_dense_backward.default,
)

# Names of prepacked layouts a constant argument is converted to in the blob (vkt_blob.TensorLayout).
W4X8 = "Q4GSW_W4X8"


@dataclass(frozen=True)
class TensorArg:
    """A positional argument of an op that may hold a tensor."""
    name: str
    dtypes: frozenset
    optional: bool = False      # may be None
    scalar_ok: bool = False     # may be a Python number instead of a tensor (e.g. add.Tensor's other)
    constant: bool = False      # must be a constant (parameter / frozen buffer / lifted constant)
    prepack: str | None = None  # layout the blob stores this constant in


def scalar_arg(name: str) -> TensorArg:
    """A positional argument that is a Python number, never a tensor (group_size, a Scalar operand)."""
    return TensorArg(name, frozenset(), scalar_ok=True)


ShapeCheck = Callable[[Node], "str | None"]


@dataclass(frozen=True)
class OpFeatures:
    key: str
    args: tuple[TensorArg, ...] = ()
    output_dtypes: frozenset = FLOAT
    shape_check: ShapeCheck | None = None
    # False where arguments are not plain tensors (getitem's tuple, cat's list): shape_check covers them.
    check_arguments: bool = True

    def prepacked_args(self) -> dict[int, str]:
        """Argument index -> layout, for constants the blob stores prepacked."""
        return {i: a.prepack for i, a in enumerate(self.args) if a.prepack is not None}

    def check(self, node: Node, program: ExportedProgram | None = None) -> str | None:
        """None if `node` can be lowered, else why not. With `program`, also checks that arguments
        marked `constant` really are constants of that program."""
        where = f"{self.key} ('{node.name}')"
        if not self.check_arguments:
            return self.shape_check(node) if self.shape_check is not None else None
        for i, spec in enumerate(self.args):
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(spec.name)
            if arg is None:
                if not spec.optional:
                    return f"{where}: argument '{spec.name}' is missing (expected a tensor)"
                continue
            if not isinstance(arg, Node):
                if spec.scalar_ok and isinstance(arg, (int, float, bool)):
                    continue
                return f"{where}: argument '{spec.name}' is {type(arg).__name__} {arg!r}, expected a tensor"
            if not spec.dtypes:
                return f"{where}: argument '{spec.name}' must be a Python number, got the tensor '{arg.name}'"
            value = arg.meta.get("val")
            if not isinstance(value, torch.Tensor):
                return f"{where}: argument '{spec.name}' has no tensor metadata (got {type(value).__name__})"
            if value.dtype not in spec.dtypes:
                return (f"{where}: argument '{spec.name}' has unsupported dtype {value.dtype}, "
                        f"expected one of {_dtype_names(spec.dtypes)}")
            if _is_symbolic(value):
                return f"{where}: argument '{spec.name}' has a symbolic shape {list(value.shape)}; only static shapes are supported"
            if spec.constant and program is not None and not is_constant_input(program, arg):
                return (f"{where}: argument '{spec.name}' must be a constant (a frozen weight) so it can be "
                        f"prepacked{' to ' + spec.prepack if spec.prepack else ''}; got the computed value '{arg.name}'")
        # Tensors in positions the record does not describe would reach the kernel unchecked.
        described = {spec.name for spec in self.args}
        extra = [f"argument {i}" for i, a in enumerate(node.args[len(self.args):], len(self.args)) if _holds_node(a)]
        extra += [f"keyword '{k}'" for k, a in node.kwargs.items() if k not in described and _holds_node(a)]
        if extra:
            return f"{where}: unexpected tensor {', '.join(extra)}; this op's record accepts tensors only as " \
                   f"{[spec.name for spec in self.args if spec.dtypes] or 'none'}"
        for out in _output_tensors(node):
            if out.dtype not in self.output_dtypes:
                return (f"{where}: output has unsupported dtype {out.dtype}, "
                        f"expected one of {_dtype_names(self.output_dtypes)}")
            if _is_symbolic(out):
                return f"{where}: output has a symbolic shape {list(out.shape)}; only static shapes are supported"
        if self.shape_check is not None:
            return self.shape_check(node)
        return None


_REGISTRY: dict[str, OpFeatures] = {}
# Not a graph op: preprocess resolves a getitem to one of its producer's outputs.
GETITEM = "getitem"
_RUNTIME_OPS = frozenset(runtime_supported_ops())


def register_op(*keys: str) -> Callable[[Callable[[str], OpFeatures]], Callable[[str], OpFeatures]]:
    """Register the OpFeatures built by the decorated function `(key) -> OpFeatures` under each key.

    Raises ValueError for a key the runtime cannot execute (no lowering or no kernel in
    vktrain.runtime.delegate.op_lowering), so the partitioner and the runtime cannot drift apart."""
    def decorate(build: Callable[[str], OpFeatures]) -> Callable[[str], OpFeatures]:
        for key in keys:
            if key in _REGISTRY:
                raise ValueError(f"op {key} is registered twice")
            if key != GETITEM and key not in _RUNTIME_OPS:
                raise ValueError(f"op {key} cannot be registered: the vktrain runtime has no lowering or kernel for "
                                 f"it (vktrain.runtime.delegate.op_lowering.supported_ops()), so a delegate holding it "
                                 f"would fail at load")
            features = build(key)
            if features.key != key:
                raise ValueError(f"OpFeatures for {key} carries the key {features.key}")
            _REGISTRY[key] = features
        return build
    return decorate


def op_key(target) -> str:
    """The registry key of a call_function target: 'aten.mm.default', 'vktrain.adamw.default', 'getitem'."""
    if target is operator.getitem:
        return GETITEM
    op = target if isinstance(target, torch._ops.OpOverload) else getattr(target, "_op", target)  # edge wraps aten
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return getattr(target, "__name__", str(target))


def get_op_features(key: str) -> OpFeatures | None:
    return _REGISTRY.get(key)


def supported_ops() -> list[str]:
    return sorted(_REGISTRY)


def check_node(node: Node, program: ExportedProgram | None = None) -> str | None:
    """None if the node can be lowered, else the reason it is refused."""
    if node.op != "call_function":
        return f"'{node.name}' is a {node.op} node, not an op call"
    key = op_key(node.target)
    features = _REGISTRY.get(key)
    if features is None:
        return f"{key} ('{node.name}'): operator is not supported by the vktrain Vulkan backend (no OpFeatures registered)"
    return features.check(node, program)


def is_constant_input(program: ExportedProgram, node: Node) -> bool:
    """True for placeholders holding parameters, non-mutated buffers and lifted tensor constants."""
    if node.op != "placeholder":
        return False
    sig = program.graph_signature
    if node.name in sig.inputs_to_parameters or node.name in sig.inputs_to_lifted_tensor_constants:
        return True
    buffer = sig.inputs_to_buffers.get(node.name)
    return buffer is not None and buffer not in set(sig.buffers_to_mutate.values())


# ---------------------------------------------------------------------------------------------------
# helpers


def _dtype_names(dtypes: frozenset) -> str:
    return "{" + ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes)) + "}"


def _holds_node(arg) -> bool:
    if isinstance(arg, Node):
        return True
    return isinstance(arg, (list, tuple)) and any(isinstance(a, Node) for a in arg)


def _is_symbolic(t: torch.Tensor) -> bool:
    return any(not isinstance(s, int) for s in t.shape)


def _output_tensors(node: Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _shape(node_or_value, index: int | None = None) -> tuple[int, ...]:
    val = node_or_value.meta["val"] if isinstance(node_or_value, Node) else node_or_value
    if index is not None:
        val = val[index]
    return tuple(val.shape)


def _q4gsw_geometry(node: Node, weights_index: int | None, scales_index: int, gs_index: int,
                    activation_index: int, activation_dim: str) -> str | None:
    """Shared shape rules of the q4gsw ops. activation_dim: 'K' (input x) or 'N' (d_out)."""
    where = f"{op_key(node.target)} ('{node.name}')"
    scales_shape = _shape(node.args[scales_index])
    group_size = node.args[gs_index]
    if not isinstance(group_size, int):
        return f"{where}: group_size must be a Python int, got {group_size!r}"
    if len(scales_shape) != 2:
        return f"{where}: scales must be 2-D [G, N], got shape {list(scales_shape)}"
    G, N = scales_shape
    K = G * group_size
    try:
        check_q4gsw_shapes(N, K, group_size)
    except ValueError as e:
        return f"{where}: {e}"
    if weights_index is not None:
        w_shape = _shape(node.args[weights_index])
        if w_shape != (N, padded_k(K) // 2):
            return (f"{where}: weights shape {list(w_shape)} does not match scales {list(scales_shape)} and "
                    f"group_size {group_size}: expected flat [N, Kp/2] = {[N, padded_k(K) // 2]}")
    a_shape = _shape(node.args[activation_index])
    expected_last = K if activation_dim == "K" else N
    if not a_shape or a_shape[-1] != expected_last:
        return f"{where}: last dim of the activation {list(a_shape)} must be {activation_dim}={expected_last}"
    return None


# ---------------------------------------------------------------------------------------------------
# vktrain ops (CONTRACTS.md)


@register_op("vktrain.linear_q4gsw.default")
def _linear_q4gsw(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        reason = _q4gsw_geometry(node, 1, 2, 3, 0, "K")
        bias = node.args[4] if len(node.args) > 4 else node.kwargs.get("bias")
        if reason is None and isinstance(bias, Node):
            N = _shape(node.args[2])[1]
            if _shape(bias) != (N,):
                return f"{key} ('{node.name}'): bias shape {list(_shape(bias))} must be [N] = [{N}]"
        return reason
    return OpFeatures(key, (
        TensorArg("x", FLOAT),
        TensorArg("weights", UINT8, constant=True, prepack=W4X8),
        TensorArg("scales", FLOAT, constant=True),
        scalar_arg("group_size"),
        TensorArg("bias", FLOAT, optional=True),
    ), FLOAT, shapes)


@register_op("vktrain.linear_q4gsw_backward.default")
def _linear_q4gsw_backward(key: str) -> OpFeatures:
    return OpFeatures(key, (
        TensorArg("d_out", FLOAT),
        TensorArg("weights", UINT8, constant=True, prepack=W4X8),
        TensorArg("scales", FLOAT, constant=True),
        scalar_arg("group_size"),
    ), FLOAT, lambda node: _q4gsw_geometry(node, 1, 2, 3, 0, "N"))


@register_op("vktrain.q4gsw_requant.default")
def _q4gsw_requant(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        reason = _q4gsw_geometry(node, None, 1, 2, 0, "K")
        if reason is None and len(_shape(node.args[0])) != 2:
            return f"{key} ('{node.name}'): latent must be 2-D [N, K], got {list(_shape(node.args[0]))}"
        return reason
    return OpFeatures(key, (
        TensorArg("latent", FLOAT),
        TensorArg("scales", FLOAT),
        scalar_arg("group_size"),
    ), UINT8, shapes)


@register_op("vktrain.linear_dW.default")
def _linear_dw(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        d, x = _shape(node.args[0]), _shape(node.args[1])
        if not d or not x or d[:-1] != x[:-1]:
            return f"{key} ('{node.name}'): d_out {list(d)} and x {list(x)} must share their leading dims"
        return None
    return OpFeatures(key, (TensorArg("d_out", FLOAT), TensorArg("x", FLOAT)), FLOAT, shapes)


@register_op("vktrain.fused_ce.default")
def _fused_ce(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        logits, labels, n_valid = (_shape(a) for a in node.args[:3])
        if len(logits) != 2 or labels != logits[:1] or n_valid != ():
            return (f"{key} ('{node.name}'): expected logits [R, V], labels [R], n_valid [], got "
                    f"{list(logits)}, {list(labels)}, {list(n_valid)}")
        return None
    return OpFeatures(key, (TensorArg("logits", FLOAT), TensorArg("labels", INDEX), TensorArg("n_valid", FLOAT)),
                      FLOAT, shapes)


@register_op("vktrain.adamw.default")
def _adamw(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        param = _shape(node.args[0])
        for i, name in ((1, "exp_avg"), (2, "exp_avg_sq"), (3, "grad")):
            if _shape(node.args[i]) != param:
                return f"{key} ('{node.name}'): {name} shape {list(_shape(node.args[i]))} != param shape {list(param)}"
        if _shape(node.args[4]) != (5,) or _shape(node.args[5]) != ():
            return (f"{key} ('{node.name}'): hparams must be [5] and step [], got "
                    f"{list(_shape(node.args[4]))} and {list(_shape(node.args[5]))}")
        return None
    names = ("param", "exp_avg", "exp_avg_sq", "grad", "hparams", "step")
    return OpFeatures(key, tuple(TensorArg(n, FLOAT) for n in names), FLOAT, shapes)


# Fused transformer ops of the Llama family (vktrain/ops/transformer.py)


def _same_shapes(key: str, names: tuple[str, ...]) -> ShapeCheck:
    def shapes(node: Node) -> str | None:
        reference = _shape(node.args[0])
        for i, name in enumerate(names[1:], 1):
            if _shape(node.args[i]) != reference:
                return (f"{key} ('{node.name}'): {name} shape {list(_shape(node.args[i]))} must equal "
                        f"{names[0]} shape {list(reference)}")
        return None
    return shapes


@register_op("vktrain.rms_norm.default")
def _rms_norm(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        x, weight = _shape(node.args[0]), _shape(node.args[1])
        if not x or weight != x[-1:]:
            return f"{key} ('{node.name}'): weight {list(weight)} must be [D] for x {list(x)}"
        return None
    return OpFeatures(key, (TensorArg("x", FLOAT), TensorArg("weight", FLOAT), scalar_arg("eps")), FLOAT, shapes)


@register_op("vktrain.rms_norm_backward.default")
def _rms_norm_backward(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        d_y, x, weight, rstd = (_shape(a) for a in node.args[:4])
        if d_y != x or weight != x[-1:] or rstd != x[:-1] + (1,):
            return (f"{key} ('{node.name}'): expected d_y = x [..., D], weight [D], rstd [..., 1]; got "
                    f"{list(d_y)}, {list(x)}, {list(weight)}, {list(rstd)}")
        return None
    names = ("d_y", "x", "weight", "rstd")
    return OpFeatures(key, tuple(TensorArg(n, FLOAT) for n in names), FLOAT, shapes)


@register_op("vktrain.rope.default")
def _rope(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        x, cos, sin = (_shape(a) for a in node.args[:3])
        if len(x) != 4 or x[3] % 2 or cos != (x[1], x[3] // 2) or sin != cos:
            return (f"{key} ('{node.name}'): expected x [B, S, H, D] (D even), cos = sin = [S, D/2]; got "
                    f"{list(x)}, {list(cos)}, {list(sin)}")
        return None
    return OpFeatures(key, (TensorArg("x", FLOAT), TensorArg("cos", FLOAT), TensorArg("sin", FLOAT)), FLOAT, shapes)


def _attention_shapes(key: str, node: Node, q_index: int) -> str | None:
    q, k, v = (_shape(node.args[i]) for i in range(q_index, q_index + 3))
    if len(q) != 4 or len(k) != 4 or k != v or (q[0], q[1], q[3]) != (k[0], k[1], k[3]) or q[2] % k[2]:
        return (f"{key} ('{node.name}'): expected q [B, S, Hq, D], k = v [B, S, Hkv, D] with Hq % Hkv == 0; got "
                f"{list(q)}, {list(k)}, {list(v)}")
    return None


@register_op("vktrain.causal_attention.default")
def _causal_attention(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("q", FLOAT), TensorArg("k", FLOAT), TensorArg("v", FLOAT), scalar_arg("scale")),
                      FLOAT, lambda node: _attention_shapes(key, node, 0))


@register_op("vktrain.causal_attention_backward.default")
def _causal_attention_backward(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        reason = _attention_shapes(key, node, 1)
        if reason is not None:
            return reason
        d_out, q, out, lse = _shape(node.args[0]), _shape(node.args[1]), _shape(node.args[4]), _shape(node.args[5])
        if d_out != q or out != q or lse != (q[0], q[2], q[1]):
            return (f"{key} ('{node.name}'): expected d_out = out = q {list(q)} and lse [B, Hq, S]; got "
                    f"{list(d_out)}, {list(out)}, {list(lse)}")
        return None
    names = ("d_out", "q", "k", "v", "out", "lse")
    return OpFeatures(key, tuple(TensorArg(n, FLOAT) for n in names) + (scalar_arg("scale"),), FLOAT, shapes)


@register_op("vktrain.swiglu.default")
def _swiglu(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("gate", FLOAT), TensorArg("up", FLOAT)), FLOAT,
                      _same_shapes(key, ("gate", "up")))


@register_op("vktrain.swiglu_backward.default")
def _swiglu_backward(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("d_h", FLOAT), TensorArg("gate", FLOAT), TensorArg("up", FLOAT)), FLOAT,
                      _same_shapes(key, ("d_h", "gate", "up")))


# ---------------------------------------------------------------------------------------------------
# aten ops of the training step (edge dialect names)


@register_op("aten.embedding.default")
def _embedding(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        if len(_shape(node.args[0])) != 2:
            return f"{key} ('{node.name}'): weight must be 2-D [V, D], got {list(_shape(node.args[0]))}"
        return None
    return OpFeatures(key, (TensorArg("weight", FLOAT), TensorArg("indices", INDEX)), FLOAT, shapes)


def _matrix_check(key: str, arg_indices: tuple[int, ...], rank: int) -> ShapeCheck:
    def shapes(node: Node) -> str | None:
        for i in arg_indices:
            if len(_shape(node.args[i])) != rank:
                return f"{key} ('{node.name}'): argument {i} must be {rank}-D, got shape {list(_shape(node.args[i]))}"
        return None
    return shapes


@register_op("aten.mm.default")
def _mm(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), TensorArg("mat2", FLOAT)), FLOAT, _matrix_check(key, (0, 1), 2))


@register_op("aten.bmm.default")
def _bmm(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), TensorArg("mat2", FLOAT)), FLOAT, _matrix_check(key, (0, 1), 3))


@register_op("aten.addmm.default")
def _addmm(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), TensorArg("mat1", FLOAT), TensorArg("mat2", FLOAT)), FLOAT,
                      _matrix_check(key, (1, 2), 2))


@register_op("aten.linear.default")
def _linear(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("input", FLOAT), TensorArg("weight", FLOAT), TensorArg("bias", FLOAT, optional=True)),
                      FLOAT, _matrix_check(key, (1,), 2))


# Shape-only ops: the runtime implements them as copies of 32-bit words, or as aliases.
@register_op("aten.view_copy.default", "aten.permute_copy.default", "aten.expand_copy.default",
             "aten.squeeze_copy.dims", "aten.squeeze_copy.dim", "aten.squeeze_copy.default",
             "aten.unsqueeze_copy.default", "aten.t_copy.default", "aten.transpose_copy.int",
             "aten.alias_copy.default", "aten.clone.default", "aten.slice_copy.Tensor", "aten.select_copy.int")
def _shape_op(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", WORDS),), WORDS)


@register_op("dim_order_ops._to_dim_order_copy.default", "aten._to_copy.default")
def _to_copy(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        memory_format = node.kwargs.get("memory_format")
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            return f"{key} ('{node.name}'): memory_format {memory_format} is not supported (contiguous only)"
        dim_order = node.kwargs.get("dim_order")
        if dim_order is not None and list(dim_order) != list(range(len(dim_order))):
            return f"{key} ('{node.name}'): dim_order {list(dim_order)} is not supported (contiguous only)"
        return None
    return OpFeatures(key, (TensorArg("self", WORDS),), WORDS, shapes)


@register_op("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
             "aten.maximum.default", "aten.minimum.default", "aten.pow.Tensor_Tensor")
def _binary(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), TensorArg("other", FLOAT, scalar_ok=True)), FLOAT)


@register_op("aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.pow.Tensor_Scalar",
             "aten.rsub.Scalar")
def _binary_scalar(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), scalar_arg("other")), FLOAT)


@register_op("aten.relu.default", "aten.gelu.default", "aten.silu.default", "aten.sigmoid.default", "aten.tanh.default",
             "aten.exp.default", "aten.erf.default", "aten.neg.default", "aten.sqrt.default",
             "aten.rsqrt.default", "aten.log.default", "aten.reciprocal.default", "aten.abs.default")
def _unary(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT),), FLOAT)


@register_op("aten.gelu_backward.default", "aten.threshold_backward.default", "aten.sigmoid_backward.default",
             "aten.tanh_backward.default", "aten.silu_backward.default")
def _activation_backward(key: str) -> OpFeatures:
    # tanh/sigmoid backward take the forward's output; gelu/silu/threshold backward take its input.
    second = "output" if key in ("aten.sigmoid_backward.default", "aten.tanh_backward.default") else "self"
    return OpFeatures(key, (TensorArg("grad_output", FLOAT), TensorArg(second, FLOAT)), FLOAT)


@register_op("aten.embedding_dense_backward.default")
def _embedding_backward(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("grad_output", FLOAT), TensorArg("indices", INDEX)), FLOAT)


@register_op("aten.cat.default")
def _cat(key: str) -> OpFeatures:
    def tensors_all_float(node: Node) -> str | None:
        tensors = node.args[0]
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, Node) for t in tensors):
            return f"{key} ('{node.name}'): expected a list of tensors, got {tensors!r}"
        for t in tensors:
            value = t.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.dtype not in FLOAT:
                return (f"{key} ('{node.name}'): input '{t.name}' has unsupported dtype "
                        f"{getattr(value, 'dtype', None)}, expected one of {_dtype_names(FLOAT)}")
        return None
    # The tensor list is checked by its own rule; the generic per-argument checks cannot see into lists.
    return OpFeatures(key, (), FLOAT, tensors_all_float, check_arguments=False)


@register_op("aten.baddbmm.default")
def _baddbmm(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", FLOAT), TensorArg("batch1", FLOAT), TensorArg("batch2", FLOAT)), FLOAT,
                      _matrix_check(key, (1, 2), 3))


@register_op("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.amax.default")
def _reduce(key: str) -> OpFeatures:
    def shapes(node: Node) -> str | None:
        if node.kwargs.get("dtype") not in (None, torch.float32):
            return f"{key} ('{node.name}'): accumulation dtype {node.kwargs['dtype']} is not supported (float32 only)"
        return None
    return OpFeatures(key, (TensorArg("self", FLOAT),), FLOAT, shapes)


# Creation ops: their tensor argument (if any) only provides the shape (and the default dtype).
@register_op("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default")
def _full_like(key: str) -> OpFeatures:
    return OpFeatures(key, (TensorArg("self", WORDS),), WORDS)


@register_op("aten.full.default", "aten.scalar_tensor.default")
def _full(key: str) -> OpFeatures:
    return OpFeatures(key, (), WORDS)


# Uninitialised tensors (no GPU work): decomposed activation backwards (SiLU) shape a full_like after one.
@register_op("aten.empty.memory_format", "aten.empty_permuted.default")
def _empty(key: str) -> OpFeatures:
    def contiguous_only(node: Node) -> str | None:
        if key == "aten.empty_permuted.default":
            layout = node.args[1] if len(node.args) > 1 else node.kwargs.get("physical_layout")
            if layout is None or list(layout) != list(range(len(layout))):
                return f"{key} ('{node.name}'): physical_layout {layout} is not supported (contiguous only)"
        elif node.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
            return f"{key} ('{node.name}'): memory_format {node.kwargs['memory_format']} is not supported " \
                   f"(contiguous only)"
        return None
    return OpFeatures(key, (), WORDS, contiguous_only)


@register_op(GETITEM)
def _getitem(key: str) -> OpFeatures:
    def producer_supported(node: Node) -> str | None:
        source = node.args[0]
        if not isinstance(source, Node) or check_node(source) is not None:
            return f"getitem ('{node.name}'): its producer '{getattr(source, 'name', source)}' is not lowered"
        return None
    return OpFeatures(key, (), ANY, producer_supported, check_arguments=False)

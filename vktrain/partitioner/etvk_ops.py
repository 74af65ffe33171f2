"""Upstream ExecuTorch's Vulkan training ops (torch.library namespace `et_vk`,
executorch.backends.vulkan.custom_ops_lib), each run as the vktrain op it matches.

A record here holds upstream's schema (as the executorch 1.5.1 wheel defines it), the vktrain op it runs
as, and the explicit mapping of its arguments onto that op's arguments. Its OpFeatures (registered under
the et_vk key) check the et_vk call by mapping it and asking the vktrain op's definition (vktrain/opdefs),
so an et_vk call is refused for exactly the reasons the vktrain op is, plus the mapping's own:

| et_vk op | runs as | mapping |
|---|---|---|
| `linear_q4gsw(self, weights, weight_scales, group_size, bias)` | `vktrain.linear_q4gsw` | weights repacked to the flat layout for K = self's last dim (`vktrain.quant.etvk`) |
| `linear_q4gsw_backward(d_out, weights, weight_scales, group_size)` | `vktrain.linear_q4gsw_backward` | upstream's d_x has 2 * weights.shape[1] columns: that must be K = G * group_size |
| `linear_dW(d_out, x)` | `vktrain.linear_dW` | as is |
| `q4gsw_requant(latent, scales, group_size)` | `vktrain.q4gsw_requant` | upstream returns [N, ceil(K/2)] bytes, vktrain [N, Kp/2]: K % 8 == 0 |
| `fused_ce(logits, labels, float n_valid)` | `vktrain.fused_ce` | n_valid baked into a float32 [] constant |
| `adamw_step(param!, m!, v!, grad, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2)` | `vktrain.adamw` | below; the three outputs are written back into param, m, v |

adamw_step takes its bias corrections as numbers, vktrain.adamw derives them from its step t as
1 - beta^t. The mapping runs vktrain.adamw at t = ADAMW_STEP (where 1 - beta^t is exactly 1 in float32)
with hparams [lr * sqrt(bc2) / bc1, beta1, beta2, eps * sqrt(bc2), weight_decay * bc1 / sqrt(bc2)]:
upstream's update p -= lr * (m / bc1) / (sqrt(v / bc2) + eps) and decay p *= 1 - lr * weight_decay
are then the kernel's, term for term (up to float32 rounding of the rescaled numbers).

Every Python float of an et_vk call is honoured as traced: it becomes a constant of the program (so an
LR schedule cannot change it), and the blob's metadata lists it for `vktrain inspect`. The tensors of
the call come from the graph as they are. etvk_rewrite.py rewrites a program's et_vk calls into the
vktrain calls these records describe (the export before decomposing, the backend what reaches it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import Node

from vktrain.contract import HPARAM_NAMES
from vktrain.opdefs import Refusal, TensorMeta, op_def
from vktrain.opdefs.schema import Schema
from vktrain.ops._library import dtype_name, torch_dtype
from vktrain.quant import padded_k
from vktrain.quant.etvk import etvk_packed_columns_ok

from .op_registry import FLOAT, KERNEL_DTYPES, UINT8, W4X8, OpFeatures, TensorArg, op_key, register_op

NAMESPACE = "et_vk"
# vktrain.adamw's step t for an et_vk adamw_step: 2^24, the largest whole float32 whose successor is whole
# too. Any beta < BETA_LIMIT has beta^t < 2^-30 there, so the kernel's 1 - beta^t rounds to exactly 1.
ADAMW_STEP = float(2 ** 24)
BETA_LIMIT = 2.0 ** (-30 / ADAMW_STEP)


@dataclass(frozen=True)
class Baked:
    """Python floats of the et_vk call that become one float32 constant tensor of the vktrain call."""
    values: tuple[float, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Repacked:
    """A packed-weight argument, stored in vktrain's flat layout for K input features (flat_from_etvk)."""
    source: Node
    K: int


@dataclass(frozen=True)
class MappedCall:
    """The vktrain call an et_vk call runs as."""
    target: str                              # vktrain op key
    args: dict[str, Any]                     # vktrain argument name -> Node, Python value, Baked or Repacked
    baked: dict[str, float] = field(default_factory=dict)  # et_vk argument -> its value as traced
    # (vktrain output index, et_vk argument): outputs written back into the argument's tensor (a buffer)
    writes_back: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class EtvkOp:
    schema: Schema
    target: str                       # the vktrain op it runs as
    tensor_names: dict[str, str]      # et_vk tensor argument -> the vktrain argument whose dtypes it takes
    map: Callable[[dict[str, Any]], MappedCall]   # et_vk arguments by name -> the vktrain call; raises Refusal
    output_dtypes: frozenset = FLOAT
    prepacked: tuple[str, ...] = ()   # et_vk arguments that must be constants (packed weights)

    @property
    def key(self) -> str:
        return self.schema.key


def _shape(value: Any, name: str) -> tuple[int, ...]:
    val = value.meta.get("val") if isinstance(value, Node) else None
    if not isinstance(val, torch.Tensor):
        raise Refusal(f"argument '{name}' is not a tensor with metadata (got {value!r})")
    return tuple(int(d) for d in val.shape)


def _packed_weight(args: dict[str, Any], K: int) -> Repacked:
    columns = _shape(args["weights"], "weights")[-1]
    if not etvk_packed_columns_ok(columns, K):
        raise Refusal(f"weights {list(_shape(args['weights'], 'weights'))} hold {2 * columns} 4-bit codes per row, "
                      f"fewer than K={K} input features (expected at least {(K + 1) // 2} bytes per row)")
    return Repacked(args["weights"], K)


def _map_linear(args: dict[str, Any]) -> MappedCall:
    x = _shape(args["self"], "self")
    if not x:
        raise Refusal("self must have at least 1 dim [..., K]")
    return MappedCall("vktrain.linear_q4gsw.default", {
        "x": args["self"], "weights": _packed_weight(args, x[-1]), "scales": args["weight_scales"],
        "group_size": args["group_size"], "bias": args["bias"]})


def _map_linear_backward(args: dict[str, Any]) -> MappedCall:
    columns = _shape(args["weights"], "weights")[-1]
    groups = _shape(args["weight_scales"], "weight_scales")[0]
    K = 2 * columns
    if K != groups * args["group_size"]:
        raise Refusal(f"upstream's d_x has 2 * weights.shape[1] = {K} columns, but weight_scales {groups} groups of "
                      f"group_size={args['group_size']} cover K={groups * args['group_size']}; expected weights "
                      f"[N, K/2] with K = G * group_size")
    return MappedCall("vktrain.linear_q4gsw_backward.default", {
        "d_out": args["d_out"], "weights": _packed_weight(args, K), "scales": args["weight_scales"],
        "group_size": args["group_size"]})


def _map_linear_dw(args: dict[str, Any]) -> MappedCall:
    return MappedCall("vktrain.linear_dW.default", {"d_out": args["d_out"], "x": args["x"]})


def _map_requant(args: dict[str, Any]) -> MappedCall:
    latent = _shape(args["latent"], "latent")
    if len(latent) == 2 and latent[1] % 8 != 0:
        raise Refusal(f"latent {list(latent)}: upstream returns [N, ceil(K/2)] = [{latent[0]}, {(latent[1] + 1) // 2}] "
                      f"bytes, vktrain's kernel writes the flat layout [N, Kp/2] = [{latent[0]}, "
                      f"{padded_k(latent[1]) // 2}]; expected K % 8 == 0, where the two agree")
    return MappedCall("vktrain.q4gsw_requant.default", dict(args))


def _checked_number(args: dict[str, Any], name: str, what: str, ok: Callable[[float], bool]) -> float:
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refusal(f"{name} must be a Python number ({what}), got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and ok(value)):
        raise Refusal(f"{name}={value} must be {what}")
    return value


def _map_fused_ce(args: dict[str, Any]) -> MappedCall:
    n_valid = _checked_number(args, "n_valid", "finite and > 0 (the loss divisor)", lambda v: v > 0)
    return MappedCall("vktrain.fused_ce.default", {
        "logits": args["logits"], "labels": args["labels"], "n_valid": Baked((n_valid,), ())},
        baked={"n_valid": n_valid})


def _map_adamw(args: dict[str, Any]) -> MappedCall:
    lr = _checked_number(args, "lr", "finite and >= 0", lambda v: v >= 0)
    betas = [_checked_number(args, name, f"in [0, {BETA_LIMIT:.9f}) (so that vktrain.adamw's 1 - beta^t at t = 2^24 is "
                                 f"exactly 1 and the bias corrections are the traced ones)", lambda v: 0 <= v < BETA_LIMIT)
             for name in ("beta1", "beta2")]
    eps = _checked_number(args, "eps", "finite and >= 0", lambda v: v >= 0)
    weight_decay = _checked_number(args, "weight_decay", "finite and >= 0", lambda v: v >= 0)
    bc1, bc2 = (_checked_number(args, name, "finite and > 0 (a bias correction divides)", lambda v: v > 0)
                for name in ("bias_correction1", "bias_correction2"))
    hparams = dict(zip(HPARAM_NAMES, (lr * math.sqrt(bc2) / bc1, betas[0], betas[1], eps * math.sqrt(bc2),
                                      weight_decay * bc1 / math.sqrt(bc2))))
    baked = {name: float(args[name]) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction1",
                                                  "bias_correction2")}
    return MappedCall("vktrain.adamw.default", {
        "param": args["param"], "exp_avg": args["m"], "exp_avg_sq": args["v"], "grad": args["grad"],
        "hparams": Baked(tuple(hparams[name] for name in HPARAM_NAMES), (len(HPARAM_NAMES),)),
        "step": Baked((ADAMW_STEP,), ())}, baked=baked, writes_back=((0, "param"), (1, "m"), (2, "v")))


def _op(schema: str, target: str, tensor_names: dict[str, str], mapping, **options) -> EtvkOp:
    return EtvkOp(Schema.parse(NAMESPACE, schema), target, tensor_names, mapping, **options)


# Upstream's schemas, as custom_ops_lib defines them (tests/test_etvk_ops.py compares them with the wheel's).
ETVK_OPS = (
    _op("linear_q4gsw(Tensor self, Tensor weights, Tensor weight_scales, int group_size, Tensor? bias=None) -> Tensor",
        "vktrain.linear_q4gsw.default", {"self": "x", "weights": "weights", "weight_scales": "scales", "bias": "bias"},
        _map_linear, prepacked=("weights", "weight_scales")),
    _op("linear_q4gsw_backward(Tensor d_out, Tensor weights, Tensor weight_scales, int group_size) -> Tensor",
        "vktrain.linear_q4gsw_backward.default", {"d_out": "d_out", "weights": "weights", "weight_scales": "scales"},
        _map_linear_backward, prepacked=("weights", "weight_scales")),
    _op("linear_dW(Tensor d_out, Tensor x) -> Tensor", "vktrain.linear_dW.default", {"d_out": "d_out", "x": "x"},
        _map_linear_dw),
    _op("q4gsw_requant(Tensor latent, Tensor scales, int group_size) -> Tensor", "vktrain.q4gsw_requant.default",
        {"latent": "latent", "scales": "scales"}, _map_requant, output_dtypes=UINT8),
    _op("fused_ce(Tensor logits, Tensor labels, float n_valid) -> (Tensor, Tensor)", "vktrain.fused_ce.default",
        {"logits": "logits", "labels": "labels"}, _map_fused_ce),
    _op("adamw_step(Tensor(a!) param, Tensor(b!) m, Tensor(c!) v, Tensor grad, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, float bias_correction1, float bias_correction2) -> (Tensor(a!), Tensor(b!), "
        "Tensor(c!))", "vktrain.adamw.default",
        {"param": "param", "m": "exp_avg", "v": "exp_avg_sq", "grad": "grad"}, _map_adamw),
)
ETVK_BY_KEY = {op.key: op for op in ETVK_OPS}


def call_arguments(op: EtvkOp, node: Node) -> dict[str, Any]:
    """The et_vk call's arguments by schema name, defaults filled in."""
    values = {}
    for i, arg in enumerate(op.schema.arguments):
        values[arg.name] = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
    return values


def mapped_call(node: Node) -> MappedCall:
    """The vktrain call of et_vk call `node`; raises Refusal (naming the node) when it has none."""
    key = op_key(node.target)
    op = ETVK_BY_KEY[key]
    try:
        mapped = op.map(call_arguments(op, node))
        _check_definition(op, node, mapped)
    except Refusal as exc:
        raise Refusal(f"{key} ('{node.name}') as {op.target}: {exc}") from None
    return mapped


def _meta(value: Any) -> Any:
    if isinstance(value, Baked):
        return TensorMeta(value.shape, "float32")
    if isinstance(value, Repacked):
        return TensorMeta((_shape(value.source, "weights")[0], padded_k(value.K) // 2), "uint8")
    if isinstance(value, Node):
        val = value.meta.get("val")
        return TensorMeta(tuple(val.shape), dtype_name(val.dtype)) if isinstance(val, torch.Tensor) else val
    return value


def _check_definition(op: EtvkOp, node: Node, mapped: MappedCall) -> None:
    """The vktrain op's definition takes the mapped call, and gives upstream's outputs (shape, dtype)."""
    definition = op_def(mapped.target)
    call = definition.bind([_meta(mapped.args.get(arg.name, arg.default_value)) for arg in definition.schema.arguments])
    outputs = definition.infer(call)
    val = node.meta.get("val")
    expected = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
    got = [(tuple(o.shape), o.dtype) for o in outputs]
    want = [(tuple(int(d) for d in v.shape), dtype_name(v.dtype)) for v in expected]
    if got != want:
        raise Refusal(f"the vktrain op gives outputs {got}, upstream's op {want}")


def _mapping_refusal(node: Node) -> str | None:
    try:
        mapped_call(node)
    except Refusal as exc:
        return str(exc)
    return None


def _features(key: str) -> OpFeatures:
    op = ETVK_BY_KEY[key]
    declared = op_def(op.target).arg_dtypes
    args = []
    for arg in op.schema.arguments:
        if not arg.is_tensor:
            args.append(TensorArg(arg.name, frozenset(), optional=True, scalar_ok=True))
            continue
        kernel = declared.get(op.tensor_names[arg.name])
        dtypes = KERNEL_DTYPES if kernel is None else frozenset(map(torch_dtype, kernel)) & KERNEL_DTYPES
        constant = arg.name in op.prepacked
        args.append(TensorArg(arg.name, dtypes, optional=arg.optional, constant=constant,
                              prepack=W4X8 if arg.name == "weights" and constant else None))
    return OpFeatures(key, tuple(args), op.output_dtypes, _mapping_refusal)


for _etvk_op in ETVK_OPS:
    register_op(_etvk_op.key, runs_as=_etvk_op.target)(_features)


__all__ = ["ADAMW_STEP", "BETA_LIMIT", "Baked", "ETVK_BY_KEY", "ETVK_OPS", "EtvkOp", "MappedCall", "NAMESPACE",
           "Repacked", "call_arguments", "mapped_call"]

"""Which ops the vktrain Vulkan backend accepts, and on what terms: one OpFeatures record per op.

Each record is registered with `@register_op(<op key>, ...)` on a function that returns it. The op key is
`<namespace>.<name>.<overload>` (e.g. `aten.mm.default`, `vktrain.linear_q4gsw.default`); edge-dialect
ops map to the key of the aten/vktrain op they wrap (see `op_key`). The same key names the op in the
delegate blob's op chain, the op definition (vktrain/opdefs) and the runtime's lowering and kernel.

A record says only what the GPU kernels add to the op's definition: the dtypes they implement per tensor
argument, which arguments must be prepacked constants, and any extra refusal. Argument names come from
the definition's schema, and the definition's shape function refuses what no implementation accepts
(`features_from_definition`).

`OpFeatures.check(node, program)` returns None when the node can be lowered, else the refusal reason:
unsupported dtype of an argument or output, symbolic shapes, a shape the op's definition refuses (q4gsw:
N % 4, K % 4, group_size % 4, K % group_size), or a prepacked argument that is not a constant.

The registry accepts only what the runtime can execute: `register_op` refuses a key that
`vktrain.opdefs.runtime_ops.RUNTIME_OPS` lacks, so the partitioner never delegates an op the GPU
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

from vktrain.opdefs import OpDef, Refusal, TensorMeta, op_def
from vktrain.opdefs.decode_ops import DECODE_OPS
from vktrain.opdefs.vktrain_ops import VKTRAIN_OPS
from vktrain.ops._library import dtype_name, torch_dtype
from vktrain.opdefs.runtime_ops import EXPANDED_OPS, RUNTIME_OPS

FLOAT = frozenset({torch.float32})
INDEX = frozenset({torch.int64, torch.int32})
BOOL = frozenset({torch.bool})
UINT8 = frozenset({torch.uint8})
ANY = FLOAT | INDEX | BOOL | UINT8
# What the runtime's copy and fill kernels move: 32-bit words (int64 lives on the GPU as int32).
WORDS = FLOAT | INDEX
# Every dtype some GPU kernel reads (float64 is the CPU references' only).
KERNEL_DTYPES = FLOAT | INDEX | UINT8

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
    """An argument of an op as the kernels take it; `dtypes` empty: not a tensor (never a graph value)."""
    name: str
    dtypes: frozenset
    optional: bool = False      # may be None
    scalar_ok: bool = False     # may be a Python number instead of a tensor (e.g. add.Tensor's other)
    constant: bool = False      # must be a constant (parameter / frozen buffer / lifted constant)
    prepack: str | None = None  # layout the blob stores this constant in


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
            if not spec.dtypes:
                if _holds_node(arg):
                    got = f"the tensor '{arg.name}'" if isinstance(arg, Node) else f"tensors in {arg!r}"
                    return f"{where}: argument '{spec.name}' must be a Python number, got {got}"
                continue
            if not isinstance(arg, Node):
                if spec.scalar_ok and isinstance(arg, (int, float, bool)):
                    continue
                return f"{where}: argument '{spec.name}' is {type(arg).__name__} {arg!r}, expected a tensor"
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
# What the runtime executes, and the ops the backend's lora_linear pass rewrites into such ops.
_RUNTIME_OPS = RUNTIME_OPS | EXPANDED_OPS
_RUNS_AS: dict[str, str] = {}  # registered key -> the op key its calls are rewritten into (register_op's runs_as)


def register_op(*keys: str, runs_as: str | None = None) -> Callable[[Callable[[str], OpFeatures]], Callable[[str], OpFeatures]]:
    """Register the OpFeatures built by the decorated function `(key) -> OpFeatures` under each key.

    Raises ValueError for a key the runtime cannot execute (no lowering or no kernel in
    vktrain.opdefs.runtime_ops), so the partitioner and the runtime cannot drift apart.
    `runs_as`: the op key the calls are rewritten into before they reach the backend (an et_vk op runs as
    its vktrain op, etvk_ops.py); that key must be one the runtime executes."""
    def decorate(build: Callable[[str], OpFeatures]) -> Callable[[str], OpFeatures]:
        for key in keys:
            if key in _REGISTRY:
                raise ValueError(f"op {key} is registered twice")
            executed = runs_as or key
            if key != GETITEM and executed not in _RUNTIME_OPS:
                target = "it" if runs_as is None else f"{runs_as}, which it runs as"
                raise ValueError(f"op {key} cannot be registered: the vktrain runtime has no lowering or kernel for "
                                 f"{target} (vktrain.opdefs.runtime_ops.RUNTIME_OPS), so a delegate "
                                 f"holding it would fail at load")
            features = build(key)
            if features.key != key:
                raise ValueError(f"OpFeatures for {key} carries the key {features.key}")
            _REGISTRY[key] = features
            if runs_as is not None:
                _RUNS_AS[key] = runs_as
        return build
    return decorate


# ATen view ops by the key of their functional `_copy` form, the one the edge dialect writes and the only
# one the registry, the blob and the runtime know. In a functional program (what torch.export gives:
# nothing writes through a view) both compute the same; the backend's view pass decides which become views.
# A program lowered whole, without to_edge (vktrain/export/whole_program.py), still holds the ATen views.
_VIEW_OP_COPY_KEYS = {
    "aten.alias.default": "aten.alias_copy.default",
    "aten.expand.default": "aten.expand_copy.default",
    "aten.permute.default": "aten.permute_copy.default",
    "aten.select.int": "aten.select_copy.int",
    "aten.slice.Tensor": "aten.slice_copy.Tensor",
    "aten.squeeze.default": "aten.squeeze_copy.default",
    "aten.squeeze.dim": "aten.squeeze_copy.dim",
    "aten.squeeze.dims": "aten.squeeze_copy.dims",
    "aten.t.default": "aten.t_copy.default",
    "aten.transpose.int": "aten.transpose_copy.int",
    "aten.unsqueeze.default": "aten.unsqueeze_copy.default",
    "aten.view.default": "aten.view_copy.default",
}


def op_key(target) -> str:
    """The registry key of a call_function target: 'aten.mm.default', 'vktrain.adamw.default', 'getitem'
    (an ATen view op by its `_copy` form: 'aten.view.default' -> 'aten.view_copy.default')."""
    if target is operator.getitem:
        return GETITEM
    op = target if isinstance(target, torch._ops.OpOverload) else getattr(target, "_op", target)  # edge wraps aten
    if isinstance(op, torch._ops.OpOverload):
        key = f"{op.namespace}.{op._opname}.{op._overloadname}"
        return _VIEW_OP_COPY_KEYS.get(key, key)
    return getattr(target, "__name__", str(target))


def get_op_features(key: str) -> OpFeatures | None:
    return _REGISTRY.get(key)


def supported_ops() -> list[str]:
    return sorted(_REGISTRY)


def executed_op(key: str) -> str:
    """The op key the runtime executes for registered op `key`: itself, or what its calls are rewritten into."""
    return _RUNS_AS.get(key, key)


def check_node(node: Node, program: ExportedProgram | None = None) -> str | None:
    """None if the node can be lowered, else the reason it is refused."""
    if node.op != "call_function":
        return f"'{node.name}' is a {node.op} node, not an op call"
    key = op_key(node.target)
    features = _REGISTRY.get(key)
    if features is None:
        return f"{key} ('{node.name}'): operator is not supported by the vktrain Vulkan backend (no OpFeatures registered)"
    return features.check(node, program)


def node_refusal(node: Node, program: ExportedProgram | None = None,
                 blocklist: frozenset[str] = frozenset()) -> str | None:
    """check_node, with the op keys of `blocklist` refused as well (a partitioner's operator_blocklist)."""
    if node.op == "call_function" and op_key(node.target) in blocklist:
        return f"{op_key(node.target)} ('{node.name}'): operator is on the partitioner's blocklist"
    return check_node(node, program)


def first_refusal(program: ExportedProgram, blocklist: frozenset[str] = frozenset()) -> str | None:
    """Why the first refused op call of `program` is refused (node_refusal), or None when the registry takes
    every one: whether a program needs decomposing, or can be delegated whole."""
    for node in program.graph.nodes:
        reason = node_refusal(node, program, blocklist) if node.op == "call_function" else None
        if reason is not None:
            return reason
    return None


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


def _meta(value):
    """A node argument as op definitions see it: tensors as TensorMeta, lists item by item."""
    if isinstance(value, Node):
        val = value.meta.get("val")
        return TensorMeta(tuple(val.shape), dtype_name(val.dtype)) if isinstance(val, torch.Tensor) else val
    if isinstance(value, (list, tuple)):
        return [_meta(v) for v in value]
    return value


def definition_check(definition: OpDef, extra: ShapeCheck | None = None) -> ShapeCheck:
    """The op definition's shape function on a node (then `extra`, the kernels' own refusals)."""
    def check(node: Node) -> str | None:
        values = {}
        for i, arg in enumerate(definition.schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            values[arg.name] = _meta(value)
        try:
            definition.infer(definition.bind(values.values()))
        except Refusal as exc:
            return f"{op_key(node.target)} ('{node.name}'): {exc}"
        return extra(node) if extra is not None else None
    return check


def features_from_definition(key: str, dtypes: frozenset | dict[str, frozenset] | None = None,
                             output_dtypes: frozenset = FLOAT, *, numbers_ok: tuple[str, ...] = (),
                             prepacked: dict[str, str | None] | None = None,
                             shape_check: ShapeCheck | None = None) -> OpFeatures:
    """OpFeatures of `key` from its op definition: one TensorArg per schema argument, in schema order.

    dtypes: what the kernels take, for every tensor argument or per name; None: the definition's argument
    dtypes that some kernel reads (KERNEL_DTYPES). numbers_ok: tensor arguments that may be a Python
    number. prepacked: constant arguments -> the layout the blob stores them in (None: kept plain)."""
    definition = op_def(key)
    prepacked = prepacked or {}
    args = []
    for arg in definition.schema.arguments:
        if not arg.is_tensor:
            args.append(TensorArg(arg.name, frozenset(), optional=True, scalar_ok=True))
            continue
        if dtypes is None:
            declared = definition.arg_dtypes.get(arg.name)
            allowed = KERNEL_DTYPES if declared is None else frozenset(map(torch_dtype, declared)) & KERNEL_DTYPES
        else:
            allowed = dtypes[arg.name] if isinstance(dtypes, dict) else dtypes
        args.append(TensorArg(arg.name, allowed, optional=arg.optional, scalar_ok=arg.name in numbers_ok,
                              constant=arg.name in prepacked, prepack=prepacked.get(arg.name)))
    return OpFeatures(key, tuple(args), output_dtypes, definition_check(definition, shape_check))


# ---------------------------------------------------------------------------------------------------
# vktrain ops (CONTRACTS.md; definitions in vktrain/opdefs/vktrain_ops.py)


@register_op("vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default",
             "vktrain.lora_linear_q4gsw.default", "vktrain.lora_linear_q4gsw_backward.default")
def _linear_q4gsw(key: str) -> OpFeatures:
    return features_from_definition(key, prepacked={"weights": W4X8, "scales": None})


@register_op("vktrain.q4gsw_requant.default")
def _q4gsw_requant(key: str) -> OpFeatures:
    return features_from_definition(key, output_dtypes=UINT8)


# Every other vktrain op: its definition says it all (kernel dtypes, no prepacked constants). One whose
# kernel the runtime does not have yet stays unregistered, so the partitioner leaves it outside the delegate.
register_op(*(op.key for op in VKTRAIN_OPS + DECODE_OPS if op.key not in _REGISTRY and op.key in _RUNTIME_OPS))(
    features_from_definition)


# ---------------------------------------------------------------------------------------------------
# aten ops of the training step (edge dialect names; schemas generated from torch, vktrain/opdefs)


@register_op("aten.embedding.default")
def _embedding(key: str) -> OpFeatures:
    return features_from_definition(key, {"weight": FLOAT, "indices": INDEX})


@register_op("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.linear.default",
             "aten.baddbmm.default")
def _matmul(key: str) -> OpFeatures:
    return features_from_definition(key, FLOAT)


# Shape-only ops: the runtime implements them as copies of 32-bit words, or as aliases.
@register_op("aten.view_copy.default", "aten.permute_copy.default", "aten.expand_copy.default",
             "aten.squeeze_copy.dims", "aten.squeeze_copy.dim", "aten.squeeze_copy.default",
             "aten.unsqueeze_copy.default", "aten.t_copy.default", "aten.transpose_copy.int",
             "aten.alias_copy.default", "aten.clone.default", "aten.slice_copy.Tensor", "aten.select_copy.int")
def _shape_op(key: str) -> OpFeatures:
    return features_from_definition(key, WORDS, WORDS)


@register_op("dim_order_ops._to_dim_order_copy.default", "aten._to_copy.default")
def _to_copy(key: str) -> OpFeatures:
    def contiguous_only(node: Node) -> str | None:
        memory_format = node.kwargs.get("memory_format")
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            return f"{key} ('{node.name}'): memory_format {memory_format} is not supported (contiguous only)"
        dim_order = node.kwargs.get("dim_order")
        if dim_order is not None and list(dim_order) != list(range(len(dim_order))):
            return f"{key} ('{node.name}'): dim_order {list(dim_order)} is not supported (contiguous only)"
        return None
    return features_from_definition(key, WORDS, WORDS, shape_check=contiguous_only)


@register_op("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
             "aten.maximum.default", "aten.minimum.default", "aten.pow.Tensor_Tensor")
def _binary(key: str) -> OpFeatures:
    return features_from_definition(key, FLOAT, numbers_ok=("other", "exponent"))


@register_op("aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.pow.Tensor_Scalar",
             "aten.rsub.Scalar",
             "aten.relu.default", "aten.gelu.default", "aten.silu.default", "aten.sigmoid.default", "aten.tanh.default",
             "aten.exp.default", "aten.expm1.default", "aten.erf.default", "aten.neg.default", "aten.sqrt.default",
             "aten.rsqrt.default", "aten.log.default", "aten.reciprocal.default", "aten.abs.default",
             "aten.gelu_backward.default", "aten.threshold_backward.default", "aten.sigmoid_backward.default",
             "aten.tanh_backward.default", "aten.silu_backward.default")
def _elementwise(key: str) -> OpFeatures:
    return features_from_definition(key, FLOAT)


@register_op("aten.embedding_dense_backward.default")
def _embedding_backward(key: str) -> OpFeatures:
    return features_from_definition(key, {"grad_output": FLOAT, "indices": INDEX})


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


@register_op("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.amax.default")
def _reduce(key: str) -> OpFeatures:
    def float32_accumulation(node: Node) -> str | None:
        if node.kwargs.get("dtype") not in (None, torch.float32):
            return f"{key} ('{node.name}'): accumulation dtype {node.kwargs['dtype']} is not supported (float32 only)"
        return None
    return features_from_definition(key, FLOAT, shape_check=float32_accumulation)


# Creation ops: their tensor argument (if any) only provides the shape (and the default dtype).
@register_op("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default",
             "aten.full.default", "aten.scalar_tensor.default")
def _fill(key: str) -> OpFeatures:
    return features_from_definition(key, WORDS, WORDS)


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
    return features_from_definition(key, WORDS, WORDS, shape_check=contiguous_only)


@register_op(GETITEM)
def _getitem(key: str) -> OpFeatures:
    def producer_supported(node: Node) -> str | None:
        source = node.args[0]
        if not isinstance(source, Node) or check_node(source) is not None:
            return f"getitem ('{node.name}'): its producer '{getattr(source, 'name', source)}' is not lowered"
        return None
    return OpFeatures(key, (), ANY, producer_supported, check_arguments=False)

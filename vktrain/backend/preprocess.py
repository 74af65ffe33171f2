"""VktrainVulkanBackend.preprocess: a partitioned edge program -> the delegate blob (vktrain.serialization).

The blob's op chain is the list of the edge ops, in graph order, named by their registry key
(`aten.mm.default`, `vktrain.adamw.default`, ...), after the fusion pass; views/reshapes are ops too
(the view pass records which produce views, the rest copy). Arguments are passed positionally in
schema order, defaults filled in, so the runtime never needs keyword handling. Non-tensor arguments become Int/Double/Bool/String/list
values; dtype, device, layout and memory_format arguments become strings (e.g. "float32").

Constants: parameters, frozen buffers and lifted constants read by the delegate. An argument the op
registry marks for prepacking (q4gsw weights) is stored as Q4GSW_W4X8 (vktrain.quant.pack_w4x8);
everything else as PLAIN. Identical bytes are stored once by the blob writer.

Synthetic constants (BENCHMARK ONLY): with the compile spec `synthetic_constants_spec(min_bytes)`,
constants of at least `min_bytes` (as stored) whose role is known become `vk.SyntheticConstant` records
generated at load, so a 1B-parameter step travels as megabytes: prepacked q4gsw weights -> random bits
(any code is valid), `*.scales` -> fill SYNTHETIC_SCALE, 2-D float `*.weight` (embeddings, unquantized
heads) -> normal(0, 0.02), 1-D float `*.weight` (norm weights) -> fill 1.0. Constants of any other role
(rope tables, biases, lifted constants) and mutable-state initial values stay real: their values steer
the computation. The skipped data is never read (so it may even be uninitialised memory). Metadata key
"synthetic_constants" records what was replaced and what stayed real.

Named data: with the compile spec `named_data_spec(min_bytes)`, constants of at least `min_bytes` go
to ExecuTorch's NamedDataStore (PreprocessResult.data_store_output) under their content's sha256, and
the blob refers to them by key: the methods of one .pte share one copy (the training step and its eval
method read the same frozen base). The runtime resolves the keys against the .pte's named data.

Extra metadata: a compile spec `metadata_spec(key, value)` (key "metadata.<key>") stores string `value`
under `key` in the blob's metadata, e.g. the configuration a benchmark exported, for the tools that
read the blob later (vktrain inspect, scripts/bench_step.py run). It may not replace a key this backend
writes.

Mutable state: each mutated buffer is a non-constant tensor with a MutableState(state, update,
initial constant); an all-zero initial value (AdamW moments, step, lora_B) stores no constant and starts
zero-filled.

Storage: once the graph is built, the passes of backend/passes (fusion, int64 -> int32 storage,
prepacked-layout typing, views, in-place optimizer updates) make every storage decision and ONE memory
planning (backend/memory_planning.py) places every op output with storage of its own; inputs, state and
constants get their own allocations. The blob records the result per tensor. Metadata records planned
bytes (the memory objects' total: what the executor allocates for them), the bytes those tensors would
take unplanned, and the partitioner's refusals.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Iterable, Sequence, final

import numpy as np
import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir._serialize._named_data_store import NamedDataStore
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from vktrain.partitioner.etvk_rewrite import lower_etvk_calls
from vktrain.partitioner.op_registry import W4X8, get_op_features, op_key
from vktrain.partitioner.partitioner import BACKEND_ID, refusals_from_compile_specs
from vktrain.quant import pack_w4x8, w4x8_num_words
from vktrain.serialization import blob
from vktrain.serialization import graph as vk

from .passes import compile_graph

from vktrain.contract import (METADATA_BACKEND, METADATA_BAKED_SCALARS, METADATA_GEMM_PRECISIONS, METADATA_REFUSALS,  # noqa: E402 (keys it writes)
                              METADATA_STATE_BYTES, METADATA_SYNTHETIC_CONSTANTS, METADATA_UNPLANNED_MEMORY_BYTES,
                              PRECISIONS)

# Compile spec: constants of at least this many bytes go to ExecuTorch's named data, keyed by content, so
# the methods of one .pte (training step and eval) store the frozen base once (see named_data_spec).
NAMED_DATA_MIN_BYTES_SPEC_KEY = "named_data_min_bytes"
# Compile specs of the benchmark-only synthetic constants (see the module docstring).
SYNTHETIC_MIN_BYTES_SPEC_KEY = "synthetic_constants_min_bytes"
SYNTHETIC_SEED_SPEC_KEY = "synthetic_constants_seed"
METADATA_SPEC_PREFIX = "metadata."
# Weights start as N(0, 0.02) (Hugging Face's initializer_range); a q4gsw weight whose codes are uniform
# on 0..15 has q = code - 8 with std sqrt((16^2 - 1) / 12), so this scale gives dequantized weights
# that same std and keeps a deep synthetic model's activations in a realistic range.
SYNTHETIC_WEIGHT_STD = 0.02
SYNTHETIC_SCALE = SYNTHETIC_WEIGHT_STD / math.sqrt((16**2 - 1) / 12)

_TORCH_TO_DTYPE = {
    torch.float32: vk.DType.FLOAT32, torch.float16: vk.DType.FLOAT16, torch.int32: vk.DType.INT32,
    torch.int64: vk.DType.INT64, torch.uint8: vk.DType.UINT8, torch.bool: vk.DType.BOOL, torch.int8: vk.DType.INT8,
}


def vk_dtype(dtype: torch.dtype) -> vk.DType:
    try:
        return _TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"tensor dtype {dtype} cannot be stored in a vktrain blob; supported: "
                         f"{sorted(str(d) for d in _TORCH_TO_DTYPE)}") from None


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def synthetic_constants_spec(min_bytes: int, seed: int = 0) -> list[CompileSpec]:
    """Compile specs making preprocess emit synthetic constants (benchmarks only; see the module docstring).

    Pass them to VktrainPartitioner(compile_specs=...). `seed` varies the generated data."""
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"synthetic constants: min_bytes must be an integer >= 0, got {min_bytes!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"synthetic constants: seed must be an integer >= 0, got {seed!r}")
    return [CompileSpec(SYNTHETIC_MIN_BYTES_SPEC_KEY, str(min_bytes).encode()),
            CompileSpec(SYNTHETIC_SEED_SPEC_KEY, str(seed).encode())]


def named_data_spec(min_bytes: int = 1024) -> CompileSpec:
    """A compile spec making preprocess leave every stored constant of at least `min_bytes` to the .pte's
    named data (key: the content's sha256), where all methods of the .pte share it; the blob refers to it
    by key (vktrain/serialization/blob.py, header flag NAMED_DATA). Smaller constants stay in the blob."""
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 1:
        raise ValueError(f"named data: min_bytes must be an integer >= 1, got {min_bytes!r}")
    return CompileSpec(NAMED_DATA_MIN_BYTES_SPEC_KEY, str(min_bytes).encode())


def metadata_spec(key: str, value: str) -> CompileSpec:
    """A compile spec storing `value` under metadata `key` in the blob (see the module docstring)."""
    if not isinstance(key, str) or not key or not isinstance(value, str):
        raise ValueError(f"blob metadata needs a non-empty str key and a str value, "
                         f"got {key!r}: {type(value).__name__}")
    return CompileSpec(METADATA_SPEC_PREFIX + key, value.encode("utf-8"))


def _metadata_from_specs(compile_specs: Iterable[CompileSpec]) -> dict[str, str]:
    return {spec.key[len(METADATA_SPEC_PREFIX):]: bytes(spec.value).decode("utf-8")
            for spec in compile_specs if spec.key.startswith(METADATA_SPEC_PREFIX)}


def _int_spec(compile_specs: Iterable[CompileSpec], key: str) -> int | None:
    for spec in compile_specs:
        if spec.key == key:
            text = bytes(spec.value).decode("ascii", errors="replace")
            if not text.isdigit():
                raise ValueError(f"compile spec {key!r} must be a non-negative decimal integer, got {text!r}")
            return int(text)
    return None


class _SyntheticPolicy:
    """Which constants become synthetic, and how (see the module docstring)."""

    def __init__(self, min_bytes: int, seed: int) -> None:
        self.min_bytes = min_bytes
        self.seed = seed
        self.replaced: dict[str, int] = {}  # name -> bytes
        self.kept_real: dict[str, int] = {}  # name -> bytes (big enough, role unknown)

    def _seed_for(self, name: str, layout: str) -> int:
        digest = hashlib.sha256(f"{self.seed}/{name}/{layout}".encode()).digest()
        return int.from_bytes(digest[:8], "little")

    def q4gsw_weights(self, name: str, n: int, k: int) -> vk.SyntheticConstant | None:
        words = w4x8_num_words(n, k)
        if 4 * words < self.min_bytes:
            return None
        self.replaced[name] = 4 * words
        return vk.SyntheticConstant(vk.SyntheticKind.RANDOM_BITS, self._seed_for(name, W4X8), vk.DType.UINT32,
                                    (words,), layout=vk.Layout.Q4GSW_W4X8, q4gsw_shape=(n, k))

    def plain(self, name: str, tensor: torch.Tensor) -> vk.SyntheticConstant | None:
        dtype, shape = vk_dtype(tensor.dtype), tuple(int(d) for d in tensor.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return None
        seed = self._seed_for(name, "PLAIN")
        record = None
        if tensor.is_floating_point() and name.endswith(".scales"):
            record = vk.SyntheticConstant(vk.SyntheticKind.FILL, seed, dtype, shape, value=SYNTHETIC_SCALE)
        elif tensor.is_floating_point() and name.endswith(".weight") and len(shape) == 1:
            record = vk.SyntheticConstant(vk.SyntheticKind.FILL, seed, dtype, shape, value=1.0)  # norm weights
        elif tensor.is_floating_point() and name.endswith(".weight") and len(shape) == 2:
            record = vk.SyntheticConstant(vk.SyntheticKind.NORMAL, seed, dtype, shape, std=SYNTHETIC_WEIGHT_STD)
        if record is None:
            self.kept_real[name] = nbytes
        else:
            self.replaced[name] = nbytes
        return record

    def summary(self) -> str:
        return json.dumps({"min_bytes": self.min_bytes, "seed": self.seed, "count": len(self.replaced),
                           "bytes": sum(self.replaced.values()), "kept_real": self.kept_real})


class _GraphBuilder:
    def __init__(self, program: ExportedProgram, synthetic: _SyntheticPolicy | None = None) -> None:
        self.program = program
        self.synthetic = synthetic
        self.signature = program.graph_signature
        # The signature's maps are properties rebuilt from every input spec on each access: read them once.
        self.buffer_of = dict(self.signature.inputs_to_buffers)  # placeholder name -> buffer FQN
        self.constant_of = {**self.signature.inputs_to_parameters, **self.buffer_of,
                            **self.signature.inputs_to_lifted_tensor_constants}  # placeholder name -> FQN
        self.graph = vk.VkGraph()
        self.node_values: dict[Node, int | tuple[int, ...]] = {}
        self.constant_values: dict[tuple[Node, str], int] = {}  # (placeholder, layout) -> value id
        self.constant_nodes: set[Node] = set()
        self.state_nodes: dict[str, Node] = {}  # buffer FQN -> placeholder

    # -- placeholders ---------------------------------------------------------------------------
    def _tensor_data(self, node: Node) -> tuple[str, torch.Tensor]:
        name = self.constant_of.get(node.name)
        if name in self.program.state_dict:
            return name, self.program.state_dict[name]
        if name in self.program.constants:
            return name, self.program.constants[name]
        raise KeyError(f"placeholder '{node.name}' ({name}) has no data in the program's state_dict or constants")

    def _add_placeholders(self) -> None:
        mutated = set(self.signature.buffers_to_mutate.values())
        user_inputs = set(self.signature.user_inputs)
        for node in self.program.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in user_inputs:
                value_id = self._new_tensor(node.meta["val"], node.name)
                self.graph.inputs.append(value_id)
                self.node_values[node] = value_id
            elif self.buffer_of.get(node.name) in mutated:
                fqn = self.buffer_of[node.name]
                value_id = self._new_tensor(node.meta["val"], fqn)
                self.node_values[node] = value_id
                self.state_nodes[fqn] = node
            elif node.name in self.constant_of:
                self.constant_nodes.add(node)  # values created on first use, in the layout that use needs
            else:
                raise ValueError(f"placeholder '{node.name}' is neither a user input, a constant nor mutable state")

    def _constant(self, node: Node, layout: str | None = None, k: int | None = None) -> int:
        key = (node, layout or "PLAIN")
        if key in self.constant_values:
            return self.constant_values[key]
        fqn, data = self._tensor_data(node)
        if layout not in (None, W4X8):
            raise ValueError(f"unknown prepack layout {layout!r} for constant {fqn}")
        synthetic = None
        if self.synthetic is not None:
            synthetic = (self.synthetic.q4gsw_weights(fqn, int(data.shape[0]), k) if layout == W4X8
                         else self.synthetic.plain(fqn, data))
        if synthetic is not None:
            value_id = self.graph.add_synthetic_tensor(synthetic, fqn)  # the data itself is never read
        elif layout == W4X8:
            value_id = self.graph.add_constant_tensor(pack_w4x8(_numpy(data), k), vk.Layout.Q4GSW_W4X8, fqn)
        else:
            value_id = self.graph.add_constant_tensor(_numpy(data), vk.Layout.PLAIN, fqn)
        self.constant_values[key] = value_id
        return value_id

    def _new_tensor(self, fake: Any, name: str) -> int:
        if not isinstance(fake, torch.Tensor):
            raise ValueError(f"'{name}' is expected to be a tensor, its metadata is {type(fake).__name__}")
        shape = tuple(int(d) for d in fake.shape)
        return self.graph.add_value(vk.TensorValue(vk_dtype(fake.dtype), shape, name=name))

    # -- arguments ------------------------------------------------------------------------------
    def _arg_value(self, arg: Any) -> int:
        if isinstance(arg, Node):
            if arg in self.constant_nodes:
                return self._constant(arg)
            value = self.node_values.get(arg)
            if not isinstance(value, int):
                raise ValueError(f"argument '{arg.name}' has no single tensor value (got {value!r})")
            return value
        if arg is None:
            return self.graph.add_value(vk.NullValue())
        if isinstance(arg, bool):
            return self.graph.add_value(vk.BoolValue(arg))
        if isinstance(arg, int):
            return self.graph.add_value(vk.IntValue(arg))
        if isinstance(arg, float):
            return self.graph.add_value(vk.DoubleValue(arg))
        if isinstance(arg, str):
            return self.graph.add_value(vk.StringValue(arg))
        if isinstance(arg, torch.dtype):
            return self.graph.add_value(vk.StringValue(str(arg).removeprefix("torch.")))
        if isinstance(arg, (torch.device, torch.layout, torch.memory_format)):
            return self.graph.add_value(vk.StringValue(str(arg).removeprefix("torch.")))
        if isinstance(arg, (list, tuple)):
            if all(isinstance(a, bool) for a in arg) and arg:
                return self.graph.add_value(vk.BoolListValue(tuple(arg)))
            if all(isinstance(a, int) and not isinstance(a, bool) for a in arg):
                return self.graph.add_value(vk.IntListValue(tuple(arg)))
            if all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in arg):
                return self.graph.add_value(vk.DoubleListValue(tuple(arg)))
            return self.graph.add_value(vk.ValueListValue(tuple(self._arg_value(a) for a in arg)))
        raise ValueError(f"argument {arg!r} of type {type(arg).__name__} cannot be stored in a vktrain blob")

    @staticmethod
    def _schema_args(node: Node) -> list[tuple[str, Any]]:
        """(name, value) of every non-out argument in schema order, defaults filled in."""
        schema = node.target._schema
        result = []
        for i, argument in enumerate(schema.arguments):
            if argument.is_out:
                continue
            if i < len(node.args):
                value = node.args[i]
            elif argument.name in node.kwargs:
                value = node.kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                raise ValueError(f"{op_key(node.target)} ('{node.name}'): required argument '{argument.name}' is missing")
            result.append((argument.name, value))
        return result

    # -- ops ------------------------------------------------------------------------------------
    def _add_op(self, node: Node) -> None:
        key = op_key(node.target)
        if key == "getitem":
            source, index = node.args
            self.node_values[node] = self.node_values[source][index]
            return
        arguments = self._schema_args(node)
        features = get_op_features(key)
        prepacked = features.prepacked_args() if features is not None else {}
        arg_ids = []
        for i, (name, value) in enumerate(arguments):
            if i in prepacked:
                if value not in self.constant_nodes:
                    raise ValueError(f"{key} ('{node.name}'): argument '{name}' must be a constant to be prepacked "
                                     f"as {prepacked[i]}")
                arg_ids.append(self._constant(value, prepacked[i], self._q4gsw_k(arguments)))
            else:
                arg_ids.append(self._arg_value(value))
        fake = node.meta["val"]
        if isinstance(fake, (tuple, list)):
            outputs = tuple(self._new_tensor(f, f"{node.name}[{i}]") for i, f in enumerate(fake))
            self.node_values[node] = outputs
        else:
            outputs = (self._new_tensor(fake, node.name),)
            self.node_values[node] = outputs[0]
        self.graph.ops.append(vk.OpCall(key, tuple(arg_ids), outputs))

    @staticmethod
    def _q4gsw_k(arguments: list[tuple[str, Any]]) -> int:
        """K of a q4gsw op = scales.shape[0] * group_size (CONTRACTS.md)."""
        named = dict(arguments)
        return int(named["scales"].meta["val"].shape[0]) * int(named["group_size"])

    # -- outputs --------------------------------------------------------------------------------
    def _add_outputs(self, output_node: Node) -> None:
        results = output_node.args[0]
        specs = self.signature.output_specs
        if len(results) != len(specs):
            raise ValueError(f"output node has {len(results)} values, the signature lists {len(specs)}")
        for result, spec in zip(results, specs):
            value_id = self._arg_value(result)
            if spec.kind == OutputKind.BUFFER_MUTATION:
                state_node = self.state_nodes[spec.target]
                _, initial = self._tensor_data(state_node)
                initial_array = _numpy(initial)
                initial_constant = -1 if not np.any(initial_array) else self.graph.add_constant(initial_array)
                self.graph.mutable_state.append(
                    vk.MutableState(self.node_values[state_node], value_id, initial_constant))
            elif spec.kind == OutputKind.USER_OUTPUT:
                self.graph.outputs.append(value_id)
            else:
                raise ValueError(f"delegate output of kind {spec.kind} ({spec.target}) is not supported")

    def build(self) -> vk.VkGraph:
        self._add_placeholders()
        for node in self.program.graph.nodes:
            if node.op == "call_function":
                self._add_op(node)
            elif node.op == "output":
                self._add_outputs(node)
            elif node.op != "placeholder":
                raise ValueError(f"node '{node.name}' of kind {node.op} cannot be lowered")
        plan = compile_graph(self.graph)
        state_bytes = sum(self.graph.values[s.state_id].nbytes for s in self.graph.mutable_state)
        self.graph.metadata.update({
            METADATA_BACKEND: BACKEND_ID,
            vk.METADATA_PLANNED_MEMORY_BYTES: str(plan.planned_bytes),
            METADATA_UNPLANNED_MEMORY_BYTES: str(plan.tensor_bytes),
            METADATA_STATE_BYTES: str(state_bytes),
            # The program allows every GEMM precision policy; the runtime picks one by device (docs/PRECISION.md).
            METADATA_GEMM_PRECISIONS: json.dumps(list(PRECISIONS)),
        })
        if self.synthetic is not None:
            self.graph.metadata[METADATA_SYNTHETIC_CONSTANTS] = self.synthetic.summary()
        return self.graph


def build_vk_graph(program: ExportedProgram, compile_specs: Sequence[CompileSpec] = ()) -> vk.VkGraph:
    """The VkGraph of one partitioned (delegated) edge program."""
    min_bytes = _int_spec(compile_specs, SYNTHETIC_MIN_BYTES_SPEC_KEY)
    synthetic = None
    if min_bytes is not None:
        synthetic = _SyntheticPolicy(min_bytes, _int_spec(compile_specs, SYNTHETIC_SEED_SPEC_KEY) or 0)
    program, baked = lower_etvk_calls(program, compile_specs)  # et_vk calls run as their vktrain ops
    graph = _GraphBuilder(program, synthetic).build()
    refusals = refusals_from_compile_specs(compile_specs)
    graph.metadata[METADATA_REFUSALS] = json.dumps([r.__dict__ for r in refusals])
    if baked:
        graph.metadata[METADATA_BAKED_SCALARS] = json.dumps(baked)
    extra = _metadata_from_specs(compile_specs)
    clashes = sorted(set(extra) & set(graph.metadata))
    if clashes:
        raise ValueError(f"metadata compile spec(s) {clashes} would replace metadata the backend writes "
                         f"({sorted(graph.metadata)}); choose other keys")
    graph.metadata.update(extra)
    graph.validate()
    return graph


@final
class VktrainVulkanBackend(BackendDetails):
    """ExecuTorch backend id "VktrainVulkanBackend" (executorch finds it by this class name)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        graph = build_vk_graph(edge_program, compile_specs)
        min_bytes = _int_spec(compile_specs, NAMED_DATA_MIN_BYTES_SPEC_KEY)
        if min_bytes is None:
            return PreprocessResult(processed_bytes=blob.serialize_blob(graph))
        named = blob.named_constants(graph, min_bytes)
        store = NamedDataStore()
        for key, data in named.values():
            store.add_named_data(key, bytes(data), alignment=blob.ALIGNMENT)
        return PreprocessResult(processed_bytes=blob.serialize_blob(graph, named),
                                data_store_output=store.get_named_data_store_output())


assert VktrainVulkanBackend.__name__ == BACKEND_ID

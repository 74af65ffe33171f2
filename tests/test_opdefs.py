"""The torch-free op definitions (vktrain/opdefs): schema parsing, the generated aten schemas, the
shape functions against torch's own results, and the verifier entry point."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)
from vktrain import opdefs
from vktrain.errors import VktrainError
from vktrain.opdefs import TensorMeta, generate, infer_outputs
from vktrain.opdefs.schema import Schema, SchemaError


def test_schema_parsing_keeps_names_defaults_kwarg_only_and_returns():
    schema = Schema.parse("aten", "sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
                                  "ScalarType? dtype=None) -> Tensor")
    assert schema.key == "aten.sum.dim_IntList"
    assert schema.arg_names == ("self", "dim", "keepdim", "dtype")
    dim, keepdim, dtype = schema.arguments[1:]
    assert (dim.type, dim.optional, dim.is_list, dim.base_type) == ("int[1]?", True, True, "int")
    assert (keepdim.default, keepdim.kwarg_only, dtype.kwarg_only) == ("False", False, True)
    out = Schema.parse("vktrain", "rms_norm.out(Tensor x, Tensor weight, float eps, *, Tensor(a!) y_out, "
                                  "Tensor(b!) rstd_out) -> (Tensor(a!), Tensor(b!))")
    assert out.key == "vktrain.rms_norm.out" and out.argument("y_out").alias == "a!"
    assert [r.alias for r in out.returns] == ["a!", "b!"]
    assert Schema.parse("aten", "amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor").arguments[1].default == "[]"
    with pytest.raises(SchemaError, match="not of the form"):
        Schema.parse("vktrain", "rms_norm(Tensor x")


def test_schemas_match_torch_for_every_op():
    """Each definition's argument names/types/defaults are exactly what torch registered (vktrain ops
    are registered FROM these schemas, aten ones are generated from torch: both must agree)."""
    for key, definition in opdefs.OP_DEFS.items():
        namespace, name, overload = key.split(".")
        if namespace == "dim_order_ops":
            import executorch.exir.passes.dim_order_ops_registry  # noqa: F401
        torch_schema = getattr(getattr(getattr(torch.ops, namespace), name), overload)._schema
        assert definition.schema.arg_names == tuple(a.name for a in torch_schema.arguments), key
        assert len(definition.schema.returns) == len(torch_schema.returns), key


def test_generated_aten_schemas_are_up_to_date():
    assert generate.main(["--check"]) == 0


def test_opdefs_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['executorch'] = None\n"
            "from vktrain import opdefs\n"
            "print(len(opdefs.OP_DEFS))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(opdefs.OP_DEFS)


def _meta(t):
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch.")) if isinstance(t, torch.Tensor) else t


def test_shape_functions_agree_with_the_cpu_references():
    """infer_outputs on the example calls gives exactly the shapes and dtypes eager execution returns."""
    from test_lora_linear_op import example_calls as lora_linear_calls
    from test_ops import example_calls as linear_calls
    from test_ops_transformer import example_calls as transformer_calls

    from vktrain.opdefs.vktrain_ops import VKTRAIN_OPS

    calls = {**linear_calls(), **transformer_calls(), **lora_linear_calls()}
    for definition in VKTRAIN_OPS:
        name, schema = definition.schema.name, definition.schema
        assert name in calls, f"{definition.key} has no example call in test_ops / test_ops_transformer / test_lora_linear_op"
        args = calls[name]
        args = tuple(args) + tuple(None for _ in schema.arguments[len(args):])  # defaults the call left out
        eager = getattr(torch.ops.vktrain, name)(*args)
        eager = eager if isinstance(eager, tuple) else (eager,)
        assert infer_outputs(f"vktrain.{name}.default", [_meta(a) for a in args]) == tuple(_meta(t) for t in eager), name


@pytest.mark.parametrize("key, args, fragment", [
    ("vktrain.rms_norm.default", [TensorMeta((2, 8), "float32"), TensorMeta((7,), "float32"), 1e-5],
     "weight must have shape [D] = [8]"),
    ("vktrain.rms_norm.default", [TensorMeta((2, 8), "int32"), TensorMeta((8,), "float32"), 1e-5],
     "x must have dtype float32 or float64, got int32"),
    ("vktrain.adamw.default", [TensorMeta((4,), "float32")] * 4 + [TensorMeta((4,), "float32"), TensorMeta((), "float32")],
     "hparams must have shape [5] = [lr, beta1, beta2, eps, weight_decay]"),
    ("vktrain.linear_q4gsw.default", [TensorMeta((3, 16), "float32"), TensorMeta((8, 4), "uint8"),
                                      TensorMeta((4, 8), "float32"), 4, None], "weights shape (8, 4) does not match"),
    ("vktrain.rope.default", [TensorMeta((1, 2, 3), "float32")] * 3, "x must be 4-D"),
    ("aten.mm.default", [TensorMeta((2, 3), "float32"), TensorMeta((4, 5), "float32")], "do not chain"),
    ("vktrain.swiglu.default", [TensorMeta((2,), "float32")], "takes 2 arguments (gate, up), got 1"),
    ("vktrain.nonexistent.default", [], "no op definition for 'vktrain.nonexistent.default'"),
])
def test_verifier_entry_point_returns_the_reason(key, args, fragment):
    reason = infer_outputs(key, args)
    assert isinstance(reason, str) and reason.startswith(key) and fragment in reason, reason


def test_a_blob_written_before_a_trailing_optional_argument_binds_its_default():
    """causal_attention gained `positions` (packed documents) after .pte files were written: their calls list 4
    values; the fifth takes the schema's default (None), and a missing required argument is still refused."""
    q = TensorMeta((1, 2, 8, 16), "float32")
    old = infer_outputs("vktrain.causal_attention.default", [q, q, q, 0.25])
    assert old == infer_outputs("vktrain.causal_attention.default", [q, q, q, 0.25, None]), old
    reason = infer_outputs("vktrain.causal_attention.default", [q, q, q])
    assert isinstance(reason, str) and "takes 5 arguments" in reason and "got 3" in reason, reason


def test_verifier_entry_point_returns_outputs():
    assert infer_outputs("aten.mm.default", [TensorMeta((2, 3), "float32"), TensorMeta((3, 5), "float32")]) == (
        TensorMeta((2, 5), "float32"),)
    assert infer_outputs("vktrain.q4gsw_requant.default",
                         {"latent": TensorMeta((8, 12), "float32"), "scales": TensorMeta((3, 8), "float32"),
                          "group_size": 4}) == (TensorMeta((8, 8), "uint8"),)
    assert infer_outputs("aten.relu.default", [TensorMeta((2,), "float32")]) is None  # no rule: the graph's stand


def test_one_dtype_table_for_every_layer():
    """names <-> numpy <-> blob DataType <-> bytes, and the layers that used to keep their own copies."""
    import numpy as np

    from vktrain.opdefs.dtypes import BIT_CONTAINERS, DTYPES, dtype_info
    from vktrain.ops._library import torch_dtype
    from vktrain.backend.kernel_planning.lowering_context import KERNEL_DTYPES
    from vktrain.serialization import graph as vk
    from vktrain.serialization.generated.vkt_blob.DataType import DataType

    assert {d.blob_code for d in DTYPES} == {v for k, v in vars(DataType).items() if not k.startswith("_")}
    for info in DTYPES:
        member = vk.DType(info.blob_code)
        assert member.numpy_dtype == info.numpy and member.itemsize == info.itemsize == torch_dtype(info.name).itemsize
        if info.name not in BIT_CONTAINERS:  # numpy has no bfloat16: its bits are held as uint16
            assert info.numpy == np.dtype(info.name)
    assert dtype_info("int64").blob_code == DataType.INT64 and dtype_info("int64").itemsize == 8
    assert KERNEL_DTYPES <= {d.name for d in DTYPES}
    with pytest.raises(VktrainError, match="dtype 'float64' is not one vktrain stores"):
        dtype_info("float64")

"""GPU kernels of the generic aten ops (vktrain/runtime/kernels: elementwise, layout, reduction, matmul,
embedding) on the Vulkan device, against torch eager in float64 (or bit-exact where the op moves data).

Tolerances:
* elementwise: 1e-5 relative per element (fp32 rounding plus the few-ulp error of exp/erfc/division
  on the GPU), with an absolute floor only in the denormal range a GPU may flush.
* reductions: |error| <= 1e-6 * sum(|x|) per output. Each thread's running sum is compensated
  (Kahan, ~2 eps), the workgroup tree adds 6 levels of plain adds and mean one more rounding:
  <= 9 * 2^-24 = 5.4e-7 of sum(|x|) in the worst case, whatever the length (a naive running sum of
  4096 terms already errs by ~4e-5, see the compensated-summation test).
* GEMM: norm-relative 1e-4 (||C - C_ref|| / ||C_ref||): the fp32 error of a K-term dot product grows
  like sqrt(K) * 2^-24 for random data, ~2e-6 for the K <= 1024 used here. Split-K adds each
  slice's fp32 partial in slice order (a few more roundings, same bound) and must be bitwise
  reproducible run to run.
Copies, permutes, embedding lookups are exact; embedding backward is compared to float64 and checked
bitwise reproducible.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from vktrain.runtime import Buffer, run_dispatches
from vktrain.backend.kernel_planning.kernels import get_kernel
from vktrain.backend.kernel_planning.kernels.copies import is_alias_view
from vktrain.backend.kernel_planning.kernels.elementwise import plan_binary, plan_unary
from vktrain.backend.kernel_planning.kernels.embedding import plan_embedding_dense_backward
from vktrain.serialization.strided_view import KernelArgumentError, StridedView
from vktrain.backend.kernel_planning.kernels.layout import broadcast_shapes, coalesce_dims, plan_strided_copy
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, runs_cpu_bodies
from vktrain.backend.kernel_planning.kernels.matmul_cpu import (
    B_N_PAIRS_SPEC_ID, CPU_LANES, CPU_MAX_K, CPU_TM_CHOICES, CPU_TN, cpu_gemm_variant, cpu_tile_rows)
from vktrain.backend.kernel_planning.kernels.matmul import (
    MAX_SPLIT_K,
    MIN_SPLIT_SLICE,
    TARGET_THREADS,
    default_gemm_tile,
    default_split_k,
    gemm_scratch_nbytes,
    plan_gemm,
    slice_length,
    split_k_scratch_nbytes,
)
from vktrain.backend.kernel_planning.op_lowering import TensorArg
from vktrain.serialization.dispatch import ceil_div
from vktrain.backend.kernel_planning.kernels.reduction import (
    STRATEGY_GROUP_PER_OUTPUT,
    STRATEGY_SPEC_ID,
    STRATEGY_THREAD_PER_OUTPUT,
    plan_sum,
    reduced_shape,
)

RNG_SEED = 20261129


@pytest.fixture
def rng():
    return np.random.default_rng(RNG_SEED)


# ----------------------------------------------------------------------------------------- helpers
def _run(device, dispatches, arrays: dict[str, np.ndarray], out_shape, out_dtype=np.float32, **options):
    """Upload `arrays` under their names, run the dispatches, return the "out" buffer's contents."""
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(a)) for name, a in arrays.items()}
    out_nbytes = max(4, int(np.prod(out_shape, dtype=np.int64)) * np.dtype(out_dtype).itemsize)
    buffers["out"] = Buffer(device, out_nbytes)
    try:
        if dispatches:
            run_dispatches(device, dispatches, buffers, **options)
        return buffers["out"].read(out_dtype, out_shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _run_aten(device, key: str, tensors: dict[str, np.ndarray], out_shape, out_dtype=np.float32, **scalars):
    """Call the registered plan of `key` with the aten calling convention and run it."""
    kwargs = dict(scalars)
    for name, array in tensors.items():
        kwargs[name] = name
        kwargs[f"{name}_shape"] = array.shape
        kwargs.setdefault(f"{name}_dtype", str(array.dtype))
    dispatches = get_kernel(key)(out="out", **kwargs)
    return _run(device, dispatches, tensors, out_shape, out_dtype)


def _f64(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def _assert_elementwise_close(got: np.ndarray, ref, rtol: float = 1e-5, atol: float = 1e-37, scale=None):
    """|got - ref| <= rtol * max(|ref|, scale) + atol per element (NaN must match NaN).

    `scale` is the magnitude of the terms an op combines where they may cancel (|a| + |alpha b| for an
    add): there fp32 rounding of the inputs' magnitude, not of the result's, bounds the error.
    """
    ref = np.asarray(ref.numpy() if isinstance(ref, torch.Tensor) else ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    got = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN positions differ")
    magnitude = np.abs(ref) if scale is None else np.maximum(np.abs(ref), np.asarray(scale, dtype=np.float64))
    finite = np.isfinite(ref)
    bound = np.where(finite, rtol * np.where(finite, magnitude, 0.0) + atol, 0.0)
    # Non-finite expectations must be met exactly (NaN positions were compared above).
    error = np.where(finite, np.abs(got - np.where(finite, ref, 0.0)),
                     np.where(np.isnan(ref) | (got == ref), 0.0, np.inf))
    worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else ()
    assert np.all(error <= bound), (
        f"{np.count_nonzero(error > bound)} of {error.size} elements out of tolerance; worst at {worst}: "
        f"got {got[worst]!r}, expected {ref[worst]!r}")


def _assert_norm_close(got: np.ndarray, ref, tol: float = 1e-4):
    ref = np.asarray(ref.numpy() if isinstance(ref, torch.Tensor) else ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    error = np.linalg.norm(got.astype(np.float64) - ref)
    assert error <= tol * np.linalg.norm(ref), f"norm-relative error {error / np.linalg.norm(ref):.3g} > {tol}"


def _accurate_gelu(x: np.ndarray) -> np.ndarray:
    """0.5 x erfc(-x / sqrt 2) in float64 with math.erfc: accurate where torch's 1 + erf cancels."""
    erfc = np.vectorize(math.erfc)
    x = x.astype(np.float64)
    return 0.5 * x * erfc(-x / math.sqrt(2.0))


def _accurate_gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(u)) rewritten as x / (1 + exp(-2u)) in float64: no cancellation for x << 0."""
    x = x.astype(np.float64)
    u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
    return x / (1.0 + np.exp(-2.0 * u))


# ----------------------------------------------------------------------------------------- pure helpers
TRAINING_STEP_OPS = [
    "aten.embedding.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.permute_copy.default", "aten.t_copy.default", "aten.view_copy.default", "aten.expand_copy.default",
    "aten.clone.default", "aten._to_copy.default", "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor",
    "aten.mul.Scalar", "aten.div.Tensor", "aten.neg.default", "aten.relu.default",
    "aten.threshold_backward.default", "aten.gelu.default", "aten.gelu_backward.default", "aten.silu.default",
    "aten.sigmoid.default", "aten.exp.default", "aten.rsqrt.default", "aten.pow.Tensor_Scalar",
    "aten.sum.dim_IntList", "aten.mean.dim", "aten.embedding_dense_backward.default",
]
# Generic ops the partitioner also accepts, with a GPU kernel here (comparisons / where need bool
# tensors on the GPU and are not implemented).
PARTITIONER_EXTRA_OPS = [
    "aten.linear.default", "aten.alias_copy.default", "dim_order_ops._to_dim_order_copy.default",
    "aten.pow.Tensor_Tensor", "aten.tanh.default", "aten.erf.default", "aten.log.default", "aten.expm1.default",
    "aten.reciprocal.default", "aten.abs.default", "aten.tanh_backward.default", "aten.amax.default",
    "aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.full.default",
    "aten.scalar_tensor.default",
]


def test_every_generic_op_of_a_training_step_has_a_plan():
    from vktrain.backend.kernel_planning.kernels import KERNELS
    assert [op for op in TRAINING_STEP_OPS + PARTITIONER_EXTRA_OPS if op not in KERNELS] == []


def _torch_op(key: str):
    namespace, name, overload = key.split(".")
    if namespace == "dim_order_ops":
        import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  (registers the namespace)
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # executorch's own importlib.resources use
@pytest.mark.parametrize("key", TRAINING_STEP_OPS + PARTITIONER_EXTRA_OPS)
def test_plan_keywords_are_the_schema_argument_names(key):
    """The runtime passes every schema argument under its schema name (tensors also as <name>_shape /
    <name>_dtype): each plan must accept all of them."""
    parameters = inspect.signature(get_kernel(key)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    schema = _torch_op(key)._schema.arguments
    missing = [a.name for a in schema if a.name not in parameters and not takes_any]
    assert missing == [], f"{key}: plan lacks keyword(s) {missing}"
    for argument in schema:
        if isinstance(argument.type, torch.TensorType):
            assert f"{argument.name}_shape" in parameters, f"{key}: no {argument.name}_shape keyword"


def test_broadcast_shapes_and_coalescing():
    assert broadcast_shapes((3, 1, 5), (4, 5)) == (3, 4, 5)
    assert broadcast_shapes((), (2, 3)) == (2, 3)
    with pytest.raises(KernelArgumentError, match="do not broadcast: size 3 vs 4"):
        broadcast_shapes((3,), (4,))
    # A contiguous [2, 3, 4] merges into one dim; a transposed operand blocks the merge where it breaks.
    assert coalesce_dims((2, 3, 4), (12, 4, 1)) == ((24,), ((1,),))
    assert coalesce_dims((2, 3, 4), (12, 4, 1), (1, 2, 6)) == ((2, 3, 4), ((12, 4, 1), (1, 2, 6)))
    assert coalesce_dims((2, 3, 4), (12, 4, 1), (1, 8, 2)) == ((2, 12), ((12, 1), (1, 2)))
    assert coalesce_dims((2, 1, 4), (4, 99, 1)) == ((8,), ((1,),))


def test_strided_view_ops_match_torch_strides():
    base = torch.empty(2, 3, 4, 5)
    view = StridedView.contiguous((2, 3, 4, 5))
    for mine, theirs in [
        (view.permute((3, 1, 0, 2)), base.permute(3, 1, 0, 2)),
        (view.transpose(-1, 0), base.transpose(-1, 0)),
        (view.slice(2, 1, None, 2), base[:, :, 1::2]),
        (view.slice(1, -2, 10), base[:, -2:10]),
        (view.select(1, -1), base.select(1, -1)),
        (view.unsqueeze(1).expand((2, 7, 3, 4, 5)), base.unsqueeze(1).expand(2, 7, 3, 4, 5)),
        (view.expand((6, -1, -1, -1, -1)), base.expand(6, -1, -1, -1, -1)),
    ]:
        assert mine.sizes == tuple(theirs.shape)
        assert mine.offset == theirs.storage_offset()
        assert all(st == ts for st, ts, size in zip(mine.strides, theirs.stride(), mine.sizes) if size > 1)
    with pytest.raises(KernelArgumentError, match="size 3 at dim 1 is not 1"):
        view.expand((2, 4, 4, 5))
    with pytest.raises(KernelArgumentError, match="not a permutation"):
        view.permute((0, 0, 1, 2))


# ----------------------------------------------------------------------------------------- elementwise
UNARY_CASES = [
    # (aten key, scalar kwargs, torch float64 reference, input transform)
    ("aten.neg.default", {}, lambda t: -t, None),
    ("aten.relu.default", {}, torch.relu, None),
    ("aten.sigmoid.default", {}, torch.sigmoid, None),
    ("aten.silu.default", {}, torch.nn.functional.silu, None),
    ("aten.exp.default", {}, torch.exp, None),
    ("aten.expm1.default", {}, torch.expm1, None),
    ("aten.rsqrt.default", {}, torch.rsqrt, np.abs),
    ("aten.sqrt.default", {}, torch.sqrt, np.abs),
    ("aten.mul.Scalar", {"other": -1.75}, lambda t: t * -1.75, None),
    ("aten.add.Scalar", {"other": 0.5, "alpha": 3}, lambda t: t + 1.5, None),
    ("aten.sub.Scalar", {"other": 0.5, "alpha": 2}, lambda t: t - 1.0, None),
    ("aten.rsub.Scalar", {"other": 2.0, "alpha": 0.5}, lambda t: 2.0 - 0.5 * t, None),
    ("aten.div.Scalar", {"other": 3.0}, lambda t: t / 3.0, None),
    ("aten.tanh.default", {}, torch.tanh, None),
    ("aten.erf.default", {}, torch.erf, None),
    ("aten.log.default", {}, torch.log, lambda x: np.abs(x) * 10.0 ** np.linspace(-30, 30, x.size).reshape(x.shape)),
    ("aten.reciprocal.default", {}, torch.reciprocal, None),
    ("aten.abs.default", {}, torch.abs, None),
]


@pytest.mark.parametrize("key, scalars, reference, transform", UNARY_CASES, ids=[c[0] for c in UNARY_CASES])
def test_unary_ops_match_torch(vk_device, rng, key, scalars, reference, transform):
    # 3 * 5 * 71 = 1065 elements: not a multiple of the 64-wide workgroup.
    x = (rng.standard_normal((3, 5, 71)) * 4).astype(np.float32)
    x.flat[:6] = [0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0]
    if transform is not None:
        x = transform(x).astype(np.float32)
    got = _run_aten(vk_device, key, {"self": x}, x.shape, **scalars)
    _assert_elementwise_close(got, reference(_f64(x)))


SPECIAL_VALUE_OPS = {
    "aten.neg.default": torch.neg, "aten.relu.default": torch.relu, "aten.sigmoid.default": torch.sigmoid,
    "aten.silu.default": torch.nn.functional.silu, "aten.exp.default": torch.exp, "aten.rsqrt.default": torch.rsqrt,
    "aten.sqrt.default": torch.sqrt, "aten.tanh.default": torch.tanh, "aten.erf.default": torch.erf,
    "aten.log.default": torch.log, "aten.reciprocal.default": torch.reciprocal, "aten.abs.default": torch.abs,
    "aten.gelu.default": torch.nn.functional.gelu, "aten.expm1.default": torch.expm1,
}


@pytest.mark.parametrize("key", sorted(SPECIAL_VALUE_OPS))
def test_unary_special_values_match_torch(vk_device, key):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0, 1e-40, -1e-40], np.float32)
    got = _run_aten(vk_device, key, {"self": x}, x.shape)
    # float32 eager: overflow to +-inf (exp(100), 1 / 1e-40) is part of what must match.
    expected = SPECIAL_VALUE_OPS[key](torch.from_numpy(x)).double().numpy()
    if key == "aten.gelu.default":
        # gelu(+inf) = +inf * Phi(+inf) = +inf, which the kernel returns; torch's CPU kernel says NaN.
        expected[0] = np.inf
    _assert_elementwise_close(got, expected, atol=1e-37)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_accurate_far_into_the_negative_tail(vk_device, rng, approximate):
    x = np.concatenate([np.linspace(-12, 12, 481), [0.0, -0.0, 1e-6, -1e-6],
                        rng.standard_normal(300) * 3]).astype(np.float32)
    got = _run_aten(vk_device, "aten.gelu.default", {"self": x}, x.shape, approximate=approximate)
    # Against an accurate float64 formula: full relative accuracy even where gelu(x) ~ 1e-32.
    accurate = _accurate_gelu(x) if approximate == "none" else _accurate_gelu_tanh(x)
    _assert_elementwise_close(got, accurate)
    # Against torch eager: torch's own 1 + erf(x) / 1 + tanh(u) cancels for x < -7 even in float64
    # (absolute error ~1e-16), hence the absolute floor.
    _assert_elementwise_close(got, torch.nn.functional.gelu(_f64(x), approximate=approximate), atol=1e-14)


def test_tanh_erf_log_keep_relative_accuracy_where_textbook_formulas_cancel(vk_device):
    near_zero = np.array([1e-30, -1e-20, 1e-8, -3e-4, 0.01, -0.2, 0.399, 0.4, -0.45, 0.5, 0.0, -0.0], np.float32)
    for key, reference in (("aten.tanh.default", torch.tanh), ("aten.erf.default", torch.erf)):
        got = _run_aten(vk_device, key, {"self": near_zero}, near_zero.shape)
        _assert_elementwise_close(got, reference(_f64(near_zero)))
    offsets = np.array([0.0, 2**-23, -2**-24, 1e-5, -1e-5, 1e-3, 0.2, -0.29, 0.41], np.float64)
    near_one = (1.0 + offsets).astype(np.float32)
    special = np.array([0.0, np.inf, -1.0, np.nan, 1e-45, 3.4e38], np.float32)
    x = np.concatenate([near_one, special])
    got = _run_aten(vk_device, "aten.log.default", {"self": x}, x.shape)
    _assert_elementwise_close(got, torch.log(_f64(x)))
    # expm1 near 0, where exp(x) - 1 keeps no digit (ORPO's log(1 - p) = log(-expm1(log p)) as p nears 1),
    # and around the switch to exp(x) - 1 at |x| = 0.5.
    small = np.array([1e-30, -1e-20, 2**-24, -1e-7, 3e-4, -0.01, 0.2, -0.3, 0.4999, -0.4999, 0.5, -0.5, 0.51,
                      -0.51, -1.0, 2.0, -20.0], np.float32)
    got = _run_aten(vk_device, "aten.expm1.default", {"self": small}, small.shape)
    _assert_elementwise_close(got, torch.expm1(_f64(small)))


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -0.5, -1.0, 0.0, 1.0, 1.7, 4.0, -3.0])
def test_pow_tensor_scalar(vk_device, rng, exponent):
    x = (rng.standard_normal(200) * 2).astype(np.float32)
    if exponent != int(exponent):
        x = np.abs(x) + 0.1  # fractional powers of negative bases are NaN (checked below)
    got = _run_aten(vk_device, "aten.pow.Tensor_Scalar", {"self": x}, x.shape, exponent=exponent)
    # pow() for the generic exponents goes through exp2(e * log2 x): a few ulp of e * log2(x).
    _assert_elementwise_close(got, torch.pow(_f64(x), exponent), rtol=2e-6 if exponent in (0.5, 1, 2, 3) else 1e-5)


def test_pow_special_values(vk_device):
    x = np.array([-2.0, -0.5, 0.0, -0.0, 1.0, 2.0, np.nan], dtype=np.float32)
    for exponent in (1.5, -2.0, 3.0, -3.0, 5.0, float("nan")):
        got = _run_aten(vk_device, "aten.pow.Tensor_Scalar", {"self": x}, x.shape, exponent=exponent)
        _assert_elementwise_close(got, torch.pow(_f64(x), exponent))
        expected = torch.pow(_f64(x), exponent).numpy()
        signed = ~np.isnan(expected)  # signed zeros and infinities must match; a NaN's sign means nothing
        assert np.array_equal(np.signbit(got[signed]), np.signbit(expected[signed])), exponent


def test_pow_tensor_tensor_broadcasts(vk_device, rng):
    base = (rng.standard_normal((4, 1, 6)) * 2).astype(np.float32)
    exponent = rng.choice([-2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 1.25], size=(5, 1)).astype(np.float32)
    got = _run_aten(vk_device, "aten.pow.Tensor_Tensor", {"self": base, "exponent": exponent}, (4, 5, 6))
    _assert_elementwise_close(got, torch.pow(_f64(base), _f64(exponent)))


BINARY_SHAPES = [
    ((1000,), (1000,)),            # same shape, 1000 % 64 != 0
    ((3, 1, 5), (4, 5)),           # both sides broadcast
    ((2, 3, 4, 5), (3, 1, 5)),     # rank 4 vs rank 3 with a size-1 dim
    ((7, 9), ()),                  # 0-d other
    ((1,), (6, 1, 1)),             # self broadcast everywhere
    ((2, 1, 3, 1, 2, 3), (1, 4, 1, 5, 2, 1)),  # rank 6, alternating broadcast dims
]
# (aten key, scalar kwargs, torch reference, magnitude of the terms that may cancel or None)
BINARY_CASES = [
    ("aten.add.Tensor", {"alpha": 2.5}, lambda a, b: a + 2.5 * b, lambda a, b: a.abs() + 2.5 * b.abs()),
    ("aten.sub.Tensor", {"alpha": 1}, lambda a, b: a - b, lambda a, b: a.abs() + b.abs()),
    ("aten.mul.Tensor", {}, lambda a, b: a * b, None),
    ("aten.div.Tensor", {}, lambda a, b: a / b, None),
    ("aten.maximum.default", {}, torch.maximum, None),
    ("aten.minimum.default", {}, torch.minimum, None),
]


@pytest.mark.parametrize("a_shape, b_shape", BINARY_SHAPES, ids=[f"{a}x{b}" for a, b in BINARY_SHAPES])
@pytest.mark.parametrize("key, scalars, reference, terms", BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_binary_broadcasting_matches_torch(vk_device, rng, key, scalars, reference, terms, a_shape, b_shape):
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    if key == "aten.div.Tensor":
        b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)
    out_shape = torch.broadcast_shapes(a_shape, b_shape)
    got = _run_aten(vk_device, key, {"self": a, "other": b}, out_shape, **scalars)
    scale = None if terms is None else terms(_f64(a), _f64(b)).numpy()
    _assert_elementwise_close(got, reference(_f64(a), _f64(b)), scale=scale)


def test_binary_ops_propagate_nan_like_torch(vk_device):
    a = np.array([1.0, np.nan, 3.0, np.nan], dtype=np.float32)
    b = np.array([np.nan, 2.0, 1.0, np.nan], dtype=np.float32)
    for key, reference in (("aten.maximum.default", torch.maximum), ("aten.minimum.default", torch.minimum)):
        got = _run_aten(vk_device, key, {"self": a, "other": b}, a.shape)
        _assert_elementwise_close(got, reference(_f64(a), _f64(b)))
    got = _run_aten(vk_device, "aten.relu.default", {"self": a}, a.shape)
    _assert_elementwise_close(got, torch.relu(_f64(a)))


def test_tensor_ops_with_a_python_number_operand(vk_device, rng):
    a = rng.standard_normal((5, 13)).astype(np.float32)
    for key, scalars, reference in [
        ("aten.add.Tensor", {"other": 2.0, "alpha": 3}, lambda t: t + 6.0),
        ("aten.sub.Tensor", {"other": 0.25}, lambda t: t - 0.25),
        ("aten.mul.Tensor", {"other": -3}, lambda t: t * -3),
        ("aten.div.Tensor", {"other": 8.0}, lambda t: t / 8.0),
    ]:
        got = _run_aten(vk_device, key, {"self": a}, a.shape, **scalars)
        _assert_elementwise_close(got, reference(_f64(a)), scale=np.abs(reference(_f64(a).abs()).numpy()))


def _gelu_tanh_grad_accurate(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dx [x sigmoid(2u)] in float64, u = sqrt(2/pi) (x + 0.044715 x^3): no 1 + tanh cancellation."""
    c = math.sqrt(2.0 / math.pi)
    s = torch.sigmoid(2 * c * (x + 0.044715 * x ** 3))
    return g * (s + x * 2 * c * (1 + 3 * 0.044715 * x ** 2) * s * (1 - s))


# (aten key, name of the second tensor, scalars, reference, magnitude of the cancelling terms)
# Activation derivatives cross zero (gelu' at x ~ -0.75, silu' at x ~ -1.28) where their O(1) terms
# cancel: the fp32 error there is relative to |grad| * (sum of |terms|), not to the tiny result.
BACKWARD_CASES = [
    ("aten.threshold_backward.default", "self", {"threshold": 0.0},
     lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.0), None),
    ("aten.threshold_backward.default", "self", {"threshold": 0.5},
     lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.5), None),
    ("aten.gelu_backward.default", "self", {"approximate": "none"},
     lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="none"),
     lambda g, x: g.abs() * (0.5 * torch.erfc(-x / math.sqrt(2))
                             + x.abs() * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi))),
    ("aten.gelu_backward.default", "self", {"approximate": "tanh"}, _gelu_tanh_grad_accurate,
     lambda g, x: g.abs() * (1 + x.abs() * (1 + x * x) * torch.exp(-x.abs()))),
    ("aten.silu_backward.default", "self", {}, torch.ops.aten.silu_backward,
     lambda g, x: g.abs() * torch.sigmoid(x) * (1 + x.abs() * (1 - torch.sigmoid(x)))),
    ("aten.sigmoid_backward.default", "output", {}, torch.ops.aten.sigmoid_backward, None),
    ("aten.tanh_backward.default", "output", {}, torch.ops.aten.tanh_backward, lambda g, y: g.abs()),
]


@pytest.mark.parametrize("key, second, scalars, reference, terms", BACKWARD_CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in BACKWARD_CASES])
def test_activation_backwards_match_torch(vk_device, rng, key, second, scalars, reference, terms):
    grad = rng.standard_normal((4, 67)).astype(np.float32)
    x = (rng.standard_normal((4, 67)) * 3).astype(np.float32)
    x[0, :4] = [0.0, 0.5, -0.0, 6.0]  # exactly at the thresholds
    if key == "aten.sigmoid_backward.default":
        x = (1 / (1 + np.exp(-x))).astype(np.float32)
    elif key == "aten.tanh_backward.default":
        x = np.tanh(x).astype(np.float32)
    got = _run_aten(vk_device, key, {"grad_output": grad, second: x}, x.shape, **scalars)
    scale = None if terms is None else terms(_f64(grad), _f64(x)).numpy()
    _assert_elementwise_close(got, reference(_f64(grad), _f64(x)), scale=scale)


def test_elementwise_reads_strided_views_in_place(vk_device, rng):
    """A transposed / offset / broadcast view is read without materialising it first."""
    storage = rng.standard_normal(200).astype(np.float32)
    a_view = StridedView.contiguous((6, 7), offset=11).transpose(0, 1)  # [7, 6] read column-major
    b_view = StridedView((7, 1), (3, 0), offset=150)                     # every third element, broadcast
    dispatches = plan_binary("mul", "out", "a", a_view, "b", b_view)
    got = _run(vk_device, dispatches, {"a": storage, "b": storage}, (7, 6))
    t = torch.from_numpy(storage).double()
    a_ref = t[11:53].reshape(6, 7).T
    b_ref = t[150:171:3].reshape(7, 1)
    _assert_elementwise_close(got, a_ref * b_ref)


def test_elementwise_split_dispatch(vk_device, rng):
    """More work groups than the per-axis limit: the runtime splits the grid, every element once."""
    x = rng.standard_normal(64 * 5 + 3).astype(np.float32)
    dispatches = plan_unary("neg", "out", "x", StridedView.contiguous(x.shape))
    got = _run(vk_device, dispatches, {"x": x}, x.shape, max_group_count=2)
    np.testing.assert_array_equal(got, -x)


# ----------------------------------------------------------------------------------------- copies
def test_layout_copies_are_exact(vk_device, rng):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    t = torch.from_numpy(x)
    cases = [
        ("aten.permute_copy.default", {"dims": [3, 1, 0, 2]}, t.permute(3, 1, 0, 2)),
        ("aten.permute_copy.default", {"dims": [0, 1, 3, 2]}, t.permute(0, 1, 3, 2)),
        ("aten.transpose_copy.int", {"dim0": 1, "dim1": -1}, t.transpose(1, -1)),
        ("aten.slice_copy.Tensor", {"dim": 2, "start": 1, "end": None, "step": 2}, t[:, :, 1::2]),
        ("aten.slice_copy.Tensor", {"dim": -1, "start": -3, "end": 100}, t[..., -3:]),
        ("aten.select_copy.int", {"dim": 1, "index": -1}, t.select(1, -1)),
        ("aten.clone.default", {}, t.clone()),
        ("aten.view_copy.default", {"size": [6, -1]}, t.reshape(6, -1)),
        ("aten.unsqueeze_copy.default", {"dim": 2}, t.unsqueeze(2)),
        ("aten.expand_copy.default", {"size": [4, -1, -1, -1, -1]}, t.expand(4, -1, -1, -1, -1)),
    ]
    for key, args, reference in cases:
        got = _run_aten(vk_device, key, {"self": x}, tuple(reference.shape), **args)
        np.testing.assert_array_equal(got, reference.numpy(), err_msg=f"{key} {args}")


def test_t_copy_squeeze_and_expand_size_one(vk_device, rng):
    m = rng.standard_normal((37, 70)).astype(np.float32)
    got = _run_aten(vk_device, "aten.t_copy.default", {"self": m}, (70, 37))
    np.testing.assert_array_equal(got, m.T)
    v = rng.standard_normal((1, 5, 1)).astype(np.float32)
    got = _run_aten(vk_device, "aten.expand_copy.default", {"self": v}, (3, 5, 4), size=[3, 5, 4])
    np.testing.assert_array_equal(got, np.broadcast_to(v, (3, 5, 4)))
    got = _run_aten(vk_device, "aten.squeeze_copy.dims", {"self": v}, (5,), dim=[0, 2])
    np.testing.assert_array_equal(got, v.reshape(5))
    got = _run_aten(vk_device, "aten.squeeze_copy.dim", {"self": v}, (5, 1), dim=0)
    np.testing.assert_array_equal(got, v.reshape(5, 1))
    got = _run_aten(vk_device, "aten.squeeze_copy.default", {"self": v}, (5,))
    np.testing.assert_array_equal(got, v.reshape(5))
    assert is_alias_view((2, 3, 4), (6, -1))
    with pytest.raises(KernelArgumentError, match="invalid for a tensor of 24 elements"):
        is_alias_view((2, 3, 4), (5, -1))


def test_to_copy_converts_like_torch(vk_device):
    f = np.array([-2.7, -0.5, 0.0, 0.99, 3.5, 1e6], dtype=np.float32)
    got = _run_aten(vk_device, "aten._to_copy.default", {"self": f}, f.shape, np.int32, dtype="int64")
    np.testing.assert_array_equal(got, torch.from_numpy(f).to(torch.int64).numpy())
    i = np.array([-7, 0, 3, 16777217, -(2**31)], dtype=np.int32)
    got = _run_aten(vk_device, "aten._to_copy.default", {"self": i}, i.shape, dtype="float32")
    np.testing.assert_array_equal(got, torch.from_numpy(i).to(torch.float32).numpy())
    got = _run_aten(vk_device, "aten._to_copy.default", {"self": i}, i.shape, np.int32)  # int32 copy
    np.testing.assert_array_equal(got, i)


def test_alias_and_dim_order_copies(vk_device, rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    got = _run_aten(vk_device, "aten.alias_copy.default", {"self": x}, x.shape)
    np.testing.assert_array_equal(got, x)
    got = _run_aten(vk_device, "dim_order_ops._to_dim_order_copy.default", {"self": x}, x.shape, np.int32,
                    dtype="int32", dim_order=[0, 1])
    np.testing.assert_array_equal(got, torch.from_numpy(x).to(torch.int32).numpy())
    with pytest.raises(KernelArgumentError, match=r"dim_order \[1, 0\] is not contiguous"):
        get_kernel("dim_order_ops._to_dim_order_copy.default")(out="o", self="x", self_shape=(3, 4), dim_order=[1, 0])


def test_fills_match_torch(vk_device):
    cases = [
        ("aten.full.default", {"size": [3, 70], "fill_value": -2.5}, torch.full((3, 70), -2.5)),
        ("aten.full.default", {"size": [5], "fill_value": 7}, torch.full((5,), 7)),  # int fill -> int64
        ("aten.scalar_tensor.default", {"s": 0.125}, torch.scalar_tensor(0.125)),
    ]
    for key, args, reference in cases:
        out_dtype = np.float32 if reference.dtype == torch.float32 else np.int32
        got = _run(vk_device, get_kernel(key)(out="out", **args), {}, tuple(reference.shape), out_dtype)
        np.testing.assert_array_equal(got, reference.numpy(), err_msg=key)
    like = np.zeros((2, 65), np.float32)
    for key, args, reference in [
        ("aten.zeros_like.default", {}, torch.zeros(2, 65)),
        ("aten.ones_like.default", {}, torch.ones(2, 65)),
        ("aten.full_like.default", {"fill_value": float("-inf")}, torch.full((2, 65), float("-inf"))),
        ("aten.full_like.default", {"fill_value": -3, "dtype": "int64"}, torch.full((2, 65), -3)),
    ]:
        out_dtype = np.float32 if reference.dtype == torch.float32 else np.int32
        got = _run_aten(vk_device, key, {"self": like}, like.shape, out_dtype, **args)
        np.testing.assert_array_equal(got, reference.numpy(), err_msg=f"{key} {args}")
    with pytest.raises(KernelArgumentError, match="not an integer that fits int32"):
        get_kernel("aten.full.default")(out="o", size=[2], fill_value=2.5, dtype="int64")


def test_cat_along_each_dim(vk_device, rng):
    parts = [rng.standard_normal(shape).astype(np.float32) for shape in [(2, 3, 4), (2, 5, 4), (2, 1, 4)]]
    got = _run(vk_device, get_kernel("aten.cat.default")(
        out="out", tensors=["p0", "p1", "p2"], tensors_shapes=[p.shape for p in parts], dim=1),
        {f"p{i}": p for i, p in enumerate(parts)}, (2, 9, 4))
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1))
    last = [rng.standard_normal((3, n)).astype(np.float32) for n in (1, 66)]
    got = _run(vk_device, get_kernel("aten.cat.default")(
        out="out", tensors=["a", "b", "empty"], tensors_shapes=[(3, 1), (3, 66), (0,)], dim=-1),
        {"a": last[0], "b": last[1], "empty": np.zeros(1, np.float32)}, (3, 67))
    np.testing.assert_array_equal(got, np.concatenate(last, axis=-1))


def test_strided_copy_into_a_region_of_a_larger_output(vk_device, rng):
    """Write a permuted source into every other row of an output (slice_scatter-style)."""
    source = rng.standard_normal((4, 6)).astype(np.float32)
    out_view = StridedView.contiguous((8, 4)).slice(0, 1, None, 2).transpose(0, 1)  # [4, 4] region
    dispatches = plan_strided_copy("out", "src", StridedView.contiguous((4, 6)).slice(1, 0, 4), out_view=out_view)
    got = _run(vk_device, dispatches, {"src": source}, (8, 4))
    # The output buffer is uninitialised except the region: compare only what was written.
    np.testing.assert_array_equal(got[1::2, :].T, source[:, :4])


# ----------------------------------------------------------------------------------------- reductions
REDUCE_CASES = [
    ((6, 7, 67), [-1], False),
    ((6, 7, 67), [0], True),
    ((2, 3, 4, 5), [1, 3], False),
    ((2, 3, 4, 5), [0, 2], True),
    ((5, 1, 9), [1], False),          # reducing a size-1 dim
    ((3, 4), None, False),            # all dims -> 0-d
    ((3, 4), [], True),               # [] also means all dims
    ((1000,), [0], False),            # long reduction: workgroup-per-output tree
    ((300, 1100), [0], False),        # column sums: thread-per-output, coalesced
    ((4, 3000), [1], True),           # long rows
]


@pytest.mark.parametrize("shape, dims, keepdim", REDUCE_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in REDUCE_CASES])
@pytest.mark.parametrize("key", ["aten.sum.dim_IntList", "aten.mean.dim"])
def test_sum_and_mean_match_torch(vk_device, rng, key, shape, dims, keepdim):
    x = rng.standard_normal(shape).astype(np.float32)
    t = _f64(x)
    torch_dims = dims if dims else list(range(len(shape)))
    reference = (t.sum if key.startswith("aten.sum") else t.mean)(dim=torch_dims, keepdim=keepdim)
    got = _run_aten(vk_device, key, {"self": x}, tuple(reference.shape), dim=dims, keepdim=keepdim)
    scale = _f64(np.abs(x)).sum(dim=torch_dims, keepdim=keepdim)
    if key == "aten.mean.dim":
        scale = scale / (x.size // max(reference.numel(), 1))
    error = np.abs(got.astype(np.float64) - reference.numpy())
    assert np.all(error <= 1e-6 * scale.numpy()), f"max error / sum|x| = {np.max(error / scale.numpy()):.3g}"


@pytest.mark.parametrize("rows, columns", [(4096, 1024), (1_000_000, 1)])
def test_sums_are_compensated(vk_device, rows, columns):
    """rows copies of 0.1f (a stride-0 view: no memory) summed per column: a plain fp32 running sum
    errs by 4e-5 (4096 terms) to 1.5e-4 (15625 terms per thread); the compensated one by ~1 ulp.
    (4096, 1024) takes the serial thread-per-column path, (1e6, 1) the workgroup tree."""
    view = StridedView((rows, columns), (0, 1))
    dispatches = plan_sum("out", "x", view, [0])
    expected_strategy = STRATEGY_THREAD_PER_OUTPUT if columns > 1 else STRATEGY_GROUP_PER_OUTPUT
    assert dict(dispatches[0].spec_constants)[STRATEGY_SPEC_ID] == expected_strategy
    got = _run(vk_device, dispatches, {"x": np.full(columns, 0.1, np.float32)}, (columns,))
    exact = rows * np.float64(np.float32(0.1))
    assert np.max(np.abs(got - exact)) <= 2e-7 * exact


def test_sum_of_infinities_is_not_nan(vk_device):
    x = np.array([[1.0, np.inf, 2.0], [np.inf, -np.inf, 0.0], [np.nan, 1.0, 1.0]], np.float32)
    got = _run_aten(vk_device, "aten.sum.dim_IntList", {"self": x}, (3,), dim=[1])
    np.testing.assert_array_equal(got, np.array([np.inf, np.nan, np.nan], np.float32))


@pytest.mark.parametrize("shape, dims, keepdim", [((6, 7, 67), [-1], False), ((300, 1100), [0], True),
                                                  ((2, 3, 4, 5), [0, 2], False), ((1000,), [], False)])
def test_amax_matches_torch(vk_device, rng, shape, dims, keepdim):
    x = rng.standard_normal(shape).astype(np.float32)
    reference = torch.amax(torch.from_numpy(x), dim=dims, keepdim=keepdim)
    got = _run_aten(vk_device, "aten.amax.default", {"self": x}, tuple(reference.shape), dim=dims, keepdim=keepdim)
    np.testing.assert_array_equal(got, reference.numpy())


def test_amax_propagates_nan_and_refuses_empty(vk_device):
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, -5.0, -np.inf]], np.float32)
    got = _run_aten(vk_device, "aten.amax.default", {"self": x}, (2,), dim=[1])
    np.testing.assert_array_equal(got, np.array([np.nan, -5.0], np.float32))
    with pytest.raises(KernelArgumentError, match="reduces zero elements"):
        get_kernel("aten.amax.default")(out="o", self="x", self_shape=(3, 0), dim=[1])


def test_reduction_strategies_are_both_exercised_and_deterministic(vk_device, rng):
    x = rng.standard_normal((300, 1100)).astype(np.float32)
    view = StridedView.contiguous(x.shape)
    columns = plan_sum("out", "x", view, [0])
    rows = plan_sum("out", "x", view, [1])
    assert dict(columns[0].spec_constants)[STRATEGY_SPEC_ID] == STRATEGY_THREAD_PER_OUTPUT
    assert dict(rows[0].spec_constants)[STRATEGY_SPEC_ID] == STRATEGY_GROUP_PER_OUTPUT
    for dispatches, out_shape in ((columns, (1100,)), (rows, (300,))):
        first = _run(vk_device, dispatches, {"x": x}, out_shape)
        second = _run(vk_device, dispatches, {"x": x}, out_shape, max_group_count=7)  # split grid
        assert first.tobytes() == second.tobytes()


def test_reduction_of_a_strided_view_and_empty_reductions(vk_device, rng):
    storage = rng.standard_normal(4 * 5 * 6).astype(np.float32)
    view = StridedView.contiguous((4, 5, 6)).permute((2, 0, 1)).slice(1, 1, 4)  # [6, 3, 5]
    got = _run(vk_device, plan_sum("out", "x", view, [0, 2], mean=True), {"x": storage}, (3,))
    reference = torch.from_numpy(storage).double().reshape(4, 5, 6).permute(2, 0, 1)[:, 1:4].mean(dim=(0, 2))
    _assert_norm_close(got, reference, 1e-6)
    empty = np.zeros((3, 0), np.float32)
    got = _run_aten(vk_device, "aten.sum.dim_IntList", {"self": empty}, (3,), dim=[1])
    np.testing.assert_array_equal(got, np.zeros(3, np.float32))
    got = _run_aten(vk_device, "aten.mean.dim", {"self": empty}, (3,), dim=[1])
    assert np.isnan(got).all()
    assert reduced_shape((3, 4, 5), (0, 2), True) == (1, 4, 1)


# ----------------------------------------------------------------------------------------- GEMM
MM_SHAPES = [(1, 1, 1), (64, 64, 64), (65, 129, 33), (7, 300, 5), (130, 17, 70)]


@pytest.mark.parametrize("M, K, N", MM_SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in MM_SHAPES])
def test_mm_matches_torch_including_partial_tiles(vk_device, rng, M, K, N):
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    got = _run_aten(vk_device, "aten.mm.default", {"self": a, "mat2": b}, (M, N))
    _assert_norm_close(got, _f64(a) @ _f64(b))


def test_bmm_matches_torch(vk_device, rng):
    a = rng.standard_normal((3, 17, 40)).astype(np.float32)
    b = rng.standard_normal((3, 40, 70)).astype(np.float32)
    got = _run_aten(vk_device, "aten.bmm.default", {"self": a, "mat2": b}, (3, 17, 70))
    _assert_norm_close(got, torch.bmm(_f64(a), _f64(b)))


@pytest.mark.parametrize("bias_shape", [(70,), (1, 70), (33, 1), (33, 70), ()])
def test_addmm_broadcast_bias_alpha_beta(vk_device, rng, bias_shape):
    a = rng.standard_normal((33, 20)).astype(np.float32)
    b = rng.standard_normal((20, 70)).astype(np.float32)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    got = _run_aten(vk_device, "aten.addmm.default", {"self": bias, "mat1": a, "mat2": b}, (33, 70),
                    beta=0.5, alpha=-2.0)
    _assert_norm_close(got, torch.addmm(_f64(bias), _f64(a), _f64(b), beta=0.5, alpha=-2.0))


def test_addmm_beta_zero_ignores_nan_bias(vk_device, rng):
    a = rng.standard_normal((5, 8)).astype(np.float32)
    b = rng.standard_normal((8, 3)).astype(np.float32)
    bias = np.full((3,), np.nan, np.float32)
    got = _run_aten(vk_device, "aten.addmm.default", {"self": bias, "mat1": a, "mat2": b}, (5, 3), beta=0)
    _assert_norm_close(got, _f64(a) @ _f64(b))


def test_gemm_transposes_and_batch_broadcast_as_strides(vk_device, rng):
    """A^T and B^T stored, read through swapped strides; a 2-D B broadcast over A's batch."""
    a_stored = rng.standard_normal((4, 50, 37)).astype(np.float32)   # holds A^T per batch: [B, K, M]
    b_stored = rng.standard_normal((66, 50)).astype(np.float32)      # holds B^T: [N, K]
    a_view = StridedView.contiguous(a_stored.shape).transpose(1, 2)  # [4, 37, 50]
    b_view = StridedView.contiguous(b_stored.shape).transpose(0, 1)  # [50, 66]
    dispatches = plan_gemm("out", "a", a_view, "b", b_view, alpha=0.25)
    got = _run(vk_device, dispatches, {"a": a_stored, "b": b_stored}, (4, 37, 66))
    reference = 0.25 * _f64(a_stored).transpose(1, 2) @ _f64(b_stored).T
    _assert_norm_close(got, reference)


@pytest.mark.parametrize("input_shape, with_bias", [((2, 5, 40), True), ((70, 40), False), ((40,), True)])
def test_linear_reads_the_weight_transposed_in_place(vk_device, rng, input_shape, with_bias):
    x = rng.standard_normal(input_shape).astype(np.float32)
    weight = rng.standard_normal((66, 40)).astype(np.float32)
    tensors = {"input": x, "weight": weight}
    if with_bias:
        tensors["bias"] = rng.standard_normal(66).astype(np.float32)
    got = _run_aten(vk_device, "aten.linear.default", tensors, input_shape[:-1] + (66,))
    reference = torch.nn.functional.linear(_f64(x), _f64(weight), _f64(tensors["bias"]) if with_bias else None)
    _assert_norm_close(got, reference)


def test_baddbmm_and_split_batch_grid(vk_device, rng):
    a = rng.standard_normal((5, 9, 12)).astype(np.float32)
    b = rng.standard_normal((5, 12, 10)).astype(np.float32)
    bias = rng.standard_normal((9, 10)).astype(np.float32)
    kwargs = {"self": "bias", "self_shape": bias.shape, "batch1": "a", "batch1_shape": a.shape,
              "batch2": "b", "batch2_shape": b.shape, "beta": 2.0, "alpha": 1.0}
    dispatches = get_kernel("aten.baddbmm.default")(out="out", **kwargs)
    got = _run(vk_device, dispatches, {"a": a, "b": b, "bias": bias}, (5, 9, 10), max_group_count=2)
    _assert_norm_close(got, torch.baddbmm(_f64(bias), _f64(a), _f64(b), beta=2.0))


# ----------------------------------------------------------------------------------------- GEMM split-K
def _run_gemm(device, dispatches, arrays: dict[str, np.ndarray], out_shape, scratch_nbytes: int = 0, **options):
    """_run with a NaN-filled "scratch" buffer: every partial the reduction reads must have been written."""
    arrays = dict(arrays)
    if scratch_nbytes:
        arrays["scratch"] = np.full(scratch_nbytes // 4, np.nan, np.float32)
    return _run(device, dispatches, arrays, out_shape, **options)


def _split_of(dispatches) -> int:
    """Slices of a planned GEMM: 1 when unsplit, else the count the reduction adds."""
    if len(dispatches) == 1:
        return 1
    gemm, reduce = dispatches
    assert reduce.shader == "linear_splitk_reduce" and gemm.bindings[0].buffer == "scratch"
    assert reduce.bindings[1].buffer == "scratch" and reduce.bindings[0].buffer == "out"
    return int.from_bytes(reduce.push_constants[8:12], "little")


# ----------------------------------------------------------------------------------------- GEMM, CPU tuning
@pytest.fixture
def cpu_bodies(vk_device):
    """The device, when it can run matmul.slang's register-tile body (CPU_TUNING; lavapipe can)."""
    if not runs_cpu_bodies(vk_device):
        pytest.skip(f"{vk_device.name} cannot run the CPU bodies ({CPU_LANES}-lane subgroups, shuffles, int64)")
    return vk_device


def _cpu_rows_suffix(M: int) -> str:
    tm = cpu_tile_rows(M)
    return "" if tm == CPU_TM_CHOICES[0] else f"+CPU_TM={tm}"


# (batch, M, K, N, A stored transposed, B stored transposed, expected paired loads A_K, B_K, B_N): M, N
# around the CPU_TM x (CPU_LANES * CPU_TN) workgroup tiles (CPU_TM 16, 32, 64), K around and off the 2 * CPU_LANES steps of
# one chunk, odd K / N (no pairs), the LoRA step's rank-8 products and a head-like transposed weight.
CPU_GEMM_CASES = [
    (1, 1, 1, 1, False, False, (False, False, False)), (1, 9, 7, 3, False, False, (False, False, False)),
    (1, 17, 9, 17, True, False, (False, False, False)), (1, 64, 576, 8, False, True, (True, True, False)),
    (1, 64, 8, 576, False, True, (True, True, False)), (1, 8, 64, 576, True, False, (False, False, True)),
    (1, 576, 64, 8, True, False, (False, False, True)), (3, 33, 41, 70, True, True, (False, False, False)),
    (2, 16, 18, 16, False, False, (True, False, True)), (1, 5, 34, 70, False, True, (True, True, False)),
    (1, 63, 40, 34, False, True, (True, True, False)), (1, 65, 20, 18, True, False, (False, False, True)),
]


@pytest.mark.parametrize("batch, M, K, N, a_transposed, b_transposed, pairs", CPU_GEMM_CASES,
                         ids=[f"{b}x{m}x{k}x{n}{'-At' if at else ''}{'-Bt' if bt else ''}"
                              for b, m, k, n, at, bt, _ in CPU_GEMM_CASES])
def test_cpu_tuning_gemm_matches_torch_with_strided_operands(cpu_bodies, rng, batch, M, K, N, a_transposed,
                                                             b_transposed, pairs):
    a_stored = rng.standard_normal((batch, K, M) if a_transposed else (batch, M, K)).astype(np.float32)
    b_stored = rng.standard_normal((N, K) if b_transposed else (K, N)).astype(np.float32)  # broadcast batch
    a_view = StridedView.contiguous(a_stored.shape)
    b_view = StridedView.contiguous(b_stored.shape)
    a_view = a_view.transpose(1, 2) if a_transposed else a_view
    b_view = b_view.transpose(0, 1) if b_transposed else b_view
    dispatches = plan_gemm("out", "a", a_view, "b", b_view, alpha=-0.75, scratch="scratch", tuning=CPU_TUNING)
    a_k, b_k, b_n = pairs
    shader = "matmul@HAS_BIAS=0+CPU_REGISTER_TILES" + ("+A_PAIRS" if a_k else "") + \
        ("+B_PAIRS" if b_k or b_n else "") + _cpu_rows_suffix(M)
    assert [d.shader for d in dispatches] == [shader], "no split-K on a CPU"
    assert dispatches[0].groups == (ceil_div(N, CPU_LANES * CPU_TN), ceil_div(M, cpu_tile_rows(M)), batch)
    assert dict(dispatches[0].spec_constants) == ({B_N_PAIRS_SPEC_ID: b_n} if b_k or b_n else {})
    got = _run(cpu_bodies, dispatches, {"a": a_stored, "b": b_stored}, (batch, M, N), max_group_count=2)
    a_ref = _f64(a_stored).transpose(1, 2) if a_transposed else _f64(a_stored)
    b_ref = _f64(b_stored).T if b_transposed else _f64(b_stored)
    _assert_norm_close(got, -0.75 * a_ref @ b_ref)


@pytest.mark.parametrize("bias_shape, beta", [((70,), 0.5), ((33, 1), -1.0), ((33, 70), 2.0), ((70,), 0.0)])
def test_cpu_tuning_addmm_bias_and_beta_zero_ignoring_nan(cpu_bodies, rng, bias_shape, beta):
    a = rng.standard_normal((33, 20)).astype(np.float32)
    b = rng.standard_normal((20, 70)).astype(np.float32)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    if beta == 0.0:
        bias[:] = np.nan
    kwargs = {"self": "bias", "self_shape": bias.shape, "mat1": "a", "mat1_shape": a.shape, "mat2": "b",
              "mat2_shape": b.shape, "beta": beta, "alpha": -2.0}
    dispatches = get_kernel("aten.addmm.default")(out="out", tuning=CPU_TUNING, **kwargs)
    assert [d.shader for d in dispatches] == ["matmul@HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=32"]
    got = _run(cpu_bodies, dispatches, {"a": a, "b": b, "bias": bias}, (33, 70))
    expected = -2.0 * _f64(a) @ _f64(b) + (0.0 if beta == 0.0 else beta * _f64(bias))
    _assert_norm_close(got, expected)


def test_cpu_tuning_reads_explicit_split_k_slices_and_adds_the_bias_once(cpu_bodies, rng):
    M, K, N, split = 20, 40, 12, 4  # slices of 16: [0, 16), [16, 32), [32, 40) and an empty one
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    bias = rng.standard_normal((N,)).astype(np.float32)
    nbytes = split_k_scratch_nbytes(1, M, N, split)
    dispatches = plan_gemm("out", "a", StridedView.contiguous(a.shape), "b", StridedView.contiguous(b.shape),
                           bias="bias", bias_view=StridedView.contiguous(bias.shape), beta=1.0, scratch="scratch",
                           split_k=split, tuning=CPU_TUNING)
    assert dispatches[0].shader == "matmul@HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS"
    assert _split_of(dispatches) == split
    got = _run_gemm(cpu_bodies, dispatches, {"a": a, "b": b, "bias": bias}, (M, N), nbytes)
    _assert_norm_close(got, _f64(a) @ _f64(b) + _f64(bias))


def test_cpu_tuning_pairs_only_aligned_operands(cpu_bodies, rng):
    """An odd offset or an odd stride across the contiguous dim rules the 64-bit pair loads out."""
    storage = rng.standard_normal(1 + 2 * 24 * 30).astype(np.float32)
    odd_a = StridedView((24, 30), (30, 1), 1)    # A [24, 30] at element offset 1
    odd_b = StridedView((30, 15), (1, 31), 0)    # B^T rows 31 apart: [30, 15] read along k
    even_b = StridedView((30, 16), (16, 1), 2)   # B [30, 16] at offset 2
    assert cpu_gemm_variant(odd_a.unsqueeze(0), odd_b.unsqueeze(0), False) == \
        ("matmul@HAS_BIAS=0+CPU_REGISTER_TILES", {})
    assert cpu_gemm_variant(odd_a.unsqueeze(0), even_b.unsqueeze(0), False) == \
        ("matmul@HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS", {B_N_PAIRS_SPEC_ID: True})
    for b_view in (odd_b, even_b):
        dispatches = plan_gemm("out", "s", odd_a, "s", b_view, tuning=CPU_TUNING)
        N = b_view.sizes[1]
        got = _run(cpu_bodies, dispatches, {"s": storage}, (24, N))
        a_ref = torch.as_strided(_f64(storage), odd_a.sizes, odd_a.strides, odd_a.offset)
        b_ref = torch.as_strided(_f64(storage), b_view.sizes, b_view.strides, b_view.offset)
        _assert_norm_close(got, a_ref @ b_ref)


def test_cpu_tile_rows_are_the_largest_choice_not_above_m():
    assert [cpu_tile_rows(M) for M in (1, 15, 16, 31, 32, 63, 64, 4096)] == [16, 16, 16, 16, 32, 32, 64, 64]


def test_cpu_tuning_keeps_the_tiled_body_for_forced_tiles_and_very_long_reductions():
    a, b = StridedView.contiguous((64, 64)), StridedView.contiguous((64, 64))
    assert plan_gemm("out", "a", a, "b", b, tile=(16, 64), tuning=CPU_TUNING)[0].shader == \
        "matmul@HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C"
    long_a, long_b = StridedView.contiguous((4, CPU_MAX_K + 1)), StridedView.contiguous((CPU_MAX_K + 1, 4))
    assert plan_gemm("out", "a", long_a, "b", long_b, tuning=CPU_TUNING)[0].shader == \
        "matmul@HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C"
    assert gemm_scratch_nbytes(1, 64, 16, 4096, CPU_TUNING) == 0 < gemm_scratch_nbytes(1, 64, 16, 4096)
    assert plan_gemm("out", "a", a, "b", b) == plan_gemm("out", "a", a, "b", b, tuning="gpu")


# The LoRA products (rank 16), scaled down for lavapipe: (name, M, K, N, A stored transposed, B stored
# transposed). Transposed operands are read in place through swapped strides, as the executor does.
LORA_CASES = [
    ("x_at", 64, 1024, 16, False, True),     # x [T, K] @ A^T [K, r]: A stored [r, K]
    ("dy_b", 48, 700, 16, False, False),     # dY [T, N] @ B [N, r]; K not a multiple of 16
    ("d_b", 80, 768, 16, True, False),       # dY^T [N, T] @ h [T, r]: dY stored [T, N]
    ("d_a", 16, 1024, 96, True, False),      # (dY B)^T [r, T] @ x [T, K]: (dY B) stored [T, r]
]


@pytest.mark.parametrize("name, M, K, N, a_transposed, b_transposed", LORA_CASES, ids=[c[0] for c in LORA_CASES])
def test_split_k_skinny_lora_products_match_torch(vk_device, rng, name, M, K, N, a_transposed, b_transposed):
    a_stored = rng.standard_normal((K, M) if a_transposed else (M, K)).astype(np.float32)
    b_stored = rng.standard_normal((N, K) if b_transposed else (K, N)).astype(np.float32)
    a_view = StridedView.contiguous(a_stored.shape)
    b_view = StridedView.contiguous(b_stored.shape)
    a_view = a_view.transpose(0, 1) if a_transposed else a_view
    b_view = b_view.transpose(0, 1) if b_transposed else b_view
    nbytes = gemm_scratch_nbytes(1, M, N, K)
    # The tiles' plan (the default one on the GPU tuning is matmul_thin's: tests/test_matmul_thin.py).
    dispatches = plan_gemm("out", "a", a_view, "b", b_view, scratch="scratch", tile=default_gemm_tile(M, N))
    split = _split_of(dispatches)
    assert split == default_split_k(1, M, N, K) > 1
    assert nbytes >= split_k_scratch_nbytes(1, M, N, split) == 4 * split * M * N
    assert "TILE_M=" in dispatches[0].shader, "a skinny output takes a 16-wide tile"
    got = _run_gemm(vk_device, dispatches, {"a": a_stored, "b": b_stored}, (M, N), nbytes)
    a_ref = _f64(a_stored).T if a_transposed else _f64(a_stored)
    b_ref = _f64(b_stored).T if b_transposed else _f64(b_stored)
    _assert_norm_close(got, a_ref @ b_ref)
    # Fixed-order reduction: bitwise reproducible, also when the runtime cuts the grid differently.
    again = _run_gemm(vk_device, dispatches, {"a": a_stored, "b": b_stored}, (M, N), nbytes, max_group_count=3)
    assert got.tobytes() == again.tobytes(), "two runs must be bitwise identical"


@pytest.mark.parametrize("N", [37, 36], ids=["scalar_stores", "vec4_stores"])
@pytest.mark.parametrize("tile", [(64, 64), (64, 16), (16, 64)])
def test_every_tile_matches_torch_with_strided_operands_and_partial_tiles(vk_device, rng, tile, N):
    a_stored = rng.standard_normal((2, 45, 70)).astype(np.float32)  # holds A^T per batch: [B, K, M]
    b = rng.standard_normal((45, N)).astype(np.float32)             # broadcast over the batch
    bias = rng.standard_normal((70, 1)).astype(np.float32)
    a_view = StridedView.contiguous(a_stored.shape).transpose(1, 2)  # [2, 70, 45]
    dispatches = plan_gemm("out", "a", a_view, "b", StridedView.contiguous(b.shape), tile=tile, alpha=1.5,
                           bias="bias", bias_view=StridedView.contiguous(bias.shape), beta=-1.0)
    assert len(dispatches) == 1 and dispatches[0].groups == (ceil_div(N, tile[1]), ceil_div(70, tile[0]), 2)
    assert dispatches[0].shader.endswith("+VEC4_C") == (N % 4 == 0)
    got = _run(vk_device, dispatches, {"a": a_stored, "b": b, "bias": bias}, (2, 70, N))
    _assert_norm_close(got, 1.5 * _f64(a_stored).transpose(1, 2) @ _f64(b) - _f64(bias))


@pytest.mark.parametrize("bias_shape", [(16,), (40, 1), (40, 16)])
def test_split_k_addmm_adds_the_bias_once_and_an_empty_slice_adds_zero(vk_device, rng, bias_shape):
    M, K, N, split = 40, 40, 16, 4  # slices of 16: [0, 16), [16, 32), [32, 40) and an empty [48, 40)
    assert split * slice_length(K, split) >= K + 16
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    kwargs = {"self": "bias", "self_shape": bias.shape, "mat1": "a", "mat1_shape": a.shape, "mat2": "b",
              "mat2_shape": b.shape, "beta": 0.5, "alpha": -2.0}
    dispatches = get_kernel("aten.addmm.default")(out="out", scratch="scratch", **kwargs)
    assert _split_of(dispatches) == 1, "K=40 is too short for the default plan to split"
    dispatches = plan_gemm("out", "a", StridedView.contiguous(a.shape), "b", StridedView.contiguous(b.shape),
                           bias="bias", bias_view=StridedView.contiguous(bias.shape), alpha=-2.0, beta=0.5,
                           scratch="scratch", split_k=split)
    assert _split_of(dispatches) == split
    got = _run_gemm(vk_device, dispatches, {"a": a, "b": b, "bias": bias}, (M, N),
                    split_k_scratch_nbytes(1, M, N, split))
    _assert_norm_close(got, torch.addmm(_f64(bias), _f64(a), _f64(b), beta=0.5, alpha=-2.0))


def test_split_k_of_an_empty_reduction_is_beta_times_bias(vk_device, rng):
    bias = rng.standard_normal((12,)).astype(np.float32)
    dispatches = plan_gemm("out", "a", StridedView.contiguous((8, 0)), "b", StridedView.contiguous((0, 12)),
                           bias="bias", bias_view=StridedView.contiguous(bias.shape), beta=3.0,
                           scratch="scratch", split_k=3)
    got = _run_gemm(vk_device, dispatches, {"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32),
                                            "bias": bias}, (8, 12), split_k_scratch_nbytes(1, 8, 12, 3))
    np.testing.assert_array_equal(got, np.broadcast_to(np.float32(3.0) * bias, (8, 12)))
    assert plan_gemm("out", "a", StridedView.contiguous((0, 64)), "b", StridedView.contiguous((64, 16)),
                     scratch="scratch", split_k=4) == []


def test_split_k_bmm_with_a_grid_cut_along_z(vk_device, rng):
    """z = slice * batch + b: with max_group_count=4 the runtime records the 15 z-groups in chunks."""
    a = rng.standard_normal((3, 20, 640)).astype(np.float32)
    b = rng.standard_normal((3, 640, 12)).astype(np.float32)
    nbytes = gemm_scratch_nbytes(3, 20, 12, 640)
    dispatches = get_kernel("aten.bmm.default")(out="out", self="a", self_shape=a.shape, mat2="b",
                                                mat2_shape=b.shape, scratch="scratch")
    split = _split_of(dispatches)
    assert split == 5 and dispatches[0].groups == (1, 1, split * 3)
    got = _run_gemm(vk_device, dispatches, {"a": a, "b": b}, (3, 20, 12), nbytes, max_group_count=4)
    _assert_norm_close(got, torch.bmm(_f64(a), _f64(b)))
    again = _run_gemm(vk_device, dispatches, {"a": a, "b": b}, (3, 20, 12), nbytes)
    assert got.tobytes() == again.tobytes()


def _lora_workgroups(M, K, N, split_allowed):
    tile = default_gemm_tile(M, N)
    split = default_split_k(1, M, N, K) if split_allowed else 1
    return ceil_div(M, tile[0]) * ceil_div(N, tile[1]) * split, tile, split


@pytest.mark.parametrize("T, K, N", [(2048, 2048, 2048), (2048, 2048, 8192), (128, 2048, 2048)])
def test_split_k_plans_enough_workgroups_for_the_llama_lora_shapes(T, K, N):
    """Host-side planning at real sizes (no device): every skinny LoRA product takes a 16-wide tile and
    splits until TARGET_THREADS threads run or a cap (MAX_SPLIT_K, slices >= MIN_SPLIT_SLICE) stops
    it, with no empty slice; at 2048 tokens that is >= 512 workgroups (4 per SM of a 132-SM GPU,
    32 before). The output-large ones (reduction r = 16) never split."""
    r = 16
    skinny = {"x @ A^T": (T, K, r), "dY @ B": (T, N, r), "dY^T @ h": (N, T, r), "(dY B)^T @ x": (r, T, K)}
    for name, (m, k, n) in skinny.items():
        workgroups, tile, split = _lora_workgroups(m, k, n, True)
        assert 16 in tile, name
        assert 1 <= split <= MAX_SPLIT_K and (split == 1 or slice_length(k, split) >= MIN_SPLIT_SLICE), name
        assert split * slice_length(k, split) - k < slice_length(k, split), f"{name}: an empty slice"
        # Enough threads for a large GPU, unless a cap on the slice count stopped the split.
        threads = workgroups * (tile[0] // 4) * (tile[1] // 4)
        assert threads >= TARGET_THREADS or split in (MAX_SPLIT_K, max(1, k // MIN_SPLIT_SLICE)), name
        if T >= 2048:
            assert workgroups >= 512, (name, workgroups)
    for m, k, n in ((T, r, N), (T, r, K)):  # h @ B^T, (dY B) @ A
        assert default_split_k(1, m, n, k) == 1 and default_gemm_tile(m, n) == (64, 64)
        assert gemm_scratch_nbytes(1, m, n, k) == 0


def test_split_k_is_not_planned_where_it_cannot_help_or_apply():
    assert default_split_k(1, 4096, 4096, 4096) == 1          # enough tiles already
    assert default_split_k(1, 64, 16, 200) == 1               # reduction shorter than 2 slices
    assert default_split_k(1, 63, 15, 4096) == 1              # 945 outputs: the vec4 reduction needs 4k
    assert default_split_k(1, 64, 16, 4096) == MAX_SPLIT_K
    a, b = StridedView.contiguous((64, 4096)), StridedView.contiguous((4096, 16))
    assert len(plan_gemm("out", "a", a, "b", b)) == 1, "no scratch: no split"
    with pytest.raises(KernelArgumentError, match=r"split_k=4 needs a scratch buffer of .* = 16384 bytes"):
        plan_gemm("out", "a", a, "b", b, split_k=4)
    with pytest.raises(KernelArgumentError, match=r"multiple of 4 elements"):
        plan_gemm("out", "a", StridedView.contiguous((3, 64)), "b", StridedView.contiguous((64, 3)),
                  scratch="s", split_k=2)
    with pytest.raises(KernelArgumentError, match=r"tile must be one of"):
        plan_gemm("out", "a", a, "b", b, tile=(32, 32))
    with pytest.raises(KernelArgumentError, match=r"split_k must be an int >= 1, got 0"):
        plan_gemm("out", "a", a, "b", b, scratch="s", split_k=0)


def _lowering_context(op_name: str, args: list, out_shape, scratch_log: list):
    from vktrain.backend.kernel_planning.op_lowering import OpContext
    from vktrain.serialization.dispatch import BufferBinding
    from vktrain.serialization import graph as vk

    def scratch(nbytes, purpose):
        scratch_log.append((nbytes, purpose))
        return BufferBinding(f"scratch.{purpose}", 0, nbytes)

    out = TensorArg(99, BufferBinding("out", 0, 4 * math.prod(out_shape)), tuple(out_shape), "float32")
    op = vk.OpCall(op_name, tuple(range(len(args))), (99,))
    return OpContext(0, op, args, [out], f"0:{op_name}", scratch)


def _tensor_arg(value_id, key, shape, view=None):
    from vktrain.serialization.dispatch import BufferBinding
    return TensorArg(value_id, BufferBinding(key, 0, 4 * math.prod(shape)), tuple(shape), "float32", view=view)


def test_executor_lowerings_allocate_split_k_scratch_only_when_splitting():
    from vktrain.backend.kernel_planning.op_lowering import OP_LOWERINGS

    log: list = []
    # mm of a lazily transposed A (the executor's view of t_copy(A)): x [64, 1024] @ A^T [1024, 16].
    a_t = StridedView.contiguous((16, 1024)).transpose(0, 1)
    args = [_tensor_arg(0, "x", (64, 1024)), _tensor_arg(1, "lora_a", (1024, 16), view=a_t)]
    dispatches = OP_LOWERINGS["aten.mm.default"].lower(_lowering_context("aten.mm.default", args, (64, 16), log))
    assert log == [(gemm_scratch_nbytes(1, 64, 16, 1024), "split_k")]
    assert [d.shader for d in dispatches] == ["matmul@HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C", "linear_splitk_reduce"]
    assert dispatches[0].bindings[0].buffer == "scratch.split_k" and dispatches[1].bindings[0].buffer == "out"

    log.clear()
    args = [_tensor_arg(0, "a", (2, 20, 640)), _tensor_arg(1, "b", (2, 640, 12))]
    dispatches = OP_LOWERINGS["aten.bmm.default"].lower(_lowering_context("aten.bmm.default", args, (2, 20, 12), log))
    assert log == [(gemm_scratch_nbytes(2, 20, 12, 640), "split_k")] and len(dispatches) == 2

    log.clear()
    args = [_tensor_arg(0, "bias", (16,)), _tensor_arg(1, "a", (64, 2048)), _tensor_arg(2, "b", (2048, 16)), 1.0, 1.0]
    dispatches = OP_LOWERINGS["aten.addmm.default"].lower(_lowering_context("aten.addmm.default", args, (64, 16), log))
    assert log == [(gemm_scratch_nbytes(1, 64, 16, 2048), "split_k")]
    assert dispatches[0].shader == "matmul@HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C" and len(dispatches) == 2

    log.clear()  # a large output over a short reduction: no split, no scratch
    args = [_tensor_arg(0, "h", (256, 16)), _tensor_arg(1, "b_t", (16, 512))]
    dispatches = OP_LOWERINGS["aten.mm.default"].lower(_lowering_context("aten.mm.default", args, (256, 512), log))
    # No device limits in this context: the Vulkan-guaranteed 128 invocations, so the 64 x 64 tile's 128-thread
    # replacement (kernels/matmul.py NARROW_TILES).
    assert log == [] and [d.shader for d in dispatches] == ["matmul@HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C"]


# ----------------------------------------------------------------------------------------- embedding
def test_embedding_forward_gathers_rows(vk_device, rng):
    weight = rng.standard_normal((11, 70)).astype(np.float32)
    indices = rng.integers(0, 11, size=(3, 5)).astype(np.int64)
    got = _run_aten(vk_device, "aten.embedding.default", {"weight": weight, "indices": indices.astype(np.int32)},
                    (3, 5, 70), indices_dtype="int64")
    np.testing.assert_array_equal(got, torch.nn.functional.embedding(torch.from_numpy(indices),
                                                                     torch.from_numpy(weight)).numpy())


def test_embedding_forward_out_of_range_index_gives_nan_row(vk_device, rng):
    weight = rng.standard_normal((4, 6)).astype(np.float32)
    indices = np.array([1, 4, -1, 3], dtype=np.int32)
    got = _run_aten(vk_device, "aten.embedding.default", {"weight": weight, "indices": indices}, (4, 6))
    np.testing.assert_array_equal(got[[0, 3]], weight[[1, 3]])
    assert np.isnan(got[[1, 2]]).all()


@pytest.mark.parametrize("padding_idx, scale_grad_by_freq", [(-1, False), (3, False), (-1, True), (0, True)])
def test_embedding_dense_backward_repeated_indices(vk_device, rng, padding_idx, scale_grad_by_freq):
    num_weights, dim = 13, 70                       # dim > 64: threads own several columns
    indices = rng.integers(0, num_weights - 3, size=(3, 50)).astype(np.int64)  # 150 > 64: several chunks
    indices[0, :8] = 5                              # a heavily repeated row
    indices[1, :3] = 3                              # the padding row (when padding_idx == 3)
    grad = rng.standard_normal((3, 50, dim)).astype(np.float32)
    args = dict(num_weights=num_weights, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    tensors = {"grad_output": grad, "indices": indices.astype(np.int32)}
    got = _run_aten(vk_device, "aten.embedding_dense_backward.default", tensors, (num_weights, dim),
                    indices_dtype="int64", **args)
    reference = torch.ops.aten.embedding_dense_backward(_f64(grad), torch.from_numpy(indices), **args)
    _assert_elementwise_close(got, reference, rtol=1e-5, atol=1e-6)
    assert not got[num_weights - 3:].any(), "rows never indexed must be exactly zero"
    again = _run_aten(vk_device, "aten.embedding_dense_backward.default", tensors, (num_weights, dim),
                      indices_dtype="int64", **args)
    assert got.tobytes() == again.tobytes(), "two runs must be bitwise identical"


def test_embedding_dense_backward_sums_in_index_order_and_splits(vk_device, rng):
    """Bitwise equal to a float32 sequential sum in position order, also with a split grid."""
    num_weights, dim = 70, 300                        # 70 rows > max_group_count=16: split; 2 column blocks
    indices = rng.integers(0, 4, size=200).astype(np.int32)
    grad = (rng.standard_normal((200, dim)) * 1e3).astype(np.float32)
    expected = np.zeros((num_weights, dim), np.float32)
    for position, row in enumerate(indices):
        expected[row] += grad[position]               # float32 adds in increasing position
    dispatches = plan_embedding_dense_backward("out", "grad", grad.shape, "indices", indices.shape, num_weights)
    got = _run(vk_device, dispatches, {"grad": grad, "indices": indices}, (num_weights, dim), max_group_count=16)
    np.testing.assert_array_equal(got, expected)


def test_long_loops_are_not_truncated(vk_device):
    """lavapipe silently ends an invocation after 65535 loop trips; the kernels unroll so that long
    reductions (GEMM K, reduction length, index scans) stay far below that. Stride-0 views make the
    long operands free: every element is 1 (or index 0)."""
    ones = np.ones(4, np.float32)
    k = 200_000  # a 16-deep K tile per trip: 12500 trips (not unrolled: ~9 trips per tile)
    dispatches = plan_gemm("out", "a", StridedView((1, k), (0, 0)), "b", StridedView((k, 1), (0, 0)))
    assert _run(vk_device, dispatches, {"a": ones, "b": ones}, (1, 1))[0, 0] == k
    n = 3_000_000  # 64 threads x 8 elements per trip: 5860 trips
    dispatches = plan_sum("out", "x", StridedView((n,), (0,)), [0])
    assert _run(vk_device, dispatches, {"x": ones}, (1,))[0] == n
    count = 70_000  # 16 staged indices per trip: 4375 trips
    dispatches = plan_embedding_dense_backward("out", "grad", (count, 1), "indices", (count,), 2)
    arrays = {"grad": np.ones(count, np.float32), "indices": np.zeros(count, np.int32)}
    got = _run(vk_device, dispatches, arrays, (2, 1))
    np.testing.assert_array_equal(got, [[count], [0.0]])


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("key, kwargs, message", [
    ("aten.add.Tensor", {"self": "a", "self_shape": (3,), "other": "b", "other_shape": (4,)},
     r"do not broadcast: size 3 vs 4"),
    ("aten.mul.Tensor", {"self": "a", "self_shape": (3,), "self_dtype": "int32", "other": "b", "other_shape": (3,)},
     r"self has dtype int32; this kernel supports float32"),
    ("aten.mul.Tensor", {"self": "a", "self_shape": (3,), "other": "b", "other_shape": (3,), "alpha": 2},
     r"takes no alpha"),
    ("aten.gelu.default", {"self": "a", "self_shape": (3,), "approximate": "sigmoid"},
     r"approximate='sigmoid' is not supported"),
    ("aten.mm.default", {"self": "a", "self_shape": (3, 4), "mat2": "b", "mat2_shape": (5, 6)},
     r"inner dims differ: A \(3, 4\) has K=4 but B \(5, 6\) has K=5"),
    ("aten.mm.default", {"self": "a", "self_shape": (2, 3, 4), "mat2": "b", "mat2_shape": (4, 6)},
     r"self must have rank 2"),
    ("aten.bmm.default", {"self": "a", "self_shape": (2, 3, 4), "mat2": "b", "mat2_shape": (3, 4, 6)},
     r"batch sizes differ"),
    ("aten.addmm.default", {"self": "c", "self_shape": (5,), "mat1": "a", "mat1_shape": (3, 4),
                            "mat2": "b", "mat2_shape": (4, 6)}, r"bias of sizes \(5,\) does not broadcast"),
    ("aten.t_copy.default", {"self": "a", "self_shape": (2, 3, 4)}, r"rank <= 2"),
    ("aten.permute_copy.default", {"self": "a", "self_shape": (2, 3), "dims": [0, 2]}, r"out of range"),
    ("aten.view_copy.default", {"self": "a", "self_shape": (2, 3), "size": [4, -1]}, r"invalid for a tensor of 6"),
    ("aten.sum.dim_IntList", {"self": "a", "self_shape": (2, 3), "dim": [1, -1]}, r"more than once"),
    ("aten.sum.dim_IntList", {"self": "a", "self_shape": (2, 3), "dim": [0], "self_dtype": "int64"},
     r"dtype int64"),
    ("aten.embedding.default", {"weight": "w", "weight_shape": (4, 3, 2), "indices": "i", "indices_shape": (5,)},
     r"weight must be 2-D"),
    ("aten.embedding.default", {"weight": "w", "weight_shape": (4, 3), "indices": "i", "indices_shape": (5,),
                                "indices_dtype": "float32"}, r"indices has dtype float32"),
    ("aten.embedding_dense_backward.default",
     {"grad_output": "g", "grad_output_shape": (5, 4), "indices": "i", "indices_shape": (6,), "num_weights": 3,
      "padding_idx": -1, "scale_grad_by_freq": False}, r"must be indices shape \(6,\) \+ \[dim\]"),
])
def test_unsupported_inputs_are_refused_with_a_reason(key, kwargs, message):
    with pytest.raises(KernelArgumentError, match=message):
        get_kernel(key)(out="out", **kwargs)


def test_strided_copy_rank_limit_is_explained():
    # 7 dims that cannot merge (every other dim transposed) exceed copy.slang's 6.
    view = StridedView.contiguous((2,) * 8).permute((1, 0, 3, 2, 5, 4, 7, 6))
    with pytest.raises(KernelArgumentError, match="copy.slang supports at most 6"):
        plan_strided_copy("out", "x", view)


def test_empty_tensors_plan_no_dispatch():
    assert get_kernel("aten.relu.default")(out="o", self="x", self_shape=(0, 5)) == []
    assert get_kernel("aten.mm.default")(out="o", self="a", self_shape=(0, 4), mat2="b", mat2_shape=(4, 3)) == []
    assert get_kernel("aten.permute_copy.default")(out="o", self="x", self_shape=(2, 0), dims=[1, 0]) == []

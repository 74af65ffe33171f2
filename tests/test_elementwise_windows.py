"""Elementwise ops over bindings larger than the device allows (kernels/elementwise_windows.py, README
"Picking a runtime": storage bindings over the max binding size).

* Geometry: `operand_span` is the exact [min, max] element an operand's strided read touches over a window of
  the flat output index space (against a numpy enumeration, transposed and broadcast strides included); the
  plan's windows cover every output element once, start at aligned binding offsets, and every binding fits.
* Kernels on lavapipe under a 4 KiB limit, Vulkan and WebGPU: windowed unary / binary ops with broadcasting
  (a bias row, a column, a scalar tensor), odd sizes, an output at an unaligned offset, equal the unsplit
  kernel bit for bit and the numpy result where fp32 arithmetic is exact (add, mul, neg).
* Copies and fills (clone, a strided slice of wide rows, select, expand, _to_copy, cat, full) split the same way and
  equal the unsplit copy and numpy bit for bit.
* An input that no window of the output can bind within the limit (a transposed read) is refused naming it.
* The untied-LoRA-head tiny-llama's eval method under a 1 MiB limit equals the unsplit eval exactly, on Vulkan and
  WebGPU; Llama-3.2-1B's eval logits add (4 x 512 x 128256) plans into 8 windows under 128 MiB.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.serialization.dispatch import BufferBinding
from vktrain.backend.kernel_planning.kernels.elementwise import plan_binary, plan_unary
from vktrain.backend.kernel_planning.kernels.elementwise_windows import element_windows, operand_span
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit
from vktrain.serialization.strided_view import KernelArgumentError, StridedView
from vktrain.backend.kernel_planning import plan_schedule

LIMIT = BindingLimit(4096, 256)  # 1024 floats per binding: the shapes below split into several windows


def test_operand_span_is_the_exact_range_of_a_strided_read():
    rng = np.random.default_rng(0)
    for sizes in [(7,), (3, 5), (4, 1, 6), (2, 3, 4, 5)]:
        numel = int(np.prod(sizes))
        coords = np.array(list(itertools.product(*(range(s) for s in sizes))))  # row-major order
        for _ in range(20):
            strides = tuple(int(s) for s in rng.integers(0, 12, len(sizes)))
            offset = int(rng.integers(0, 5))
            index = offset + coords @ np.array(strides)
            for _ in range(10):
                begin = int(rng.integers(0, numel))
                end = int(rng.integers(begin + 1, numel + 1))
                window = index[begin:end]
                assert operand_span(sizes, strides, offset, begin, end) == (window.min(), window.max() + 1), \
                    (sizes, strides, offset, begin, end)


def test_windows_cover_every_element_once_aligned_and_within_the_limit():
    out_shape = (37, 101)
    bias = StridedView.contiguous((101,))
    plan = plan_binary("add", "out", "a", StridedView.contiguous(out_shape), "bias", bias, binding_limit=LIMIT)
    windows = element_windows(37 * 101, LIMIT)
    assert len(plan) == len(windows) > 3
    assert [w[0] for w in windows] == sorted({w[0] for w in windows}) and windows[0][0] == 0
    assert all(end == next_begin for (_, end), (next_begin, _) in zip(windows, windows[1:]))
    assert windows[-1][1] == 37 * 101
    covered = np.zeros(37 * 101, int)
    for dispatch, (begin, end) in zip(plan, windows):
        out, a, b = dispatch.bindings
        for bound in dispatch.bindings:
            assert bound.offset % LIMIT.alignment == 0 and bound.size <= LIMIT.max_bytes
        assert (out.offset, out.size) == (4 * begin, 4 * (end - begin))  # the output exactly at the window
        assert (a.offset, a.offset + a.size) == (4 * begin, 4 * end)  # same shape: the same element window
        assert b.size <= 4 * 101  # the bias: at most all of its row, once
        covered[begin:end] += 1
    assert (covered == 1).all()
    scalar = plan_binary("mul", "out", "a", StridedView.contiguous(out_shape), "s", StridedView.contiguous(()),
                         binding_limit=LIMIT)
    assert all(d.bindings[2].size == 4 for d in scalar)  # a scalar tensor: its one element each window


def test_an_input_no_window_can_bind_is_refused_naming_it():
    transposed = StridedView.contiguous((64, 48)).transpose(0, 1)  # [48, 64] read column-wise
    # Output (row, col) reads element col * 48 + row; the narrowest window (one alignment, 64 elements) is one
    # output row, whose 64 elements 48 apart still span 12 KiB.
    last = 63 * 48
    with pytest.raises(KernelArgumentError, match=rf"my_add: input a \(elements 0\.\.{last} .*max storage binding"):
        plan_binary("add", "out", "a", transposed, "b", StridedView.contiguous((48, 64)), binding_limit=LIMIT,
                    label="my_add")


# (op, a shape, b shape or None): odd sizes, bias rows, columns, scalars, shapes of a multiple of 4 (VEC4 windows).
CASES = [
    ("add", (37, 101), (101,)),
    ("mul", (37, 101), (37, 1)),
    ("mul", (3, 41, 29), ()),
    ("sub", (64, 100), (64, 100)),
    ("add", (4099,), (4099,)),
    ("div", (5, 1, 303), (7, 1)),
    ("neg", (37, 101), None),
    ("gelu", (3, 41, 29), None),
    ("exp", (64, 96), None),
]
OUT_OFFSET = 12  # bytes: the output a BufferBinding at an unaligned offset of its buffer


def _plan(op, a_shape, b_shape, out, binding_limit):
    a_view = StridedView.contiguous(a_shape)
    if b_shape is None:
        return plan_unary(op, out, "a", a_view, binding_limit=binding_limit), a_shape
    b_view = StridedView.contiguous(b_shape)
    return plan_binary(op, out, "a", a_view, "b", b_view, scalar0=1.0, binding_limit=binding_limit), \
        np.broadcast_shapes(a_shape, b_shape)


def _run(device, dispatches, arrays, out_elements):
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(a)) for name, a in arrays.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_elements + OUT_OFFSET // 4 + 3, np.nan, np.float32))
    try:
        run_dispatches(device, dispatches, buffers)
        return buffers["out"].read(np.float32, (out_elements + OUT_OFFSET // 4 + 3,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _check_cases(device):
    rng = np.random.default_rng(3)
    exact = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative}
    for op, a_shape, b_shape in CASES:
        arrays = {"a": rng.standard_normal(a_shape).astype(np.float32)}
        if b_shape is not None:
            arrays["b"] = (rng.standard_normal(b_shape) + 3.0).astype(np.float32)
        whole, out_shape = _plan(op, a_shape, b_shape, "out", None)
        numel = int(np.prod(out_shape))
        reference = _run(device, whole, arrays, numel)[:numel]
        assert len(whole) == 1
        for out in ("out", BufferBinding("out", OUT_OFFSET)):
            windowed, _ = _plan(op, a_shape, b_shape, out, LIMIT)
            assert len(windowed) > 1, (op, a_shape)
            first = 0 if out == "out" else OUT_OFFSET // 4
            result = _run(device, windowed, arrays, numel)
            np.testing.assert_array_equal(result[first:first + numel], reference,
                                          err_msg=f"{op} {a_shape} {b_shape} out={out}")
            assert np.isnan(result[:first]).all() and np.isnan(result[first + numel:]).all()  # nothing outside
        if op in exact:
            np.testing.assert_array_equal(reference, exact[op](*arrays.values()).reshape(-1))


def test_windowed_ops_equal_the_unsplit_kernel_on_vulkan(vk_device):
    _check_cases(vk_device)


def test_windowed_ops_equal_the_unsplit_kernel_on_webgpu(webgpu_device):
    _check_cases(webgpu_device)


def test_llama_1b_eval_logits_add_plans_within_a_browsers_128_mib():
    """The issue's shapes: the eval graph's LoRA add over 4 x 512 tokens of a 128,256 vocabulary (1 GB of logits)
    plans into windows of whole bindings under 128 MiB (no device)."""
    limit = BindingLimit(128 << 20, 256)
    logits = StridedView.contiguous((4, 512, 128256))
    plan = plan_binary("add", "out", "logits", logits, "lora", logits, scalar0=1.0, binding_limit=limit)
    nbytes = 4 * logits.numel
    assert len(plan) == -(-nbytes // (limit.max_bytes - limit.alignment)) == 8
    assert all(b.size <= limit.max_bytes for d in plan for b in d.bindings)
    assert all(d.shader == "elementwise@ARITY=2+VEC4" for d in plan)  # aligned windows keep the vec4 body


# Copies and fills (kernels/copies.py): (op key, keyword arguments, input shape and dtype or None).
COPY_CASES = [
    ("aten.clone.default", {}, ((37, 101), "float32")),
    ("aten.slice_copy.Tensor", {"dim": 1, "start": 3, "end": 100, "step": 2}, ((37, 203), "float32")),
    ("aten.select_copy.int", {"dim": 1, "index": 5}, ((1300, 7), "float32")),
    ("aten.expand_copy.default", {"size": [37, 101]}, ((1, 101), "float32")),
    ("aten._to_copy.default", {"dtype": "float32"}, ((4099,), "int32")),
    ("aten.full.default", {"size": [37, 101], "fill_value": 1.5}, None),
]


def _copy_plan(key, kwargs, source, binding_limit):
    from vktrain.backend.kernel_planning.kernels import KERNELS

    if source is not None:
        kwargs = dict(kwargs, self="a", self_shape=source[0], self_dtype=source[1])
    return KERNELS[key](out="out", **kwargs, binding_limit=binding_limit, label=key)


def _check_copies(device):
    rng = np.random.default_rng(5)
    expected_of = {"aten.clone.default": lambda a: a, "aten.slice_copy.Tensor": lambda a: a[:, 3:100:2],
                   "aten.select_copy.int": lambda a: a[:, 5],
                   "aten.expand_copy.default": lambda a: np.broadcast_to(a, (37, 101)),
                   "aten._to_copy.default": lambda a: a.astype(np.float32),
                   "aten.full.default": lambda a: np.full((37, 101), 1.5, np.float32)}
    for key, kwargs, source in COPY_CASES:
        arrays = {}
        if source is not None:
            shape, dtype = source
            arrays["a"] = rng.integers(-1000, 1000, shape).astype(dtype) if dtype == "int32" else \
                rng.standard_normal(shape).astype(dtype)
        expected = np.ascontiguousarray(expected_of[key](arrays.get("a"))).reshape(-1)
        whole = _copy_plan(key, kwargs, source, None)
        windowed = _copy_plan(key, kwargs, source, LIMIT)
        assert len(whole) == 1 and len(windowed) > 1, key
        for dispatch in windowed:
            assert all(b.size <= LIMIT.max_bytes and b.offset % LIMIT.alignment == 0 for b in dispatch.bindings)
        reference = _run(device, whole, arrays, expected.size)[:expected.size]
        result = _run(device, windowed, arrays, expected.size)
        np.testing.assert_array_equal(result[:expected.size], reference, err_msg=key)
        assert np.isnan(result[expected.size:]).all()
        np.testing.assert_array_equal(reference, expected)


def test_windowed_copies_equal_the_unsplit_copy_on_vulkan(vk_device):
    _check_copies(vk_device)


def test_windowed_copies_equal_the_unsplit_copy_on_webgpu(webgpu_device):
    _check_copies(webgpu_device)


def _check_cat(device):
    from vktrain.backend.kernel_planning.kernels import KERNELS

    rng = np.random.default_rng(6)
    arrays = {"x": rng.standard_normal((37, 61)).astype(np.float32),
              "y": rng.standard_normal((37, 40)).astype(np.float32)}
    expected = np.concatenate([arrays["x"], arrays["y"]], axis=1).reshape(-1)
    plans = [KERNELS["aten.cat.default"](out="out", tensors=["x", "y"], tensors_shapes=[(37, 61), (37, 40)], dim=1,
                                         binding_limit=limit) for limit in (None, LIMIT)]
    assert len(plans[0]) == 2 and len(plans[1]) > 2
    for plan in plans:
        np.testing.assert_array_equal(_run(device, plan, arrays, expected.size)[:expected.size], expected)


def test_windowed_cat_writes_each_slab_on_vulkan(vk_device):
    _check_cat(vk_device)


def test_windowed_cat_writes_each_slab_on_webgpu(webgpu_device):
    _check_cat(webgpu_device)


def test_a_transpose_over_the_limit_is_refused_naming_its_input():
    from vktrain.backend.kernel_planning.kernels import KERNELS

    with pytest.raises(KernelArgumentError, match=r"aten.permute_copy.default: the input \(elements .*max storage"):
        KERNELS["aten.permute_copy.default"](out="out", self="a", self_shape=(64, 48), dims=[1, 0], binding_limit=LIMIT,
                                             label="aten.permute_copy.default")


MIB = 1 << 20


@pytest.fixture(scope="module")
def untied_head_program(tmp_path_factory):
    """A 1-layer tiny-llama with an untied q4gsw head [20480, 128] carrying LoRA: its eval method adds the
    head's LoRA output to the logits [2, 32, 20480] (5 MiB) with an aten.add the training step fuses away."""
    torch = pytest.importorskip("torch")
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-llama", n_layers=1, vocab_size=20480, tie_embeddings=False)
    report = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj,lm_head", group_size=32, seed=0))
    assert "lm_head" in report.replaced
    step, evaluation = export_training_and_eval_steps(model, (2, 32))
    path = tmp_path_factory.mktemp("pte") / "untied_head_eval.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


def _evaluate(path, device, max_binding_bytes):
    from vktrain.runtime.program.runner import TrainingRunner

    rng = np.random.default_rng(7)
    token_ids = rng.integers(0, 20480, (2, 32))
    labels = np.roll(token_ids, -1, axis=1)
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, max_binding_bytes=max_binding_bytes) as runner:
        result = runner.evaluate(token_ids, labels)
        return result, list(runner._eval.executor.dispatches)


def _check_untied_head_eval(device, path):
    (loss, count), dispatches = _evaluate(path, device, MIB)
    (whole_loss, whole_count), whole_dispatches = _evaluate(path, device, None)
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            assert bound.size <= MIB, (dispatch.name, bound)
    assert any(d.shader.startswith("elementwise") and ".window" in d.name for d in dispatches)
    assert not any(".window" in d.name for d in whole_dispatches)
    assert (loss, count) == (whole_loss, whole_count) and count == 64 and np.isfinite(loss)


def test_untied_lora_head_eval_splits_on_vulkan(vk_device, untied_head_program):
    _check_untied_head_eval(vk_device, untied_head_program)


def test_untied_lora_head_eval_splits_on_webgpu(webgpu_device, untied_head_program):
    _check_untied_head_eval(webgpu_device, untied_head_program)

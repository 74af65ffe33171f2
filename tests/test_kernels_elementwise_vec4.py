"""elementwise.slang's VEC4 variants (kernels/elementwise.py): same-shape contiguous operands read and
written as vec4s, VEC4_ELEMENTS_PER_GROUP elements per workgroup.

The variant must give exactly the general variant's bits (the same per-element functions, only the
addressing differs): checked against the general shader run on the same push constants, for binary
ops (add with alpha, mul, div, maximum with NaN, an activation backward) and unary ones, on lengths
that end inside a workgroup and inside a thread's vec4s, with operand offsets, on the grid the runtime
splits, and on the WebGPU runtime's WGSL kernel too. Which operands take it is checked on the plans.
Its speed is measured by scripts/bench_kernels.py --kernels elementwise (bench/README.md), not here:
lavapipe's memory bandwidth says nothing about a GPU's.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.backend.kernel_planning.kernels.elementwise import VEC4_ELEMENTS_PER_GROUP, plan_binary, plan_unary
from vktrain.serialization.strided_view import StridedView
from vktrain.backend.kernel_planning.kernels.layout import elementwise_groups
from vktrain.serialization.dispatch import ceil_div

VEC4_BINARY, VEC4_UNARY = "elementwise@ARITY=2+VEC4", "elementwise@ARITY=1+VEC4"


def _as_general(dispatch, numel):
    """The same dispatch on the general variant (its push constants already describe the operands)."""
    return replace(dispatch, shader=dispatch.shader.removesuffix("+VEC4"), groups=elementwise_groups(numel),
                   local_size=None)


def _run(device, dispatches, arrays, numel, **options):
    buffers = {name: Buffer.from_array(device, a) for name, a in arrays.items()}
    buffers["out"] = Buffer.from_array(device, np.full(numel, np.nan, np.float32))
    try:
        run_dispatches(device, dispatches, buffers, **options)
        return buffers["out"].read(np.float32, (numel,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def test_same_shape_contiguous_operands_take_the_vec4_variant():
    contiguous = StridedView.contiguous((8, 1025 * 4))
    (d,) = plan_binary("add", "out", "a", contiguous, "b", contiguous, scalar0=1.0)
    assert d.shader == VEC4_BINARY and d.groups == (ceil_div(8 * 1025 * 4, VEC4_ELEMENTS_PER_GROUP), 1, 1) == (9, 1, 1)
    assert plan_unary("exp", "out", "a", StridedView.contiguous((4, 4), offset=8))[0].shader == VEC4_UNARY
    general = [
        ("broadcast", contiguous, StridedView.contiguous((1025 * 4,))),
        ("offset not a multiple of 4", StridedView.contiguous((8, 1025 * 4), offset=2), contiguous),
        ("numel not a multiple of 4", StridedView.contiguous((3, 5)), StridedView.contiguous((3, 5))),
        ("transposed", StridedView.contiguous((1025 * 4, 8)).transpose(0, 1), contiguous),
    ]
    for what, a, b in general:
        assert plan_binary("mul", "out", "a", a, "b", b)[0].shader == "elementwise@ARITY=2", what


BINARY_CASES = [("add", 1.0, 0.0), ("add", -0.75, 0.0), ("mul", 0.0, 0.0), ("div", 0.0, 0.0),
                ("maximum", 0.0, 0.0), ("silu_backward", 0.0, 0.0)]
UNARY_CASES = [("exp", 0.0, 0.0), ("gelu", 0.0, 0.0), ("rsub_scalar", 1.0, 0.5), ("relu", 0.0, 0.0)]
# Lengths: under one thread's 4 vec4s, a tail inside a workgroup, and more than one workgroup.
LENGTHS = [12, VEC4_ELEMENTS_PER_GROUP + 4 * 37, 3 * VEC4_ELEMENTS_PER_GROUP]


def _operands(numel, offset, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(offset + numel).astype(np.float32) * 3
    b = rng.standard_normal(offset + numel).astype(np.float32)
    a[offset + 5] = np.nan
    b[offset + 7] = np.nan
    return a, b


def _check_binary_is_general_bits(device, op, s0, s1, numel, offset, **options):
    a, b = _operands(numel, offset, seed=numel + offset)
    view = StridedView.contiguous((numel,), offset=offset)
    (vec4,) = plan_binary(op, "out", "a", view, "b", view, scalar0=s0, scalar1=s1)
    assert vec4.shader == VEC4_BINARY
    got = _run(device, [vec4], {"a": a, "b": b}, numel, **options)
    expected = _run(device, [_as_general(vec4, numel)], {"a": a, "b": b}, numel)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), f"{op}: {np.count_nonzero(got != expected)}"
    if op == "add" and s0 == 1.0:  # and it is the add: fp32 a + b, round to nearest
        assert np.array_equal(got, a[offset:] + b[offset:], equal_nan=True)


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("op, s0, s1", BINARY_CASES)
def test_vec4_binary_ops_give_the_general_variants_bits(vk_device, op, s0, s1, numel):
    _check_binary_is_general_bits(vk_device, op, s0, s1, numel, offset=8)


def test_vec4_at_the_vulkan_floor_of_128_lanes_gives_the_same_bits(vk_device):
    """A profile allowing 128 invocations (the phones): the VEC4 body runs 128 lanes, twice the workgroups,
    and every output element its 256-lane bits (each is computed alone)."""
    numel = LENGTHS[2]
    a, b = _operands(numel, 8, seed=5)
    view = StridedView.contiguous((numel,), offset=8)
    (wide,) = plan_binary("silu_backward", "out", "a", view, "b", view)
    (narrow,) = plan_binary("silu_backward", "out", "a", view, "b", view, max_workgroup_size=128)
    assert (wide.local_size, narrow.local_size) == ((256, 1, 1), (128, 1, 1))
    assert narrow.groups[0] == 2 * wide.groups[0] == 6
    got = _run(vk_device, [narrow], {"a": a, "b": b}, numel)
    expected = _run(vk_device, [wide], {"a": a, "b": b}, numel)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("op, s0, s1", UNARY_CASES)
def test_vec4_unary_ops_give_the_general_variants_bits(vk_device, op, s0, s1):
    numel = LENGTHS[1]
    a, _ = _operands(numel, 4, seed=3)
    (vec4,) = plan_unary(op, "out", "a", StridedView.contiguous((numel,), offset=4), scalar0=s0, scalar1=s1)
    assert vec4.shader == VEC4_UNARY
    got = _run(vk_device, [vec4], {"a": a}, numel)
    expected = _run(vk_device, [_as_general(vec4, numel)], {"a": a}, numel)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), op


def test_vec4_covers_every_element_of_a_split_grid(vk_device):
    _check_binary_is_general_bits(vk_device, "add", 1.0, 0.0, 5 * VEC4_ELEMENTS_PER_GROUP - 8, offset=0,
                                  max_group_count=2)


@pytest.mark.parametrize("op, s0, s1", [BINARY_CASES[0], BINARY_CASES[4]])
def test_the_wgsl_vec4_kernel_gives_the_same_bits(webgpu_device, op, s0, s1):
    _check_binary_is_general_bits(webgpu_device, op, s0, s1, LENGTHS[1], offset=4)

"""linear_q4gsw / linear_q4gsw_backward over bindings larger than the device allows (kernels/linear.py,
"Bindings over the limit"; geometry: kernels/q4gsw_windows.py).

* Layout: a window of K columns of a W_4X8 buffer (from the offset q4gsw_windows gives) is bit for bit the
  W_4X8 packing (vktrain.quant.pack_w4x8) of those columns as their own weight, scales likewise.
* Plans: every binding of every window fits the limit, the windows tile K and M once, the forward's later K
  windows accumulate (read_write output, no other binding of it), the bias goes with the last.
* Kernels on lavapipe under a small limit, Vulkan (tiled and register-tile bodies) and WebGPU: the windowed
  forward and backward equal the unsplit kernel bit for bit on odd shapes (N4 odd, K windows ending inside
  the range, M not a multiple of the window), and the op library's CPU reference within the dot-product
  bound of tests/test_kernels_linear.py.
* Limits too small for one window step or one row are refused naming the limit.
* A tiny-llama with an UNTIED q4 head trains under a limit that splits the head, on Vulkan and WebGPU: the
  same losses bit for bit as the unsplit run. On the fp16-tc route (emulated) a windowed q4 op runs the fp32
  kernels. Llama-3-8B's untied head plans into windows that fit a browser's 128 MiB (no device).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import vktrain.ops  # noqa: E402,F401  (registers torch.ops.vktrain.*)
from vktrain.quant import dequantize, pack_w4x8, quantize  # noqa: E402
from vktrain.runtime import Buffer, run_dispatches  # noqa: E402
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING, runs_cpu_bodies  # noqa: E402
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit  # noqa: E402
from vktrain.serialization.strided_view import KernelArgumentError
from vktrain.backend.kernel_planning.kernels.linear import (GemmPlacement, GemmTiles, gemm_push,  # noqa: E402
                                                     plan_linear_q4gsw, plan_linear_q4gsw_backward, prepack_weights,
                                                     weights_nbytes)
from vktrain.backend.kernel_planning.kernels.q4gsw_windows import (k_window_step, scales_byte_range,  # noqa: E402
                                                            words_byte_range)
from vktrain.backend.kernel_planning import plan_schedule

UNIT_ROUNDOFF = 2.0 ** -24
LIMIT = BindingLimit(4096, 256)  # 4 KiB bindings: the shapes below split along K and M
# (M, N, K, group_size): N4 odd (W_4X8 padding rows), K not a multiple of the K window, M of the M window.
SHAPES = [(37, 44, 320, 32), (11, 20, 640, 16), (70, 64, 256, 64)]


def _weight(rng, N, K, group_size):
    flat, scales = quantize(rng.standard_normal((N, K)).astype(np.float32), group_size)
    return flat, scales


def test_a_window_of_k_is_the_w4x8_of_those_columns():
    rng = np.random.default_rng(0)
    N, K, group_size = 44, 320, 32
    flat, scales = _weight(rng, N, K, group_size)
    words = prepack_weights(flat, K).view(np.uint8)
    step = k_window_step(group_size)
    for begin in range(0, K, step):
        end = min(K, begin + 3 * step)
        lo, hi = words_byte_range(N, begin, end)
        np.testing.assert_array_equal(words[lo:hi], pack_w4x8(flat[:, begin // 2:end // 2], end - begin).view(np.uint8))
        lo, hi = scales_byte_range(N, group_size, begin, end)
        np.testing.assert_array_equal(scales.view(np.uint8).ravel()[lo:hi],
                                      scales[begin // group_size:end // group_size].view(np.uint8).ravel())


def _bindings_fit(dispatches, limit):
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            if bound.buffer == "b":
                continue  # the bias [N] is bound whole (a row of y, which fits)
            assert bound.size is not None and bound.size <= limit.max_bytes, (dispatch.label, bound)
            assert bound.offset % limit.alignment == 0, (dispatch.label, bound)


@pytest.mark.parametrize("tuning", [GPU_TUNING, CPU_TUNING])
def test_forward_windows_tile_k_and_m_and_accumulate(tuning):
    M, N, K, group_size = SHAPES[0]
    plan = plan_linear_q4gsw(M=M, N=N, K=K, group_size=group_size, out="out", x="x", weights="w", scales="s",
                             bias="b", tuning=tuning, binding_limit=LIMIT)
    _bindings_fit(plan, LIMIT)
    # Forward: y rows are whole (N), so a window of M is [m, m + mm) rows of y; its K windows follow in order.
    k_pushes = [np.frombuffer(d.push_constants, np.uint32) for d in plan]
    ks = [int(p[2]) for p in k_pushes]
    windows_per_m = len(plan) // len({d.bindings[0].offset for d in plan})
    assert windows_per_m > 1 and len(plan) % windows_per_m == 0
    assert sum(ks[:windows_per_m]) == K and all(k % k_window_step(group_size) == 0 for k in ks[:windows_per_m - 1])
    assert sum(int(p[0]) for p in k_pushes[::windows_per_m]) == M
    for index, dispatch in enumerate(plan):
        first, last = index % windows_per_m == 0, index % windows_per_m == windows_per_m - 1
        assert ("ACCUMULATE" in dispatch.shader) != first
        assert dispatch.bindings[0].access == ("w" if first else "rw")
        assert ("HAS_BIAS" in dispatch.shader) == last
        assert ("CPU_REGISTER_TILES" in dispatch.shader) == (tuning == CPU_TUNING)
        assert len({b.buffer for b in dispatch.bindings}) == len(dispatch.bindings)  # no buffer bound twice


def test_backward_windows_are_output_columns():
    M, N, K, group_size = SHAPES[0]
    plan = plan_linear_q4gsw_backward(M=M, N=N, K=K, group_size=group_size, out="out", d_out="d", weights="w",
                                      scales="s", binding_limit=LIMIT)
    _bindings_fit(plan, LIMIT)
    assert len(plan) > 1 and not any("ACCUMULATE" in d.shader for d in plan)
    assert all(d.bindings[0].access == "w" for d in plan)


def test_limits_below_one_window_are_refused_naming_the_limit():
    tiny = BindingLimit(1024, 256)
    with pytest.raises(KernelArgumentError, match=r"W \[4096, 256\].*over the device's max storage binding size of "
                                                  r"1024 bytes"):
        plan_linear_q4gsw(M=4, N=4096, K=256, group_size=32, out="o", x="x", weights="w", scales="s",
                          binding_limit=tiny)
    with pytest.raises(KernelArgumentError, match=r"one row of d_out \[4, 8\] / the output \[4, 512\] needs a "
                                                  r"binding of 2048 bytes.* of 1024 bytes"):
        plan_linear_q4gsw_backward(M=4, N=8, K=512, group_size=32, out="o", d_out="d", weights="w", scales="s",
                                   binding_limit=tiny)
    with pytest.raises(KernelArgumentError, match="without split-K"):
        plan_linear_q4gsw(M=40, N=64, K=256, group_size=32, out="o", x="x", weights="w", scales="s",
                          split_k=2, binding_limit=LIMIT)


def test_placement_is_checked():
    push = gemm_push(4, 8, 16, 8, 4, 8, 16, GemmPlacement(a_offset=4, a_row_stride=32, c_offset=8, c_row_stride=12,
                                                           w_offset=16, s_offset=20))
    assert np.frombuffer(push, "<u4").tolist() == [4, 8, 16, 8, 4, 32, 8, 12, 16, 20]
    with pytest.raises(KernelArgumentError, match="multiples of 4"):
        gemm_push(4, 8, 16, 8, 4, 8, 16, GemmPlacement(w_offset=2))
    with pytest.raises(KernelArgumentError, match="row strides >= the reduction 16"):
        gemm_push(4, 8, 16, 8, 4, 8, 16, GemmPlacement(a_row_stride=12))
    with pytest.raises(KernelArgumentError, match="32-bit indices"):
        gemm_push(4, 8, 16, 8, 4, 8, 16, GemmPlacement(c_row_stride=2**31))


def _run(device, dispatches, arrays, out_elements):
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(a)) for name, a in arrays.items()}
    buffers["out"] = Buffer.from_array(device, np.full(out_elements, np.nan, np.float32))
    try:
        run_dispatches(device, dispatches, buffers)
        return buffers["out"].read(np.float32, (out_elements,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _assert_within_dot_bound(actual, expected, magnitudes, length, factor=1.0):
    """|actual - expected| <= factor * gamma_(length + 2) * magnitudes (tests/test_kernels_linear.py's bound)."""
    n = length + 2
    bound = factor * n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF) * magnitudes
    excess = np.abs(actual.astype(np.float64) - expected) - bound
    assert (excess <= 0).all(), f"worst excess over the bound: {excess.max()}"


def _tunings(device):
    return [GPU_TUNING, CPU_TUNING] if runs_cpu_bodies(device) else [GPU_TUNING]


def _unsplit_body(tuning):
    """What forces the unsplit plan onto the body the windows run: GPU, the tiled GEMM with the default
    forward tiling (the default plan would take the GEMV at M <= 8 and split-K given scratch)."""
    return {} if tuning == CPU_TUNING else {"tiles": GemmTiles(16, 16, 8)}


def _check_forward(device):
    rng = np.random.default_rng(1)
    for M, N, K, group_size in SHAPES:
        flat, scales = _weight(rng, N, K, group_size)
        x = rng.standard_normal((M, K)).astype(np.float32)
        bias = rng.standard_normal(N).astype(np.float32)
        arrays = {"x": x, "w": prepack_weights(flat, K), "s": scales, "b": bias}
        deq = dequantize(flat, scales, group_size).astype(np.float64)
        expected = x.astype(np.float64) @ deq.T + bias
        magnitudes = np.abs(x.astype(np.float64)) @ np.abs(deq).T + np.abs(bias)
        library = torch.ops.vktrain.linear_q4gsw(torch.from_numpy(x), torch.from_numpy(flat), torch.from_numpy(scales),
                                                 group_size, torch.from_numpy(bias)).numpy()
        for tuning in _tunings(device):
            args = dict(M=M, N=N, K=K, group_size=group_size, out="out", x="x", weights="w", scales="s", bias="b",
                        tuning=tuning)
            unsplit = _run(device, plan_linear_q4gsw(**args, **_unsplit_body(tuning)), arrays, M * N)
            plan = plan_linear_q4gsw(**args, binding_limit=LIMIT)
            assert len(plan) > 3 and any("ACCUMULATE" in d.shader for d in plan), [d.shader for d in plan]
            windowed = _run(device, plan, arrays, M * N)
            np.testing.assert_array_equal(windowed, unsplit)  # the same chain of roundings per output
            _assert_within_dot_bound(windowed.reshape(M, N), expected, magnitudes, K + 1)
            _assert_within_dot_bound(windowed.reshape(M, N), library, magnitudes, K + 1, factor=2.0)


def _check_backward(device):
    rng = np.random.default_rng(2)
    for M, N, K, group_size in SHAPES:
        flat, scales = _weight(rng, N, K, group_size)
        d_out = rng.standard_normal((M, N)).astype(np.float32)
        arrays = {"d": d_out, "w": prepack_weights(flat, K), "s": scales}
        deq = dequantize(flat, scales, group_size).astype(np.float64)
        expected = d_out.astype(np.float64) @ deq
        magnitudes = np.abs(d_out.astype(np.float64)) @ np.abs(deq)
        library = torch.ops.vktrain.linear_q4gsw_backward(torch.from_numpy(d_out), torch.from_numpy(flat),
                                                          torch.from_numpy(scales), group_size).numpy()
        for tuning in _tunings(device):
            args = dict(M=M, N=N, K=K, group_size=group_size, out="out", d_out="d", weights="w", scales="s",
                        tuning=tuning)
            forced = {} if tuning == CPU_TUNING else {"tiles": GemmTiles(16, 16, 16)}
            unsplit = _run(device, plan_linear_q4gsw_backward(**args, **forced), arrays, M * K)
            plan = plan_linear_q4gsw_backward(**args, binding_limit=LIMIT)
            assert len(plan) > 3, [d.shader for d in plan]
            windowed = _run(device, plan, arrays, M * K)
            np.testing.assert_array_equal(windowed, unsplit)
            _assert_within_dot_bound(windowed.reshape(M, K), expected, magnitudes, N)
            _assert_within_dot_bound(windowed.reshape(M, K), library, magnitudes, N, factor=2.0)


def test_windowed_forward_is_the_unsplit_kernel_bit_for_bit(vk_device):
    _check_forward(vk_device)


def test_wgsl_windowed_forward_is_the_unsplit_kernel_bit_for_bit(webgpu_device):
    _check_forward(webgpu_device)


def test_windowed_backward_is_the_unsplit_kernel_bit_for_bit(vk_device):
    _check_backward(vk_device)


def test_wgsl_windowed_backward_is_the_unsplit_kernel_bit_for_bit(webgpu_device):
    _check_backward(webgpu_device)


MIB = 1 << 20
HEAD_VOCAB, HEAD_BATCH, HEAD_SEQ, HEAD_STEPS = 20480, 2, 32, 2
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


@pytest.fixture(scope="module")
def untied_head_program(tmp_path_factory):
    """A 1-layer tiny-llama with an untied q4gsw head [32768, 128] (2 MiB of W_4X8 words; logits [128, 32768]
    16 MiB) and LoRA on it: under 1 MiB bindings the head splits into windows of K and of M rows."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama", n_layers=1, vocab_size=HEAD_VOCAB, tie_embeddings=False)
    report = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj,lm_head", group_size=32, seed=0))
    assert "lm_head" in report.replaced
    step, evaluation = export_training_and_eval_steps(model, (HEAD_BATCH, HEAD_SEQ))
    path = tmp_path_factory.mktemp("pte") / "untied_head_step.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


def _train(path, device, max_binding_bytes):
    from vktrain.runtime.program.runner import TrainingRunner

    token_ids = torch.randint(0, HEAD_VOCAB, (HEAD_BATCH, HEAD_SEQ), generator=torch.Generator().manual_seed(7))
    labels = torch.roll(token_ids, -1, dims=1)
    # Training only; the eval method's unfused LoRA add over the logits splits too (tests/test_elementwise_windows.py).
    with TrainingRunner.from_pte(path, device, planner=plan_schedule, max_binding_bytes=max_binding_bytes) as runner:
        losses = [runner.step(token_ids.numpy(), labels.numpy(), HPARAMS) for _ in range(HEAD_STEPS)]
        return losses, list(runner.executor.dispatches)


def _check_untied_head_training(device, path):
    losses, dispatches = _train(path, device, MIB)
    whole_losses, whole_dispatches = _train(path, device, None)
    for dispatch in dispatches:
        for bound in dispatch.bindings:
            assert bound.size <= MIB, (dispatch.name, bound)
    windowed = [d for d in dispatches if "linear_q4gsw" in d.name and "window" in d.name]
    assert any("ACCUMULATE" in d.shader for d in windowed)  # the head's forward over windows of K
    assert any("linear_q4gsw_backward" in d.name for d in windowed)
    assert not any("window" in d.name for d in whole_dispatches)
    # Every split here keeps each sum's order (q4 windows, the head LoRA's mm over rows / vocabulary columns,
    # fused_ce over rows): the very same losses.
    assert losses == whole_losses
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_untied_q4_head_trains_split_on_vulkan(vk_device, untied_head_program):
    _check_untied_head_training(vk_device, untied_head_program)


def test_untied_q4_head_trains_split_on_webgpu(webgpu_device, untied_head_program):
    _check_untied_head_training(webgpu_device, untied_head_program)


def test_a_windowed_q4_op_takes_the_fp32_kernels_on_the_tensor_core_route(vk_device, tmp_path):
    """fp16-tc (emulated here): the coopmat kernels have no windows, so the untied head's linear_q4gsw over the
    limit runs the fp32 windows while it takes the coopmat kernel unsplit; the other ops keep their route."""
    from _helpers import export_mlp_lora_training_step
    from vktrain.runtime.program.runner import TrainingRunner

    path = tmp_path / "mlp.pte"
    # logits [2, 8, 32768]: 2 MiB out of linear_q4gsw; reductions past STARVED_REDUCTION (64), so that the route
    # takes every base GEMM to the tensor cores (kernels/coopmat_tiling.py).
    export_mlp_lora_training_step(path, (2, 8), 32768, dim=96, hidden=128)
    routes = {}
    for limit in (None, MIB):
        with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision="fp16-tc", emulate_tensor_cores=True,
                                     max_binding_bytes=limit) as runner:
            windowed = {d.name.split(".window")[0] for d in runner.executor.dispatches
                        if "linear_q4gsw" in d.name and ".window" in d.name}
            routes[limit] = (set(runner.executor.tensor_core_ops), windowed)
    (unsplit_tc, unsplit_windows), (split_tc, split_windows) = routes[None], routes[MIB]
    assert not unsplit_windows and split_windows
    assert split_windows & unsplit_tc and not split_windows & split_tc  # the head's forward left the coopmat kernel
    assert {label for label in unsplit_tc if "linear_q4gsw" in label} - split_windows <= split_tc


def test_llama_3_8b_untied_head_plans_fit_a_browsers_128_mib():
    """The issue's shapes: Llama-3-8B's untied 4-bit head [128256, 4096] (262 MB of W_4X8 words) in a 64-token
    step, planned for WebGPU's default 128 MiB binding (no device): 2 windows of K (65 steps of 32 columns, 2 MB of
    words each, per window), y and d_out in whole rows."""
    limit = BindingLimit(max_bytes=128 * MIB, alignment=256)
    tokens, vocab, dim, group_size = 64, 128256, 4096, 32
    for plan, small in ((plan_linear_q4gsw(M=tokens, N=vocab, K=dim, group_size=group_size, out="y", x="x",
                                           weights="w", scales="s", binding_limit=limit), "x"),
                        (plan_linear_q4gsw_backward(M=tokens, N=vocab, K=dim, group_size=group_size, out="d_x",
                                                    d_out="d_y", weights="w", scales="s", binding_limit=limit), "d_x")):
        assert len(plan) == 2
        words = sorted((d.bindings[2].offset, d.bindings[2].offset + d.bindings[2].size) for d in plan)
        assert words[0][0] == 0 and words[-1][1] == weights_nbytes(vocab, dim)  # every column of W, once
        assert all(end <= start for (_, end), (start, _) in zip(words, words[1:]))
        for dispatch in plan:
            assert all(b.size <= limit.max_bytes and b.offset % limit.alignment == 0 for b in dispatch.bindings)
    assert [d.shader for d in plan_linear_q4gsw(M=tokens, N=vocab, K=dim, group_size=group_size, out="y", x="x",
                                                weights="w", scales="s", binding_limit=limit)] == [
        "linear_q4gsw", "linear_q4gsw@ACCUMULATE"]

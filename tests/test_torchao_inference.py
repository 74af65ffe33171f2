"""torchao-quantized models in the eval, forward and generation exports: linear_q4gsw on torchao's codes.

The training export fuses torchao's int4 weight-only linears (dequantize + linear) into frozen linear_q4gsw
ops over torchao's own codes and scales (tests/test_torchao.py); the eval method, the inference forward and
the generation program (prefill / decode) go through the same fusion (vktrain.export.training.traceable_copy).
Traced as they are, torchao's weights would dequantize into a dense float matmul whose int8 casts the
partitioner refuses (they would run outside the delegate). Checked here: each lowered program is ONE
delegate, every quantized linear of it is a linear_q4gsw whose W_4X8 words unpack (vktrain.quant, the one
layout definition) to torchao's codes and scales bit for bit, and its outputs on the device match eager
PyTorch running the torchao model.

Bounds. Every output is a chain of fp32 dot products of length K <= 128 (q4gsw dequantization is exact:
torchao's q * s is q4gsw's). The reference is the same model in float64 (the fused copy: its dequantized
weights are torchao's exactly); each fp32 dot product errs by about sqrt(K) * 6e-8 relative, a few per
layer: the logits stay within 2e-5 of the largest logit (tests/test_generate.py's bound) and the loss
within LOSS_RTOL (tests/_helpers.py). Eager torchao in float32 must meet the same bounds, so they measure
rounding, not luck.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

torchao_quantization = pytest.importorskip("torchao.quantization")
from torchao.quantization import IntxWeightOnlyConfig, quantize_  # noqa: E402
from torchao.quantization.granularity import PerGroup  # noqa: E402

from vktrain.export import export_eval_step, export_forward, lower_to_pte  # noqa: E402
from vktrain.export.decode import DECODE, PREFILL, export_generation, lower_generation  # noqa: E402
from vktrain.export.training import traceable_copy  # noqa: E402
from vktrain.lora import LoRAConfig, apply_lora, lora_modules  # noqa: E402
from vktrain.models import build_model  # noqa: E402
from vktrain.partitioner import VktrainPartitioner  # noqa: E402
from vktrain.quant import unpack_flat, unpack_w4x8  # noqa: E402
from vktrain.runtime.delegate.executor import GraphExecutor  # noqa: E402
from vktrain.serialization.pte import DelegateCall, PteFile  # noqa: E402
from vktrain.serialization.verify import load_delegate_graph  # noqa: E402

from _helpers import LOSS_RTOL, _cast_floating  # noqa: E402
from _helpers import planned

GROUP = 32
BATCH, SEQ, VOCAB = 2, 8, 64
LOGIT_BOUND = 2e-5  # of the largest |logit| (module docstring)
MLP_QUANTIZED = ("layers.0", "layers.1", "head")


def _int4() -> IntxWeightOnlyConfig:
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(GROUP))


def _torchao_codes(model: nn.Module, paths) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Path -> (int8 codes [N, K], float32 scales [N, G]) as torchao holds them."""
    return {path: (model.get_submodule(path).weight.qdata.numpy().copy(),
                   model.get_submodule(path).weight.scale.numpy().copy()) for path in paths}


def _nonzero_adapters(model: nn.Module, seed: int) -> None:
    """lora_B starts at zero; a random one makes the adapters change the outputs (so they are checked)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0.0, 0.1, generator=generator)


def _lowered_q4gsw(graph) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layer path -> (codes [N, K], scales [N, G]) of every linear_q4gsw of a delegate graph, unpacked from
    its W_4X8 constant."""
    lowered = {}
    for op in graph.ops:
        if op.name == "vktrain.linear_q4gsw.default":
            weights, scales = graph.tensor(op.args[1]), graph.tensor(op.args[2])
            path = weights.name.removeprefix("model.").removesuffix(".weights")
            G, N = scales.shape
            K = G * GROUP
            flat = unpack_w4x8(graph.constant_array(op.args[1]), N, K)
            lowered[path] = (unpack_flat(flat, K), graph.constant_array(op.args[2]).T)
    return lowered


def _assert_torchaos_codes(graph, codes: dict) -> None:
    lowered = _lowered_q4gsw(graph)
    assert sorted(lowered) == sorted(codes)  # every quantized linear, adapted or fused, and nothing else
    for path, (torchao_codes, torchao_scales) in codes.items():
        np.testing.assert_array_equal(lowered[path][0], torchao_codes, err_msg=path)
        np.testing.assert_array_equal(lowered[path][1], torchao_scales, err_msg=path)


def _one_delegate(program_bytes: bytes, method: str = "forward"):
    """(the .pte, the method's delegate graph), checking the method is one DelegateCall and nothing else."""
    pte = PteFile.from_bytes(program_bytes)
    plan = pte.execution_plan(method)
    assert [type(i) for i in plan.instructions] == [DelegateCall], method
    return pte, load_delegate_graph(pte, plan)[1]


def _float64(model: nn.Module) -> nn.Module:
    """The model in float64, its torchao linears fused first (their dequantization is torchao's exactly)."""
    exact = traceable_copy(model)
    _cast_floating(exact, torch.float64)
    return exact


def _assert_logits_close(actual: np.ndarray, exact: np.ndarray, label: str) -> None:
    error = np.abs(np.asarray(actual, np.float64) - exact).max() / np.abs(exact).max()
    assert error <= LOGIT_BOUND, f"{label}: max error {error:.2e} of the largest logit > {LOGIT_BOUND}"


@pytest.fixture(scope="module")
def torchao_mlp():
    """mlp-lora with every linear torchao-quantized, LoRA (non-zero) on its hidden layers, its head left
    torchao's (fused at export); torchao's codes; a token batch."""
    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2)
    quantize_(model, _int4())
    codes = _torchao_codes(model, MLP_QUANTIZED)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="layers.*", seed=0))
    _nonzero_adapters(model, 1)
    generator = torch.Generator().manual_seed(7)
    token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = (3 * token_ids + 1) % VOCAB
    labels[0, :3] = -100
    return model, codes, token_ids, labels


def test_the_eval_method_of_a_torchao_model_runs_linear_q4gsw_on_torchaos_codes(torchao_mlp, vk_device):
    model, codes, token_ids, labels = torchao_mlp
    partitioner = VktrainPartitioner()
    program = lower_to_pte(export_eval_step(model, (BATCH, SEQ)), partitioner)
    assert partitioner.refusals == []
    _, graph = _one_delegate(program)
    _assert_torchaos_codes(graph, codes)
    n_valid = (labels >= 0).sum().to(torch.float32)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        (loss,) = executor.run(token_ids.numpy(), labels.numpy(), n_valid.numpy())
    with torch.no_grad():
        exact = _float64(model).loss(token_ids, labels, n_valid).item()  # n_valid: a count, exact in float32
        eager = model.loss(token_ids, labels, n_valid).item()  # torchao dequantizes in eager PyTorch
    np.testing.assert_allclose(eager, exact, rtol=LOSS_RTOL)
    np.testing.assert_allclose(float(loss), exact, rtol=LOSS_RTOL)


@pytest.mark.parametrize("with_adapters", [True, False], ids=["with-adapters", "base"])
def test_the_forward_of_a_torchao_model_runs_linear_q4gsw_on_torchaos_codes(torchao_mlp, vk_device, with_adapters):
    model, codes, token_ids, _ = torchao_mlp
    partitioner = VktrainPartitioner()
    program = lower_to_pte(export_forward(model, (BATCH, SEQ), with_adapters=with_adapters), partitioner)
    assert partitioner.refusals == []
    _, graph = _one_delegate(program)
    _assert_torchaos_codes(graph, codes)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        (logits,) = executor.run(token_ids.numpy())
    reference = copy.deepcopy(model)
    for layer in lora_modules(reference).values():
        layer.adapter_enabled = with_adapters
    with torch.no_grad():
        exact = _float64(reference)(token_ids).numpy()
        eager = reference(token_ids).numpy()
    _assert_logits_close(eager, exact, "eager torchao float32")
    _assert_logits_close(logits, exact, "vktrain forward")


def _torchao_llama() -> tuple[nn.Module, dict]:
    """A small Llama whose decoder linears are torchao int4 (the tied head stays the float embedding),
    LoRA (non-zero) over torchao's codes on q_proj / v_proj; torchao's codes of every quantized linear."""
    torch.manual_seed(0)
    model = build_model("tiny-llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, vocab_size=VOCAB,
                        max_seq_len=32)
    quantize_(model, _int4(), filter_fn=lambda module, fqn: isinstance(module, nn.Linear) and ".layers." in f".{fqn}")
    quantized = [path for path, module in model.named_modules()
                 if isinstance(module, nn.Linear) and type(module.weight).__name__ == "IntxUnpackedToInt8Tensor"]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer
    codes = _torchao_codes(model, quantized)
    report = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*.q_proj,*.v_proj", seed=0))
    assert len(report.replaced) == 4
    _nonzero_adapters(model, 2)
    return model, codes


def test_the_generation_program_of_a_torchao_model_runs_linear_q4gsw_on_torchaos_codes(vk_device, tmp_path):
    from vktrain.generate.runner import GenerationRunner

    model, codes = _torchao_llama()
    prefill_length, cache_length = 8, 16
    path = tmp_path / "generation.pte"
    path.write_bytes(lower_generation(export_generation(model, prefill_length, cache_length)))
    for method in (PREFILL, DECODE):
        _, graph = _one_delegate(path.read_bytes(), method)
        _assert_torchaos_codes(graph, codes)  # CachedLlama holds the model as `model`: the same paths
    prompt = [5, 17, 3, 60, 22, 9, 41, 8, 30, 2]  # two prefill chunks
    new = [11, 47, 0]
    with GenerationRunner.from_pte(path, vk_device) as runner:
        got = [*runner.prefill(prompt)]
        got += [runner.decode(token, len(prompt) + i) for i, token in enumerate(new)]
    sequence = torch.tensor([prompt + new])
    with torch.no_grad():
        exact = _float64(model)(sequence).numpy()[0]
        eager = model(sequence).numpy()[0]  # torchao dequantizes in eager PyTorch
    _assert_logits_close(eager, exact, "eager torchao float32")
    _assert_logits_close(np.stack(got), exact[:len(prompt) + len(new)], "vktrain prefill + decode")

"""torchao-quantized models in: IntxWeightOnlyConfig(int4, PerGroup(32)) weights lower as q4gsw, losslessly.

torchao's codes and scales must reach the lowered program unchanged (W_4X8 words unpacked with
vktrain.quant, the one layout definition), whether apply_lora wrapped the linear or the export fused an
un-adapted one; vktrain's quantizer must give the same codes under torchao's scales; the trained step must
follow eager PyTorch (the torchao model itself, in float32) and the float64 reference (tests/_helpers.py).
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
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

from vktrain.contract import TRAIN_METHOD, hparams_values  # noqa: E402
from vktrain.export import export_training_step, lower_to_pte  # noqa: E402
from vktrain.lora import (LoRAConfig, LoRAQ4Linear, Q4GSWLinear, TorchaoWeightError, apply_lora,  # noqa: E402
                          replace_torchao_linears)
from vktrain.lora.torchao_weights import torchao_q4gsw  # noqa: E402
from vktrain.models import build_model  # noqa: E402
from vktrain.partitioner import VktrainPartitioner  # noqa: E402
from vktrain.quant import dequantize, quantize, requant, unpack_flat, unpack_w4x8  # noqa: E402
from vktrain.serialization.pte import DelegateCall, PteFile  # noqa: E402
from vktrain.runtime.program.runner import TrainingRunner  # noqa: E402
from vktrain.serialization.verify import load_delegate_graph  # noqa: E402

from _helpers import (TrainingReference, assert_training_matches_reference, eager_lora_adamw_training,  # noqa: E402
                      readme_snippet, runner_losses)
from vktrain.backend.kernel_planning import plan_schedule

GROUP = 32
BATCH, SEQ, VOCAB = 2, 8, 64
STEPS = 10
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
HPARAMS = np.array(hparams_values(LR, *BETAS, EPS, WEIGHT_DECAY), np.float32)
QUANTIZED = ("layers.0", "layers.1", "head")  # mlp-lora's linears


def _int4(**options) -> IntxWeightOnlyConfig:
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(GROUP), **options)


def _torchao_mlp() -> nn.Module:
    """mlp-lora with every linear quantized by torchao (the upstream Vulkan recipe)."""
    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2)
    quantize_(model, _int4())
    return model


def _torchao_codes(model: nn.Module) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Path -> (int8 codes [N, K], float32 scales [N, G]) of each torchao weight, as torchao holds them."""
    return {path: (model.get_submodule(path).weight.qdata.numpy().copy(),
                   model.get_submodule(path).weight.scale.numpy().copy()) for path in QUANTIZED}


@pytest.fixture(scope="module")
def torchao_lora_model():
    """(the torchao model with LoRA on its hidden layers, its head left torchao-quantized; torchao's codes)."""
    model = _torchao_mlp()
    codes = _torchao_codes(model)
    report = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="layers.*", group_size=16, seed=0))
    assert report.replaced == ["layers.0", "layers.1"]
    return model, codes


def test_torchao_int4_is_symmetric_and_its_codes_are_vktrains_under_its_scales():
    assert IntxWeightOnlyConfig().mapping_type == MappingType.SYMMETRIC  # the default the recipe relies on
    linear = nn.Linear(96, 48, bias=False)
    weight = linear.weight.detach().numpy().copy()
    quantize_(nn.Sequential(linear), _int4())
    base = torchao_q4gsw(linear, "0")
    codes, scales = linear.weight.qdata.numpy(), linear.weight.scale.numpy()
    assert base.group_size == GROUP and not linear.weight.zero_point.any()
    np.testing.assert_array_equal(unpack_flat(base.flat, 96), codes)
    np.testing.assert_array_equal(base.scales, scales.T)
    # Lossless: q4gsw's dequantization is torchao's, bit for bit.
    np.testing.assert_array_equal(dequantize(base.flat, base.scales, GROUP), linear.weight.dequantize().numpy())
    # vktrain's quantizer agrees on the codes given torchao's scales, except at exact half steps: torchao
    # rounds w * (1 / s), vktrain w / s (both half to even), so a tie (the group's absmax at -7.5 steps)
    # can fall either way. The scale rules differ: torchao puts absmax at 7.5 steps (its range [-8, 7]
    # halved), vktrain's "absmax" rule at 7.
    ours = requant(weight, base.scales, GROUP)
    steps = weight.astype(np.float64) / np.repeat(base.scales.T, GROUP, axis=1)
    differ = ours != codes
    assert np.all(np.abs(np.abs(steps[differ] - np.floor(steps[differ])) - 0.5) < 1e-5)  # ties only
    assert np.all(np.abs(ours.astype(int) - codes) <= 1) and differ.mean() < 0.01
    _, absmax_scales = quantize(weight, GROUP, "absmax")
    np.testing.assert_allclose(base.scales, absmax_scales * 7 / 7.5, rtol=1e-6)


def test_the_lowered_program_holds_torchaos_codes_and_scales(torchao_lora_model):
    model, codes = torchao_lora_model
    assert isinstance(model.layers[0], LoRAQ4Linear) and model.layers[0].group_size == GROUP  # torchao's, not 16
    partitioner = VktrainPartitioner()
    pte = PteFile.from_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ)), partitioner))
    plan = pte.execution_plan(TRAIN_METHOD)
    assert partitioner.refusals == [] and [type(i) for i in plan.instructions] == [DelegateCall]
    _, graph = load_delegate_graph(pte, plan)
    lowered = {}
    for op in graph.ops:
        if op.name == "vktrain.linear_q4gsw.default":
            weights, scales = graph.tensor(op.args[1]), graph.tensor(op.args[2])
            path = weights.name.removeprefix("model.").removesuffix(".weights")
            G, N = scales.shape
            flat = unpack_w4x8(graph.constant_array(op.args[1]), N, G * GROUP)
            lowered[path] = (unpack_flat(flat, G * GROUP), graph.constant_array(op.args[2]).T)
    assert sorted(lowered) == sorted(QUANTIZED)  # the adapted layers and the fused head
    for path, (torchao_codes, torchao_scales) in codes.items():
        np.testing.assert_array_equal(lowered[path][0], torchao_codes, err_msg=path)
        np.testing.assert_array_equal(lowered[path][1], torchao_scales, err_msg=path)


def _batches(count: int):
    generator = torch.Generator().manual_seed(4321)
    for _ in range(count):
        token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = (5 * token_ids + 3) % VOCAB
        labels[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = -1
        yield token_ids, labels


def test_a_torchao_model_with_lora_trains_ten_steps_like_eager(vk_device, torchao_lora_model, tmp_path):
    model, _ = torchao_lora_model
    path = tmp_path / "torchao_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ))))
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    # float64: the head as q4gsw (its dequantization is torchao's exactly, tested above); float32: the
    # torchao model itself, its head dequantized by torchao in eager PyTorch.
    as_q4gsw = copy.deepcopy(model)
    assert replace_torchao_linears(as_q4gsw) == ["head"] and isinstance(as_q4gsw.head, Q4GSWLinear)
    reference = TrainingReference(*eager_lora_adamw_training(as_q4gsw, _batches(STEPS), dtype=torch.float64, **hyper),
                                  *eager_lora_adamw_training(model, _batches(STEPS), **hyper))
    initial = {name: param.detach().numpy().copy() for name, param in model.named_parameters() if param.requires_grad}
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        losses = runner_losses(runner, _batches(STEPS), HPARAMS)
        lora = runner.lora_state()
        exp_avg = {name: runner.read_state("optimizer.exp_avg." + name) for name in reference.state}
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it trains
    assert_training_matches_reference(losses, {n: lora["model." + n] for n in reference.state}, exp_avg,
                                      reference, {n: initial[n] for n in reference.state})


def test_torchao_weights_without_a_q4gsw_form_are_refused():
    asymmetric = _torchao_mlp_with(_int4(mapping_type=MappingType.ASYMMETRIC))
    with pytest.raises(TorchaoWeightError, match="layer 'layers.0': .* is asymmetric"):
        apply_lora(asymmetric, LoRAConfig(rank=2, targets="layers.*"))
    # A head left without an adapter: the export refuses it the same way.
    head_only = _torchao_mlp_with(_int4(mapping_type=MappingType.ASYMMETRIC), lambda module, fqn: fqn == "head")
    apply_lora(head_only, LoRAConfig(rank=2, targets="layers.*", group_size=16))
    with pytest.raises(TorchaoWeightError, match="layer 'head': .* is asymmetric"):
        export_training_step(head_only, (BATCH, SEQ))
    int8 = _torchao_mlp_with(IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(GROUP)))
    with pytest.raises(TorchaoWeightError, match="holds torch.int8 codes"):
        apply_lora(int8, LoRAConfig(rank=2, targets="layers.*"))


def _torchao_mlp_with(config: IntxWeightOnlyConfig, filter_fn=None) -> nn.Module:
    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2)
    quantize_(model, config, filter_fn=filter_fn)
    return model


def test_the_readme_example_lowers_with_torchaos_codes(tmp_path, monkeypatch):
    """README.md's torchao snippet as written: every linear of its .pte is q4gsw, the head (left to the
    export's fusion) with torchao's codes."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_snippet("## torchao models"), "README.md", "exec"), namespace)
    pte = PteFile.load(tmp_path / "torchao_step.pte")
    _, graph = load_delegate_graph(pte, pte.execution_plan(TRAIN_METHOD))
    weights = {graph.tensor(op.args[1]).name: op.args[1] for op in graph.ops
               if op.name == "vktrain.linear_q4gsw.default"}
    assert sorted(weights) == sorted(f"model.{path}.weights" for path in QUANTIZED)
    head = namespace["model"].head.weight
    assert type(head).__name__ == "IntxUnpackedToInt8Tensor"
    N, K = head.qdata.shape
    lowered = unpack_flat(unpack_w4x8(graph.constant_array(weights["model.head.weights"]), N, K), K)
    np.testing.assert_array_equal(lowered, head.qdata.numpy())

"""LoRA insertion (vktrain.lora) and the built-in model registry (vktrain.models)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vktrain.lora import (LoRAConfig, LoRAInsertionError, LoRAQ4Linear, apply_lora, lora_modules,
                          lora_parameter_names, lora_state_dict, peft_name)
from vktrain.models import MLPLanguageModel, available_models, build_model
from vktrain.quant import dequantize


class _Mixed(nn.Module):
    """Linear layers of shapes the q4gsw op accepts and refuses (group size 16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.good = nn.Linear(32, 16)
        self.bad_n = nn.Linear(32, 18)        # N % 4 != 0
        self.bad_group = nn.Linear(40, 16)    # K % group_size != 0
        self.inner = nn.ModuleDict({"proj": nn.Linear(64, 8, bias=False)})
        self.norm = nn.LayerNorm(8)


def _apply(model: nn.Module, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_lora(model, LoRAConfig(**kwargs))
    return report, [str(w.message) for w in caught]


def test_replaces_accepted_layers_and_warns_for_each_refused_one():
    model = _Mixed()
    report, messages = _apply(model, rank=4, alpha=8, group_size=16)
    assert report.replaced == ["good", "inner.proj"]
    assert set(report.skipped) == {"bad_n", "bad_group"}
    assert "N=18 (out features) must be a multiple of 4" in report.skipped["bad_n"]
    assert "K=40 must be a multiple of group_size=16" in report.skipped["bad_group"]
    assert len(messages) == 2
    assert any("'bad_n'" in m and "N=18" in m for m in messages)
    assert any("'bad_group'" in m and "K=40" in m for m in messages)
    assert isinstance(model.good, LoRAQ4Linear) and isinstance(model.inner["proj"], LoRAQ4Linear)
    assert type(model.bad_n) is nn.Linear and type(model.bad_group) is nn.Linear


def test_k_not_multiple_of_4_is_refused_with_its_reason():
    model = nn.Sequential(nn.Linear(6, 8))
    with pytest.warns(UserWarning, match="K=6 \\(in features\\) must be a multiple of 4"):
        with pytest.raises(LoRAInsertionError, match="every matching layer was refused"):
            apply_lora(model, LoRAConfig(rank=2, group_size=4))


def test_only_lora_tensors_train():
    model = _Mixed()
    _apply(model, rank=4, group_size=16)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(lora_parameter_names(model))
    assert trainable == ["good.lora_A", "good.lora_B", "inner.proj.lora_A", "inner.proj.lora_B"]
    # The frozen q4gsw base is held in buffers, not parameters.
    assert {n for n, _ in model.good.named_buffers()} == {"weights", "scales", "bias"}


@pytest.mark.parametrize("targets, expected", [
    ("inner.*", ["inner.proj"]),
    ("good,inner.proj", ["good", "inner.proj"]),
    (("good",), ["good"]),
    (r"re:inner\.p.*", ["inner.proj"]),
    ("re:goo", []),  # regexes must match the whole path
])
def test_target_patterns(targets, expected):
    model = _Mixed()
    if not expected:
        with pytest.raises(LoRAInsertionError, match="no nn.Linear layer matches") as err:
            _apply(model, targets=targets, group_size=16)
        assert "good" in str(err.value) and "inner.proj" in str(err.value)  # names the candidates
        return
    report, _ = _apply(model, targets=targets, group_size=16)
    assert report.replaced == expected


def test_nothing_to_train_errors():
    with pytest.raises(LoRAInsertionError, match="nothing to train"):
        apply_lora(nn.Sequential(nn.ReLU()), LoRAConfig())
    with pytest.raises(ValueError, match="invalid regular expression"):
        apply_lora(_Mixed(), LoRAConfig(targets="re:("))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        apply_lora(_Mixed(), LoRAConfig(rank=0))


def test_initialisation_matches_peft():
    model = _Mixed()
    _apply(model, rank=4, alpha=8, group_size=16)
    layer = model.good
    assert torch.count_nonzero(layer.lora_B) == 0
    # kaiming_uniform(a=sqrt(5)) on [r, K]: U(-1/sqrt(K), 1/sqrt(K)).
    bound = 1 / math.sqrt(32)
    assert layer.lora_A.abs().max() <= bound
    assert layer.lora_A.abs().max() > 0.5 * bound
    assert layer.scaling == 8 / 4


def test_seeded_init_is_reproducible():
    first, second, third = _Mixed(), _Mixed(), _Mixed()
    _apply(first, group_size=16, seed=7)
    _apply(second, group_size=16, seed=7)
    _apply(third, group_size=16, seed=8)
    assert torch.equal(first.good.lora_A, second.good.lora_A)
    assert not torch.equal(first.good.lora_A, third.good.lora_A)


def test_quantized_base_is_vktrain_quant_of_the_float_weight():
    model = _Mixed()
    float_weight = model.good.weight.detach().clone()
    _apply(model, rank=4, group_size=16)
    deq = dequantize(model.good.weights.numpy(), model.good.scales.numpy(), 16)
    # absmax/7 scales: every weight within half a quantization step of its float value.
    step = np.repeat(model.good.scales.numpy().T, 16, axis=1)
    assert np.all(np.abs(deq - float_weight.numpy()) <= step / 2 + 1e-7)


def test_forward_equals_dequantized_linear_plus_lora_formula():
    model = _Mixed()
    _apply(model, rank=4, alpha=12, group_size=16)
    layer = model.good
    with torch.no_grad():
        layer.lora_B.normal_()  # B = 0 would hide the adapter term
    x = torch.randn(3, 5, 32)
    W = torch.from_numpy(dequantize(layer.weights.numpy(), layer.scales.numpy(), 16)).double()
    A, B, bias = layer.lora_A.double(), layer.lora_B.double(), layer.bias.double()
    expected = x.double() @ W.T + bias + (12 / 4) * (x.double() @ A.T) @ B.T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    layer.adapter_enabled = False
    torch.testing.assert_close(layer(x).double(), x.double() @ W.T + bias, rtol=1e-5, atol=1e-5)


def test_lora_gradients_flow_only_to_adapters():
    model = _Mixed()
    _apply(model, rank=4, group_size=16)
    x = torch.randn(4, 32, requires_grad=True)
    model.good(x).square().sum().backward()
    assert model.good.lora_A.grad is not None and model.good.lora_B.grad is not None
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_peft_names():
    model = _Mixed()
    _apply(model, rank=4, group_size=16)
    state = lora_state_dict(model)
    assert sorted(state) == [
        "base_model.model.good.lora_A.weight", "base_model.model.good.lora_B.weight",
        "base_model.model.inner.proj.lora_A.weight", "base_model.model.inner.proj.lora_B.weight"]
    assert torch.equal(state["base_model.model.good.lora_A.weight"], model.good.lora_A.detach())
    assert state["base_model.model.inner.proj.lora_B.weight"].shape == (8, 4)
    with pytest.raises(ValueError, match="expected a LoRA parameter path"):
        peft_name("good.weight")


# ---------------------------------------------------------------------------------------------------
# models


def test_registry():
    assert "mlp-lora" in available_models()
    with pytest.raises(ValueError, match="unknown model 'nope'.*mlp-lora"):
        build_model("nope")
    with pytest.raises(ValueError, match="unknown mlp-lora config field.*'width'"):
        build_model("mlp-lora", width=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        build_model("mlp-lora", activation="tanh")


def test_mlp_structure_and_determinism():
    model = build_model("mlp-lora", dim=16, hidden=32, n_layers=3)
    assert isinstance(model, MLPLanguageModel)
    assert [tuple(l.weight.shape) for l in model.layers] == [(32, 16), (32, 32), (32, 32)]
    assert tuple(model.head.weight.shape) == (256, 32)
    again = build_model("mlp-lora", dim=16, hidden=32, n_layers=3)
    assert torch.equal(model.head.weight, again.head.weight)  # seeded
    ids = torch.randint(0, 256, (2, 5))
    assert model(ids).shape == (2, 5, 256)


def test_mlp_lora_loss_is_cross_entropy_over_valid_labels():
    model = build_model("mlp-lora", dim=16, hidden=32)
    report = apply_lora(model, LoRAConfig(rank=2, group_size=16))
    assert report.replaced == ["layers.0", "layers.1", "head"]
    assert set(lora_modules(model)) == {"layers.0", "layers.1", "head"}
    ids = torch.randint(0, 256, (2, 6))
    labels = torch.randint(0, 256, (2, 6))
    labels[0, :2] = -1
    n_valid = (labels >= 0).sum().float()
    loss = model.loss(ids, labels, n_valid)
    expected = F.cross_entropy(model(ids).reshape(-1, 256).double(), labels.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_calibration_importance_weights_the_base_by_what_its_inputs_carry():
    """input_importance is E[x_k^2] of each linear's inputs; quantizing with it (imatrix) lowers the output
    error on such inputs against the plain mse rule, for the same number of bits."""
    import numpy as np

    from vktrain.lora.calibration import input_importance

    torch.manual_seed(0)
    vocab, K, N = 64, 128, 96
    column_scale = torch.exp(1.5 * torch.randn(K))  # columns of very different magnitude, as real activations
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, K), torch.nn.Linear(K, N, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(column_scale)
    tokens = np.random.default_rng(0).integers(0, vocab, 300)
    importance = input_importance(model, tokens, window=128)
    x = model[0].weight.detach()[torch.from_numpy(tokens)].double()
    np.testing.assert_allclose(importance["1"], x.square().mean(0).numpy(), rtol=1e-6)

    errors = {}
    for name, weights in (("plain", None), ("imatrix", importance)):
        copy_ = torch.nn.Sequential(torch.nn.Embedding(vocab, K), torch.nn.Linear(K, N, bias=False))
        copy_.load_state_dict(model.state_dict())
        apply_lora(copy_, LoRAConfig(rank=2, targets="1", scale_rule="mse", seed=0), weights)
        deq = copy_[1].dequantized_weight().double()
        errors[name] = float((x @ (deq - model[1].weight.detach().double()).T).square().mean())
    assert errors["imatrix"] < 0.8 * errors["plain"], errors


def test_peft_target_modules_select_the_layers_peft_selects():
    """adapter_config.json's target_modules (short names, as vktrain train writes them, or a regex
    string) pick the same layers through vktrain's patterns as PEFT's own matching."""
    from vktrain.models import build_model
    from vktrain.train.adapters import peft_target_patterns

    for target_modules, expected in ((["q_proj", "down_proj"], ("self_attn.q_proj", "mlp.down_proj")),
                                     (r".*\.v_proj", ("self_attn.v_proj",))):
        model = build_model("tiny-llama")
        report = apply_lora(model, LoRAConfig(rank=2, targets=tuple(peft_target_patterns(target_modules))))
        layers = model.config.n_layers
        assert sorted(report.replaced) == sorted(f"model.layers.{i}.{name}" for i in range(layers) for name in expected)

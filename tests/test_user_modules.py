"""The training-step export of modules that are not vktrain's built-in models.

A user's nn.Module whose forward (or `loss` method) returns the scalar loss exports as ONE training step,
lowers into one delegate and trains on the Vulkan device with the losses, trained tensors and AdamW moments
of eager PyTorch + torch.optim.AdamW (bounds: tests/_helpers.py, against a float64 eager run, which
PyTorch's own float32 run must meet too). Also: the program's signature, which tensors are state and
which constants, the refusals of what the export cannot take, and README.md's example, run as written.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vktrain.contract import HPARAMS, TRAIN_METHOD, hparams_values
from vktrain.export import export_training_and_eval_steps, export_training_step, lower_methods_to_pte, lower_to_pte
from vktrain.export.step_graph import StepInputError
from vktrain.export.training import StepExportError
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.runtime.delegate.executor import GraphExecutor
from vktrain.serialization.pte import DelegateCall, PteFile
from vktrain.serialization.verify import load_delegate_graph

from _helpers import LOSS_RTOL, TrainingReference, _cast_floating, assert_training_matches_reference, readme_snippet
from _helpers import planned

STEPS = 10
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
HPARAMS_ARRAY = np.array(hparams_values(LR, *BETAS, EPS, WEIGHT_DECAY), np.float32)


class ResidualMLP(nn.Module):
    """A regression MLP with a residual block; its forward returns the loss (no `loss` method)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 16))  # a buffer: a constant of the step

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x - self.shift))
        h = h + torch.tanh(self.block(h))
        return ((self.out(h) - target) ** 2).sum() / target.numel()


class FrozenEncoderClassifier(nn.Module):
    """A frozen float encoder (plain float weights, requires_grad off) under a trainable linear head;
    `loss` is the cross-entropy of one-hot targets (the forward returns logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(24, 48)
        self.encoder.requires_grad_(False)
        self.register_buffer("mean", torch.randn(24, generator=torch.Generator().manual_seed(5)))
        self.head_weight = nn.Parameter(0.1 * torch.randn(10, 48, generator=torch.Generator().manual_seed(6)))
        self.head_bias = nn.Parameter(torch.zeros(10))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.silu(self.encoder(features - self.mean)) @ self.head_weight.t() + self.head_bias

    def loss(self, features: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        logits = self.forward(features)
        shift = logits.detach().amax(-1, keepdim=True)  # logsumexp's shift: the gradient does not depend on it
        logsumexp = (logits - shift).exp().sum(-1).log() + shift.squeeze(-1)
        return (logsumexp - (logits * onehot).sum(-1)).mean(0)


class GramRegressor(nn.Module):
    """A loss through torch.bmm and a plain `.mean()` (aten.mean.default, which the export once left outside
    the delegate: "model.inp.lora_A is read but nothing writes it")."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return ((torch.bmm(h, h.transpose(1, 2)) / 32 - target) ** 2).mean()


def _gram_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(13)
    true_map = torch.randn(16, 16, generator=generator) / 2
    distinct = []
    for _ in range(2):
        x = torch.randn(2, 4, 16, generator=generator)
        y = x @ true_map
        distinct.append((x, torch.bmm(y, y.transpose(1, 2)) / 16))
    return [distinct[i % 2] for i in range(count)]


def _gram_regressor_with_lora() -> nn.Module:
    torch.manual_seed(0)
    model = GramRegressor()
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=16, seed=0))
    return model


def _regression_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    true_map = torch.randn(16, 8, generator=generator) / 4
    batches = []
    for _ in range(count):
        x = torch.randn(4, 16, generator=generator)
        batches.append((x, torch.tanh(x @ true_map)))  # a learnable map, so the loss must fall
    return batches


def _classification_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches in turn (ten steps of fresh batches would not show a 10-class head learning)."""
    generator = torch.Generator().manual_seed(12)
    distinct = []
    for _ in range(2):
        features = torch.randn(6, 24, generator=generator)
        labels = features[:, :10].argmax(-1)
        distinct.append((features, F.one_hot(labels, 10).to(torch.float32)))
    return [distinct[i % 2] for i in range(count)]


def _residual_mlp_with_lora() -> nn.Module:
    torch.manual_seed(0)
    model = ResidualMLP()
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=16, seed=0))  # q4gsw bases
    return model


def _frozen_encoder_classifier() -> nn.Module:
    torch.manual_seed(0)
    return FrozenEncoderClassifier()


def eager_adamw_training(model: nn.Module, batches, hparams: np.ndarray = HPARAMS_ARRAY, *, dtype=None):
    """torch.optim.AdamW over the parameters with requires_grad of a copy of `model`, one step per batch
    through its loss (the `loss` method, else the forward); in float64 with dtype=torch.float64 (q4gsw
    scales stay float32: dequantization is exact either way). Returns (losses, final trainable tensors,
    final AdamW first moments) by parameter name."""
    model = copy.deepcopy(model)
    if dtype is not None:
        _cast_floating(model, dtype)
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    lr, beta1, beta2, eps, weight_decay = (float(value) for value in hparams)
    optimizer = torch.optim.AdamW(params.values(), lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    loss_function = getattr(model, "loss", model)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_function(*(t.to(dtype) if dtype is not None else t for t in batch))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {name: param.detach().numpy().copy() for name, param in params.items()}
    exp_avg = {name: optimizer.state[param]["exp_avg"].numpy().copy() for name, param in params.items()}
    return losses, state, exp_avg


def device_training(pte_bytes: bytes, device, batches, names: list[str]):
    """Run the .pte's training method on the device, one step per batch (its inputs, then hparams).
    Returns (losses, final trainable tensors, final AdamW first moments) by parameter name."""
    pte = PteFile.from_bytes(pte_bytes, source="user_step.pte")
    _, graph = load_delegate_graph(pte, pte.execution_plan(TRAIN_METHOD))
    with GraphExecutor(device, graph, planned(device, graph)) as executor:
        losses = []
        for batch in batches:
            (loss,) = executor.run(*(t.numpy() for t in batch), HPARAMS_ARRAY)
            losses.append(float(loss))
        state = {name: executor.read_state("model." + name) for name in names}
        exp_avg = {name: executor.read_state("optimizer.exp_avg." + name) for name in names}
    return losses, state, exp_avg


@pytest.mark.parametrize("make_model, make_batches, loss_inputs, trainable", [
    (_residual_mlp_with_lora, _regression_batches, ["x", "target"],
     [f"{layer}.lora_{which}" for layer in ("inp", "block", "out") for which in "AB"]),
    (_frozen_encoder_classifier, _classification_batches, ["features", "onehot"], ["head_weight", "head_bias"]),
    (_gram_regressor_with_lora, _gram_batches, ["x", "target"], ["inp.lora_A", "inp.lora_B"]),
], ids=["residual-mlp-q4gsw-lora", "frozen-float-encoder", "bmm-mean-loss"])
def test_a_user_module_trains_ten_steps_like_eager_adamw(vk_device, make_model, make_batches, loss_inputs, trainable):
    model = make_model()
    batches = make_batches(STEPS)
    initial = {name: param.detach().numpy().copy() for name, param in model.named_parameters()}
    program = export_training_step(model, example_inputs=batches[0])

    # The signature: the loss's inputs then hparams; state = the trainable tensors and their optimizer
    # state; frozen parameters and buffers are constants.
    assert list(program.graph_signature.user_inputs) == loss_inputs + [HPARAMS]
    mutated = sorted(program.graph_signature.buffers_to_mutate.values())
    assert mutated == sorted(["model." + n for n in trainable] + ["optimizer.step"]
                             + [f"optimizer.{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in trainable])
    frozen = {"model." + name for name, _ in model.named_buffers()} | \
        {"model." + name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen <= set(program.graph_signature.inputs_to_buffers.values()) and not frozen & set(mutated)

    pte_bytes = lower_to_pte(program)
    plan = PteFile.from_bytes(pte_bytes).execution_plan(TRAIN_METHOD)
    assert [type(i) for i in plan.instructions] == [DelegateCall]  # ONE delegate, nothing outside it

    reference = TrainingReference(*eager_adamw_training(model, batches, dtype=torch.float64),
                                  *eager_adamw_training(model, batches))
    losses, state, exp_avg = device_training(pte_bytes, vk_device, batches, trainable)
    assert sorted(reference.state) == sorted(trainable)
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it trains
    assert_training_matches_reference(losses, state, exp_avg, reference, {n: initial[n] for n in trainable})


def test_the_eval_method_of_a_user_module_takes_the_loss_inputs(vk_device):
    model = _frozen_encoder_classifier()
    batch = _classification_batches(1)[0]
    step, evaluation = export_training_and_eval_steps(model, example_inputs=batch)
    assert list(evaluation.graph_signature.user_inputs) == ["features", "onehot"]
    assert not evaluation.graph_signature.buffers_to_mutate
    pte = PteFile.from_bytes(lower_methods_to_pte({TRAIN_METHOD: step, "eval": evaluation}))
    _, graph = load_delegate_graph(pte, pte.execution_plan("eval"))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        (loss,) = executor.run(*(t.numpy() for t in batch))
    with torch.no_grad():
        expected = model.double().loss(*(t.double() for t in batch)).item()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_what_the_export_refuses():
    model = _residual_mlp_with_lora()
    x, target = _regression_batches(1)[0]
    with pytest.raises(StepExportError, match="exactly one of the two"):
        export_training_step(model, (1, 4), example_inputs=(x, target))
    with pytest.raises(StepExportError, match="exactly one of the two"):
        export_training_step(model)
    with pytest.raises(StepExportError, match=r"ResidualMLP.forward cannot take the 3 example input\(s\)"):
        export_training_step(model, example_inputs=(x, target, target))
    with pytest.raises(StepExportError, match=r"example inputs \['target'\] .* are not tensors"):
        export_training_step(model, example_inputs=(x, 0.5))
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(StepExportError, match="no parameter of ResidualMLP requires grad: nothing to train"):
        export_training_step(frozen, example_inputs=(x, target))

    class NotScalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    with pytest.raises(StepExportError, match=r"NotScalar's loss must be a float32 scalar tensor, got .*32 \[3\]"):
        export_training_step(NotScalar(), example_inputs=(torch.ones(3),))

    class CumulativeLoss(NotScalar):  # once: "GraphError: value 0 (model.weight) is read but nothing writes it"
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cumsum(x * self.weight, 0).sum()

    with pytest.raises(StepExportError, match=r"training step of CumulativeLoss .* cannot run: aten\.cumsum\.default"):
        export_training_step(CumulativeLoss(), example_inputs=(torch.ones(3),))

    class TakesHparams(NotScalar):
        def forward(self, hparams: torch.Tensor) -> torch.Tensor:
            return (hparams * self.weight).sum()

    with pytest.raises(StepInputError, match="the loss takes an input named 'hparams'"):
        export_training_step(TakesHparams(), example_inputs=(torch.ones(3),))

    class IgnoresAParameter(NotScalar):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.weight).sum()

    with pytest.raises(StepExportError, match=r"trainable parameters \['unused'\] of IgnoresAParameter do not affect"):
        export_training_step(IgnoresAParameter(), example_inputs=(torch.ones(3),))


def test_the_readme_example_runs_and_trains_like_eager(vk_device, tmp_path, monkeypatch):
    """README.md's snippet as written (its own Device; vk_device skips the test where Vulkan is missing)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_snippet("## Training any module"), "README.md", "exec"), namespace)
    assert (tmp_path / "regressor.pte").exists()
    losses = namespace["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0]
    # The same ten steps in eager float64 from the module as exported (export copies it: the snippet's
    # LoRA init), on the snippet's batch and hparams.
    batch = (namespace["x"], namespace["target"])
    expected, _, _ = eager_adamw_training(namespace["model"], [batch] * 10, namespace["hparams"], dtype=torch.float64)
    np.testing.assert_allclose(losses, expected, rtol=LOSS_RTOL)

"""A Hugging Face checkpoint trained by vktrain on the Vulkan device against the reference a user would
otherwise run: transformers' own modeling code + PEFT LoRA + torch.optim.AdamW.

The checkpoint is a tiny random Llama (transformers 5 `rope_parameters`, tied head, GQA) saved to a temp
dir and brought in through the front door (`vktrain.models.load`). vktrain freezes its linears as q4gsw,
so the reference's frozen linears get the same dequantized q4gsw weights; PEFT wraps it with LoRA on
all-linear (never the head, as vktrain's default) and the same initial A/B; both train 20 steps on the same
batches with the same hyper-parameters. The reference runs in float64 (CPU-independent), and PyTorch's
own float32 run must meet the same bounds (tests/_helpers.py: LOSS_RTOL, DELTA_REL_FROB and why).
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora, lora_modules
from vktrain.models import load
from vktrain.runtime.program.runner import TrainingRunner

from _helpers import DELTA_REL_FROB, LOSS_RTOL, relative_frobenius_error
from vktrain.backend.kernel_planning import plan_schedule

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, DIM, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 2, 4, 2
BATCH, SEQ, STEPS = 2, 16, 20
RANK, ALPHA = 4, 8.0
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_checkpoint(directory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) activations: HF's 0.02 init leaves attention near-uniform
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif param.dim() == 2:
                fan_in = 1 if "embed" in name else param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    model.save_pretrained(directory)


def _batches():
    """Token sequences whose label is a fixed function of the current and previous token (attention must
    look back), about 15% of the labels ignored (-100, as transformers ignores them)."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        token_ids = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        labels = (token_ids + 3 * torch.roll(token_ids, 1, dims=1)) % 32
        labels[torch.rand((BATCH, SEQ), generator=generator) < 0.15] = -100
        yield token_ids, labels


def peft_model(directory, vk_model, dtype):
    """transformers' LlamaForCausalLM from the same checkpoint, frozen linears replaced by vktrain's
    dequantized q4gsw weights, PEFT LoRA (all-linear) initialised with vktrain's A/B. Returns (the PEFT
    model, its LoRA layers by vktrain module path, torch AdamW over them)."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager").to(dtype)
    adapters = lora_modules(vk_model)
    with torch.no_grad():
        for path, adapter in adapters.items():
            model.get_submodule(path).weight.copy_(adapter.dequantized_weight().to(dtype))
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, bias="none")
    model = peft.get_peft_model(model, lora)
    peft_layers = {name.removeprefix("base_model.model."): module for name, module in model.named_modules()
                   if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert sorted(peft_layers) == sorted(adapters)  # PEFT's all-linear adapts exactly what vktrain adapts
    with torch.no_grad():
        for path, layer in peft_layers.items():
            layer.lora_A["default"].weight.copy_(adapters[path].lora_A.detach().to(dtype))
            layer.lora_B["default"].weight.copy_(adapters[path].lora_B.detach().to(dtype))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(adapters)
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return model, peft_layers, optimizer


def peft_lora_state(peft_layers) -> dict[str, np.ndarray]:
    """The PEFT LoRA tensors by vktrain parameter name, float64."""
    state = {}
    for path, layer in peft_layers.items():
        state[f"{path}.lora_A"] = layer.lora_A["default"].weight.detach().double().numpy()
        state[f"{path}.lora_B"] = layer.lora_B["default"].weight.detach().double().numpy()
    return state


def _peft_reference(directory, vk_model, dtype):
    """peft_model trained on _batches() with torch AdamW. Returns (per-step losses, trained PEFT LoRA
    tensors by vktrain parameter name)."""
    model, peft_layers, optimizer = peft_model(directory, vk_model, dtype)
    losses = []
    for token_ids, labels in _batches():
        optimizer.zero_grad()
        logits = model(input_ids=token_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, peft_lora_state(peft_layers)


@pytest.fixture(scope="module")
def hf_program(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama")
    _hf_checkpoint(directory)
    model = load(directory).model
    report = apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=32, seed=0, scale_rule="mse"))
    assert report.excluded_heads == ["lm_head"]
    assert sorted({path.rsplit(".", 1)[1] for path in report.replaced}) == sorted(ADAPTED)
    path = directory / "step.pte"
    path.write_bytes(lower_to_pte(export_training_step(copy.deepcopy(model), (BATCH, SEQ))))
    return directory, path, model


def test_twenty_steps_match_transformers_peft_adamw(vk_device, hf_program):
    directory, path, model = hf_program
    initial = {name: param.detach().double().numpy() for name, param in model.named_parameters()
               if name.endswith(("lora_A", "lora_B"))}
    exact_losses, exact_state = _peft_reference(directory, model, torch.float64)
    single_losses, single_state = _peft_reference(directory, model, torch.float32)
    hparams = np.array([LR, *BETAS, EPS, WEIGHT_DECAY], np.float32)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        losses = [runner.step(t.numpy(), l.numpy(), hparams) for t, l in _batches()]
        ours = {name.removeprefix("model."): value for name, value in runner.lora_state().items()}
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1  # it trains
    assert sorted(ours) == sorted(exact_state)
    for label, run_losses, run_state in (("vktrain", losses, ours), ("torch float32", single_losses, single_state)):
        np.testing.assert_allclose(run_losses, exact_losses, rtol=LOSS_RTOL,
                                   err_msg=f"{label}: per-step losses vs transformers + PEFT in float64")
        for name in exact_state:
            error = relative_frobenius_error(run_state[name] - initial[name], exact_state[name] - initial[name])
            assert error <= DELTA_REL_FROB, f"{label}: {name}: trained delta off by {error:.2e} (relative)"

"""mlp-lora: a byte-level token MLP (embedding -> Linear+activation layers -> head), the smallest model
whose training step exercises every piece of the pipeline (q4gsw linears, LoRA, fused CE, AdamW)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)

from .registry import register_model

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 256  # bytes
    dim: int = 64
    hidden: int = 128
    n_layers: int = 2
    activation: str = "relu"
    bias: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "hidden", "n_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLPConfig.{name} must be positive, got {getattr(self, name)}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"MLPConfig.activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}")


class MLPLanguageModel(nn.Module):
    """logits[b, s] = head(act(layers[-1](... act(layers[0](embed(ids[b, s])))))): one token at a time."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)  # reproducible weights without disturbing the caller's RNG
        try:
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            widths = [config.dim] + [config.hidden] * config.n_layers
            self.layers = nn.ModuleList(
                nn.Linear(widths[i], widths[i + 1], bias=config.bias) for i in range(config.n_layers))
            self.act = _ACTIVATIONS[config.activation]()
            self.head = nn.Linear(widths[-1], config.vocab_size, bias=config.bias)
        finally:
            torch.random.set_rng_state(generator_state)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(token_ids)
        for layer in self.layers:
            h = self.act(layer(h))
        return self.head(h)

    def loss(self, token_ids: torch.Tensor, labels: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over labels >= 0, divided by the runtime input n_valid (float32 [])."""
        logits = self.forward(token_ids)
        loss, _ = torch.ops.vktrain.fused_ce(logits.reshape(-1, self.vocab_size), labels.reshape(-1), n_valid)
        return loss


@register_model("mlp-lora")
def build_mlp(**overrides) -> MLPLanguageModel:
    known = {f.name for f in fields(MLPConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown mlp-lora config field(s) {unknown}; known fields: {sorted(known)}")
    return MLPLanguageModel(MLPConfig(**overrides))

"""Built-in models by name. A factory takes keyword overrides of the model's config and returns an
nn.Module with float nn.Linear layers (LoRA is inserted afterwards by vktrain.lora.apply_lora).

Every model implements `forward(token_ids [B, S] int64) -> logits [B, S, V]` and
`loss(token_ids, labels, n_valid) -> loss []` (fused cross-entropy; labels < 0 are ignored).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

ModelFactory = Callable[..., nn.Module]
_MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    def decorate(factory: ModelFactory) -> ModelFactory:
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = factory
        return factory
    return decorate


def available_models() -> list[str]:
    return sorted(_MODELS)


def build_model(name: str, **overrides) -> nn.Module:
    """Build a registered model; keyword overrides replace fields of its default config."""
    try:
        factory = _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(available_models())}") from None
    return factory(**overrides)

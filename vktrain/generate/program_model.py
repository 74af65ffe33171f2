"""The torch model a training-step .pte was exported from, rebuilt from the program itself: its recorded
model config, its frozen constants as they are (the q4gsw codes and scales of every adapted layer, the
float weights of the rest) and the LoRA tensors given. Generation programs exported from it run exactly
the base the adapters were trained through, with no source checkpoint, seed or quantization flags needed.
"""
from __future__ import annotations

import os
from typing import Mapping, Union

import numpy as np
import torch

from vktrain.contract import MODEL_PREFIX
from vktrain.errors import VktrainError
from vktrain.quant import unpack_w4x8
from vktrain.train.adapters import adapters_from_state
from vktrain.train.merge import program_weights


class ProgramModelError(VktrainError, ValueError):
    """A program whose model cannot be rebuilt (not a Llama-family step, adapters that do not fit)."""


def model_from_program(program: Union[str, os.PathLike], lora_state: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """LlamaForCausalLM with LoRAQ4Linear layers holding `program`'s constants and `lora_state`
    ({"model.<layer>.lora_A" / ".lora_B": array}, every adapted layer's)."""
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models.llama import LlamaConfig, LlamaForCausalLM

    weights, bases, recorded = program_weights(program)
    adapters = adapters_from_state({name: array for name, array in lora_state.items() if name.startswith(MODEL_PREFIX)})
    if sorted(adapters) != sorted(bases):
        raise ProgramModelError(f"{program}: the adapters ({len(adapters)} layers) are not those of the program's "
                                f"q4gsw layers ({len(bases)}): missing {sorted(set(bases) - set(adapters))[:4]}, "
                                f"unknown {sorted(set(adapters) - set(bases))[:4]}")
    ranks = {lora_a.shape[0] for lora_a, _ in adapters.values()}
    if len(ranks) != 1 or recorded.lora_alpha is None:
        raise ProgramModelError(f"{program}: the adapters need one rank (got {sorted(ranks)}) and a recorded lora_alpha")
    fields = dict(recorded.model_config)
    if fields.get("rope_freq_factors") is not None:
        fields["rope_freq_factors"] = tuple(fields["rope_freq_factors"])
    model = LlamaForCausalLM(LlamaConfig(**fields))
    in_features = {name: module.in_features for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)}
    group_sizes = {in_features[module] // scales.shape[0] for module, (_, scales) in bases.items()}
    if len(group_sizes) != 1:
        raise ProgramModelError(f"{program}: q4gsw layers of several group sizes {sorted(group_sizes)}")
    # The bases apply_lora quantizes are replaced below by the program's own codes and scales.
    apply_lora(model, LoRAConfig(rank=ranks.pop(), alpha=recorded.lora_alpha, targets=tuple(sorted(bases)),
                                 group_size=group_sizes.pop(), scale_rule="absmax"))
    state = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in weights.items()}
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for module, (words, scales) in bases.items():
        flat = unpack_w4x8(words, scales.shape[1], in_features[module])
        lora_a, lora_b = adapters[module]
        state.update({f"{module}.weights": torch.from_numpy(flat), f"{module}.scales": torch.from_numpy(scales.copy()),
                      f"{module}.lora_A": torch.from_numpy(np.array(lora_a, np.float32)),
                      f"{module}.lora_B": torch.from_numpy(np.array(lora_b, np.float32))})
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ProgramModelError(f"{program}: its constants do not form the recorded model: {exc}") from None
    return model.eval()


__all__ = ["ProgramModelError", "model_from_program"]

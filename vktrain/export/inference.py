"""Export the inference forward (token ids -> logits), with or without the LoRA adapters."""
from __future__ import annotations

import torch
from torch import nn
from torch.export import ExportedProgram

from vktrain.lora import lora_modules

from .training import check_batch_shape, in_registry_ops, traceable_copy


class _ForwardModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids)


def export_forward(model: nn.Module, batch_shape: tuple[int, int], with_adapters: bool = True) -> ExportedProgram:
    """Program `token_ids int64 [B, S] -> logits float32 [B, S, V]`; all weights are frozen constants.

    with_adapters=False exports the q4gsw base alone (every LoRAQ4Linear's adapter disabled). torchao int4
    linears lower as linear_q4gsw on torchao's codes and scales (traceable_copy)."""
    batch_size, seq_len = check_batch_shape(batch_shape)
    model = traceable_copy(model).eval()  # torchao's int4 linears as frozen linear_q4gsw
    for param in model.parameters():
        param.requires_grad_(False)
    for adapter in lora_modules(model).values():
        adapter.adapter_enabled = with_adapters
    token_ids = torch.zeros((batch_size, seq_len), dtype=torch.int64)
    with torch.no_grad():
        return in_registry_ops(torch.export.export(_ForwardModule(model), (token_ids,)))

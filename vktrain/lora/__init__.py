"""LoRA adapters over a frozen q4gsw base."""
from vktrain.serialization.peft_adapters import PEFT_PREFIX

from .inject import (
    ALL_LINEAR,
    LoRAConfig,
    LoRAInsertionError,
    LoRAReport,
    apply_lora,
    load_adapters,
    lora_modules,
    lora_parameter_names,
    lora_state_dict,
    output_head_paths,
    peft_name,
)
from .layers import PREQUANTIZED_ATTR, LoRAQ4Linear, Q4GSWWeight
from .torchao_weights import Q4GSWLinear, TorchaoWeightError, replace_torchao_linears

__all__ = [
    "ALL_LINEAR", "PEFT_PREFIX", "PREQUANTIZED_ATTR", "LoRAConfig", "LoRAInsertionError", "LoRAReport", "LoRAQ4Linear",
    "Q4GSWLinear", "Q4GSWWeight", "TorchaoWeightError", "replace_torchao_linears", "apply_lora", "load_adapters",
    "lora_modules", "lora_parameter_names", "lora_state_dict",
    "output_head_paths", "peft_name",
]

"""LoRA adapters over a frozen q4gsw base."""
from vktrain.train.adapters import PEFT_PREFIX

from .inject import (
    LoRAConfig,
    LoRAInsertionError,
    LoRAReport,
    apply_lora,
    load_adapters,
    lora_modules,
    lora_parameter_names,
    lora_state_dict,
    peft_name,
)
from .layers import LoRAQ4Linear

__all__ = [
    "PEFT_PREFIX", "LoRAConfig", "LoRAInsertionError", "LoRAReport", "LoRAQ4Linear", "apply_lora", "load_adapters",
    "lora_modules", "lora_parameter_names", "lora_state_dict", "peft_name",
]

"""LoRA adapter files in PEFT's format, read torch-free (numpy + safetensors): names, config, tensors.

The AOT side (vktrain.lora: apply a trained adapter before export) and the app (vktrain train / eval /
merge, vktrain/train/adapters.py, which also writes them) both read adapter directories with this one
reader. An adapter directory holds
  adapter_model.safetensors   base_model.model.<module path>.lora_A.weight  float32 [r, in_features]
                              base_model.model.<module path>.lora_B.weight  float32 [out_features, r]
  adapter_config.json         PEFT LoraConfig fields (peft_type "LORA", r, lora_alpha, target_modules, ...)
"""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Union

import numpy as np
import safetensors
import safetensors.numpy

from vktrain.errors import VktrainError

PathLike = Union[str, os.PathLike]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
LORA_PARTS = ("lora_A", "lora_B")
LORA_SUFFIXES = tuple("." + part for part in LORA_PARTS)  # state names of adapter tensors end so


class AdapterError(VktrainError, ValueError):
    """Adapter tensors or files that do not form valid LoRA adapters."""


def peft_name(module_path: str, part: str) -> str:
    """('layers.0', 'lora_A') -> 'base_model.model.layers.0.lora_A.weight'."""
    if part not in LORA_PARTS:
        raise ValueError(f"LoRA part must be one of {LORA_PARTS}, got {part!r}")
    return f"{PEFT_PREFIX}{module_path}.{part}.weight"


def check_pair(module: str, lora_a: np.ndarray, lora_b: np.ndarray) -> None:
    if lora_a.ndim != 2 or lora_b.ndim != 2:
        raise AdapterError(f"{module}: lora_A and lora_B must be 2-D, got {list(lora_a.shape)} and {list(lora_b.shape)}")
    if lora_a.shape[0] != lora_b.shape[1]:
        raise AdapterError(f"{module}: lora_A is [r, in] and lora_B is [out, r] with the same r; got "
                           f"{list(lora_a.shape)} and {list(lora_b.shape)}")


def load_adapter_config(directory: PathLike) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{path} does not exist: not an adapter directory") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    return config


def load_adapters(directory: PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module path: (A [r, in], B [out, r])} from an adapter directory written by `save_adapters` (or PEFT)."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{path} does not exist: not an adapter directory")
    try:
        tensors = safetensors.numpy.load(path.read_bytes())
    except Exception as exc:  # safetensors' own error types for a corrupt file
        raise AdapterError(f"{path} is not a readable safetensors file: {exc}") from None
    parts: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    for name, array in tensors.items():
        stem = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else None
        if stem is None or not stem.endswith(".weight"):
            raise AdapterError(f"{path}: tensor {name!r} is not named {PEFT_PREFIX}<module>.lora_A|lora_B.weight")
        module, _, part = stem[:-len(".weight")].rpartition(".")
        if part not in LORA_PARTS or not module:
            raise AdapterError(f"{path}: tensor {name!r} is not named {PEFT_PREFIX}<module>.lora_A|lora_B.weight")
        parts[module][part] = array
    adapters = {}
    for module, pair in sorted(parts.items()):
        missing = [p for p in LORA_PARTS if p not in pair]
        if missing:
            raise AdapterError(f"{path}: module {module!r} has no {missing}")
        check_pair(module, pair["lora_A"], pair["lora_B"])
        adapters[module] = (pair["lora_A"], pair["lora_B"])
    return adapters

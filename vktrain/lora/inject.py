"""Insert LoRAQ4Linear adapters into a model in place of selected nn.Linear layers.

Targets are module-name patterns: shell-style globs (`layers.*.up`), or regular expressions prefixed with
`re:` (`re:layers\\.[02]\\..*`), matched against the full dotted module path. Several patterns may be
given as a list or a comma-separated string; a layer is targeted when any pattern matches.

The default, ALL_LINEAR ("all-linear", as in PEFT), is every nn.Linear except the output head: the module
`model.get_output_embeddings()` returns (transformers' convention, which LlamaForCausalLM follows) or,
for models without that method, a module named `lm_head`. Adapting the head would quantize it to 4 bits
and, where it is tied to the embedding, untie it; name it explicitly (`lm_head`, or `*`) to adapt it.
"""
from __future__ import annotations

import fnmatch
import re
import warnings
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
from torch import nn

from vktrain.quant import SCALE_RULES, check_q4gsw_shapes

from vktrain.serialization import peft_adapters as peft_files  # torch-free PEFT naming and files: one implementation

from .layers import LoRAQ4Linear
from .torchao_weights import torchao_q4gsw
from vktrain.errors import VktrainError



@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: str | tuple[str, ...] = "all-linear"  # ALL_LINEAR
    group_size: int = 32
    seed: int | None = None  # seeds lora_A's init (None: torch's global RNG)
    # q4gsw scale rule for the frozen bases (vktrain.quant.SCALE_RULES). "absmax" stays the library default
    # (tests and references pin it); `vktrain export` defaults to "mse" (24-30% less squared error).
    scale_rule: str = "absmax"

    def patterns(self) -> list[str]:
        raw = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        patterns = [p.strip() for item in raw for p in item.split(",") if p.strip()]
        if not patterns:
            raise ValueError(f"LoRA targets must name at least one module pattern, got {self.targets!r}")
        return patterns


ALL_LINEAR = "all-linear"


def output_head_paths(model: nn.Module) -> set[str]:
    """Module paths of the model's output head (see the module docstring)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None:
        return {name for name, module in model.named_modules() if module is head}
    return {name for name, _ in model.named_modules() if name.rpartition(".")[2] == "lm_head"}


@dataclass
class LoRAReport:
    """What apply_lora did: replaced layer paths, skipped ones with the reason each was skipped, and the
    output head(s) that "all-linear" left out."""
    replaced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    excluded_heads: list[str] = field(default_factory=list)


def _matches(path: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], path):
                return True
        elif fnmatch.fnmatchcase(path, pattern):
            return True
    return False


class LoRAInsertionError(VktrainError, ValueError):
    """The model would have nothing to train."""


def apply_lora(model: nn.Module, config: LoRAConfig,
               importance: Mapping[str, np.ndarray] | None = None) -> LoRAReport:
    """Replace each nn.Linear whose path matches `config.targets` with a LoRAQ4Linear, in place.

    `importance` (module path -> mean squared input activation per input column, from
    vktrain.lora.calibration.input_importance) weights the "mse" scale search of those layers.

    Every parameter of the model is frozen first; only the inserted lora_A / lora_B train. Layers whose
    shape the q4gsw op refuses (N % 4, K % 4, K % group_size) stay as they are, with one warning each.
    A linear quantized by torchao (int4, symmetric, per group: vktrain/lora/torchao_weights.py) keeps its
    codes, scales and group size (config.group_size and scale_rule do not apply to it).
    Raises LoRAInsertionError when no layer was replaced (nothing to train).
    """
    if config.rank <= 0:
        raise ValueError(f"LoRA rank must be a positive integer, got {config.rank}")
    if config.scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown q4gsw scale rule {config.scale_rule!r}; rules: {', '.join(SCALE_RULES)}")
    patterns = config.patterns()
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"invalid regular expression in LoRA target {p!r}: {e}") from None
    for param in model.parameters():
        param.requires_grad_(False)

    generator = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    linear_paths = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    report = LoRAReport()
    all_linear, explicit = ALL_LINEAR in patterns, [p for p in patterns if p != ALL_LINEAR]
    heads = output_head_paths(model)
    owners: dict[int, list[str]] = {}  # parameter id -> the modules holding it (tied weights: several)
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    for path in linear_paths:
        if not _matches(path, explicit):
            if all_linear and path in heads:
                report.excluded_heads.append(path)
            if not all_linear or path in heads:
                continue
        linear = model.get_submodule(path)
        tied = [owner for owner in owners.get(id(linear.weight), []) if owner != path]
        if tied:
            warnings.warn(f"LoRA: adapting '{path}' unties its weight from {tied}: the layer gets its own 4-bit "
                          f"copy while the others keep the float weight", stacklevel=2)
        torchao_base = torchao_q4gsw(linear, path)
        try:
            check_q4gsw_shapes(linear.out_features, linear.in_features,
                               config.group_size if torchao_base is None else torchao_base.group_size)
        except ValueError as e:
            reason = str(e)
            report.skipped[path] = reason
            warnings.warn(f"LoRA: leaving layer '{path}' as a plain nn.Linear: {reason}", stacklevel=2)
            continue
        if torchao_base is not None:
            adapter = LoRAQ4Linear(linear.in_features, linear.out_features, torch.from_numpy(torchao_base.flat),
                                   torch.from_numpy(torchao_base.scales), torchao_base.group_size, config.rank,
                                   config.alpha, linear.bias, generator)
        else:
            adapter = LoRAQ4Linear.from_linear(linear, config.rank, config.alpha, config.group_size, generator,
                                               scale_rule=config.scale_rule,
                                               importance=None if importance is None else importance.get(path))
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, adapter)
        report.replaced.append(path)

    if not report.replaced:
        if report.skipped:
            detail = "; ".join(f"{p}: {r}" for p, r in report.skipped.items())
            raise LoRAInsertionError(f"no layer can take a LoRA adapter (every matching layer was refused): {detail}")
        raise LoRAInsertionError(
            f"no nn.Linear layer matches LoRA targets {patterns}; the model's linear layers are "
            f"{linear_paths if linear_paths else 'none'}: nothing to train")
    return report


def lora_modules(model: nn.Module) -> dict[str, LoRAQ4Linear]:
    """Path -> LoRAQ4Linear for every adapter in the model, in module order."""
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LoRAQ4Linear)}


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Dotted parameter paths of every LoRA tensor (`<layer>.lora_A`, `<layer>.lora_B`), in module order."""
    return [f"{path}.{which}" for path in lora_modules(model) for which in ("lora_A", "lora_B")]


def peft_name(parameter_path: str) -> str:
    """`layers.0.up.lora_A` -> `base_model.model.layers.0.up.lora_A.weight` (PEFT's adapter file naming)."""
    layer, _, which = parameter_path.rpartition(".")
    if which not in ("lora_A", "lora_B") or not layer:
        raise ValueError(f"expected a LoRA parameter path '<layer>.lora_A' or '<layer>.lora_B', got {parameter_path!r}")
    return peft_files.peft_name(layer, which)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors (detached copies), ready for safetensors."""
    return {peft_name(name): model.get_parameter(name).detach().clone().contiguous()
            for name in lora_parameter_names(model)}


def load_adapters(model: nn.Module, directory) -> list[str]:
    """Load PEFT-format adapters (as `vktrain train --out-adapters` writes them) into a LoRA model.

    Every adapted module of the file must be a LoRA layer of `model` with matching shapes, and every LoRA
    layer of `model` must be in the file: a partial load would silently train or evaluate something else.
    Returns the module paths loaded."""
    adapters = peft_files.load_adapters(directory)
    layers = lora_modules(model)
    unknown = sorted(set(adapters) - set(layers))
    missing = sorted(set(layers) - set(adapters))
    if unknown or missing:
        raise ValueError(f"adapters in {directory} do not match the model's LoRA layers: "
                         f"not in the model {unknown}, not in the file {missing}")
    with torch.no_grad():
        for path, (lora_a, lora_b) in adapters.items():
            layer = layers[path]
            for name, array in (("lora_A", lora_a), ("lora_B", lora_b)):
                param = getattr(layer, name)
                if tuple(array.shape) != tuple(param.shape):
                    raise ValueError(f"{path}.{name}: file has shape {list(array.shape)}, model expects {list(param.shape)}")
                param.copy_(torch.from_numpy(array.astype("float32", copy=False)))
    return sorted(adapters)

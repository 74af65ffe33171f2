"""Insert LoRAQ4Linear adapters into a model in place of selected nn.Linear layers.

Targets are module-name patterns: shell-style globs (`layers.*.up`), or regular expressions prefixed with
`re:` (`re:layers\\.[02]\\..*`), matched against the full dotted module path. Several patterns may be
given as a list or a comma-separated string; a layer is targeted when any pattern matches.
"""
from __future__ import annotations

import fnmatch
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from vktrain.quant import check_q4gsw_shapes

from vktrain.train import adapters as peft_files  # torch-free PEFT naming and files: one implementation

from .layers import LoRAQ4Linear
from vktrain.errors import VktrainError



@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: str | tuple[str, ...] = "*"
    group_size: int = 32
    seed: int | None = None  # seeds lora_A's init (None: torch's global RNG)

    def patterns(self) -> list[str]:
        raw = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        patterns = [p.strip() for item in raw for p in item.split(",") if p.strip()]
        if not patterns:
            raise ValueError(f"LoRA targets must name at least one module pattern, got {self.targets!r}")
        return patterns


@dataclass
class LoRAReport:
    """What apply_lora did: replaced layer paths, and skipped ones with the reason each was skipped."""
    replaced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


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


def apply_lora(model: nn.Module, config: LoRAConfig) -> LoRAReport:
    """Replace each nn.Linear whose path matches `config.targets` with a LoRAQ4Linear, in place.

    Every parameter of the model is frozen first; only the inserted lora_A / lora_B train. Layers whose
    shape the q4gsw op refuses (N % 4, K % 4, K % group_size) stay as they are, with one warning each.
    Raises LoRAInsertionError when no layer was replaced (nothing to train).
    """
    if config.rank <= 0:
        raise ValueError(f"LoRA rank must be a positive integer, got {config.rank}")
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
    for path in linear_paths:
        if not _matches(path, patterns):
            continue
        linear = model.get_submodule(path)
        try:
            check_q4gsw_shapes(linear.out_features, linear.in_features, config.group_size)
        except ValueError as e:
            reason = str(e)
            report.skipped[path] = reason
            warnings.warn(f"LoRA: leaving layer '{path}' as a plain nn.Linear: {reason}", stacklevel=2)
            continue
        adapter = LoRAQ4Linear.from_linear(linear, config.rank, config.alpha, config.group_size, generator)
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

"""LoRA adapters in PEFT's format (numpy + safetensors, no torch): writing them, and a program's adapters.

The format and its reader are vktrain/serialization/peft_adapters.py (the AOT side reads adapters too).

An adapter directory holds
  adapter_model.safetensors   base_model.model.<module path>.lora_A.weight  float32 [r, in_features]
                              base_model.model.<module path>.lora_B.weight  float32 [out_features, r]
                              (header metadata {"format": "pt"}, which transformers/PEFT expect)
  adapter_config.json         PEFT LoraConfig fields: peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha,
                              target_modules, base_model_name_or_path, ... (rank_pattern when ranks differ)
The training program's state names them `model.<module path>.lora_A` / `.lora_B`
(vktrain.export.training); `adapters_from_state` maps one to the other. Both files are written atomically.
What adapter_config.json says beyond the tensors (lora_alpha, target_modules, base_model_name_or_path) the
exporter records in the program's metadata; `ProgramAdapters.from_metadata` reads it back.
vktrain's layer computes base(x) + (alpha / r) * B(A(x)), PEFT's LoRA with the same r and lora_alpha.
"""
from __future__ import annotations

import collections
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import safetensors
import safetensors.numpy

from vktrain.contract import (METADATA_BASE_MODEL, METADATA_LORA_ALPHA, METADATA_LORA_LAYERS, METADATA_LORA_RANK,
                              METADATA_LORA_TARGET_MODULES, METADATA_MODEL_CONFIG, METADATA_MODEL_FAMILY,
                              METADATA_SOURCE_MODEL)
from vktrain.contract import MODEL_PREFIX as STATE_PREFIX  # the exporter's prefix of model tensors
from vktrain.train.checkpoint import atomic_write_bytes, atomic_write_json, load_checkpoint, sha256_file
from vktrain.serialization.peft_adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_PARTS, LORA_SUFFIXES,
                                                 AdapterError, check_pair, load_adapter_config, load_adapters,
                                                 peft_name)

PathLike = Union[str, os.PathLike]

def adapters_from_state(state: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module path: (A, B)} from a training program's state (`model.<path>.lora_A` / `.lora_B`); other
    state (optimizer moments, step) is ignored. Every adapted module must have both tensors."""
    parts: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    for name, array in state.items():
        if not name.startswith(STATE_PREFIX):
            continue
        module, _, part = name[len(STATE_PREFIX):].rpartition(".")
        if part in LORA_PARTS and module:
            parts[module][part] = np.asarray(array)
    adapters = {}
    for module, pair in parts.items():
        missing = [p for p in LORA_PARTS if p not in pair]
        if missing:
            raise AdapterError(f"module {module!r} has {sorted(pair)} but no {missing} in the program's state")
        check_pair(module, pair["lora_A"], pair["lora_B"])
        adapters[module] = (pair["lora_A"], pair["lora_B"])
    if not adapters:
        raise AdapterError(f"no LoRA tensors ({STATE_PREFIX}<module>.lora_A / .lora_B) in the state: "
                           f"{sorted(state)[:8]}")
    return adapters


@dataclass(frozen=True)
class ProgramAdapters:
    """What a program's metadata records about its adapters (vktrain.contract's ADAPTER_METADATA_KEYS,
    written at export); None for what it does not record (a .pte of an older vktrain)."""

    source_model: Optional[str] = None
    base_model: Optional[str] = None
    rank: Optional[int] = None
    lora_alpha: Optional[float] = None
    target_modules: Optional[list[str]] = None
    layers: Optional[list[str]] = None
    family: Optional[str] = None
    model_config: Optional[dict] = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], where: str) -> "ProgramAdapters":
        """Parse the recorded fields; a malformed one is an AdapterError naming `where` and the key."""
        def parsed(key: str, parse, check, expected: str):
            if key not in metadata:
                return None
            try:
                value = parse(metadata[key])
            except (TypeError, ValueError):
                value = None
            if value is None or not check(value):
                raise AdapterError(f"{where}: metadata {key!r} is {metadata[key]!r}; expected {expected}")
            return value

        def is_names(value: Any) -> bool:
            return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)

        return cls(
            source_model=metadata.get(METADATA_SOURCE_MODEL),
            base_model=metadata.get(METADATA_BASE_MODEL),
            rank=parsed(METADATA_LORA_RANK, int, lambda v: v > 0, "a positive integer"),
            lora_alpha=parsed(METADATA_LORA_ALPHA, float, lambda v: math.isfinite(v) and v > 0, "a positive number"),
            target_modules=parsed(METADATA_LORA_TARGET_MODULES, json.loads, is_names, "a JSON list of module names"),
            layers=parsed(METADATA_LORA_LAYERS, json.loads, is_names, "a JSON list of module paths"),
            family=metadata.get(METADATA_MODEL_FAMILY),
            model_config=parsed(METADATA_MODEL_CONFIG, json.loads, lambda v: isinstance(v, dict), "a JSON object"),
        )

    def family_refusal(self, supported: Sequence[str], where: str, needs: str) -> Optional[str]:
        """Why the program cannot give `needs` (e.g. "a GGUF adapter"), which only a model of a `supported`
        family can: None when it can. An older export records no model config (a re-export helps); a model
        of another kind (the built-in mlp-lora, a module of your own) has no family (a re-export cannot)."""
        if self.model_config is None:
            return (f"{where}: {needs} needs the model family and config recorded at export (family None, "
                    f"supported {tuple(supported)}); re-export the program with this vktrain")
        if self.family not in supported:
            model = f"{self.source_model!r}" if self.source_model else "its model"
            return (f"{where}: {needs} needs a language model of family {', '.join(supported)}; the program was "
                    f"exported from {model}, of family {self.family} (not a Llama-family language model)")
        return None

    def check_layers(self, adapters: Mapping[str, Any], where: str) -> None:
        """The adapters found in a program's state are the layers its export recorded (when it recorded them)."""
        if self.layers is not None and sorted(self.layers) != sorted(adapters):
            raise AdapterError(f"{where}: the state holds adapters of {sorted(adapters)}, the metadata records the "
                               f"adapted layers {sorted(self.layers)}")


def peft_target_patterns(target_modules) -> list[str]:
    """PEFT's target_modules as vktrain.lora target patterns: a string is a regular expression matched
    against the whole module path; a list names modules whose path is a name or ends with "." + name."""
    if isinstance(target_modules, str):
        return [target_modules if target_modules == "all-linear" else "re:" + target_modules]
    patterns = []
    for name in target_modules:
        patterns += [name, "*." + name]
    return patterns


def adapter_config(adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], lora_alpha: float,
                   base_model: Optional[str] = None, target_modules: Optional[Sequence[str]] = None) -> dict:
    """PEFT LoraConfig fields describing `adapters` (rank from the tensors; the most common rank is r,
    modules of another rank go to rank_pattern, as PEFT does). target_modules defaults to the module
    paths (PEFT matches a full path as well as a leaf name)."""
    if not (isinstance(lora_alpha, (int, float)) and np.isfinite(lora_alpha) and lora_alpha > 0):
        raise AdapterError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
    ranks = {module: int(a.shape[0]) for module, (a, _) in adapters.items()}
    rank = collections.Counter(ranks.values()).most_common(1)[0][0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": float(lora_alpha),
        "target_modules": sorted(adapters) if target_modules is None else sorted(target_modules),
        "rank_pattern": {module: r for module, r in sorted(ranks.items()) if r != rank},
        "alpha_pattern": {},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapters(directory: PathLike, adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], lora_alpha: float,
                  base_model: Optional[str] = None, target_modules: Optional[Sequence[str]] = None) -> Path:
    """Write adapter_model.safetensors and adapter_config.json into `directory` (created if needed)."""
    directory = Path(directory)
    if not adapters:
        raise AdapterError("no adapters to save")
    tensors = {}
    for module, (lora_a, lora_b) in adapters.items():
        lora_a, lora_b = np.asarray(lora_a), np.asarray(lora_b)
        check_pair(module, lora_a, lora_b)
        tensors[peft_name(module, "lora_A")] = np.ascontiguousarray(lora_a, dtype=np.float32)
        tensors[peft_name(module, "lora_B")] = np.ascontiguousarray(lora_b, dtype=np.float32)
    config = adapter_config(adapters, lora_alpha, base_model, target_modules)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / ADAPTER_WEIGHTS, safetensors.numpy.save(tensors, metadata={"format": "pt"}))
    atomic_write_json(directory / ADAPTER_CONFIG, config)
    return directory


def frozen_lora_tensors(graph) -> dict[str, np.ndarray]:
    """The LoRA tensors that are constants of a training step's delegate graph (a VkGraph), by state name:
    lora_A of a --freeze-lora-a (FFA-LoRA) export. Empty when every LoRA tensor is state."""
    return {value.name: np.asarray(graph.constant_array(index)) for index, value in enumerate(graph.values)
            if getattr(value, "name", "").endswith(LORA_SUFFIXES) and getattr(value, "constant_id", -1) >= 0}


def runner_frozen_lora(runner) -> dict[str, np.ndarray]:
    """frozen_lora_tensors of a runner's delegate graph (`runner.graph`); {} for a runner without one."""
    graph = getattr(runner, "graph", None)
    return {} if graph is None else frozen_lora_tensors(graph)


def check_frozen_lora(adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], frozen: Mapping[str, np.ndarray],
                      where: str) -> None:
    """Adapters given to a program whose lora_A are constants (`frozen`, frozen_lora_tensors) must hold
    exactly those lora_A: the program cannot change them, and its lora_B were trained against them."""
    for module, pair in adapters.items():
        for part, array in zip(LORA_PARTS, pair):
            constant = frozen.get(f"{STATE_PREFIX}{module}.{part}")
            if constant is None:
                continue
            given = np.asarray(array, dtype=np.float32)
            if given.shape != constant.shape or not np.array_equal(given, constant):
                found = (f"shape {list(given.shape)}, the constant's {list(constant.shape)}" if given.shape != constant.shape
                         else f"max |difference| {float(np.max(np.abs(given - constant))):.3g}")
                raise AdapterError(f"{where}: {peft_name(module, part)} differs from the program's {part} of {module}, "
                                   f"a constant of this --freeze-lora-a program ({found}); the program cannot change "
                                   f"{part}: give adapters trained from this program")


def read_program_graph(program: PathLike):
    """The delegate graph (vktrain.serialization.graph.VkGraph) of a training-step .pte, read and verified
    torch-free; its `metadata` is what ProgramAdapters.from_metadata reads."""
    from vktrain.serialization.pte import PteFile
    from vktrain.runtime.program.interpreter import verify_training_program

    if not Path(program).is_file():
        raise AdapterError(f"program {program} does not exist (or is not a file)")
    return verify_training_program(PteFile.load(program)).graph


def load_program_adapters(program: PathLike, recorded: ProgramAdapters, adapters_dir: Optional[PathLike] = None,
                          checkpoint: Optional[PathLike] = None) -> tuple[dict, float]:
    """(adapters {module: (A, B)}, lora_alpha) of a program, from an adapter directory (alpha from its
    adapter_config.json) or from a checkpoint of that same program (alpha as the program records it). A
    --freeze-lora-a program's lora_A come from its constants; an adapter directory must hold exactly those."""
    if (adapters_dir is None) == (checkpoint is None):
        raise AdapterError("give the adapters as an adapter directory or a checkpoint (one of the two)")
    if adapters_dir is not None:
        alpha = load_adapter_config(adapters_dir).get("lora_alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise AdapterError(f"{Path(adapters_dir) / ADAPTER_CONFIG}: lora_alpha is {alpha!r}, "
                               f"expected a positive number")
        adapters = load_adapters(adapters_dir)
    else:
        saved = load_checkpoint(checkpoint)
        if saved.program_sha256 != sha256_file(program):
            raise AdapterError(f"{checkpoint} is a checkpoint of another program than {program} (sha256 differs)")
        if recorded.lora_alpha is None:
            raise AdapterError(f"{program} does not record its LoRA alpha; give an adapter directory instead")
        # A checkpoint holds the program's state only: the lora_A of a --freeze-lora-a program are its constants.
        adapters = adapters_from_state({**frozen_lora_tensors(read_program_graph(program)), **saved.tensors})
        alpha = recorded.lora_alpha
    if adapters_dir is not None:
        check_frozen_lora(adapters, frozen_lora_tensors(read_program_graph(program)), str(adapters_dir))
    recorded.check_layers(adapters, str(program))
    return adapters, float(alpha)


def add_program_adapter_arguments(parser) -> None:
    """A command's `STEP.pte` and `--adapters DIR | --checkpoint FILE` arguments (load_program_adapters)."""
    parser.add_argument("program", metavar="STEP.pte", help="the training-step program the adapters were trained with")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--adapters", metavar="DIR", help="PEFT adapter directory (vktrain train --out-adapters)")
    source.add_argument("--checkpoint", metavar="FILE",
                        help="a checkpoint of this program (vktrain train --checkpoint)")


__all__ = ["ProgramAdapters", "adapter_config", "adapters_from_state", "add_program_adapter_arguments",
           "check_frozen_lora", "frozen_lora_tensors", "runner_frozen_lora", "load_program_adapters",
           "read_program_graph", "save_adapters"]

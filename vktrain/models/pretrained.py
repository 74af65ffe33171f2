"""load(PATH) and open_model(SPEC): which reader opens a pretrained checkpoint (a Hugging Face directory:
vktrain/models/loading.py; a .gguf file: gguf_import.py; a bundled name: bundled.py), or which built-in
preset a name builds (registry.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from vktrain.models.loading import LoadedModel, load_hf_directory


def load(path, **overrides) -> LoadedModel:
    """Load a Hugging Face model directory, a .gguf file, or a bundled checkpoint by name
    (vktrain.models.bundled, e.g. "smollm2-135m-instruct") (module docstring)."""
    from vktrain.models.bundled import bundled_checkpoint

    path = bundled_checkpoint(str(path)) or Path(path)
    if path.is_dir():
        return load_hf_directory(path, **overrides)
    if path.is_file():
        from vktrain.models.gguf_import import load_gguf  # the gguf package is needed for GGUF files only

        return load_gguf(path, **overrides)
    raise ValueError(f"{path}: no such file or directory (expected a Hugging Face model directory with config.json "
                     f"and *.safetensors, or a .gguf file)")


def open_model(spec: str, **overrides) -> tuple[torch.nn.Module, LoadedModel | None]:
    """What `--model SPEC` names: a built-in preset (-> (model, None)), or a pretrained checkpoint, i.e. a
    bundled name, a Hugging Face directory or a .gguf file (-> (loaded.model, loaded)). Anything else is
    refused, naming the presets, the bundled names and the path forms."""
    from vktrain.models.bundled import BUNDLED_CHECKPOINTS
    from vktrain.models.registry import available_models, build_model

    if spec in available_models():
        return build_model(spec, **overrides), None
    if spec in BUNDLED_CHECKPOINTS or Path(spec).exists():
        loaded = load(spec, **overrides)
        return loaded.model, loaded
    raise ValueError(f"unknown model {spec!r}: not a built-in model ({', '.join(available_models())}), a bundled "
                     f"checkpoint ({', '.join(BUNDLED_CHECKPOINTS)}), a Hugging Face directory or a .gguf file")

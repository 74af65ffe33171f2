"""The lines torch, torchao and executorch print on every import and export although nothing is wrong,
silenced for every user of vktrain (the command line and `import vktrain.export` alike): torchao's optional
CUDA/CUTLASS extensions (`_C_*.so`) that a CPU install cannot load, and torch pytree deprecation notices
about how torchao and executorch register their types. Exactly these: everything else those libraries
log or warn still shows. Standard library only (the torch-free runtime imports it too, via vktrain/__init__).
"""
from __future__ import annotations

import logging
import re
import warnings


class _DropMessages(logging.Filter):
    """Drops the log records whose message matches `pattern` (re.match), and nothing else."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


IMPORT_NOISE = {
    "torchao": _DropMessages(r"Failed to load \S*torchao/_C\S*\.so: "),
    "torch.utils._pytree": _DropMessages(r"<enum '\w+'> is an Enum subclass and is now natively supported by "
                                         r"torch.compile"),
}
IMPORT_NOISE_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def silence_known_import_noise() -> None:
    """Silence exactly IMPORT_NOISE and IMPORT_NOISE_WARNING (idempotent)."""
    for logger, drop in IMPORT_NOISE.items():
        logging.getLogger(logger).addFilter(drop)  # adding the same filter twice keeps one
    warnings.filterwarnings("ignore", message=IMPORT_NOISE_WARNING, category=FutureWarning)


__all__ = ["IMPORT_NOISE", "IMPORT_NOISE_WARNING", "silence_known_import_noise"]

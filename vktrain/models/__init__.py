"""Built-in models (registry by name). Importing this package registers them."""
from . import mlp as _mlp  # noqa: F401  (registers "mlp-lora")
from . import llama as _llama  # noqa: F401  (registers "tiny-llama", "llama-3.2-1b")
from .mlp import MLPConfig, MLPLanguageModel
from .registry import available_models, build_model, register_model

__all__ = ["MLPConfig", "MLPLanguageModel", "available_models", "build_model", "register_model"]

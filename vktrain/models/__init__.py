"""Built-in models (registry by name; importing this package registers them), and load(PATH) for
pretrained Hugging Face directories and GGUF files (vktrain.models.pretrained)."""
from . import mlp as _mlp  # noqa: F401  (registers "mlp-lora")
from . import llama as _llama  # noqa: F401  (registers "tiny-llama", "llama-3.2-1b")
from .loading import LoadedModel, TokenizerInfo
from .mlp import MLPConfig, MLPLanguageModel
from .pretrained import load, open_model
from .registry import available_models, build_model, register_model

__all__ = ["LoadedModel", "MLPConfig", "MLPLanguageModel", "TokenizerInfo", "available_models", "build_model", "load",
           "open_model", "register_model"]

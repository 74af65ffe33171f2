"""Pretrained Llama-family models: the Hugging Face directory reader, and what it shares with the GGUF reader.

vktrain.models.load(PATH) (vktrain/models/pretrained.py) picks the reader; either returns a LoadedModel.

Architectures: Llama 2/3.x (SmolLM2, TinyLlama, ...), Mistral (GQA; sequences capped at the sliding
window, within which its attention is plain causal), Qwen2 (q/k/v biases) and Qwen3 (q/k norms): all the
same LlamaForCausalLM with config switches. Anything else is refused, naming what is supported.

    loaded = vktrain.models.load("SmolLM2-135M-Instruct/")      # config.json + *.safetensors
    loaded = vktrain.models.load("smollm2-135m-instruct.gguf")  # metadata + tensors (see gguf_import)
    apply_lora(loaded.model, LoRAConfig(...))                   # then export / train as with a preset

Returns a LoadedModel: the LlamaForCausalLM with the checkpoint's float weights (GGUF Q4_0 linear weights
also carry their exact q4gsw codes for apply_lora, see vktrain.lora.layers), the LlamaConfig read, and
what the checkpoint says about its tokenizer and chat template (TokenizerInfo; `.build()` makes the
runtime's vktrain.serialization.tokenizer.ModelTokenizer of it, which export embeds in the .pte).
Keyword overrides replace LlamaConfig fields (e.g. max_seq_len). Anything missing, unknown or mis-shaped
is a ValueError naming the file, the field and what was expected.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from vktrain.lora.layers import PREQUANTIZED_ATTR, Q4GSWWeight

from .llama import LlamaConfig, LlamaForCausalLM, load_hf_state_dict

# Hugging Face model_type -> architecture class; all load into LlamaForCausalLM (same weights and math).
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
# Rope tables are built for min(context length, this) positions unless max_seq_len is given: a 128k
# context would otherwise put 2 x 64 MiB of tables into every exported program.
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class TokenizerInfo:
    """A checkpoint's tokenizer and chat template, as found (for tokenizing data and rendering chats)."""
    source: str  # "hf" or "gguf"
    tokenizer_json: Path | None = None  # HF: tokenizer.json, loadable with the `tokenizers` package
    tokenizer_config: Mapping[str, Any] = field(default_factory=dict)  # HF: tokenizer_config.json
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    gguf_vocab: Mapping[str, Any] = field(default_factory=dict)  # GGUF: tokenizer.ggml.* (model, tokens, merges, ...)
    where: str = ""  # the file or directory it came from, for messages

    def build(self):
        """The tokenizer as vktrain.serialization.tokenizer.ModelTokenizer (encodes as transformers' tokenizer from the
        same files), or None for a Hugging Face directory without tokenizer.json."""
        from vktrain.serialization.tokenizer import ModelTokenizer

        if self.source == "gguf":
            return ModelTokenizer.from_gguf_metadata(self.gguf_vocab, self.chat_template, source=self.where)
        if self.tokenizer_json is None:
            return None
        eos = self.eos_token_id[0] if isinstance(self.eos_token_id, list) and self.eos_token_id else self.eos_token_id
        return ModelTokenizer.from_hf_files(self.tokenizer_json, self.tokenizer_config, self.chat_template,
                                            eos_token_id=eos if isinstance(eos, int) else None)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    path: Path
    format: str  # "hf" or "gguf"
    architecture: str  # HF architecture class or GGUF general.architecture
    tokenizer: TokenizerInfo
    metadata: Mapping[str, Any]  # config.json, or the GGUF's scalar metadata

    def describe(self) -> str:
        """One line: what was read, including the rope settings (a wrong theta changes nothing visible)."""
        c = self.config
        rope = (f"llama3 scaling x{c.rope_scaling.factor:g}" if c.rope_scaling else
                "llama.cpp rope_freqs" if c.rope_freq_factors else "no scaling")
        exact = sum(hasattr(m, PREQUANTIZED_ATTR) for m in self.model.modules())
        return (f"{self.format} {self.architecture}: vocab {c.vocab_size}, dim {c.dim}, {c.n_layers} layers, "
                f"{c.n_heads}/{c.n_kv_heads} heads, hidden {c.hidden}, rope theta {c.rope_theta:g} ({rope}), "
                f"max_seq_len {c.max_seq_len}, tied head {c.tie_embeddings}"
                + (f", {exact} linear(s) with exact Q4_0 codes" if exact else ""))


def context_max_seq_len(context: int | None, overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
    """overrides with max_seq_len defaulted to min(context, DEFAULT_MAX_SEQ_LEN); a longer one is refused."""
    out = dict(overrides)
    limit = context if context else DEFAULT_MAX_SEQ_LEN
    if "max_seq_len" in out:
        if out["max_seq_len"] > limit:
            raise ValueError(f"{where}: max_seq_len={out['max_seq_len']} exceeds the model's context of {limit}")
    else:
        out["max_seq_len"] = min(limit, DEFAULT_MAX_SEQ_LEN)
    return out


def check_overrides(overrides: Mapping[str, Any]) -> None:
    known = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown Llama config field(s) {unknown}; known fields: {sorted(known)}")


def build_loaded_model(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor], where: str,
                       prequantized: Mapping[str, Q4GSWWeight] | None = None) -> LlamaForCausalLM:
    """A LlamaForCausalLM holding `state_dict` (HF names); each nn.Linear whose `<path>.weight` is in
    `prequantized` gets that Q4GSWWeight attached for apply_lora."""
    model = LlamaForCausalLM(config)
    try:
        load_hf_state_dict(model, state_dict)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    prequantized = dict(prequantized or {})
    if config.tie_embeddings and "model.embed_tokens.weight" in prequantized:
        prequantized.setdefault("lm_head.weight", prequantized["model.embed_tokens.weight"])
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in prequantized:
            setattr(module, PREQUANTIZED_ATTR, prequantized[f"{name}.weight"])
    return model


# ---- Hugging Face directories ---------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _safetensors_files(directory: Path) -> list[Path]:
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' {{tensor name: shard file}}")
        shards = sorted({directory / shard for shard in weight_map.values()})
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ValueError(f"{index}: shard file(s) {missing} listed in weight_map are not in {directory}")
        return shards
    found = sorted(p.name for p in directory.glob("*.safetensors")) or sorted(
        p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise ValueError(f"{directory}: no model.safetensors or model.safetensors.index.json (found: {found or 'none'}); "
                     f"only safetensors checkpoints are read")


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(directory):
        for key, tensor in load_file(str(shard)).items():
            if key in state:
                raise ValueError(f"{shard}: tensor {key!r} is also in another shard")
            state[key] = tensor
    index = directory / "model.safetensors.index.json"
    if not (directory / "model.safetensors").is_file() and index.is_file():
        absent = sorted(set(_read_json(index)["weight_map"]) - set(state))
        if absent:
            raise ValueError(f"{index}: weight_map lists tensors no shard holds: {absent[:8]}")
    return state


def hf_tokenizer_info(directory: Path, hf_config: Mapping[str, Any]) -> TokenizerInfo:
    """What a Hugging Face directory holds of its tokenizer (`hf_config`: config.json, for the special ids)."""
    tokenizer_json = directory / "tokenizer.json"
    config_path = directory / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.is_file() else {}
    template = tok_config.get("chat_template")
    template_file = directory / "chat_template.jinja"  # where transformers 5 saves it
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    return TokenizerInfo(source="hf", tokenizer_json=tokenizer_json if tokenizer_json.is_file() else None,
                         tokenizer_config=tok_config, chat_template=template,
                         bos_token_id=hf_config.get("bos_token_id"), eos_token_id=hf_config.get("eos_token_id"),
                         where=str(directory))


def load_hf_directory(directory, **overrides) -> LoadedModel:
    """A Llama-family model from a Hugging Face directory: config.json, model.safetensors (or a sharded
    model.safetensors.index.json), tokenizer.json / tokenizer_config.json as metadata."""
    directory = Path(directory)
    check_overrides(overrides)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: no config.json (a Hugging Face model directory has one)")
    hf_config = _read_json(config_path)
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or [HF_ARCHITECTURES.get(model_type)]
    supported = ", ".join(f"{t} ({a})" for t, a in HF_ARCHITECTURES.items())
    if model_type not in HF_ARCHITECTURES or architectures != [HF_ARCHITECTURES[model_type]]:
        raise ValueError(f"{config_path}: model_type {model_type!r} / architectures {architectures} is not supported; "
                         f"supported: {supported}")
    context = hf_config.get("max_position_embeddings")
    windowed = model_type == "mistral" or (model_type in ("qwen2", "qwen3") and hf_config.get("use_sliding_window"))
    window = hf_config.get("sliding_window") if windowed else None
    if window:  # attention is plain causal while sequences fit the window: cap them there
        context = min(context or window, window)
    overrides = context_max_seq_len(context, overrides, str(config_path))
    try:
        config = LlamaConfig.from_hf_config(hf_config, **overrides)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    state = _read_state_dict(directory)
    model = build_loaded_model(config, state, str(directory))
    return LoadedModel(model=model, config=config, path=directory, format="hf", architecture=architectures[0],
                       tokenizer=hf_tokenizer_info(directory, hf_config), metadata=hf_config)


__all__ = ["DEFAULT_MAX_SEQ_LEN", "HF_ARCHITECTURES", "LoadedModel", "TokenizerInfo", "hf_tokenizer_info", "load",
           "load_hf_directory"]

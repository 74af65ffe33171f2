"""The Llama family (Llama 2/3 architecture) on vktrain's fused ops.

token embedding -> n_layers x [x + o(attn(rope(q), rope(k), v)) over rms_norm(x); x + down(swiglu(gate, up))
over rms_norm(x)] -> rms_norm -> lm_head, with grouped-query causal attention. Modules carry Hugging Face's
names (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, `model.layers.N.mlp.gate_proj`,
`model.norm`, `lm_head`), so a HF checkpoint loads key for key and LoRA targets and adapter files use HF's
paths. q/k/v/o/gate/up/down/lm_head are plain nn.Linear layers: vktrain.lora.apply_lora swaps them for a
q4gsw base + adapter. Norm weights are frozen parameters (rms_norm has no weight gradient). Variants of
the same network: qkv_bias (q/k/v biases: Qwen2); qk_norm (an RMSNorm over each head of q and k before
rope: Qwen3) with attn_head_dim (a head width other than dim / n_heads, as Qwen3 has).

Presets: `tiny-llama` (byte vocabulary, ~0.1M parameters, for tests and smoke runs) and `llama-3.2-1b`
(the shapes of meta-llama/Llama-3.2-1B, including its "llama3" rope frequency scaling).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)
from vktrain.lora.layers import LoRAQ4Linear

from .registry import register_model

# HF's initializer_range: weights start as N(0, 0.02).
_INIT_STD = 0.02


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1+'s rope frequency scaling (HF rope_type "llama3"): long wavelengths are stretched by
    `factor`, short ones kept, the band between blended smoothly."""
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1:
            raise ValueError(f"Llama3RopeScaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"Llama3RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"Llama3RopeScaling.original_max_position_embeddings must be positive, "
                             f"got {self.original_max_position_embeddings}")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # bytes
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    # 192 rather than ~8/3 * dim = 176: a multiple of 32 and 64, so down_proj (K = hidden) takes a
    # q4gsw LoRA base at the usual group sizes.
    hidden: int = 192
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    # llama.cpp's form of rope scaling (the GGUF tensor rope_freqs.weight): inv_freq[i] / factors[i],
    # D/2 values. Exclusive with rope_scaling (a Llama 3 GGUF stores its scaling only this way).
    rope_freq_factors: tuple[float, ...] | None = None
    max_seq_len: int = 512  # length of the rope tables; longer sequences are refused
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before rope (Qwen3)
    attn_head_dim: int | None = None  # head width when it is not dim / n_heads (Qwen3)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # e.g. JSON from the command line
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.attn_head_dim is not None and (isinstance(self.attn_head_dim, bool) or
                                               not isinstance(self.attn_head_dim, int) or self.attn_head_dim <= 0):
            raise ValueError(f"LlamaConfig.attn_head_dim must be a positive integer or None, got {self.attn_head_dim!r}")
        if self.attn_head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig.dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads="
                             f"{self.n_kv_heads} (each kv head serves a group of query heads)")
        if self.head_dim % 2 != 0:
            raise ValueError(f"the head dim dim / n_heads = {self.head_dim} must be even for rotary embeddings")
        if not (self.norm_eps >= 0 and math.isfinite(self.norm_eps)):
            raise ValueError(f"LlamaConfig.norm_eps must be finite and >= 0, got {self.norm_eps}")
        if not (self.rope_theta > 1 and math.isfinite(self.rope_theta)):
            raise ValueError(f"LlamaConfig.rope_theta must be finite and > 1, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise TypeError(f"LlamaConfig.rope_scaling must be a Llama3RopeScaling or None, "
                            f"got {type(self.rope_scaling).__name__}")
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)
            object.__setattr__(self, "rope_freq_factors", factors)
            if len(factors) != self.head_dim // 2 or not all(f > 0 and math.isfinite(f) for f in factors):
                raise ValueError(f"LlamaConfig.rope_freq_factors must be head_dim / 2 = {self.head_dim // 2} finite "
                                 f"positive values, got {len(factors)}")
            if self.rope_scaling is not None:
                raise ValueError("LlamaConfig: give rope_scaling or rope_freq_factors, not both")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim if self.attn_head_dim is not None else self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], **overrides) -> "LlamaConfig":
        """A LlamaConfig from a Hugging Face `config.json` dict (model_type "llama", "mistral", "qwen2" (whose
        q/k/v always carry biases) or "qwen3" (q/k norms, its own head_dim)); keyword overrides win. Rope theta and scaling are read from transformers 5's `rope_parameters` as well as from
        the older top-level `rope_theta` / `rope_scaling` (see hf_rope)."""
        try:
            values = dict(
                vocab_size=hf_config["vocab_size"], dim=hf_config["hidden_size"],
                n_layers=hf_config["num_hidden_layers"], n_heads=hf_config["num_attention_heads"],
                n_kv_heads=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
                hidden=hf_config["intermediate_size"], norm_eps=hf_config.get("rms_norm_eps", 1e-6),
                tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
                qkv_bias=hf_config.get("model_type") == "qwen2", qk_norm=hf_config.get("model_type") == "qwen3")
        except KeyError as e:
            raise ValueError(f"Hugging Face Llama config lacks required key {e.args[0]!r}") from None
        values["rope_theta"], values["rope_scaling"] = hf_rope(hf_config)
        head_dim = hf_config.get("head_dim")
        if head_dim is not None and head_dim * values["n_heads"] != values["dim"]:
            values["attn_head_dim"] = int(head_dim)
        for flag in ("attention_bias", "mlp_bias"):
            if hf_config.get(flag):
                raise ValueError(f"Hugging Face config sets {flag}=true: biased Llama projections are not supported")
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Hugging Face config sets hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
        values.update(overrides)
        return cls(**values)


ROPE_TYPES = ("default", "llama3")  # HF rope_type values this model implements


def hf_rope(hf_config: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, rope_scaling) from a HF config dict.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, factor, ...}`; transformers 4 writes
    `rope_theta` at the top level and the scaling in `rope_scaling` (`rope_type` or the older `type`).
    Either form is read; a rope type other than ROPE_TYPES, or a partial rotary factor, is refused rather
    than silently computing other frequencies."""
    params = hf_config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or not ({"rope_type", "type", "rope_theta"} & set(params)):
            raise ValueError(f"config.json: rope_parameters must be one dict with rope_type / rope_theta "
                             f"(per-layer-type rope parameters are not supported), got {params!r}")
        theta, scaling = params.get("rope_theta", hf_config.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = hf_config.get("rope_theta", 10000.0), hf_config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor={scaling['partial_rotary_factor']} is not supported "
                         f"(rope over the whole head only)")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"config.json: rope scaling type {rope_type!r} is not supported; supported rope types: "
                         f"{', '.join(repr(t) for t in ROPE_TYPES)}")
    try:
        return float(theta), Llama3RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"config.json: llama3 rope scaling lacks required key {e.args[0]!r}") from None


PRESETS: dict[str, LlamaConfig] = {
    # ~0.8M parameters: 4 layers, dim 128, 4 query / 2 kv heads of 32, SwiGLU 384, byte vocabulary, tied head.
    "tiny-llama": LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden=384),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden=8192, norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=Llama3RopeScaling(), max_seq_len=2048, tie_embeddings=True),
}


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """theta^(-2i/D) for i < D/2 in float64, with Llama 3's scaling applied when configured."""
    head_dim = config.head_dim
    inv_freq = config.rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if config.rope_freq_factors is not None:
        return inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelength = old_context / scaling.low_freq_factor
    high_freq_wavelength = old_context / scaling.high_freq_factor
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(medium, blended, scaled)


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin float32 [max_seq_len, D/2] of the angles position * inv_freq (formed in float64)."""
    angles = np.arange(config.max_seq_len, dtype=np.float64)[:, None] * rope_inverse_frequencies(config)[None, :]
    return (torch.from_numpy(np.cos(angles).astype(np.float32)),
            torch.from_numpy(np.sin(angles).astype(np.float32)))


class LlamaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, through vktrain.rms_norm; the weight is frozen."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = torch.ops.vktrain.rms_norm(x, self.weight, self.eps)
        return y


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        if config.qk_norm:  # HF's Qwen3 names
            self.q_norm = LlamaRMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = LlamaRMSNorm(config.head_dim, config.norm_eps)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, S, heads, D] of x [B, S, dim], q/k normed (Qwen3) and rotated (also the KV-cache
        programs' projections, vktrain/export/decode.py)."""
        batch, seq_len, _ = x.shape
        # [B, S, H, D] straight from the projections: the fused ops take this layout, no permutes.
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.ops.vktrain.rope(q, cos, sin), torch.ops.vktrain.rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        out, _ = torch.ops.vktrain.causal_attention(q, k, v, self.scale, positions)
        return self.o_proj(out.reshape(batch, seq_len, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.ops.vktrain.swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """HF's `LlamaModel`: embeddings, decoder layers and the final norm (no head)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.n_layers))
        self.norm = LlamaRMSNorm(config.dim, config.norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(token_ids [B, S] int64) -> logits [B, S, V]; loss(token_ids, labels, n_valid) -> loss []."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.model = LlamaBackbone(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(config)
        # Functions of the config, not state: non-persistent, so checkpoints hold HF's keys only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(torch.Generator().manual_seed(config.seed))

    @torch.no_grad()
    def _init_weights(self, generator: torch.Generator) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
                module.weight.normal_(0.0, _INIT_STD, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()  # HF's init; and reproducible (nn.Linear's uses the global RNG)

    def _check_token_ids(self, token_ids: torch.Tensor) -> None:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            got = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
            raise TypeError(f"token_ids must be an int64 (or int32) tensor [B, S], got {got}")
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be 2-D [B, S] (batch, sequence), got shape {tuple(token_ids.shape)}")
        if token_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {token_ids.shape[1]} exceeds max_seq_len={self.config.max_seq_len} "
                             f"(the rope tables' length); build the model with a larger max_seq_len")

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm output [B, S, dim] (the lm_head's input). `positions` int [B, S] (packed
        documents): each token's position in its document (0 at a document's first token); attention
        then stays within each document and rope rotates by these positions, so every document computes
        what it computes alone."""
        self._check_token_ids(token_ids)
        seq_len = token_ids.shape[1]
        if positions is None:
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        else:  # [B, S, D/2]: each token's own row of the tables
            cos, sin = (torch.nn.functional.embedding(positions, table) for table in (self.rope_cos, self.rope_sin))
        h = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, positions)
        return self.model.norm(h)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(token_ids, positions))

    def get_output_embeddings(self) -> nn.Module:
        """The output head (transformers' name for it): LoRA's default "all-linear" targets leave it out."""
        return self.lm_head

    def loss(self, token_ids: torch.Tensor, labels: torch.Tensor, n_valid: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-entropy summed over labels >= 0 and divided by the runtime input n_valid (float32 []).
        labels[b, s] is the target for position s (the caller shifts them); `positions`: packed documents
        (hidden_states)."""
        logits = self.forward(token_ids, positions)
        loss, _ = torch.ops.vktrain.fused_ce(logits.reshape(-1, self.vocab_size), labels.reshape(-1), n_valid)
        return loss


# ---- Hugging Face checkpoints ---------------------------------------------------------------------------

# Keys some HF checkpoints carry that are recomputed here rather than loaded.
_DERIVED_KEY_SUFFIXES = (".rotary_emb.inv_freq",)


def _describe_keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > limit else shown


def load_hf_state_dict(model: LlamaForCausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a Hugging Face Llama state dict (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`,
    ..., `model.norm.weight`, `lm_head.weight`) into `model`, in place, converting to float32.

    For a tied model `lm_head.weight` may be absent (HF omits it) or must equal `model.embed_tokens.weight`.
    Missing, unexpected or mis-shaped keys raise ValueError listing them all; nothing is copied then.
    Call before vktrain.lora.apply_lora (the adapters replace the float projection weights).
    """
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
    adapted = [name for name, module in model.named_modules() if isinstance(module, LoRAQ4Linear)]
    if adapted:
        raise ValueError(f"load Hugging Face weights before vktrain.lora.apply_lora: {_describe_keys(adapted)} "
                         f"already hold quantized bases with adapters")
    targets = model.state_dict(keep_vars=True)  # persistent entries: exactly HF's key names
    provided = {k: v for k, v in state_dict.items() if not k.endswith(_DERIVED_KEY_SUFFIXES)}
    tied = model.config.tie_embeddings
    if tied:
        targets.pop("lm_head.weight")
        head = provided.pop("lm_head.weight", None)
        embed = provided.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ValueError("the model ties lm_head to model.embed_tokens (tie_embeddings=True) but the checkpoint's "
                             "lm_head.weight differs from its model.embed_tokens.weight; build the model with "
                             "tie_embeddings=False")

    problems = []
    missing = sorted(set(targets) - set(provided))
    unexpected = sorted(set(provided) - set(targets))
    if missing:
        problems.append(f"missing keys: {_describe_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_describe_keys(unexpected)}")
    mis_shaped = [f"{k}: checkpoint {list(provided[k].shape)}, model expects {list(targets[k].shape)}"
                  for k in sorted(set(targets) & set(provided)) if tuple(provided[k].shape) != tuple(targets[k].shape)]
    if mis_shaped:
        problems.append("mis-shaped keys: " + "; ".join(mis_shaped))
    not_float = [f"{k} ({provided[k].dtype})" for k in sorted(set(targets) & set(provided))
                 if not provided[k].is_floating_point()]
    if not_float:
        problems.append("non-floating-point tensors: " + ", ".join(not_float))
    if problems:
        raise ValueError(f"Hugging Face state dict does not fit this Llama ({_config_summary(model.config)}): "
                         + "; ".join(problems))

    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(provided[key].to(device=target.device, dtype=target.dtype))


def _config_summary(config: LlamaConfig) -> str:
    return (f"vocab {config.vocab_size}, dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads / "
            f"{config.n_kv_heads} kv heads, hidden {config.hidden}, tied={config.tie_embeddings}")


# ---- registry -------------------------------------------------------------------------------------------

def build_llama(preset: str = "tiny-llama", **overrides) -> LlamaForCausalLM:
    """A randomly initialised Llama from a preset with config fields overridden by keyword."""
    if preset not in PRESETS:
        raise ValueError(f"unknown Llama preset {preset!r}; presets: {sorted(PRESETS)}")
    known = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {preset} config field(s) {unknown}; known fields: {sorted(known)}")
    return LlamaForCausalLM(replace(PRESETS[preset], **overrides))


for _preset in PRESETS:
    register_model(_preset)(partial(build_llama, _preset))

__all__ = ["Llama3RopeScaling", "LlamaConfig", "LlamaForCausalLM", "PRESETS", "ROPE_TYPES", "build_llama", "hf_rope",
           "load_hf_state_dict", "rope_inverse_frequencies", "rope_tables"]

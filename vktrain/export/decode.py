"""Export generation: ONE program with two methods over a KV cache, `prefill` and `decode`.

    prefill(token_ids int64 [1, P], input_pos int64 [P]) -> logits float32 [1, P, V]
    decode (token_ids int64 [1, 1], input_pos int64 [1]) -> logits float32 [1, 1, V]
    state   kv_cache.layers.<i>.k / .v float32 [1, C, Hkv, D] (C = cache length), zero at load,
            shared by both methods; each call writes the rows of its tokens at their positions and
            attends to the cache rows 0 .. input_pos[l] (vktrain.kv_cache_update, vktrain.cached_attention)

Positions are runtime inputs (never baked in): the rope rows are gathered from the cos/sin tables with
an embedding lookup of input_pos, so a prompt longer than P is prefilled in chunks and decode runs at
any position < C. Prefill returns every position's logits: the caller picks the last real one (a short
prompt pads the chunk) and tests compare each position against the full-sequence forward.

The model is a LlamaForCausalLM after vktrain.lora.apply_lora (its q4gsw bases, and its adapters unless
disabled, as in training; torchao int4 linears fused into linear_q4gsw on their own codes, as the training
export fuses them); its weights are frozen constants of both methods.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.export import ExportedProgram

from vktrain.lora import lora_modules
from vktrain.models.llama import LlamaForCausalLM

from .training import in_registry_ops, traceable_copy

KV_CACHE_PREFIX = "kv_cache."
PREFILL, DECODE = "prefill", "decode"


def kv_cache_names(n_layers: int) -> list[str]:
    """State names of the caches, layer by layer: key then value."""
    return [f"{KV_CACHE_PREFIX}layers.{i}.{which}" for i in range(n_layers) for which in ("k", "v")]


class CachedLlama(nn.Module):
    """forward(token_ids [1, L], input_pos [L]) -> logits [1, L, V], reading and writing the KV caches."""

    def __init__(self, model: LlamaForCausalLM, cache_length: int) -> None:
        super().__init__()
        config = model.config
        self.model = model
        shape = (1, cache_length, config.n_kv_heads, config.head_dim)
        self.cache_names = kv_cache_names(config.n_layers)
        caches = nn.Module()
        for i in range(config.n_layers):
            layer = nn.Module()
            layer.register_buffer("k", torch.zeros(shape))
            layer.register_buffer("v", torch.zeros(shape))
            caches.add_module(str(i), layer)
        self.kv_cache = nn.Module()
        self.kv_cache.layers = caches

    def forward(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        model = self.model
        cos = nn.functional.embedding(input_pos, model.rope_cos)  # [L, D/2]: the rows of these positions
        sin = nn.functional.embedding(input_pos, model.rope_sin)
        h = model.model.embed_tokens(token_ids)
        for i, layer in enumerate(model.model.layers):
            cache = self.kv_cache.layers.get_submodule(str(i))
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, input_pos, cache)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(model.model.norm(h))

    @staticmethod
    def _attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                   cache: nn.Module) -> torch.Tensor:
        # The same projections, norms and rope as LlamaAttention.forward; the cache replaces k/v of the call.
        batch, rows, _ = x.shape
        q, k, v = attn.project_qkv(x, cos, sin)
        k_cache = torch.ops.vktrain.kv_cache_update(cache.k, k, input_pos)
        v_cache = torch.ops.vktrain.kv_cache_update(cache.v, v, input_pos)
        cache.k.copy_(k_cache)
        cache.v.copy_(v_cache)
        out = torch.ops.vktrain.cached_attention(q, k_cache, v_cache, input_pos, attn.scale)
        return attn.o_proj(out.reshape(batch, rows, attn.n_heads * attn.head_dim))


def check_generation_shapes(model: nn.Module, prefill_length: int, cache_length: int) -> None:
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"generation programs are exported for a LlamaForCausalLM, got {type(model).__name__}")
    limit = model.config.max_seq_len
    if not 0 < cache_length <= limit:
        raise ValueError(f"cache length must be in [1, {limit}] (the model's max_seq_len, its rope tables' "
                         f"length), got {cache_length}")
    if not 0 < prefill_length <= cache_length:
        raise ValueError(f"prefill length must be in [1, cache length {cache_length}], got {prefill_length}")


def export_generation(model: nn.Module, prefill_length: int, cache_length: int,
                      with_adapters: bool = True) -> dict[str, ExportedProgram]:
    """{"prefill": ..., "decode": ...} of `model` (see the module docstring); with_adapters=False runs the
    q4gsw base alone. The model is not modified."""
    check_generation_shapes(model, prefill_length, cache_length)
    model = traceable_copy(model).eval()  # torchao's int4 linears as frozen linear_q4gsw
    for param in model.parameters():
        param.requires_grad_(False)
    for adapter in lora_modules(model).values():
        adapter.adapter_enabled = with_adapters
    programs = {}
    for method, rows in ((PREFILL, prefill_length), (DECODE, 1)):
        module = CachedLlama(model, cache_length)
        example = (torch.zeros((1, rows), dtype=torch.int64), torch.arange(rows, dtype=torch.int64))
        with torch.no_grad():
            programs[method] = in_registry_ops(torch.export.export(module, example))
    return programs


def lower_generation(programs: dict[str, ExportedProgram]) -> bytes:
    """The .pte bytes of both methods, each one vktrain delegate (refused ops make it a LoweringError); the
    weights both read are stored once (lower_methods_to_pte's named data)."""
    from vktrain.export.lower import LoweringError, _refusal_summary, lower_methods_to_pte
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.serialization.pte import PteFile
    from vktrain.serialization.verify import check_single_delegate_call

    partitioners = {name: VktrainPartitioner() for name in programs}
    pte = lower_methods_to_pte(programs, partitioners)
    refused = {name: p for name, p in partitioners.items() if p.refusals}
    if refused:
        raise LoweringError("the generation program would leave ops outside the vktrain delegate: " + "; ".join(
            f"method {name!r}: {_refusal_summary(p)}" for name, p in refused.items()))
    written = PteFile.from_bytes(pte, source="the lowered generation program")
    for method in programs:
        check_single_delegate_call(written, written.execution_plan(method))
    return pte

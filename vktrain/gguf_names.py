"""llama.cpp's names and conventions for the Hugging Face Llama family in GGUF files: the one table the
GGUF importer (vktrain/models/gguf_import.py) and the GGUF LoRA adapter writer
(vktrain/train/gguf_adapter.py) both read. Torch-free.

llama.cpp runs llama with rope over adjacent pairs of rows, so its converter permutes the rows of
attn_q / attn_k (HF's rope rotates dims i and i + D/2 of each head); qwen2 / qwen3 run NeoX-style rope
(HF's pairing) and are written unpermuted."""
from __future__ import annotations

GGUF_FAMILIES = ("llama", "qwen2", "qwen3")  # general.architecture values of the Llama family
PERMUTED_QK_FAMILIES = ("llama",)

# llama.cpp tensor (after blk.N.) -> HF module path (after model.layers.N.): the adaptable linears.
LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
OUTPUT_HEAD = "output"  # lm_head.weight is output.weight (absent when the head is tied to the embedding)

# GGUF tensor name -> HF name: whole-model tensors, and per layer (after blk.N. / model.layers.N.).
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  f"{OUTPUT_HEAD}.weight": "lm_head.weight"}
LAYER_TENSORS = {
    **{f"{gguf}.weight": f"{hf}.weight" for gguf, hf in LAYER_LINEARS.items()},
    **{f"{gguf}.bias": f"{LAYER_LINEARS[gguf]}.bias" for gguf in ("attn_q", "attn_k", "attn_v")},  # Qwen2
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",  # Qwen3
}

__all__ = ["GGUF_FAMILIES", "GLOBAL_TENSORS", "LAYER_LINEARS", "LAYER_TENSORS", "OUTPUT_HEAD", "PERMUTED_QK_FAMILIES"]

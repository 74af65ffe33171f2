"""The Llama model family: its loss and gradients against a plain-PyTorch Llama written here from the
standard formulas (Hugging Face conventions: rotate_half rope, repeat_kv GQA, masked softmax attention,
SwiGLU MLP), presets, Hugging Face checkpoint loading, and export (joint graph and training step)."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.export.experimental import _export_forward_backward

from vktrain.export import STEP_BUFFER, export_training_step
from vktrain.lora import LoRAConfig, apply_lora, lora_parameter_names
from vktrain.models import available_models, build_model
from vktrain.models.llama import (PRESETS, Llama3RopeScaling, LlamaConfig, LlamaForCausalLM, load_hf_state_dict,
                                  rope_inverse_frequencies, rope_tables)
from vktrain.ops import adamw_hparams

from _helpers import DELTA_REL_FROB, relative_frobenius_error

# Untied head, multi-query attention (4 query heads on 1 kv head) and llama3 rope scaling whose three
# bands (kept, blended, stretched) all occur for head_dim 8: wavelengths 2*pi*10^{0,1,2,3} around 16..64.
SMALL_UNTIED = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, hidden=48, max_seq_len=16,
                    tie_embeddings=False, rope_scaling=Llama3RopeScaling(factor=4.0, low_freq_factor=1.0,
                                                                         high_freq_factor=4.0,
                                                                         original_max_position_embeddings=64))


def hf_key_names(n_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        names |= {prefix + s for s in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                       "mlp.down_proj.weight", "input_layernorm.weight",
                                       "post_attention_layernorm.weight")}
    return names if tied else names | {"lm_head.weight"}


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """What a HF checkpoint holds: every weight under its HF name; tied models omit lm_head.weight."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["lm_head.weight"]
    return state


# ---- the reference Llama -------------------------------------------------------------------------------

def reference_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """HF's default rope frequencies, then its "llama3" rope_type adjustment, in float64 torch."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth_factor = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    batch, kv_heads, seq_len, head_dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, n_rep, seq_len, head_dim).reshape(batch, kv_heads * n_rep, seq_len,
                                                                                   head_dim)


def reference_logits(cfg: LlamaConfig, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Llama forward from HF-named weights `w`, in their dtype, using only torch / F ops."""
    batch, seq_len = ids.shape
    dtype = w["model.embed_tokens.weight"].dtype
    heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms_norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps))

    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), reference_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))

    h = F.embedding(ids, w["model.embed_tokens.weight"])
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(batch, seq_len, heads, head_dim).transpose(1, 2)
        k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq_len, heads * head_dim)
        h = h + F.linear(attn, w[p + "self_attn.o_proj.weight"])
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"])
        h = h + F.linear(mlp, w[p + "mlp.down_proj.weight"])
    h = rms_norm(h, w["model.norm.weight"])
    return F.linear(h, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


def batch(vocab_size, shape=(2, 11), seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, shape, generator=gen)
    labels = torch.randint(0, vocab_size, shape, generator=gen)
    labels[0, :4] = -100  # ignored positions
    return ids, labels, (labels >= 0).sum().to(torch.float32)


def reference_rope_tables(cfg, dtype):
    """cos/sin [max_seq_len, D/2] of position * reference_inv_freq (HF's emb = cat(freqs, freqs) halves)."""
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), reference_inv_freq(cfg))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def use_float64_rope_tables(model):
    """The model stores float32 tables; .double() only widens them, so give a float64 check exact ones."""
    model.rope_cos, model.rope_sin = reference_rope_tables(model.config, torch.float64)


def perturb_norm_weights(model):
    """Norm weights start at 1; random ones make sure each is applied where it belongs."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))


# ---- forward / loss / gradients ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, SMALL_UNTIED], ids=["tiny-llama", "untied-mqa-llama3-rope"])
def test_loss_and_gradients_match_the_reference_llama_in_float64(overrides):
    model = build_model("tiny-llama", **overrides).double()
    use_float64_rope_tables(model)
    perturb_norm_weights(model)
    cfg = model.config
    ids, labels, n_valid = batch(cfg.vocab_size)

    loss = model.loss(ids, labels, n_valid)
    loss.backward()

    weights = {k: v.detach().clone().requires_grad_(not k.endswith("norm.weight"))
               for k, v in hf_state_dict(model).items()}
    logits = reference_logits(cfg, weights, ids)
    ref_loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), ignore_index=-100,
                               reduction="sum") / n_valid.double()
    ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(model(ids), logits.detach(), rtol=1e-11, atol=1e-12)
    trainable = dict(model.named_parameters())  # deduplicated: a tied head shares embed_tokens.weight
    assert set(trainable) == {k for k in hf_key_names(cfg.n_layers, cfg.tie_embeddings)}
    for name, param in trainable.items():
        if name.endswith("norm.weight"):
            assert not param.requires_grad and param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, weights[name].grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("preset,overrides", [("tiny-llama", {}), ("tiny-llama", SMALL_UNTIED),
                                              ("llama-3.2-1b", {})])
def test_rope_tables_are_float32_roundings_of_the_reference_angles(preset, overrides):
    cfg = replace(PRESETS[preset], **overrides)
    cos, sin = rope_tables(cfg)
    ref_cos, ref_sin = reference_rope_tables(cfg, torch.float32)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (cfg.max_seq_len, cfg.head_dim // 2)
    # Angles are formed in float64 before rounding: at most one float32 ulp from the reference.
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1.2e-7)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1.2e-7)


def test_float32_forward_matches_the_float64_reference():
    model = build_model("tiny-llama", n_kv_heads=1, seed=3)
    perturb_norm_weights(model)
    ids, labels, n_valid = batch(256, shape=(3, 20), seed=1)
    weights = {k: v.double() for k, v in hf_state_dict(model).items()}
    logits = model(ids)
    assert logits.dtype == torch.float32 and logits.shape == (3, 20, 256)
    expected = reference_logits(model.config, weights, ids)
    err = (logits.double() - expected).abs().max() / expected.abs().max()
    assert err < 2e-5, f"relative error {err:.2e}"


def test_causality_later_tokens_do_not_change_earlier_logits():
    model = build_model("tiny-llama", seed=4)
    ids, _, _ = batch(256, shape=(1, 12), seed=2)
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_bad_token_ids_are_refused():
    model = build_model("tiny-llama", max_seq_len=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"token_ids must be 2-D \[B, S\]"):
        model(torch.zeros(9, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_ids must be an int64"):
        model(torch.zeros(1, 4))


# ---- presets, config, registry -------------------------------------------------------------------------

def test_registry_builds_presets_with_overrides():
    assert {"tiny-llama", "llama-3.2-1b"} <= set(available_models())
    model = build_model("tiny-llama")
    assert isinstance(model, LlamaForCausalLM) and model.config == PRESETS["tiny-llama"]
    assert model.vocab_size == 256 and model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == hf_key_names(model.config.n_layers, tied=False)  # state_dict lists the tied head too
    # The rope tables are buffers, not state: nothing beyond HF's names is saved.
    assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert model.rope_cos.shape == (model.config.max_seq_len, model.config.head_dim // 2)

    custom = build_model("tiny-llama", dim=32, n_heads=2, n_kv_heads=1, tie_embeddings=False, seed=5)
    assert custom.config.head_dim == 16 and custom.lm_head.weight is not custom.model.embed_tokens.weight
    assert custom.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)
    # Same seed, same weights; a different seed, different ones.
    torch.testing.assert_close(build_model("tiny-llama").state_dict(), model.state_dict(), rtol=0, atol=0)
    assert not torch.equal(build_model("tiny-llama", seed=1).model.embed_tokens.weight,
                           model.model.embed_tokens.weight)
    # Norm weights are frozen parameters (rms_norm has no weight gradient).
    assert not model.model.norm.weight.requires_grad

    with pytest.raises(ValueError, match=r"unknown tiny-llama config field\(s\) \['heads'\]"):
        build_model("tiny-llama", heads=3)
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        build_model("tiny-llama", n_kv_heads=3)
    with pytest.raises(ValueError, match="dim=60 must be a multiple of n_heads=8"):
        build_model("tiny-llama", dim=60, n_heads=8)
    with pytest.raises(ValueError, match="head dim dim / n_heads = 3 must be even"):
        build_model("tiny-llama", dim=12, n_heads=4, n_kv_heads=4)
    with pytest.raises(ValueError, match="LlamaConfig.hidden must be a positive integer"):
        LlamaConfig(hidden=0)


def test_llama_3_2_1b_preset_has_the_published_shapes():
    cfg = PRESETS["llama-3.2-1b"]
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden, cfg.head_dim) == (
        128256, 2048, 16, 32, 8, 8192, 64)
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings and cfg.norm_eps == 1e-5
    assert cfg.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    with torch.device("meta"):  # shapes only: 1.2B parameters are not allocated
        model = build_model("llama-3.2-1b")
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400  # Llama-3.2-1B's published count
    attn = model.model.layers[15].self_attn
    assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape, attn.v_proj.weight.shape) == (
        (2048, 2048), (512, 2048), (512, 2048))
    assert model.model.layers[0].mlp.down_proj.weight.shape == (2048, 8192)
    torch.testing.assert_close(torch.from_numpy(rope_inverse_frequencies(cfg)), reference_inv_freq(cfg),
                               rtol=1e-14, atol=0)

    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
                 "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
                 "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
                 "vocab_size": 128256, "max_position_embeddings": 131072,
                 "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    assert LlamaConfig.from_hf_config(hf_config, max_seq_len=2048) == cfg
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        LlamaConfig.from_hf_config({**hf_config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="lacks required key 'intermediate_size'"):
        LlamaConfig.from_hf_config({k: v for k, v in hf_config.items() if k != "intermediate_size"})


# ---- Hugging Face checkpoints --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, SMALL_UNTIED], ids=["tied", "untied"])
def test_load_hf_state_dict_round_trip(overrides):
    source = build_model("tiny-llama", seed=7, **overrides)
    perturb_norm_weights(source)
    state = hf_state_dict(source)
    assert set(state) == hf_key_names(source.config.n_layers, source.config.tie_embeddings)
    target = build_model("tiny-llama", seed=8, **overrides)
    ids, _, _ = batch(source.vocab_size, seed=3)
    assert not torch.allclose(target(ids), source(ids))
    load_hf_state_dict(target, state)
    torch.testing.assert_close(target(ids), source(ids), rtol=0, atol=0)
    if source.config.tie_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied after loading


def test_load_hf_state_dict_converts_dtypes_and_ignores_derived_keys():
    source = build_model("tiny-llama", seed=9)
    state = {k: v.to(torch.bfloat16) for k, v in hf_state_dict(source).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # a tied checkpoint may carry the head
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older HF checkpoints carry this
    target = build_model("tiny-llama", seed=10)
    load_hf_state_dict(target, state)
    for name, value in target.state_dict().items():
        assert value.dtype == torch.float32
        hf_name = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(value, state[hf_name].float(), rtol=0, atol=0, msg=name)


def _state_with(model, change):
    state = hf_state_dict(model)
    change(state)
    return state


@pytest.mark.parametrize("change,message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing keys: model.layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}),
     "unexpected keys: model.layers.2.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
     r"mis-shaped keys: model.layers.0.self_attn.k_proj.weight: checkpoint \[64, 64\], model expects \[32, 64\]"),
    (lambda s: s.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)}),
     r"non-floating-point tensors: model.norm.weight \(torch.int64\)"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(256, 64)}),
     "lm_head.weight differs from its model.embed_tokens.weight; build the model with tie_embeddings=False"),
    (lambda s: {s.pop(k) for k in [k for k in s if k.startswith("model.layers.1.")]},
     r"missing keys: .*\(9 in all\)"),
])
def test_load_hf_state_dict_refuses_mismatched_checkpoints_and_changes_nothing(change, message):
    # The messages above name the shapes of this configuration.
    dims = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=192)
    model = build_model("tiny-llama", seed=11, **dims)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        load_hf_state_dict(model, _state_with(build_model("tiny-llama", seed=12, **dims), change))
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_load_hf_state_dict_refuses_an_untied_head_for_a_model_that_needs_one_and_lora_models():
    untied = build_model("tiny-llama", tie_embeddings=False)
    with pytest.raises(ValueError, match="missing keys: lm_head.weight"):
        load_hf_state_dict(untied, hf_state_dict(build_model("tiny-llama")))
    adapted = build_model("tiny-llama")
    apply_lora(adapted, LoRAConfig(rank=2, targets="*.q_proj"))
    with pytest.raises(ValueError, match="load Hugging Face weights before vktrain.lora.apply_lora"):
        load_hf_state_dict(adapted, hf_state_dict(build_model("tiny-llama")))
    with pytest.raises(TypeError, match="model must be a LlamaForCausalLM, got MLPLanguageModel"):
        load_hf_state_dict(build_model("mlp-lora"), {})


# ---- export ---------------------------------------------------------------------------------------------

class LossModule(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, token_ids, labels, n_valid):
        return (self.model.loss(token_ids, labels, n_valid),)


def randomize_lora_b(model, seed=3):
    """lora_B starts at 0, which would zero every lora_A gradient; random values make all of them count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def test_tiny_llama_joint_graph_keeps_the_fused_ops_and_matches_eager_gradients():
    seq_len = 12  # distinct from every other dim, so an [.., S, S] tensor is recognisable
    model = build_model("tiny-llama", seed=13)
    perturb_norm_weights(model)
    apply_lora(model, LoRAConfig(rank=4, targets="*_proj", seed=0))  # lm_head stays the tied float linear
    randomize_lora_b(model)
    ids, labels, n_valid = batch(256, shape=(2, seq_len), seed=4)
    joint = _export_forward_backward(torch.export.export(LossModule(model), (ids, labels, n_valid)))

    calls = [n for n in joint.graph.nodes if n.op == "call_function"]
    count = {}
    for node in calls:
        count[node.target] = count.get(node.target, 0) + 1
    vk = torch.ops.vktrain
    n_layers = model.config.n_layers
    assert count[vk.causal_attention.default] == count[vk.causal_attention_backward.default] == n_layers
    assert count[vk.swiglu.default] == count[vk.swiglu_backward.default] == n_layers
    # Every norm runs forward; all but layer 0's input norm (its input, the frozen embedding, needs no
    # gradient) run backward.
    assert count[vk.rms_norm.default] == 2 * n_layers + 1
    assert count[vk.rms_norm_backward.default] == 2 * n_layers
    assert count[vk.rope.default] == 4 * n_layers  # q and k, forward and backward (cos, -sin)
    # No attention score matrix outside the fused ops: no [.., S, S] value, no softmax.
    for node in calls:
        if "vktrain" in str(node.target):
            continue
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (tuple, list)) else (vals,):
            if isinstance(val, torch.Tensor):
                assert tuple(val.shape[-2:]) != (seq_len, seq_len), f"{node.target} makes {tuple(val.shape)}"
        assert "softmax" not in str(node.target)

    # The joint graph's loss and LoRA gradients are eager autograd's.
    state = {**{f"model.{k}": v for k, v in model.named_parameters(remove_duplicate=False)},
             **{f"model.{k}": v for k, v in model.named_buffers()}}
    user_inputs = iter((ids, labels, n_valid))
    flat = [state[s.target] if s.target is not None else next(user_inputs) for s in joint.graph_signature.input_specs]
    outputs = dict(zip((s.target or "loss" for s in joint.graph_signature.output_specs), joint.graph_module(*flat)))
    loss = model.loss(ids, labels, n_valid)
    loss.backward()
    torch.testing.assert_close(outputs["loss"], loss.detach())
    for name in lora_parameter_names(model):
        torch.testing.assert_close(outputs[f"model.{name}"], model.get_parameter(name).grad, msg=name)


def test_tiny_llama_training_step_exports_and_matches_eager_adamw():
    model = build_model("tiny-llama", seed=14)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets="*", seed=1))
    randomize_lora_b(model, seed=5)
    program = export_training_step(model, (2, 10)).module()
    eager = copy.deepcopy(model)
    params = [eager.get_parameter(p) for p in lora_parameter_names(eager)]
    initial_lora = {p: eager.get_parameter(p).detach().numpy().copy() for p in lora_parameter_names(eager)}
    lr, betas, eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.05
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for seed in (20, 21):
        ids, labels, n_valid = batch(256, shape=(2, 10), seed=seed)
        loss = program(ids, labels, adamw_hparams(lr, *betas, eps, wd), n_valid)
        optimizer.zero_grad()
        eager_loss = eager.loss(ids, labels, n_valid)
        eager_loss.backward()
        optimizer.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)
    assert program.get_buffer(STEP_BUFFER).item() == 2.0
    # Per tensor, in relative Frobenius norm (elementwise AdamW state is ill-conditioned: see _helpers).
    for path in lora_parameter_names(eager):
        initial = initial_lora[path]
        delta = program.get_buffer(f"model.{path}").numpy() - initial
        assert relative_frobenius_error(delta, eager.get_parameter(path).detach().numpy() - initial) <= DELTA_REL_FROB, path

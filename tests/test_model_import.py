"""vktrain.models.load against independent references: transformers' own forward on the same weights, and
the gguf package's writer, quantizer and dequantizer (no network: every checkpoint is built here)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vktrain.lora import LoRAConfig, LoRAQ4Linear, apply_lora
from vktrain.models import load
from vktrain.models.llama import LlamaConfig
from vktrain.quant import dequantize, quantize, unpack_flat
from _helpers import planned

VOCAB, DIM, HIDDEN, LAYERS, HEADS = 96, 64, 128, 2, 4
SEQ = 24

# Logits tolerance. The reference runs in float64, ours in float32: each op rounds to float32
# (unit roundoff u = 2^-24 ~ 6e-8) and a dot product of length K <= 128 errs by at most ~K*u relative
# to sum|a*b| (~8e-6); about ten such stages chain through 2 layers (norm, q/k/v, rope, attention, o,
# gate/up, swiglu, down, head), so |error| <= 1e-4 * max|logit| is a safe bound (measured: ~4e-7).
LOGITS_RTOL = 1e-4


def _reinit(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations (HF's 0.02 init leaves attention near-uniform, where rope barely shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):  # HF starts biases at 0, which would hide a mishandled one
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                fan_in = p.shape[1] if "embed" not in name else 1
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def _hf_model(model_type="llama", seed=0, **kwargs):
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    defaults = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                    attn_implementation="eager")
    model = model_cls(config_cls(**{**defaults, **kwargs})).eval()
    _reinit(model, seed)
    return model


def _tokens(seed=1):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _reference_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model.double()(ids).logits


def _assert_logits_match(ours: torch.Tensor, reference: torch.Tensor) -> float:
    err = (ours.double() - reference).abs().max().item()
    bound = LOGITS_RTOL * reference.abs().max().item()
    assert err <= bound, f"max |logits error| {err:.3g} > {bound:.3g}"
    return bound


ROPE_THETA_1E5 = {"rope_type": "default", "rope_theta": 100000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

HF_CASES = {
    "llama-tied-theta1e5": dict(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True),
    "llama3-scaling-untied-sharded": dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "mistral-gqa-window": dict(model_type="mistral", num_key_value_heads=1, sliding_window=48,
                               rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=False),
    "qwen2-qkv-bias-tied": dict(model_type="qwen2", rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True),
    "qwen3-qk-norm-head32": dict(model_type="qwen3", head_dim=32, rope_parameters=ROPE_THETA_1E5,
                                 tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_directory_import_equals_transformers_forward(tmp_path, case):
    kwargs = dict(HF_CASES[case])
    hf = _hf_model(**kwargs)
    shard = "40KB" if "sharded" in case else "100MB"
    hf.save_pretrained(tmp_path, max_shard_size=shard)
    if "sharded" in case:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in written and "rope_parameters" in written  # the transformers-5 form

    loaded = load(tmp_path)
    assert loaded.format == "hf" and loaded.config.tie_embeddings == bool(kwargs["tie_word_embeddings"])
    ids = _tokens()
    with torch.no_grad():
        ours = loaded.model(ids)
    reference = _reference_logits(hf, ids)
    bound = _assert_logits_match(ours, reference)

    # The comparison sees the rope: the default theta (what the old reader used) misses by far more.
    wrong = _with_config(loaded, rope_theta=10000.0, rope_scaling=None)
    with torch.no_grad():
        assert (wrong(ids).double() - reference).abs().max().item() > 100 * bound


def _with_config(loaded, **config_changes):
    """The loaded weights under a changed config."""
    from dataclasses import replace

    from vktrain.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(replace(loaded.config, **config_changes))
    model.load_state_dict(loaded.model.state_dict())
    return model


def test_rope_parameters_theta_and_llama3_scaling_are_read():
    base = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=64)
    v5 = transformers.LlamaConfig(**base, rope_parameters=ROPE_THETA_1E5).to_dict()
    assert "rope_theta" not in v5  # nothing at the top level: the old reader fell back to 10000
    assert LlamaConfig.from_hf_config(v5).rope_theta == 100000.0
    v5_llama3 = transformers.LlamaConfig(**base, rope_parameters=LLAMA3_ROPE).to_dict()
    cfg = LlamaConfig.from_hf_config(v5_llama3)
    assert cfg.rope_theta == 500000.0
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (8.0, 16)
    with pytest.raises(ValueError, match=r"rope scaling type 'yarn' is not supported; supported rope types: "
                                         r"'default', 'llama3'"):
        LlamaConfig.from_hf_config({**v5, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})


def test_hf_tokenizer_metadata_is_carried(tmp_path):
    from tokenizers import Tokenizer, models

    hf = _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    info = load(tmp_path).tokenizer
    assert info.tokenizer_json == tmp_path / "tokenizer.json" and info.chat_template == template
    assert info.tokenizer_config["eos_token"] == "</s>"
    assert (info.bos_token_id, info.eos_token_id) == (hf.config.bos_token_id, hf.config.eos_token_id)


# ---- default LoRA targets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_default_targets_leave_the_output_head_alone(tmp_path, tied):
    _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=tied).save_pretrained(tmp_path)
    model = load(tmp_path).model
    report = apply_lora(model, LoRAConfig(rank=2))
    assert report.excluded_heads == ["lm_head"] and "lm_head" not in report.replaced
    assert type(model.lm_head) is torch.nn.Linear
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied  # still tied when it was
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert report.replaced == [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in per_layer]
    # Naming the head adapts it, with a warning when that unties it.
    again = load(tmp_path).model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_lora(again, LoRAConfig(rank=2, targets="all-linear,lm_head"))
    assert "lm_head" in report.replaced and isinstance(again.lm_head, LoRAQ4Linear)
    assert any("unties" in str(w.message) for w in caught) == tied


def test_cli_export_of_a_hf_directory_prints_what_it_adapted(tmp_path):
    _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True, num_hidden_layers=1).save_pretrained(tmp_path)
    out = tmp_path / "forward.pte"
    result = subprocess.run([sys.executable, "-m", "vktrain.cli", "export", "--model", str(tmp_path), "--program",
                             "forward", "--lora-rank", "2", "--batch", "1", "--seq", "8", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded {tmp_path}: hf LlamaForCausalLM: vocab {VOCAB}, dim {DIM}, 1 layers" in result.stdout
    assert "rope theta 100000 (no scaling)" in result.stdout
    assert "adapting 7 layer(s)" in result.stdout and "model.layers.0.mlp.down_proj" in result.stdout
    assert "q4gsw base (mse scales, no calibration)" in result.stdout  # the export default (no tokenizer here)
    assert "not adapted (output head; name it in --targets to adapt it): lm_head" in result.stdout
    assert out.stat().st_size > 0


# ---- errors -------------------------------------------------------------------------------------------------

def test_hf_directory_errors_name_file_and_field(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match="no such file or directory"):
        load(tmp_path / "nothing")
    hf = _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gemma",
                                                      "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'gemma' .* is not supported; supported: "
                                         r"llama \(LlamaForCausalLM\), mistral \(MistralForCausalLM\), "
                                         r"qwen2 \(Qwen2ForCausalLM\), qwen3 \(Qwen3ForCausalLM\)"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * HIDDEN}))
    with pytest.raises(ValueError, match=r"mis-shaped keys: model.layers.0.mlp.down_proj.weight: checkpoint "
                                         rf"\[{DIM}, {HIDDEN}\], model expects \[{DIM}, {2 * HIDDEN}\]"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(weights))
    with pytest.raises(ValueError, match=rf"{tmp_path}.*missing keys: model.layers.1.mlp.up_proj.weight"):
        load(tmp_path)
    weights.unlink()
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"shard file\(s\) \['shard-1.safetensors'\]"):
        load(tmp_path)


# ---- GGUF -----------------------------------------------------------------------------------------------------

def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim: how llama.cpp's converter writes attn_q / attn_k."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _llama_cpp_rope_factors(theta, dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """convert_hf_to_gguf.py's rope_freqs for rope_type 'llama3' (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
Q = gguf.GGMLQuantizationType


def _gguf_name(hf_key: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_key in top:
        return top[hf_key]
    _, _, layer, rest = hf_key.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def _tensor_type(hf_key: str) -> Q:
    """A mix of types: Q4_0 for most projections, others for the rest (each read by gguf's dequantizer)."""
    if hf_key.endswith(("norm.weight", ".bias")):
        return Q.F32
    if "v_proj" in hf_key:
        return Q.F16
    if "down_proj" in hf_key or "embed" in hf_key:
        return Q.Q8_0
    if "up_proj" in hf_key:
        return Q.Q4_1
    return Q.Q4_0


def _write_gguf(path, hf, arch="llama", rope_factors=None, drop_keys=(), omit=(), changed=None):
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2Config has none
    writer = gguf.GGUFWriter(str(path), arch)
    hparams = dict(context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size,
                   block_count=cfg.num_hidden_layers, feed_forward_length=cfg.intermediate_size,
                   head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
                   layer_norm_rms_eps=cfg.rms_norm_eps, rope_freq_base=cfg.rope_parameters["rope_theta"],
                   rope_dimension_count=head_dim, key_length=head_dim, value_length=head_dim,
                   vocab_size=cfg.vocab_size)
    for key, value in {**hparams, **(changed or {})}.items():
        if key not in omit:
            getattr(writer, f"add_{key}")(value)  # writes "<arch>.<key>" as llama.cpp's converter does
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key, value in hf.state_dict().items():
        if key in drop_keys or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = value.detach().to(torch.float32).numpy()
        if arch == "llama" and key.endswith("q_proj.weight"):  # llama.cpp's LlamaModel permutes; Qwen2Model not
            w = _llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and key.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = _tensor_type(key)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(_gguf_name(key), w.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            writer.add_tensor(_gguf_name(key), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_round_trip(hf_key: str, w: np.ndarray) -> np.ndarray:
    """What the GGUF holds for an HF weight, dequantized by gguf. Blocks run along rows, so quantizing
    before or after llama.cpp's row permutation gives the same values: no permutation is needed here."""
    qtype = _tensor_type(hf_key)
    if qtype in (Q.F32, Q.F16):
        return w.astype(np.float16).astype(np.float32) if qtype == Q.F16 else w
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def _hf_reference_on_gguf_values(hf):
    ref = type(hf)(hf.config).eval()
    tied = hf.config.tie_word_embeddings  # then lm_head is the embedding (the GGUF has no output.weight)
    state = {k: torch.from_numpy(_gguf_round_trip(k, v.detach().numpy()).copy()) for k, v in hf.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert not tied or ref.lm_head.weight is ref.model.embed_tokens.weight
    return ref


GGUF_CASES = {
    "tied-theta1e5": dict(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True),
    "llama3-rope-freqs-untied": dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen2-qkv-bias": dict(model_type="qwen2", rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True),
    "qwen3-qk-norm-head32": dict(model_type="qwen3", head_dim=32, rope_parameters=ROPE_THETA_1E5,
                                 tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_import_equals_transformers_forward(tmp_path, case):
    hf = _hf_model(**GGUF_CASES[case])
    factors = None
    if "llama3" in case:
        p = LLAMA3_ROPE
        factors = _llama_cpp_rope_factors(p["rope_theta"], DIM // HEADS, p["factor"], p["low_freq_factor"],
                                          p["high_freq_factor"], p["original_max_position_embeddings"])
    path = tmp_path / "model.gguf"
    arch = GGUF_CASES[case].get("model_type", "llama")
    _write_gguf(path, hf, arch=arch, rope_factors=factors)
    loaded = load(path)
    assert loaded.format == "gguf" and loaded.architecture == arch
    assert (loaded.config.n_kv_heads, loaded.config.rope_theta) == (2, hf.config.rope_parameters["rope_theta"])
    assert loaded.config.tie_embeddings == hf.config.tie_word_embeddings
    ids = _tokens()
    with torch.no_grad():
        ours = loaded.model(ids)
    _assert_logits_match(ours, _reference_logits(_hf_reference_on_gguf_values(hf), ids))

    info = loaded.tokenizer
    assert info.source == "gguf" and info.chat_template.startswith("{% for m in messages %}")
    assert (info.bos_token_id, info.eos_token_id, info.gguf_vocab["model"]) == (1, 2, "gpt2")
    assert info.gguf_vocab["tokens"][:2] == ["tok0", "tok1"]


def _decode_q4_0(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's block_q4_0: float16 d, then qs[16] with element j in the low nibble and j + 16 in the high one."""
    blocks = raw.reshape(n, k // 32, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)
    return codes, d


def test_gguf_q4_0_weights_become_the_q4gsw_base_bit_for_bit(tmp_path):
    hf = _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True)
    path = tmp_path / "model.gguf"
    _write_gguf(path, hf)
    reader_types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    model = load(path).model
    apply_lora(model, LoRAConfig(rank=2, group_size=32))
    checked = 0
    for key, value in hf.state_dict().items():
        if _tensor_type(key) != Q.Q4_0 or key == "lm_head.weight":  # tied: the head is the Q8_0 embedding
            continue
        assert reader_types[_gguf_name(key)] == Q.Q4_0
        w = value.detach().numpy()
        n, k = w.shape
        raw = gguf.quants.quantize(w, Q.Q4_0)  # HF row order: see _gguf_round_trip
        codes, d = _decode_q4_0(raw, n, k)
        layer = model.get_submodule(key.removesuffix(".weight"))
        np.testing.assert_array_equal(unpack_flat(layer.weights.numpy(), k), codes.astype(np.int8) - 8)
        np.testing.assert_array_equal(layer.scales.numpy(), d.T)
        np.testing.assert_array_equal(layer.dequantized_weight().numpy(), gguf.quants.dequantize(raw, Q.Q4_0))
        # Re-quantizing those values by the absmax/7 rule (the path every other type takes) would have changed
        # them; the "mse" rule's candidates include Q4_0's own scale (max/-8), which reproduces them exactly.
        values = gguf.quants.dequantize(raw, Q.Q4_0)
        assert not np.array_equal(dequantize(*quantize(values, 32, "absmax"), 32), values)
        np.testing.assert_array_equal(dequantize(*quantize(values, 32, "mse"), 32), values)
        checked += 1
    assert checked == 4 * LAYERS  # q, k, o, gate of each layer
    # At another group size the codes cannot be used: re-quantized, with a warning saying so.
    other = load(path).model
    with pytest.warns(UserWarning, match="re-quantizing it at group size 64"):
        apply_lora(other, LoRAConfig(rank=2, group_size=64, targets="*.q_proj"))


def test_gguf_errors_name_file_and_field(tmp_path):
    hf = _hf_model(rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True)
    path = tmp_path / "gemma.gguf"
    _write_gguf(path, hf, arch="gemma")
    with pytest.raises(ValueError, match=r"gemma.gguf: general.architecture 'gemma' is not supported; supported: "
                                         r"llama, qwen2, qwen3"):
        load(path)
    path = tmp_path / "partial.gguf"
    _write_gguf(path, hf, drop_keys=("model.layers.1.mlp.gate_proj.weight",))
    with pytest.raises(ValueError, match=r"partial.gguf: .*missing keys: model.layers.1.mlp.gate_proj.weight"):
        load(path)
    path = tmp_path / "no_blocks.gguf"
    _write_gguf(path, hf, omit=("block_count",))
    with pytest.raises(ValueError, match=r"no_blocks.gguf: metadata lacks required field 'llama.block_count'"):
        load(path)
    path = tmp_path / "wrong_ffn.gguf"
    _write_gguf(path, hf, changed={"feed_forward_length": 2 * HIDDEN})
    with pytest.raises(ValueError, match=r"wrong_ffn.gguf: .*mis-shaped keys: model.layers.0.mlp.down_proj.weight"):
        load(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
        load(junk)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_imported_gguf_forward_on_the_vulkan_device_matches_eager(vk_device, tmp_path, arch):
    """The exported forward of a GGUF import on the device: Q4_0 bases carry negative scales (Q4_0 maps
    the largest-magnitude weight to c = 0 with d = max / -8), and so do "mse"-rule bases; the kernels
    only multiply by the scale, so the device must match the eager model. qwen2: with q/k/v biases;
    qwen3: q/k norms over [B, S, H, D] and a head width of 32 (not dim / heads = 16)."""
    from vktrain.export import export_forward, lower_to_pte
    from vktrain.runtime.delegate.executor import GraphExecutor
    from vktrain.serialization.pte import PteFile
    from vktrain.runtime.program.interpreter import ProgramInterpreter
    from vktrain.serialization import deserialize_blob

    extra = {"head_dim": 32} if arch == "qwen3" else {}
    hf = _hf_model(arch, rope_parameters=ROPE_THETA_1E5, tie_word_embeddings=True, num_hidden_layers=1, **extra)
    path = tmp_path / "model.gguf"
    _write_gguf(path, hf, arch=arch)
    model = load(path, max_seq_len=SEQ).model
    apply_lora(model, LoRAConfig(rank=2, group_size=32, scale_rule="mse", seed=0))
    q_scales = model.model.layers[0].self_attn.q_proj.scales
    up_scales = model.model.layers[0].mlp.up_proj.scales  # Q4_1 in the file: re-quantized by the mse rule
    assert (q_scales < 0).any() and (q_scales > 0).any() and (up_scales < 0).any()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 would hide the adapters
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    ids = _tokens()
    pte = PteFile.from_bytes(lower_to_pte(export_forward(model, tuple(ids.shape))))
    plan = pte.execution_plan()
    graph = deserialize_blob(bytes(plan.delegates[0].data))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        interpreter = ProgramInterpreter(pte, plan, lambda index, args: executor.run(*args[:len(graph.inputs)]))
        (logits,) = interpreter.run([ids.numpy()])
    with torch.no_grad():
        expected = model(ids).numpy()
    # Both float32, different summation orders: the bound the runner's forward parity test uses.
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())

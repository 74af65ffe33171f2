"""Adapters and models out of vktrain, against independent references: PEFT + transformers (adapter
directories), the gguf package's reader and llama.cpp's q/k row permutation written out here (GGUF
adapters), transformers' own loading (merged models). One tiny Hugging Face llama is made with
transformers, exported from the command line, and trained a few steps on the Vulkan device (lavapipe)."""
from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from _helpers import assert_import_loads_none

from vktrain import cli
from vktrain.contract import METADATA_LORA_ALPHA, METADATA_LORA_TARGET_MODULES
from vktrain.lora import LoRAConfig, apply_lora, load_adapters as load_adapters_into
from vktrain.models import load
from vktrain.models.gguf_import import unpermute_rows
from vktrain.quant import dequantize, quantize
from vktrain.serialization.peft_adapters import AdapterError, load_adapter_config, load_adapters
from vktrain.train.adapters import ProgramAdapters
from vktrain.train.checkpoint import load_checkpoint, save_checkpoint
from vktrain.train.gguf_adapter import check_gguf_adapter_program, gguf_tensor_name
from vktrain.train.lr_schedule import LRSchedule
from vktrain.train.merge import MergeError, hf_config, merged_state_dict

VOCAB, DIM, HIDDEN, LAYERS, HEADS, KV_HEADS = 96, 64, 128, 2, 4, 2
RANK, ALPHA, GROUP = 4, 8.0, 32
BATCH, SEQ, STEPS = 2, 16, 4
LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
# Two float32 computations of the same model (vktrain's ops, transformers' modules) differ by rounding:
# ~1e-6 relative on a loss or a logit of this 2-layer model; 1e-4 is far above that and far below what a
# wrong adapter scale, permutation or tensor changes (the adapters move the loss by > 1e-2).
RTOL = 1e-4


def _q4_exact_hf_model() -> transformers.LlamaForCausalLM:
    """A tiny HF llama whose linear weights are q4gsw dequantizations (absmax scales, group 32), so the 4-bit
    base vktrain trains through equals the checkpoint's float weights and PEFT on the float model is the
    reference of vktrain's LoRA model."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                w = (torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])).numpy()
                flat, scales = quantize(w, GROUP, "absmax")
                p.copy_(torch.from_numpy(dequantize(flat, scales, GROUP, w.shape[1])))
    return model


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _hf_loss(hf_model, ids, labels) -> float:
    with torch.no_grad():
        logits = hf_model(ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).double(), labels.reshape(-1)).item()


def _vktrain_lora_model(hf_dir, adapters_dir):
    model = load(hf_dir).model
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=GROUP, scale_rule="absmax"))
    load_adapters_into(model, adapters_dir)
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(tmp dir, HF dir, .pte): exported with `vktrain export` (no --lora-alpha needed later) and trained
    with `vktrain train --out-adapters --out-gguf-adapter --checkpoint --json`, validation on."""
    root = tmp_path_factory.mktemp("adapters_out")
    hf_dir = root / "hf"
    _q4_exact_hf_model().save_pretrained(hf_dir)
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(hf_dir / "tokenizer.json"))
    pte = root / "step.pte"
    assert cli.main(["export", "--model", str(hf_dir), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                     "--scale-rule", "absmax", "--group-size", str(GROUP), "--batch", str(BATCH), "--seq", str(SEQ),
                     "--out", str(pte)]) == 0
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4096)
    np.save(root / "tokens.npy", tokens)
    mp = pytest.MonkeyPatch()
    mp.setenv("VKTRAIN_VALIDATION", "1")
    try:
        code = cli.main(["train", str(pte), "--steps", str(STEPS), "--data", str(root / "tokens.npy"), "--lr", "0.05",
                         "--no-progress", "--out-adapters", str(root / "adapters"), "--out-gguf-adapter",
                         str(root / "adapter.gguf"), "--checkpoint", str(root / "ck.safetensors"),
                         "--json", str(root / "records.json")])
    finally:
        mp.undo()
    assert code == 0
    return root, hf_dir, pte


def test_adapter_config_carries_what_the_pte_recorded(trained):
    root, hf_dir, _ = trained
    config = load_adapter_config(root / "adapters")
    assert config["base_model_name_or_path"] == str(hf_dir.absolute())
    assert config["target_modules"] == LINEARS  # PEFT's leaf names: all-linear without the head
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["rank_pattern"] == {}


def test_peft_loads_the_adapters_and_reproduces_vktrains_loss(trained):
    root, hf_dir, _ = trained
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    base_loss = _hf_loss(base, *_batch(7))
    peft_model = PeftModel.from_pretrained(base, root / "adapters").eval()
    ours = _vktrain_lora_model(hf_dir, root / "adapters")
    ids, labels = _batch(7)
    with torch.no_grad():
        vk_loss = ours.loss(ids, labels, torch.tensor(float(labels.numel()))).item()
    peft_loss = _hf_loss(peft_model, ids, labels)
    assert abs(peft_loss - vk_loss) <= RTOL * abs(vk_loss)
    assert abs(peft_loss - base_loss) > 100 * RTOL * abs(vk_loss)  # the trained adapters do change the loss


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permute of q/k rows, written out: per head, rows (i, i + D/2) become adjacent."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def test_gguf_adapter_reads_back_and_applies_to_the_permuted_base(trained):
    root, hf_dir, pte = trained
    # `vktrain adapters convert` from the run's last checkpoint writes the same file as `train --out-gguf-adapter`.
    converted = root / "converted.gguf"
    assert cli.main(["adapters", "convert", str(pte), "--checkpoint", str(root / "ck.safetensors"),
                     "--out", str(converted)]) == 0
    assert converted.read_bytes() == (root / "adapter.gguf").read_bytes()
    reader = gguf.GGUFReader(str(root / "adapter.gguf"))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == pytest.approx(ALPHA)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    dims = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # GGUF's ne order (contiguous dim first)
    kinds = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    assert set(tensors) == {f"blk.{i}.{k}.weight.lora_{p}" for i in range(LAYERS) for k in kinds for p in "ab"}

    adapters = load_adapters(root / "adapters")
    hf_weights = dict(transformers.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict())
    heads = {"q_proj": HEADS, "k_proj": KV_HEADS}
    for module, (a, b) in adapters.items():
        name = gguf_tensor_name(module, tie_embeddings=True)
        lora_a, lora_b = tensors[name + ".lora_a"], tensors[name + ".lora_b"]
        assert lora_a.shape == a.shape and lora_b.shape == b.shape  # numpy [r, in], [out, r]
        # What llama.cpp's loader checks against the base weight's ne = [in, out]: a.ne = [in, r], b.ne = [r, out].
        assert dims[name + ".lora_a"] == [a.shape[1], RANK] and dims[name + ".lora_b"] == [RANK, b.shape[0]]
        w = hf_weights[module + ".weight"].double().numpy()
        merged_hf = w + ALPHA / RANK * (b.astype(np.float64) @ a)
        leaf = module.rpartition(".")[2]
        permute = (lambda x: _llama_cpp_permute(x, heads[leaf])) if leaf in heads else (lambda x: x)
        merged_gguf = permute(w) + ALPHA / RANK * (lora_b.astype(np.float64) @ lora_a)
        np.testing.assert_allclose(merged_gguf, permute(merged_hf), rtol=0, atol=1e-12)
        if leaf in heads:  # and the importer's inverse takes it back to the HF layout
            np.testing.assert_allclose(unpermute_rows(merged_gguf, heads[leaf]), merged_hf, rtol=0, atol=1e-12)


def test_merged_directory_loads_in_transformers_with_vktrains_logits(trained):
    root, hf_dir, pte = trained
    out = root / "merged"
    assert cli.main(["merge", str(pte), "--adapters", str(root / "adapters"), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = _vktrain_lora_model(hf_dir, root / "adapters")
    ids, _ = _batch(3)
    with torch.no_grad():
        expected, got = ours(ids), merged(ids).logits
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= RTOL * scale
    # The same merge from the run's checkpoint (adapters + alpha from the program): the same weights.
    from_checkpoint, _ = merged_state_dict(pte, checkpoint=root / "ck.safetensors")
    from_adapters, recorded = merged_state_dict(pte, adapters_dir=root / "adapters")
    assert sorted(from_checkpoint) == sorted(from_adapters)
    for name, array in from_adapters.items():
        np.testing.assert_array_equal(from_checkpoint[name], array)
    # Without the source directory, config.json is built from the recorded model config: the same model.
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **hf_config(recorded.model_config, recorded.family), attn_implementation="eager")).eval()
    missing, unexpected = rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in from_adapters.items()},
                                                  strict=False)
    assert unexpected == [] and missing in ([], ["lm_head.weight"])  # the tied head is the embedding
    with torch.no_grad():
        assert (rebuilt(ids).logits - expected).abs().max().item() <= RTOL * scale


def test_merge_refuses_a_checkpoint_of_another_program(trained, tmp_path):
    root, _, pte = trained
    saved = load_checkpoint(root / "ck.safetensors")
    other = tmp_path / "other.safetensors"
    save_checkpoint(other, dataclasses.replace(saved, program_sha256="0" * 64))
    with pytest.raises(AdapterError, match="checkpoint of another program"):
        merged_state_dict(pte, checkpoint=other)
    with pytest.raises(AdapterError, match="one of the two"):
        merged_state_dict(pte, adapters_dir=root / "adapters", checkpoint=root / "ck.safetensors")


def test_the_cosine_schedules_last_step_trains_and_records_carry_seconds(trained):
    root, _, _ = trained
    schedule = LRSchedule("cosine", 1e-3, 10)
    assert schedule.lr(10) > 0 and schedule.lr(11) == 0.0  # the floor comes after the last step
    assert LRSchedule("cosine", 1e-3, 5, warmup_steps=4).lr(5) > 0
    records = json.loads((root / "records.json").read_text())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["lr"] > 0 and r["seconds"] > 0 for r in records)


def test_recorded_metadata_is_checked_naming_the_key():
    with pytest.raises(AdapterError, match=f"step.pte: metadata '{METADATA_LORA_ALPHA}' is 'abc'"):
        ProgramAdapters.from_metadata({METADATA_LORA_ALPHA: "abc"}, "step.pte")
    with pytest.raises(AdapterError, match=METADATA_LORA_TARGET_MODULES):
        ProgramAdapters.from_metadata({METADATA_LORA_TARGET_MODULES: "[]"}, "step.pte")
    assert ProgramAdapters.from_metadata({}, "old.pte") == ProgramAdapters()  # an older .pte records nothing


def test_gguf_adapter_refusals_name_what_is_missing():
    with pytest.raises(AdapterError, match="family None"):
        check_gguf_adapter_program(ProgramAdapters(), "mlp.pte")
    config = {"n_heads": HEADS, "n_kv_heads": KV_HEADS, "tie_embeddings": True}
    with pytest.raises(AdapterError, match="tied to the embedding"):
        check_gguf_adapter_program(ProgramAdapters(family="llama", model_config=config, layers=["lm_head"]), "x.pte")
    with pytest.raises(AdapterError, match="no llama.cpp tensor name"):
        check_gguf_adapter_program(ProgramAdapters(family="llama", model_config=config, layers=["model.foo"]), "x.pte")


def test_merge_refuses_rope_factors_a_hf_config_cannot_express():
    config = {"rope_freq_factors": [1.0, 2.0], "dim": DIM, "n_heads": HEADS}
    with pytest.raises(MergeError, match="rope_freqs"):
        hf_config(config, "llama")


def test_adapter_writers_and_merge_import_no_torch():
    assert_import_loads_none(["vktrain.train.gguf_adapter", "vktrain.train.merge", "vktrain.train.command"],
                             ["torch", "executorch"])


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", LINEARS),  # every layer's linears: PEFT's leaf names pick exactly those
    ("model.layers.0.*", [f"model.layers.0.{p}" for p in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
                                                          "self_attn.v_proj")])])
def test_target_modules_are_leaf_names_only_when_those_pick_exactly_the_adapted_layers(targets, expected):
    from vktrain.export.training import adapter_metadata
    from vktrain.models import build_model

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets, group_size=GROUP))
    metadata = adapter_metadata(model, "tiny-llama")
    recorded = ProgramAdapters.from_metadata(metadata, "tiny-llama")
    assert recorded.target_modules == expected and recorded.family == "llama"
    assert (recorded.rank, recorded.lora_alpha, recorded.base_model) == (RANK, ALPHA, "tiny-llama")
    assert recorded.model_config["n_layers"] == model.config.n_layers

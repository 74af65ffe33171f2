"""Generation: the KV-cache ops (kv_cache_update, cached_attention), the prefill + decode program and
`vktrain generate`, against independent references.

Tolerances (fp32 GPU kernels against float64 references):
* kv_cache_update moves 32-bit words: bit-exact.
* cached_attention: each output is a softmax-weighted sum over at most C keys of D-long fp32 dot
  products, as causal_attention (tests/test_kernels_transformer.py): norm-relative error 1e-6.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain)
from vktrain.opdefs.decode_ops import CachePositionError
from vktrain.runtime import Buffer, Program
from vktrain.backend.kernel_planning.kernels import kv_cache

OPS = torch.ops.vktrain


def _run(device, plan, inputs, outputs):
    """Run `plan` once with `inputs` {key: array} uploaded as they are and `outputs` {key: shape}
    allocated as fp32 (poisoned with NaN first). Returns {key: array}."""
    buffers = {}
    try:
        for key, array in inputs.items():
            buffers[key] = Buffer.from_array(device, np.ascontiguousarray(array), name=key)
        for key, shape in outputs.items():
            buffers[key] = Buffer(device, 4 * max(1, math.prod(shape)), name=key)
            buffers[key].write(np.full(math.prod(shape), np.nan, np.float32))
        with Program(device, plan, buffers) as program:
            program.replay()
            return {key: buffers[key].read(np.float32, shape) for key, shape in outputs.items()}
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _attention_reference(q, k_cache, v_cache, positions, scale):
    """Float64 softmax attention written out per query row: row l over the cache rows 0 .. positions[l]."""
    batch, rows, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        for l, position in enumerate(positions):
            for h in range(q_heads):
                keys = k_cache[b, :position + 1, h // group].astype(np.float64)
                scores = scale * keys @ q[b, l, h].astype(np.float64)
                weights = np.exp(scores - scores.max())
                out[b, l, h] = weights @ v_cache[b, :position + 1, h // group] / weights.sum()
    return out


def _norm_rel(got, ref):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("B,C,H,D,positions", [(1, 16, 2, 8, [0]), (1, 16, 2, 8, [5, 6, 7]),
                                               (2, 10, 3, 4, [9, 0, 4]), (1, 8, 1, 16, list(range(8)))])
def test_kv_cache_update_kernel_is_the_reference_bit_for_bit(vk_device, B, C, H, D, positions):
    rng = np.random.default_rng(C + len(positions))
    cache = rng.standard_normal((B, C, H, D)).astype(np.float32)
    new = rng.standard_normal((B, len(positions), H, D)).astype(np.float32)
    pos = np.asarray(positions, np.int32)
    plan = kv_cache.plan_kv_cache_update(cache="cache", cache_shape=cache.shape, new="new", new_shape=new.shape,
                                         input_pos="pos", input_pos_shape=pos.shape, out="out")
    got = _run(vk_device, plan, {"cache": cache, "new": new, "pos": pos}, {"out": cache.shape})["out"]
    expected = cache.copy()
    for l, p in enumerate(positions):  # written out, independent of the op library
        expected[:, p] = new[:, l]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, OPS.kv_cache_update(torch.from_numpy(cache), torch.from_numpy(new),
                                                           torch.from_numpy(pos.astype(np.int64))).numpy())


@pytest.mark.parametrize("B,L,Hq,Hkv,C,D,positions", [
    (1, 1, 4, 2, 16, 8, [0]), (1, 1, 4, 2, 200, 32, [150]),  # decode: several 64-key tiles
    (1, 5, 4, 4, 32, 16, [3, 4, 5, 6, 7]),  # a chunk at an offset
    (2, 3, 6, 2, 70, 72, [69, 0, 64]),  # GQA 3:1, D over one thread's share, ragged tiles
])
def test_cached_attention_kernel_matches_float64_softmax(vk_device, B, L, Hq, Hkv, C, D, positions):
    rng = np.random.default_rng(C + D)
    q = rng.standard_normal((B, L, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, C, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, C, Hkv, D)).astype(np.float32)
    pos = np.asarray(positions, np.int32)
    scale = 1 / math.sqrt(D)
    plan = kv_cache.plan_cached_attention(q="q", q_shape=q.shape, k_cache="k", k_cache_shape=k.shape, v_cache="v",
                                          v_cache_shape=v.shape, input_pos="pos", input_pos_shape=pos.shape,
                                          scale=scale, out="out")
    got = _run(vk_device, plan, {"q": q, "k": k, "v": v, "pos": pos}, {"out": q.shape})["out"]
    reference = _attention_reference(q, k, v, positions, scale)
    assert np.isfinite(got).all()
    assert _norm_rel(got, reference) <= 1e-6
    cpu = OPS.cached_attention(*(torch.from_numpy(a).double() for a in (q, k, v)),
                               torch.from_numpy(pos.astype(np.int64)), scale).numpy()
    assert _norm_rel(cpu, reference) <= 1e-12


def test_cached_attention_over_a_full_prefix_is_causal_attention():
    """The cache read from position 0 with positions 0..S-1 is causal attention over S tokens."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    k_cache = torch.zeros(1, 9, 2, 8, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(6)
    k_cache = OPS.kv_cache_update(k_cache, k, positions)
    v_cache = OPS.kv_cache_update(v_cache, v, positions)
    expected, _ = OPS.causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(OPS.cached_attention(q, k_cache, v_cache, positions, 0.3), expected,
                               rtol=1e-12, atol=1e-12)


def test_positions_outside_the_cache_are_refused():
    cache, new = torch.zeros(1, 4, 1, 8), torch.ones(1, 2, 1, 8)
    with pytest.raises(CachePositionError, match=r"positions in \[3, 4\]; the KV cache holds positions 0 .. 3"):
        OPS.kv_cache_update(cache, new, torch.tensor([3, 4]))
    with pytest.raises(CachePositionError, match="a position twice"):
        OPS.kv_cache_update(cache, new, torch.tensor([1, 1]))
    with pytest.raises(CachePositionError, match=r"positions in \[-1, -1\]"):
        OPS.cached_attention(torch.zeros(1, 1, 1, 8), cache, cache, torch.tensor([-1]), 1.0)


def test_decode_op_shape_functions_agree_with_the_cpu_references():
    from vktrain.opdefs import TensorMeta, infer_outputs
    from vktrain.opdefs.decode_ops import DECODE_OPS

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 9, 2, 8, generator=gen)
    calls = {"kv_cache_update": (cache, torch.randn(2, 3, 2, 8, generator=gen), torch.tensor([0, 4, 8])),
             "cached_attention": (torch.randn(2, 3, 6, 8, generator=gen), cache, cache, torch.tensor([0, 4, 8]), 0.5)}
    meta = lambda t: TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch.")) if isinstance(t, torch.Tensor) else t
    for definition in DECODE_OPS:
        name = definition.schema.name
        eager = getattr(OPS, name)(*calls[name])
        assert infer_outputs(definition.key, [meta(a) for a in calls[name]]) == (meta(eager),), name
    assert "input_pos must have one position per row of q (L = 3)" in infer_outputs(
        "vktrain.cached_attention.default", [meta(a) for a in calls["cached_attention"][:3]]
        + [TensorMeta((2,), "int64"), 0.5])


# ---- sampling (host, numpy) ----------------------------------------------------------------------

def test_greedy_takes_the_lowest_id_of_tied_maxima():
    from vktrain.generate.sampling import Sampler

    assert Sampler()(np.array([0.5, 2.0, -1.0, 2.0], np.float32)) == 1


def test_sampling_draws_from_the_tempered_top_p_nucleus():
    from vktrain.generate.sampling import Sampler

    logits = np.array([1.0, 3.0, 0.0, 2.5, -1.0])
    temperature, top_p, draws = 0.7, 0.9, 20000
    probs = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    order = np.argsort(-probs)
    nucleus = order[:np.argmax(np.cumsum(probs[order]) >= top_p) + 1]  # smallest prefix reaching top_p
    expected = np.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    sampler = Sampler(temperature, top_p, seed=5)
    counts = np.bincount([sampler(logits) for _ in range(draws)], minlength=logits.size)
    assert set(np.flatnonzero(counts)) == set(nucleus.tolist())
    # Binomial standard deviation sqrt(p (1 - p) / n) <= 0.0036 here: 5 sigma.
    assert np.abs(counts / draws - expected).max() <= 5 * math.sqrt(0.25 / draws)
    same_seed = [Sampler(temperature, top_p, seed=5) for _ in range(2)]
    runs = [[sampler(logits) for _ in range(50)] for sampler in same_seed]
    assert runs[0] == runs[1]  # the seed fixes the draws


def test_sampling_settings_are_checked():
    from vktrain.generate.sampling import Sampler, SamplingError

    with pytest.raises(SamplingError, match="temperature must be finite and >= 0"):
        Sampler(temperature=-1.0)
    with pytest.raises(SamplingError, match=r"top_p must be in \(0, 1\], got 0"):
        Sampler(temperature=1.0, top_p=0.0)


# ---- prompt text (host) --------------------------------------------------------------------------

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def test_prompt_text_and_chat_match_transformers_tokenization(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from vktrain.generate.text import chat_prompt, codec_for
    from vktrain.models.loading import TokenizerInfo

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "user": 5, ":": 6, "assistant": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    info = TokenizerInfo(source="hf", tokenizer_json=tmp_path / "tokenizer.json",
                         tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"}, chat_template=CHAT_TEMPLATE,
                         eos_token_id=1)
    codec = codec_for(info, len(vocab))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                                     eos_token="</s>")
    reference.chat_template = CHAT_TEMPLATE
    assert codec.encode("hello world", True) == reference("hello world").input_ids == [0, 3, 4]
    messages = [{"role": "user", "content": "hello world"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert codec.encode(chat_prompt(codec, "hello world"), False) == list(expected)
    assert codec.decode([3, 4, 1]) == "hello world" and codec.stop_ids == (1,)


def test_byte_vocabularies_read_bytes_and_others_need_a_tokenizer():
    from vktrain.generate.text import TokenizerError, chat_prompt, codec_for

    codec = codec_for(None, 256)
    assert codec.encode("hé", True) == [104, 195, 169] and codec.decode([104, 195, 169]) == "hé"
    with pytest.raises(TokenizerError, match="--chat needs the model's chat template"):
        chat_prompt(codec, "hi")
    with pytest.raises(TokenizerError, match="no tokenizer.json or GGUF vocabulary.*--prompt-ids"):
        codec_for(None, 1000)


def test_the_program_cache_key_follows_what_the_program_depends_on(tmp_path):
    import argparse

    from vktrain.generate.command import program_key

    (tmp_path / "adapter_model.safetensors").write_bytes(b"A")
    args = dict(model_arg=[], cache_length=32, prefill_length=8, group_size=32, scale_rule="mse",
                calibration_data="auto", calibration_tokens=1024, adapters=str(tmp_path))
    key = program_key(argparse.Namespace(**args), "tiny-llama")
    assert program_key(argparse.Namespace(**args), "tiny-llama") == key
    assert program_key(argparse.Namespace(**{**args, "cache_length": 64}), "tiny-llama") != key
    assert program_key(argparse.Namespace(**{**args, "calibration_data": "none"}), "tiny-llama") != key
    assert program_key(argparse.Namespace(**args), "mlp-lora") != key
    (tmp_path / "adapter_model.safetensors").write_bytes(b"B")
    assert program_key(argparse.Namespace(**args), "tiny-llama") != key


def test_the_generation_runner_imports_neither_torch_nor_executorch():
    from _helpers import assert_import_loads_none

    assert_import_loads_none(["vktrain.generate.runner", "vktrain.generate.sampling"], ["torch", "executorch"])


# ---- the generation program, end to end ----------------------------------------------------------
# One tiny Llama made with transformers, with LoRA adapters in PEFT format; `vktrain generate` exports
# its program once (into a program cache) and every test below runs that program.

VOCAB, CACHE_LENGTH, PREFILL_LENGTH, NEW_TOKENS = 320, 32, 8, 6
PROMPTS = ([1, 2, 3], [7, 300, 12, 45, 45, 99, 3, 18, 250, 4, 61], [42])  # the second takes two prefill chunks


def _cli(*args, timeout=900):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "vktrain.cli", "generate", *args], capture_output=True, text=True,
                            timeout=timeout)
    return result


@pytest.fixture(scope="module")
def generation(tmp_path_factory):
    import json

    import transformers

    from vktrain.lora import LoRAConfig, apply_lora, load_adapters, lora_modules
    from vktrain.models import load
    from vktrain.train.adapters import save_adapters

    root = tmp_path_factory.mktemp("generation")
    torch.manual_seed(0)
    # initializer_range 0.2 (HF's default is 0.02): peaked logits, so greedy choices are not near-ties.
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(root / "hf")

    # Adapters: vktrain's LoRA layers with a non-zero B, written as PEFT files.
    model = load(root / "hf").model
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, scale_rule="mse", seed=1))
    gen = torch.Generator().manual_seed(2)
    adapters = {}
    for path, layer in lora_modules(model).items():
        with torch.no_grad():
            layer.lora_B.normal_(0.0, 0.1, generator=gen)
        adapters[path] = (layer.lora_A.detach().numpy(), layer.lora_B.detach().numpy())
    save_adapters(root / "adapters", adapters, lora_alpha=8.0, base_model="tiny-hf-llama")

    # The same model as `vktrain generate` builds it (default group size 32, mse scales).
    model = load(root / "hf").model
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=",".join(adapters), group_size=32, scale_rule="mse"))
    load_adapters(model, root / "adapters")

    common = ["--model", str(root / "hf"), "--adapters", str(root / "adapters"), "--max-new-tokens", str(NEW_TOKENS),
              "--prefill-length", str(PREFILL_LENGTH), "--cache-length", str(CACHE_LENGTH),
              "--program-cache", str(root / "programs")]
    first = _cli(*common, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--json", str(root / "first.json"))
    assert first.returncode == 0, first.stderr
    second = _cli(*common, "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--json", str(root / "second.json"))
    assert second.returncode == 0, second.stderr
    (pte,) = (root / "programs").glob("*.pte")
    runs = [(first, json.loads((root / "first.json").read_text())),
            (second, json.loads((root / "second.json").read_text()))]
    return dict(root=root, hf=hf, model=model, pte=pte, runs=runs)


def _hf_reference(generation):
    """transformers' LlamaForCausalLM on vktrain's dequantized q4gsw weights, with the adapters loaded by PEFT."""
    import copy

    import peft

    from vktrain.lora import lora_modules

    hf = copy.deepcopy(generation["hf"])
    with torch.no_grad():
        for path, layer in lora_modules(generation["model"]).items():
            hf.get_submodule(path).weight.copy_(layer.dequantized_weight())
    return peft.PeftModel.from_pretrained(hf, str(generation["root"] / "adapters")).eval()


def _float64_logits(model, token_ids):
    import copy

    from _helpers import _cast_floating

    model = copy.deepcopy(model)
    _cast_floating(model, torch.float64)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).numpy()[0]


def test_generate_command_equals_transformers_greedy_generation(generation):
    reference = _hf_reference(generation)
    (first, first_json), (second, second_json) = generation["runs"]
    assert "program cached" in first.stdout and "program from the cache" in second.stdout
    assert "tokens/s" in first.stdout
    for prompt, record in ((PROMPTS[0], first_json), (PROMPTS[1], second_json)):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                          pad_token_id=0)[0, len(prompt):].tolist()
        assert record["prompt_tokens"] == prompt
        assert record["tokens"] == expected
        assert record["tokens_per_s"] > 0 and record["text"] is None  # no tokenizer in this checkpoint


def test_runner_greedy_equals_transformers_and_logits_equal_the_full_sequence(generation, vk_device):
    from vktrain.generate.runner import GenerationRunner
    from vktrain.generate.sampling import Sampler

    import copy

    from vktrain.lora import lora_modules

    reference = _hf_reference(generation)
    generated = []
    with GenerationRunner.from_pte(generation["pte"], vk_device) as runner:
        assert (runner.cache_length, runner.prefill_length, runner.vocab_size) == (CACHE_LENGTH, PREFILL_LENGTH, VOCAB)
        # One device copy of the weights and of the caches: every constant and state of decode lives in a buffer
        # that prefill uses too (decode reading prefill's cache is what the token comparison below checks).
        executors = runner.prefill_method.executor, runner.decode_method.executor
        decode = executors[1]
        weights = {decode.storage_of(v) for op in decode.ops for v in op.args
                   if getattr(decode.graph.values[v], "constant_id", -1) >= 0
                   and decode.graph.values[v].storage_of < 0 and decode.graph.values[v].name.startswith("model.")}
        states = {decode.storage_of(s.state_id) for s in decode.graph.mutable_state}
        assert len(states) == 4 and all(key.startswith("shared:") for key in states)  # prefill's caches
        assert weights and all(key.startswith("shared:") for key in weights)  # prefill's weights
        assert not any(key.startswith("state") for key in decode.buffer_bytes)  # decode allocates no cache
        marker = np.full(executors[1].read_state(runner.cache_names[0]).shape, 7.0, np.float32)
        executors[1].write_state(runner.cache_names[0], marker)  # generate() overwrites every row it reads
        np.testing.assert_array_equal(executors[0].read_state(runner.cache_names[0]), marker)
        for prompt in PROMPTS:
            result = runner.generate(prompt, NEW_TOKENS, Sampler())
            with torch.no_grad():
                expected = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                              do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                              pad_token_id=0)[0, len(prompt):].tolist()
            assert result.tokens == expected, prompt
            # Logits of every position: prefill (all prompt rows) then one decode per new token fed back, against
            # the float64 eager forward of the whole sequence. fp32 dot products of length K <= 128 err by about
            # sqrt(K) * 6e-8 ~ 1e-6 relative each, a few such per layer over 2 layers and the head: ~1e-6 of the
            # largest logit (measured 1e-7 .. 3e-7); 2e-5 leaves a margin without hiding a wrong position or row.
            sequence = prompt + result.tokens
            exact = _float64_logits(generation["model"], sequence)
            scale = np.abs(exact).max()
            got = [*runner.prefill(prompt)]
            got += [runner.decode(token, len(prompt) + i) for i, token in enumerate(result.tokens[:-1])]
            errors = np.abs(np.stack(got) - exact[:len(sequence) - 1]).max(axis=1) / scale
            assert errors.max() <= 2e-5, errors
            generated.append(result.tokens)
    # The check has teeth: the outputs vary, and without its adapters the model's logits are far off.
    assert len({t for tokens in generated for t in tokens}) > 2
    without_adapters = copy.deepcopy(generation["model"])
    for layer in lora_modules(without_adapters).values():
        layer.adapter_enabled = False
    sequence = PROMPTS[1]
    exact = _float64_logits(generation["model"], sequence)
    assert np.abs(_float64_logits(without_adapters, sequence) - exact).max() > 1e-2 * np.abs(exact).max()


def test_positions_past_the_cache_are_refused(generation, vk_device):
    from vktrain.generate.runner import GenerationRunner
    from vktrain.generate.sampling import Sampler

    with GenerationRunner.from_pte(generation["pte"], vk_device) as runner:
        with pytest.raises(CachePositionError, match=r"30 prompt tokens \+ 3 new tokens need 33 cache positions; "
                                                     r"the program's KV cache has 32"):
            runner.generate([1] * 30, 3, Sampler())
        with pytest.raises(CachePositionError, match=r"the decode position holds positions in \[32, 32\]"):
            runner.decode(1, CACHE_LENGTH)
        with pytest.raises(CachePositionError, match="a prompt of 32 tokens leaves no position"):
            runner.prefill([1] * CACHE_LENGTH)
    result = _cli("--model", str(generation["root"] / "hf"), "--prompt-ids", "1,2", "--max-new-tokens", "100",
                  "--cache-length", str(CACHE_LENGTH), "--program-cache", str(generation["root"] / "programs"),
                  "--adapters", str(generation["root"] / "adapters"), "--prefill-length", str(PREFILL_LENGTH))
    assert result.returncode == 2
    assert ("vktrain generate: error: 2 prompt tokens + --max-new-tokens 100 need 102 KV-cache positions; "
            "--cache-length is 32: the model's max_seq_len is 64: pass at most --max-new-tokens 62 with "
            "--cache-length 64") in result.stderr

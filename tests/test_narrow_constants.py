"""Lossless narrow storage of float32 constants (serialization/narrow_constant.py, the backend pass
constant_storage.narrow_float_constants): GGUF Q8_0 values travel as Q8_0 blocks (checked against the
gguf package's quantize / dequantize), bfloat16- and float16-exact constants in 2-byte elements, and all
read back bit for bit; anything else stays float32; a tiny Llama whose embedding is bf16-exact or Q8_0
values gets a smaller .pte that trains to exactly the same losses and adapters."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from vktrain.backend import passes
from vktrain.backend.passes.constant_storage import narrow_float_constants
from vktrain.backend.passes.q8_0_weights import hold_q8_0_weights
from vktrain.serialization import deserialize_blob, serialize_blob
from vktrain.serialization import graph as vk
from vktrain.serialization.blob import BlobFormatError, named_constants
from vktrain.serialization.generated.vkt_blob import ConstantData as FbConstantData
from vktrain.serialization.generated.vkt_blob.ConstantEncoding import ConstantEncoding as FbConstantEncoding
from vktrain.serialization.graph import ConstantEncoding, GraphError, NarrowConstant, narrow_losslessly
from vktrain.backend.kernel_planning import plan_schedule

Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q8_0_BLOCK_BYTES = 34  # gguf's block: a float16 scale and 32 int8 codes

SPECIALS = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan], np.float32)


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, np.float32).view(np.uint32)


def _random(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _bf16_exact(array: np.ndarray) -> np.ndarray:
    """Truncate each float32 to its upper 16 bits (an independent way to make bf16 numbers)."""
    return (_bits(array) & np.uint32(0xFFFF0000)).view(np.float32)


def _fp16_exact_not_bf16(shape, seed=0) -> np.ndarray:
    values = _random(shape, seed).astype(np.float16).astype(np.float32)
    assert np.any(_bits(values) & 0xFFFF)  # float16's 11-bit mantissa: not all of them are bf16 numbers
    return values


def _q8_0_values(shape, seed=0) -> tuple[np.ndarray, bytes]:
    """Q8_0 values as a GGUF file holds them (gguf quantizes, then dequantizes as the importer does), with
    an all-zero block; and gguf's Q8_0 bytes of them."""
    values = _random(shape, seed)
    values.reshape(-1)[:32] = 0.0
    blocks = gguf.quants.quantize(values, Q8_0)
    return gguf.quants.dequantize(blocks, Q8_0).reshape(shape), blocks.tobytes()


def test_the_encoding_enum_is_the_schemas():
    assert {e.name: int(e) for e in ConstantEncoding} == {
        name: value for name, value in vars(FbConstantEncoding).items() if not name.startswith("_")}


def test_gguf_q8_0_values_are_stored_as_gguf_q8_0_blocks_and_widen_bit_exactly():
    values, gguf_bytes = _q8_0_values((96, 64))
    assert not np.any(values.reshape(-1)[:32]) and narrow_losslessly(values.reshape(-1)[32:64]) is not None
    narrow = narrow_losslessly(values)
    assert narrow is not None and (narrow.encoding, narrow.stored_dtype) == (ConstantEncoding.GGUF_Q8_0, None)
    assert narrow.stored_form == "gguf_q8_0"
    assert bytes(narrow.stored_bytes) == gguf_bytes  # exactly gguf's block layout
    assert narrow.stored_nbytes == values.size // 32 * Q8_0_BLOCK_BYTES and narrow.nbytes == values.nbytes
    np.testing.assert_array_equal(_bits(narrow.widen()), _bits(values).reshape(-1))


@pytest.mark.parametrize("case", ["random", "one_ulp", "not_whole_blocks", "negative_zero", "infinity",
                                  "largest_code_126"])
def test_values_that_are_not_q8_0_are_not_stored_as_q8_0(case):
    values, _ = _q8_0_values((8, 64), 4)
    values = values.reshape(-1)
    if case == "random":
        values = _random(512, 5)
    elif case == "one_ulp":
        values[100] = np.nextafter(values[100], np.float32(np.inf))
    elif case == "not_whole_blocks":
        values = values[:-1]
    elif case == "negative_zero":
        values[3] = -0.0  # in the all-zero block: Q8_0's codes cannot hold the sign of a zero
    elif case == "infinity":
        values[40] = np.inf
    else:  # a block of d * q whose largest |q| is 126: another quantizer's, not llama.cpp's amax / 127
        values[32:64] = np.float32(np.float16(0.01)) * np.arange(-126, 126, 252 / 32, dtype=np.float32).round()
        assert np.abs(values[32:64]).max() == np.float32(np.float16(0.01)) * 126
    narrow = narrow_losslessly(values)
    assert narrow is None or narrow.encoding != ConstantEncoding.GGUF_Q8_0
    assert narrow is None  # nor are these float16 / bfloat16 numbers: they stay float32


def test_the_smallest_lossless_form_wins():
    # float16-exact data is almost never Q8_0 (one scale per 32 values): it stays float16.
    fp16 = _fp16_exact_not_bf16(1024, 6)
    assert narrow_losslessly(fp16).stored_dtype == vk.DType.FLOAT16
    # Small integers whose blocks each reach 127 are bfloat16, float16 and Q8_0 numbers at once:
    # Q8_0 takes 8.5 bits a value, the 2-byte forms 16, so Q8_0 is chosen.
    integers = np.random.default_rng(7).integers(-127, 128, 1024).astype(np.float32)
    integers[::32] = 127
    assert narrow_losslessly(integers[:32].copy()) is not None
    assert not np.any(_bits(integers) & 0xFFFF)  # bfloat16-exact too
    narrow = narrow_losslessly(integers)
    assert narrow.encoding == ConstantEncoding.GGUF_Q8_0 and narrow.stored_nbytes == 1024 // 32 * Q8_0_BLOCK_BYTES
    np.testing.assert_array_equal(_bits(narrow.widen()), _bits(integers))


def test_q8_0_narrows_and_widens_the_smollm2_embedding():
    # Full size, so the chunked encoder crosses many chunk boundaries (its speed is a benchmark's
    # business: bench/results/export_cpu_smollm2-135m-instruct.json reports load time).
    values, gguf_bytes = _q8_0_values((49152, 576), 8)  # SmolLM2-135M's token_embd.weight
    narrow = narrow_losslessly(values)  # encoded chunk by chunk: many chunks here
    assert narrow.encoding == ConstantEncoding.GGUF_Q8_0 and bytes(narrow.stored_bytes) == gguf_bytes
    nudged = values.copy()
    nudged[-1, -1] = np.nextafter(nudged[-1, -1], np.float32(np.inf))  # in the last chunk
    assert narrow_losslessly(nudged) is None
    np.testing.assert_array_equal(_bits(narrow.widen()), _bits(values.reshape(-1)))


def test_bf16_exact_values_are_stored_as_bfloat16_and_widen_bit_exactly():
    values = np.concatenate([_bf16_exact(_random(1000)), SPECIALS, [np.float32(1e38), np.float32(-3e-39)]])
    values = _bf16_exact(values)  # the specials and the tiny subnormal keep only their upper half
    narrow = narrow_losslessly(values)
    assert narrow is not None and narrow.stored_dtype == vk.DType.BFLOAT16
    assert narrow.stored_nbytes == 2 * values.size and narrow.nbytes == values.nbytes
    np.testing.assert_array_equal(_bits(narrow.widen()), _bits(values))


def test_fp16_exact_values_are_stored_as_float16_and_widen_bit_exactly():
    values = np.concatenate([_fp16_exact_not_bf16(1000), SPECIALS, np.float32([65504.0, 2.0**-24, -(2.0**-14)])])
    narrow = narrow_losslessly(values)
    assert narrow is not None and narrow.stored_dtype == vk.DType.FLOAT16
    assert narrow.stored_nbytes == 2 * values.size
    np.testing.assert_array_equal(_bits(narrow.widen()), _bits(values))


@pytest.mark.parametrize("case", ["random", "one_inexact", "fp16_overflow", "fp16_underflow", "nan_payload"])
def test_values_that_would_change_stay_float32(case):
    values = _fp16_exact_not_bf16(64)
    if case == "random":
        values = _random(64)
    elif case == "one_inexact":
        values[17] = np.float32(0.1)  # neither a float16 nor a bfloat16 number
    elif case == "fp16_overflow":
        values[3] = np.float32(65520.0)  # > float16's max, and not a bfloat16 (mantissa bits below the top 7)
        assert _bits(values[3:4])[0] & 0xFFFF
    elif case == "fp16_underflow":
        values[5] = np.float32(2.0**-25 * 3)  # below float16's smallest subnormal step
    else:
        values[9] = np.uint32(0x7FC00001).view(np.float32)  # a NaN whose payload lives in the low bits
    assert narrow_losslessly(values) is None


def _graph_of(*arrays: np.ndarray) -> tuple[vk.VkGraph, list[int]]:
    graph = vk.VkGraph()
    ids = [graph.add_constant_tensor(array, name=f"c{i}") for i, array in enumerate(arrays)]
    graph.outputs = list(ids)
    return graph, ids


def test_pass_narrows_exact_constants_in_the_blob_and_they_read_back_bit_exactly():
    exact_bf16, exact_fp16, inexact = _bf16_exact(_random((64, 32), 1)), _fp16_exact_not_bf16((64, 32), 2), _random((64, 32), 3)
    plain_graph, ids = _graph_of(exact_bf16, exact_fp16, inexact)
    plain_size = len(serialize_blob(plain_graph))
    graph, _ = _graph_of(exact_bf16, exact_fp16, inexact)
    narrow_float_constants(graph)
    assert [getattr(c, "stored_dtype", None) for c in graph.constants] == [vk.DType.BFLOAT16, vk.DType.FLOAT16, None]
    data = serialize_blob(graph)
    saved = 2 * 64 * 32 * 2  # two constants at 2 of their 4 bytes per element
    assert saved - 32 <= plain_size - len(data) <= saved  # less the two stored_dtype fields (+ alignment)
    read = deserialize_blob(data)
    assert [getattr(c, "stored_dtype", None) for c in read.constants] == [vk.DType.BFLOAT16, vk.DType.FLOAT16, None]
    for value_id, expected in zip(ids, (exact_bf16, exact_fp16, inexact)):
        array = read.constant_array(value_id)
        assert array.dtype == np.float32 and array.shape == expected.shape
        np.testing.assert_array_equal(_bits(array), _bits(expected))


@pytest.mark.parametrize("named", [False, True], ids=["segment", "named_data"])
def test_a_q8_0_constant_round_trips_through_the_blob(named):
    q8_0, gguf_bytes = _q8_0_values((64, 64), 9)
    bf16, inexact = _bf16_exact(_random((64, 32), 10)), _random((64, 32), 11)
    graph, ids = _graph_of(q8_0, bf16, inexact)
    narrow_float_constants(graph)
    assert [c.stored_form if isinstance(c, NarrowConstant) else None for c in graph.constants] == [
        "gguf_q8_0", "bfloat16", None]
    named_data = named_constants(graph, 0) if named else {}
    data = serialize_blob(graph, named_data)
    plain_graph, _ = _graph_of(q8_0, bf16, inexact)
    plain = serialize_blob(plain_graph, named_constants(plain_graph, 0) if named else {})
    if not named:  # the segment area holds the stored bytes
        saved = q8_0.nbytes - len(gguf_bytes) + bf16.nbytes // 2
        assert saved - 48 <= len(plain) - len(data) <= saved
    else:  # the named data holds them, keyed by their content
        assert bytes(named_data[0][1]) == gguf_bytes
    read = deserialize_blob(data, named_data={key: view for key, view in named_data.values()} if named else None)
    assert isinstance(read.constants[0], NarrowConstant) and read.constants[0].encoding == ConstantEncoding.GGUF_Q8_0
    assert bytes(read.constants[0].stored_bytes) == gguf_bytes
    for value_id, expected in zip(ids, (q8_0, bf16, inexact)):
        array = read.constant_array(value_id)
        assert array.dtype == np.float32 and array.shape == expected.shape
        np.testing.assert_array_equal(_bits(array), _bits(expected))


def test_inspect_reports_constants_by_their_stored_bytes_and_forms():
    from vktrain.runtime.program.summary import summarize_blob

    q8_0, gguf_bytes = _q8_0_values((64, 64), 13)
    bf16, inexact = _bf16_exact(_random((64, 32), 14)), _random((64, 32), 15)
    graph, _ = _graph_of(q8_0, bf16, inexact, inexact)  # the last two share bytes
    narrow_float_constants(graph)
    constants = summarize_blob(graph)["constants"]
    assert constants["bytes"] == q8_0.nbytes + bf16.nbytes + 2 * inexact.nbytes  # as the tensors read them
    assert constants["deduplicated_bytes"] == q8_0.nbytes + bf16.nbytes + inexact.nbytes
    assert constants["stored_bytes"] == len(gguf_bytes) + bf16.size * 2 + 2 * inexact.nbytes
    assert constants["stored_deduplicated_bytes"] == len(gguf_bytes) + bf16.size * 2 + inexact.nbytes
    assert constants["stored_forms"] == {"as read": 2, "gguf_q8_0": 1, "bfloat16": 1}


def _q8_0_blob_written_with(monkeypatch, field: str, rewrite) -> bytes:
    """The blob of a graph holding one Q8_0 constant (read by tensor "emb") and one synthetic constant,
    its ConstantData records written with `FbConstantData.<field>(builder, value)` replaced by
    `rewrite(builder, value, original)`: the records a corrupt or foreign writer would produce."""
    graph = vk.VkGraph()
    graph.outputs = [graph.add_constant_tensor(_q8_0_values((4, 64), 12)[0], name="emb"),
                     graph.add_synthetic_tensor(vk.SyntheticConstant(vk.SyntheticKind.NORMAL, 0, vk.DType.FLOAT32,
                                                                     (8,), std=1.0), name="noise")]
    narrow_float_constants(graph)
    assert graph.constants[0].encoding == ConstantEncoding.GGUF_Q8_0
    original = getattr(FbConstantData, field)
    monkeypatch.setattr(FbConstantData, field, lambda builder, value: rewrite(builder, value, original))
    data = serialize_blob(graph)
    monkeypatch.undo()
    return data


Q8_0_LENGTH = 4 * 64 // 32 * Q8_0_BLOCK_BYTES


@pytest.mark.parametrize("field, rewrite, message", [
    ("AddLength", lambda b, n, write: write(b, n - 2 if n == Q8_0_LENGTH else n),
     r"constant 0 \(read by tensor value 0 \(emb\)\): narrow constant \(GGUF_Q8_0\) has 270 bytes, not a whole "
     r"number of 34-byte blocks"),
    ("AddStoredEncoding", lambda b, encoding, write: write(b, 7),
     r"constant 0 \(read by tensor value 0 \(emb\)\): narrow constant has stored_encoding 7; expected one of "
     r"\['ELEMENTS \(0\)', 'GGUF_Q8_0 \(1\)'\]"),
    ("AddStoredEncoding", lambda b, encoding, write: (write(b, encoding), FbConstantData.AddStoredDtype(b, 1)),
     r"constant 0 \(read by tensor value 0 \(emb\)\): narrow constant stored as GGUF_Q8_0 blocks also has "
     r"stored_dtype FLOAT16"),
    ("AddSynthetic", lambda b, synthetic, write: (write(b, synthetic), FbConstantData.AddStoredEncoding(b, 1)),
     r"constant 1 is synthetic but has stored_dtype None / stored_encoding 1 \(expected neither"),
], ids=["length_not_whole_blocks", "unknown_encoding", "encoding_and_stored_dtype", "encoding_on_synthetic"])
def test_inconsistent_q8_0_records_are_refused_naming_the_constant(monkeypatch, field, rewrite, message):
    data = _q8_0_blob_written_with(monkeypatch, field, rewrite)
    with pytest.raises(BlobFormatError, match=message):
        deserialize_blob(data, verify_constants=False)  # (a shortened record's crc32 no longer matches)


def test_pass_leaves_constants_that_are_not_read_as_plain_float32():
    graph = vk.VkGraph()
    codes = np.zeros((16, 8), np.uint8)  # all zero: "exact" as bits, but not a float tensor
    graph.outputs = [graph.add_constant_tensor(codes), graph.add_constant_tensor(np.zeros(4, np.int32))]
    shared = graph.add_constant_tensor(np.ones(4, np.float32))
    # The same constant read as int32 too: narrowing it would change what that reader sees.
    graph.outputs += [shared, graph.add_value(vk.TensorValue(vk.DType.INT32, (4,), constant_id=graph.tensor(shared).constant_id))]
    narrow_float_constants(graph)
    assert not any(isinstance(c, NarrowConstant) for c in graph.constants)


def test_a_narrow_constant_read_by_a_non_float32_tensor_is_refused():
    graph = vk.VkGraph()
    constant_id = graph.add_constant(narrow_losslessly(np.ones(4, np.float32)))
    graph.outputs = [graph.add_value(vk.TensorValue(vk.DType.INT32, (4,), constant_id=constant_id, name="idx"))]
    with pytest.raises(GraphError, match=r"value 0 \(idx\) is INT32 .* narrow constant"):
        graph.validate()


def test_a_narrow_constant_must_be_a_2_byte_type_with_whole_elements():
    with pytest.raises(GraphError, match="FLOAT32"):
        NarrowConstant(b"\0" * 8, vk.DType.FLOAT32)
    with pytest.raises(GraphError, match="3 bytes"):
        NarrowConstant(b"\0" * 3, vk.DType.FLOAT16)


# ------------------------------------------------------------------------------------------------
# end to end: tiny-llama with a bf16-exact / GGUF Q8_0 embedding
# ------------------------------------------------------------------------------------------------

BATCH, SEQ, STEPS = 2, 16, 4


def _constants_holding(pte, values: np.ndarray) -> list:
    """The delegate's constants whose (widened) float32 contents are exactly `values`."""
    (delegate,) = pte.delegates
    graph = deserialize_blob(delegate.data)
    found = []
    for value_id, value in enumerate(graph.values):
        if (isinstance(value, vk.TensorValue) and value.constant_id >= 0 and value.shape == values.shape
                and value.dtype == vk.DType.FLOAT32
                and np.array_equal(_bits(graph.constant_array(value_id)), _bits(values))):
            found.append(graph.constants[value.constant_id])
    return found


def _as_bf16_checkpoint(weight: np.ndarray) -> np.ndarray:
    return _bf16_exact(weight)  # what a bf16 checkpoint holds


def _as_gguf_q8_0(weight: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(weight, Q8_0), Q8_0).reshape(weight.shape)  # the importer's


@pytest.mark.parametrize("stored_as, stored_form, stored_bytes_per_value", [
    (_as_bf16_checkpoint, "bfloat16", 2), (_as_gguf_q8_0, "gguf_q8_0", Q8_0_BLOCK_BYTES / 32),
], ids=["bf16", "gguf_q8_0"])
def test_tiny_llama_with_a_narrow_exact_embedding_gets_a_smaller_pte_that_trains_identically(
        vk_device, tmp_path, monkeypatch, stored_as, stored_form, stored_bytes_per_value):
    import torch

    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.ops import adamw_hparams
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.serialization.pte import PteFile

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.copy_(torch.from_numpy(stored_as(embedding.detach().numpy())))
    program = export_training_step(model, (BATCH, SEQ))
    # The storage in the file, read back as float32 on the device (tests/test_q8_0_weights.py: held as Q8_0 there).
    without_q8_0_weights = tuple(p for p in passes.PASSES if p is not hold_q8_0_weights)
    monkeypatch.setattr(passes, "PASSES", without_q8_0_weights)
    compact = lower_to_pte(program)
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in without_q8_0_weights if p is not narrow_float_constants))
    plain = lower_to_pte(program)
    monkeypatch.undo()

    embedding_values = embedding.detach().numpy()
    (narrow,) = _constants_holding(PteFile.from_bytes(compact), embedding_values)
    (wide,) = _constants_holding(PteFile.from_bytes(plain), embedding_values)
    assert isinstance(narrow, NarrowConstant) and narrow.stored_form == stored_form
    assert not isinstance(wide, NarrowConstant)
    # The file shrinks by what its constants' storage shrinks (the embedding's saving, and the norm weights'
    # of ones, exact in every narrow form; identical bytes are stored once), give or take the padding of
    # its segments to their alignment.
    def stored(pte):
        graph = deserialize_blob(PteFile.from_bytes(pte).delegates[0].data)
        return sum(len(data) for data in {bytes(vk.stored_bytes(constant)) for constant in graph.constants})
    saved = stored(plain) - stored(compact)
    assert saved >= embedding.numel() * (4 - stored_bytes_per_value)
    assert abs((len(plain) - len(compact)) - saved) <= 1024

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, model.vocab_size, (BATCH, SEQ)), rng.integers(0, model.vocab_size, (BATCH, SEQ)))
               for _ in range(STEPS)]
    hparams = adamw_hparams(1e-2).numpy()
    results = []
    for data in (compact, plain):
        path = tmp_path / f"step{len(results)}.pte"
        path.write_bytes(data)
        runner = TrainingRunner.from_pte(path, vk_device, planner=plan_schedule)
        losses = [runner.step(tokens, labels, hparams) for tokens, labels in batches]
        results.append((losses, runner.lora_state()))
    (compact_losses, compact_lora), (plain_losses, plain_lora) = results
    assert compact_losses == plain_losses  # exactly: the widened embedding is the float32 one
    assert compact_losses[-1] < compact_losses[0]  # it did train
    assert compact_lora.keys() == plain_lora.keys()
    for name in compact_lora:
        np.testing.assert_array_equal(compact_lora[name], plain_lora[name])

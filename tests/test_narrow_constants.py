"""Lossless narrow storage of float32 constants (serialization/narrow_constant.py, the backend pass
constant_storage.narrow_float_constants): bfloat16- and float16-exact constants travel in 2-byte
elements and read back bit for bit; anything else stays float32; a tiny Llama whose embedding is
bf16-exact gets a smaller .pte that trains to exactly the same losses and adapters."""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.backend import passes
from vktrain.backend.passes.constant_storage import narrow_float_constants
from vktrain.serialization import deserialize_blob, serialize_blob
from vktrain.serialization import graph as vk
from vktrain.serialization.graph import GraphError, NarrowConstant, narrow_losslessly

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
# end to end: tiny-llama with a bf16-exact embedding
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


def test_tiny_llama_with_a_bf16_exact_embedding_gets_a_smaller_pte_that_trains_identically(
        vk_device, tmp_path, monkeypatch):
    import torch

    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.ops import adamw_hparams
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.runtime.program.pte import PteFile

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.copy_(embedding.to(torch.bfloat16).to(torch.float32))  # what a bf16 checkpoint holds
    program = export_training_step(model, (BATCH, SEQ))
    compact = lower_to_pte(program)
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p is not narrow_float_constants))
    plain = lower_to_pte(program)
    monkeypatch.undo()

    embedding_values = embedding.detach().numpy()
    (narrow,) = _constants_holding(PteFile.from_bytes(compact), embedding_values)
    (wide,) = _constants_holding(PteFile.from_bytes(plain), embedding_values)
    assert isinstance(narrow, NarrowConstant) and narrow.stored_dtype == vk.DType.BFLOAT16
    assert not isinstance(wide, NarrowConstant)
    # The embedding's saved half, less what the .pte's segment alignment (128 bytes a segment) takes back.
    assert len(plain) - len(compact) >= embedding.numel() * 2 - 1024

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, model.vocab_size, (BATCH, SEQ)), rng.integers(0, model.vocab_size, (BATCH, SEQ)))
               for _ in range(STEPS)]
    hparams = adamw_hparams(1e-2).numpy()
    results = []
    for data in (compact, plain):
        path = tmp_path / f"step{len(results)}.pte"
        path.write_bytes(data)
        runner = TrainingRunner.from_pte(path, vk_device)
        losses = [runner.step(tokens, labels, hparams) for tokens, labels in batches]
        results.append((losses, runner.lora_state()))
    (compact_losses, compact_lora), (plain_losses, plain_lora) = results
    assert compact_losses == plain_losses  # exactly: the widened embedding is the float32 one
    assert compact_losses[-1] < compact_losses[0]  # it did train
    assert compact_lora.keys() == plain_lora.keys()
    for name in compact_lora:
        np.testing.assert_array_equal(compact_lora[name], plain_lora[name])

"""Synthetic constants (benchmark blobs): records generated at load instead of stored.

Covers: the generation recipe per kind (bits reproducible from the seed, q4gsw padding codes reset to 8
without touching real codes, normal statistics, fills), refusal of records that cannot mean anything,
the blob round trip with header format version 2 (and refusal when version and content disagree), the
executor generating and uploading them (a linear_q4gsw + embedding graph against float64 references,
mutable state starting from a synthetic value), and preprocess emitting them for a real exported
training step that then runs.
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from vktrain import quant
from vktrain.backend.passes import compile_graph
from vktrain.serialization import BlobFormatError, deserialize_blob, serialize_blob
from vktrain.serialization import graph as vk
from vktrain.serialization.graph import GraphError, SyntheticConstant, SyntheticKind
from vktrain.backend.kernel_planning import plan_schedule
from _helpers import planned

F32 = vk.DType.FLOAT32
HEADER = struct.Struct("<4sIIIQQQQ")


def _bits(seed: int, shape, dtype=vk.DType.UINT8, **kw) -> SyntheticConstant:
    return SyntheticConstant(SyntheticKind.RANDOM_BITS, seed, dtype, shape, **kw)


def _w4x8(seed: int, n: int, k: int) -> SyntheticConstant:
    return _bits(seed, (quant.w4x8_num_words(n, k),), vk.DType.UINT32, layout=vk.Layout.Q4GSW_W4X8,
                 q4gsw_shape=(n, k))


# ------------------------------------------------------------------------------------------------
# generation
# ------------------------------------------------------------------------------------------------

def test_random_bits_follow_the_documented_recipe_and_the_seed():
    record = _bits(1234, (64, 1000), vk.DType.UINT32)
    data = record.materialize()
    assert data.dtype == np.uint32 and data.shape == (64, 1000) and data.flags.c_contiguous
    expected = np.frombuffer(np.random.default_rng(1234).bytes(4 * 64 * 1000), "<u4").reshape(64, 1000)
    np.testing.assert_array_equal(data, expected)
    np.testing.assert_array_equal(record.materialize(), data)  # the same bits on every load
    assert np.mean(_bits(1235, (64, 1000), vk.DType.UINT32).materialize() == data) < 0.001
    # Every nibble value (a q4gsw code) about equally often: 256000 words hold 2048000 nibbles.
    nibbles = ((data.reshape(-1, 1) >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).reshape(-1)
    counts = np.bincount(nibbles, minlength=16)
    assert np.all(np.abs(counts / nibbles.size - 1 / 16) < 0.002), counts


@pytest.mark.parametrize("n, k", [(12, 20), (8, 16), (36, 44)])
def test_w4x8_random_codes_keep_padding_at_code_8_and_real_codes_random(n, k):
    record = _w4x8(5, n, k)
    words = record.materialize()
    raw = np.frombuffer(np.random.default_rng(5).bytes(words.nbytes), "<u4")
    kp, n8_rows = quant.padded_k(k), -(-n // 8) * 8
    # Decode every stored code the way a kernel addresses it (w4x8.md), padding included.
    n8_count = (n // 4 + 1) // 2
    def codes_of(buffer):
        out = np.empty((n8_rows, kp), np.int64)
        for row in range(n8_rows):
            for col in range(kp):
                k4, t, n4, ni = col >> 2, col & 3, row >> 2, row & 3
                j = 2 * (n4 & 1) + (ni >> 1)
                out[row, col] = (int(buffer[4 * (k4 * n8_count + (n4 >> 1)) + j]) >> (8 * t + 4 * (ni & 1))) & 0xF
        return out
    stored, generated = codes_of(words), codes_of(raw)
    padding = np.zeros_like(stored, bool)
    padding[n:, :] = True
    padding[:, k:] = True
    assert np.all(stored[padding] == quant.CODE_ZERO)
    np.testing.assert_array_equal(stored[~padding], generated[~padding])  # real codes untouched
    if padding.any():
        assert np.any(generated[padding] != quant.CODE_ZERO)  # the raw bits did need the reset
    # The decoder above (w4x8.md's formula) agrees with vktrain.quant's on the real codes.
    scales = np.ones((1, n), np.float32)
    for row, col in [(0, 0), (n - 1, k - 1), (n // 2, k // 3)]:
        assert quant.decode_w4x8_element(words, scales, row, col, n, k) == stored[row, col] - quant.CODE_ZERO


def test_flat_random_codes_keep_padding_columns_at_code_8():
    n, k = 6, 12  # Kp = 16: codes 12..15 of each row are padding
    record = _bits(9, (n, quant.padded_k(k) // 2), vk.DType.UINT8, layout=vk.Layout.Q4GSW_FLAT, q4gsw_shape=(n, k))
    flat = record.materialize()
    codes = np.stack([flat & 0xF, flat >> 4], axis=-1).reshape(n, -1)
    assert np.all(codes[:, k:] == quant.CODE_ZERO)
    raw = np.frombuffer(np.random.default_rng(9).bytes(flat.nbytes), np.uint8).reshape(flat.shape)
    raw_codes = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(n, -1)
    np.testing.assert_array_equal(codes[:, :k], raw_codes[:, :k])


def test_normal_has_the_requested_statistics_and_recipe():
    record = SyntheticConstant(SyntheticKind.NORMAL, 77, F32, (500, 800), std=0.02)
    data = record.materialize()
    assert data.dtype == np.float32 and data.shape == (500, 800)
    values = data.astype(np.float64)
    assert abs(values.mean()) < 0.02 * 5 / np.sqrt(values.size)  # 5 standard errors
    assert abs(values.std() / 0.02 - 1) < 0.005
    expected = np.random.default_rng(77).standard_normal(400000, dtype=np.float32) * np.float32(0.02)
    np.testing.assert_array_equal(data.reshape(-1), expected)
    half = SyntheticConstant(SyntheticKind.NORMAL, 77, vk.DType.FLOAT16, (10,), std=1.0).materialize()
    assert half.dtype == np.float16 and np.all(np.isfinite(half))


def test_fill_gives_the_value_in_the_dtype():
    ones = SyntheticConstant(SyntheticKind.FILL, 0, F32, (3, 4), value=1.0).materialize()
    np.testing.assert_array_equal(ones, np.ones((3, 4), np.float32))
    ints = SyntheticConstant(SyntheticKind.FILL, 0, vk.DType.INT32, (5,), value=-7).materialize()
    assert ints.dtype == np.int32 and ints.tolist() == [-7] * 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=F32), "integer dtype"),
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=vk.DType.BOOL), "integer dtype"),
    (dict(kind=SyntheticKind.NORMAL, dtype=vk.DType.INT32, std=1.0), "float dtype"),
    (dict(kind=SyntheticKind.NORMAL, dtype=F32, std=-1.0), "std"),
    (dict(kind=SyntheticKind.NORMAL, dtype=F32, std=float("nan")), "std"),
    (dict(kind=SyntheticKind.FILL, dtype=vk.DType.UINT8, value=300), "not representable"),
    (dict(kind=SyntheticKind.FILL, dtype=vk.DType.INT32, value=0.5), "not representable"),
    (dict(kind=SyntheticKind.FILL, dtype=F32, value=float("inf")), "finite"),
    (dict(kind=SyntheticKind.FILL, dtype=F32, seed=-1), "seed"),
    (dict(kind=SyntheticKind.FILL, dtype=F32, seed=2**64), "seed"),
    (dict(kind=SyntheticKind.FILL, dtype=F32, layout=vk.Layout.Q4GSW_W4X8, q4gsw_shape=(8, 8)), "only meaningful"),
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=vk.DType.UINT32, q4gsw_shape=(8, 8)), "layout is PLAIN"),
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=vk.DType.UINT32, layout=vk.Layout.Q4GSW_W4X8), "q4gsw_shape"),
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=vk.DType.UINT32, layout=vk.Layout.Q4GSW_W4X8,
          q4gsw_shape=(8, 16)), "stored as UINT32\\[16\\]"),
    (dict(kind=SyntheticKind.RANDOM_BITS, dtype=vk.DType.UINT32, layout=vk.Layout.Q4GSW_W4X8,
          q4gsw_shape=(6, 16)), "N % 4"),
    (dict(kind=7, dtype=F32), "SyntheticKind"),
])
def test_meaningless_records_are_refused(kwargs, message):
    fields = dict(seed=0, shape=(4, 2)) | kwargs
    with pytest.raises(GraphError, match=message):
        SyntheticConstant(**fields)


def test_a_tensor_may_not_reinterpret_a_synthetic_constant():
    graph = vk.VkGraph()
    constant = graph.add_constant(SyntheticConstant(SyntheticKind.NORMAL, 1, F32, (4, 4), std=1.0))
    graph.add_value(vk.TensorValue(vk.DType.INT32, (4, 4), constant_id=constant, name="w"))
    with pytest.raises(GraphError, match="w.*INT32\\[4, 4\\].*generated as FLOAT32\\[4, 4\\]"):
        graph.validate()


# ------------------------------------------------------------------------------------------------
# blob
# ------------------------------------------------------------------------------------------------

def _synthetic_graph() -> vk.VkGraph:
    graph = vk.VkGraph()
    x = graph.add_value(vk.TensorValue(F32, (2, 8), name="x"))
    graph.inputs = [x]
    graph.add_synthetic_tensor(_w4x8(3, 12, 20), "layer.weights")
    graph.add_synthetic_tensor(SyntheticConstant(SyntheticKind.FILL, 4, F32, (1, 12), value=0.25), "layer.scales")
    graph.add_synthetic_tensor(SyntheticConstant(SyntheticKind.NORMAL, 2**64 - 1, F32, (1000, 1000), std=0.02),
                               "embed.weight")
    graph.add_constant_tensor(np.arange(6, dtype=np.float32), name="real")
    state = graph.add_value(vk.TensorValue(F32, (3, 8), name="lora_A"))
    initial = graph.add_constant(SyntheticConstant(SyntheticKind.NORMAL, 11, F32, (3, 8), std=0.1))
    graph.mutable_state = [vk.MutableState(state, state, initial)]
    graph.outputs = [x]
    graph.metadata = {"synthetic_constants": "{}"}
    return graph


def _header(blob: bytes) -> list:
    return list(HEADER.unpack_from(blob, 0))


def _with_version(blob: bytes, version: int) -> bytes:
    """`blob` with another format version, its graph checksum (blob.py) recomputed so the version check speaks."""
    fields = _header(blob)
    fields[2] = version
    patched = HEADER.pack(*fields) + blob[HEADER.size:]
    fb_offset, fb_size = fields[4], fields[5]
    graph_crc32 = zlib.crc32(patched[fb_offset:fb_offset + fb_size], zlib.crc32(patched[:HEADER.size]))
    return patched[:HEADER.size] + struct.pack("<I", graph_crc32) + patched[HEADER.size + 4:]


def test_blob_round_trip_keeps_records_and_stores_no_synthetic_bytes():
    graph = _synthetic_graph()
    blob = serialize_blob(graph)
    assert _header(blob)[2] == 2  # format version 2: the blob holds synthetic constants
    assert len(blob) < 4096  # a 4 MB embedding travels as a record
    parsed = deserialize_blob(blob)
    assert parsed.values == graph.values and parsed.mutable_state == graph.mutable_state
    assert parsed.constants[:3] == graph.constants[:3] and parsed.constants[4] == graph.constants[4]
    assert bytes(parsed.constants[3]) == np.arange(6, dtype=np.float32).tobytes()
    assert parsed.synthetic_constant_ids == [0, 1, 2, 4]
    np.testing.assert_array_equal(parsed.constant_array(1), graph.constants[0].materialize())
    np.testing.assert_array_equal(parsed.constant_array(2), np.full((1, 12), 0.25, np.float32))


def test_blobs_without_synthetic_constants_stay_version_1():
    graph = vk.VkGraph()
    graph.add_constant_tensor(np.ones(4, np.float32), name="w")
    assert _header(serialize_blob(graph))[2] == 1


def test_header_version_must_agree_with_the_content():
    blob = serialize_blob(_synthetic_graph())
    with pytest.raises(BlobFormatError, match="version 1 cannot hold synthetic constants"):
        deserialize_blob(_with_version(blob, 1))
    with pytest.raises(BlobFormatError, match="versions 1 to 2"):
        deserialize_blob(_with_version(blob, 3))
    plain = vk.VkGraph()
    plain.add_constant_tensor(np.ones(4, np.float32), name="w")
    with pytest.raises(BlobFormatError, match="only for graphs with synthetic constants"):
        deserialize_blob(_with_version(serialize_blob(plain), 2))


# ------------------------------------------------------------------------------------------------
# executor (lavapipe)
# ------------------------------------------------------------------------------------------------

def test_executor_generates_and_uploads_synthetic_constants(vk_device):
    from vktrain.runtime.delegate.executor import GraphExecutor

    m, n, k, group, vocab = 5, 24, 64, 32, 50
    graph = vk.VkGraph()
    x = graph.add_value(vk.TensorValue(F32, (m, k), name="x"))
    ids = graph.add_value(vk.TensorValue(vk.DType.INT64, (m,), name="ids"))
    graph.inputs = [x, ids]
    weights = graph.add_synthetic_tensor(_w4x8(21, n, k), "head.weights")
    scales_record = SyntheticConstant(SyntheticKind.NORMAL, 22, F32, (k // group, n), std=0.01)
    scales = graph.add_synthetic_tensor(scales_record, "head.scales")
    table_record = SyntheticConstant(SyntheticKind.NORMAL, 23, F32, (vocab, k), std=0.02)
    table = graph.add_synthetic_tensor(table_record, "embed.weight")
    y = graph.add_value(vk.TensorValue(F32, (m, n), name="y"))
    rows = graph.add_value(vk.TensorValue(F32, (m, k), name="rows"))
    state = graph.add_value(vk.TensorValue(F32, (4, 3), name="lora_A"))
    state_record = SyntheticConstant(SyntheticKind.NORMAL, 24, F32, (4, 3), std=0.5)
    graph.mutable_state = [vk.MutableState(state, state, graph.add_constant(state_record))]
    group_size, no_bias = graph.add_value(vk.IntValue(group)), graph.add_value(vk.NullValue())
    graph.ops = [vk.OpCall("vktrain.linear_q4gsw.default", (x, weights, scales, group_size, no_bias), (y,)),
                 vk.OpCall("aten.embedding.default", (table, ids, graph.add_value(vk.IntValue(-1)),
                                                      graph.add_value(vk.BoolValue(False)),
                                                      graph.add_value(vk.BoolValue(False))), (rows,))]
    graph.outputs = [y, rows]
    compile_graph(graph)  # the backend's passes: the int64 ids are stored as int32
    graph = deserialize_blob(serialize_blob(graph))  # what a runtime reads from a .pte

    rng = np.random.default_rng(0)
    x_value = rng.standard_normal((m, k)).astype(np.float32)
    id_values = np.array([0, 49, 7, 7, 31])
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        y_out, rows_out = executor.run(x_value, id_values)
        table_bytes, scale_bytes, word_bytes = table_record.nbytes, scales_record.nbytes, _w4x8(21, n, k).nbytes
        assert executor.synthetic_constant_bytes == table_bytes + scale_bytes + word_bytes
        np.testing.assert_array_equal(executor.initial_state("lora_A"), state_record.materialize())
        np.testing.assert_array_equal(executor.read_state("lora_A"), state_record.materialize())
    # Embedding rows are copies: bitwise the generated table.
    np.testing.assert_array_equal(rows_out, table_record.materialize()[id_values])
    # The linear read the generated codes and scales: float64 reference from the generator's arrays.
    flat = quant.unpack_w4x8(_w4x8(21, n, k).materialize(), n, k)
    weight = quant.dequantize(flat, scales_record.materialize(), group, k).astype(np.float64)
    reference = x_value.astype(np.float64) @ weight.T
    np.testing.assert_allclose(y_out, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


# ------------------------------------------------------------------------------------------------
# preprocess: a real exported training step
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_step_graphs():
    """(graph lowered with real constants, graph lowered with synthetic constants, path of the synthetic .pte)"""
    from vktrain.backend import synthetic_constants_spec
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.serialization.pte import PteFile

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=64, n_layers=2)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="layers.*", group_size=32, seed=0))
    program = export_training_step(model, (2, 8))

    def lowered(specs):
        data = lower_to_pte(program, VktrainPartitioner(compile_specs=specs))
        return data, deserialize_blob(PteFile.from_bytes(data).execution_plan("forward").delegates[0].data)

    _, real = lowered([])
    data, synthetic = lowered(synthetic_constants_spec(min_bytes=1024, seed=3))
    return real, synthetic, data


def test_preprocess_replaces_big_constants_by_role(mlp_step_graphs):
    from vktrain.backend.preprocess import SYNTHETIC_SCALE, SYNTHETIC_WEIGHT_STD

    real, synthetic, _ = mlp_step_graphs
    # Same graph apart from where constant data comes from.
    assert real.ops == synthetic.ops and real.inputs == synthetic.inputs and real.outputs == synthetic.outputs
    assert real.mutable_state == synthetic.mutable_state
    assert [v for v in real.values if not isinstance(v, vk.TensorValue)] == \
        [v for v in synthetic.values if not isinstance(v, vk.TensorValue)]
    records = {}
    for value_id, value in enumerate(synthetic.values):
        if isinstance(value, vk.TensorValue) and value.constant_id >= 0:
            assert value == real.values[value_id]  # dtype, shape, layout, name unchanged
            if synthetic.is_synthetic(value.constant_id):
                records[value.name] = synthetic.constants[value.constant_id]
            else:  # too small, or of a role whose values matter: the real bytes
                np.testing.assert_array_equal(synthetic.constant_array(value_id), real.constant_array(value_id))
    # layer weights: W_4X8 [N=64, K] codes (K = 32, then 64), 1 KiB and 2 KiB -> random bits
    layer0 = records["model.layers.0.weights"]
    assert (layer0.kind, layer0.layout, layer0.q4gsw_shape) == (SyntheticKind.RANDOM_BITS, vk.Layout.Q4GSW_W4X8,
                                                                (64, 32))
    assert records["model.layers.1.weights"].q4gsw_shape == (64, 64)
    # embedding [64, 32] and head [64, 64] fp32 weights -> N(0, 0.02); scales [G, 64] are 256-512 bytes: real
    for name in ("model.embed.weight", "model.head.weight"):
        assert (records[name].kind, records[name].std) == (SyntheticKind.NORMAL, SYNTHETIC_WEIGHT_STD)
    assert set(records) == {"model.layers.0.weights", "model.layers.1.weights", "model.embed.weight",
                            "model.head.weight"}
    assert len({r.seed for r in records.values()}) == len(records)  # distinct data per constant
    summary = json.loads(synthetic.metadata["synthetic_constants"])
    assert summary["count"] == 4 and summary["min_bytes"] == 1024 and summary["seed"] == 3
    assert summary["bytes"] == sum(r.nbytes for r in records.values())
    assert SYNTHETIC_SCALE == pytest.approx(0.02 / np.sqrt(255 / 12))


def test_preprocess_metadata_spec_and_bad_specs():
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    from vktrain.backend import metadata_spec, synthetic_constants_spec
    from vktrain.backend.preprocess import _int_spec, _metadata_from_specs

    assert _metadata_from_specs([metadata_spec("bench", '{"a": 1}'), CompileSpec("other", b"x")]) == \
        {"bench": '{"a": 1}'}
    with pytest.raises(ValueError, match="min_bytes"):
        synthetic_constants_spec(-1)
    with pytest.raises(ValueError, match="non-negative decimal integer"):
        _int_spec([CompileSpec("synthetic_constants_min_bytes", b"64k")], "synthetic_constants_min_bytes")


def test_training_step_with_synthetic_constants_runs(vk_device, mlp_step_graphs, tmp_path):
    from vktrain.runtime.program.runner import TrainingRunner

    _, synthetic, data = mlp_step_graphs
    path = tmp_path / "synthetic_step.pte"
    path.write_bytes(data)
    rng = np.random.default_rng(1)
    token_ids = rng.integers(0, 64, (2, 8))
    labels = rng.integers(0, 64, (2, 8))
    hparams = np.array([1e-2, 0.9, 0.999, 1e-8, 0.0], np.float32)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        summary = json.loads(synthetic.metadata["synthetic_constants"])
        assert runner.executor.synthetic_constant_bytes == summary["bytes"]
        losses = [runner.step(token_ids, labels, hparams) for _ in range(4)]
    # Random N(0, 0.02) weights give near-uniform logits: the first loss is about ln(64); the same batch
    # repeated must then be learned.
    assert abs(losses[0] - np.log(64)) < 0.1
    assert losses[-1] < losses[0]


def test_same_stored_bytes_decides_by_the_record_where_it_settles_the_bytes(monkeypatch):
    """graph.same_stored_bytes: equal records, and FILLs differing only in their seed, are equal without being
    generated; other synthetic pairs, and stored bytes, are compared by their bytes (np.array_equal)."""
    from vktrain.serialization.graph import SyntheticConstant, SyntheticKind, same_stored_bytes

    normal = SyntheticConstant(SyntheticKind.NORMAL, 7, vk.DType.FLOAT32, (4, 8), std=0.02)
    fill = SyntheticConstant(SyntheticKind.FILL, 1, vk.DType.FLOAT32, (8,), value=1.0)
    refill = SyntheticConstant(SyntheticKind.FILL, 2, vk.DType.FLOAT32, (8,), value=1.0)
    generate = SyntheticConstant.materialize
    monkeypatch.setattr(SyntheticConstant, "materialize", lambda self: pytest.fail("generated"))
    assert same_stored_bytes(normal, SyntheticConstant(SyntheticKind.NORMAL, 7, vk.DType.FLOAT32, (4, 8), std=0.02))
    assert same_stored_bytes(fill, refill)
    monkeypatch.setattr(SyntheticConstant, "materialize", generate)
    assert not same_stored_bytes(normal, SyntheticConstant(SyntheticKind.NORMAL, 8, vk.DType.FLOAT32, (4, 8), std=0.02))
    assert not same_stored_bytes(fill, SyntheticConstant(SyntheticKind.FILL, 1, vk.DType.FLOAT32, (8,), value=2.0))
    assert same_stored_bytes(fill, np.ones(8, np.float32).tobytes())  # generated, then compared
    data = np.arange(32, dtype=np.float32).tobytes()
    view = memoryview(data)
    assert same_stored_bytes(view[:64], view[:64]) and same_stored_bytes(view, bytes(data))
    assert not same_stored_bytes(view, data[:-4] + b"\0\0\0\1") and not same_stored_bytes(view, data[:-4])

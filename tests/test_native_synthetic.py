"""Synthetic constants (BENCHMARK ONLY: vktrain/serialization/synthetic.py) in the native runtime: a .pte whose
weights, scales and embedding are generated at load (scripts/bench_step.py exports them so) gives, natively, the
bytes the Python runtime generates (numpy's PCG64 + SeedSequence, its float32 ziggurat normal, q4gsw padding codes
reset to 8), and trains the Python runtime's losses bit for bit. The model is mlp-lora with a 260-row embedding
and a 260-row q4gsw head (N/4 odd: the W_4X8 padding rows). The generator alone (tests/native_synthetic_check.cc on
the static library) is checked against numpy at scale: millions of normals, float16 casts, every record kind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _helpers import build_native

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


@pytest.fixture(scope="module")
def native() -> Path:
    return build_native()


@pytest.fixture(scope="module")
def synthetic_pte(tmp_path_factory) -> Path:
    from vktrain.backend import synthetic_constants_spec
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    model = build_model("mlp-lora", dim=128, hidden=64, vocab_size=260, n_layers=1, activation="relu")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("native_synthetic") / "synthetic.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (2, 16)),
                                  VktrainPartitioner(compile_specs=synthetic_constants_spec(1024)),
                                  rewrite_blobs=TargetEmbedder(resolve_targets("lavapipe"))))
    return path


@pytest.fixture(scope="module")
def generator(native, tmp_path_factory) -> Path:
    """tests/native_synthetic_check.cc linked against the native runtime's static library."""
    import shutil

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("synthetic_check") / "native_synthetic_check"
    subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{REPO / 'native' / 'src'}",
                    str(REPO / "tests" / "native_synthetic_check.cc"), str(native / "libvktrain_native.a"), "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


@pytest.mark.parametrize("seed", [0, 2**32 + 5, 2**64 - 1])
def test_the_normal_generator_is_numpys_float32_ziggurat_bit_for_bit(generator, seed):
    """2M normals per seed (one and two 32-bit seed words, the largest seed): ~500 of each take the ziggurat's
    tail branch beyond r = 3.654 and thousands its wedges, where a table entry or a rounding off by one shows."""
    count = 2_000_000
    ours = np.frombuffer(subprocess.run([str(generator), "normal", str(seed), str(count)], capture_output=True,
                                        check=True, timeout=120).stdout, dtype=np.float32)
    theirs = np.random.default_rng(seed).standard_normal(count, dtype=np.float32)
    assert np.count_nonzero(np.abs(theirs) > 3.6541528853610088) > 300
    assert ours.tobytes() == theirs.tobytes()


def test_float16_casts_and_each_record_kind_match_numpy(generator):
    from vktrain.serialization.synthetic import SyntheticConstant, SyntheticKind
    from vktrain.serialization.tensor_types import DType

    rng = np.random.default_rng(1)  # every float16 range: subnormals, ties, the largest finite, overflow to inf
    floats = np.concatenate([rng.standard_normal(100_000).astype(np.float32) *
                             np.float32(10.0) ** rng.integers(-9, 6, 100_000).astype(np.float32),
                             np.array([65504, 65519.99, 65520, 2.98e-8, 5.96e-8, -0.0, 6.1e-5, 1.00048828125], np.float32)])
    halves = subprocess.run([str(generator), "half"], input=floats.tobytes(), capture_output=True, check=True).stdout
    with np.errstate(over="ignore"):
        assert halves == floats.astype(np.float16).tobytes()
    codes = {DType.FLOAT32: 0, DType.FLOAT16: 1, DType.INT32: 2, DType.UINT8: 4}
    for record in (SyntheticConstant(SyntheticKind.NORMAL, 7, DType.FLOAT16, (1000, 77), std=0.02),
                   SyntheticConstant(SyntheticKind.RANDOM_BITS, 9, DType.UINT8, (12347,)),  # a cut last draw
                   SyntheticConstant(SyntheticKind.FILL, 1, DType.FLOAT16, (3,), value=1.00048828125 + 2**-40),
                   SyntheticConstant(SyntheticKind.FILL, 1, DType.FLOAT32, (5,), value=0.004338609156373124),
                   SyntheticConstant(SyntheticKind.FILL, 1, DType.INT32, (5,), value=-7)):
        theirs = record.materialize().tobytes()
        ours = subprocess.run([str(generator), "stream", str(int(record.kind)), str(record.seed), str(codes[record.dtype]),
                               repr(record.std), repr(record.value), str(len(theirs))], capture_output=True, check=True).stdout
        assert ours == theirs, record


def _synthetic_tensors(pte: Path) -> dict[str, np.ndarray]:
    """name -> the array the Python runtime generates (graph.constant_array: SyntheticConstant.materialize)."""
    from vktrain.runtime.program import fuzz

    graph = fuzz.load(pte.read_bytes())[1].graph
    return {value.name: graph.constant_array(index) for index, value in enumerate(graph.values)
            if getattr(value, "constant_id", -1) >= 0 and graph.is_synthetic(value.constant_id)}


def test_every_kind_is_generated_as_the_python_runtime_generates_it(native, synthetic_pte, tmp_path):
    from vktrain.serialization.synthetic import SyntheticKind

    expected = _synthetic_tensors(synthetic_pte)
    from vktrain.runtime.program import fuzz

    graph = fuzz.load(synthetic_pte.read_bytes())[1].graph
    kinds = {graph.constants[c].kind for c in graph.synthetic_constant_ids}
    assert kinds == {SyntheticKind.NORMAL, SyntheticKind.RANDOM_BITS, SyntheticKind.FILL}
    assert expected["model.embed.weight"].size == 260 * 128
    for name, theirs in expected.items():
        out = tmp_path / f"{name}.npy"
        result = subprocess.run([str(native / "vktrain-native-inspect"), str(synthetic_pte), "--constant", name,
                                 "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        ours = np.load(out)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        assert ours.tobytes() == theirs.tobytes(), name
    # The head's W_4X8 codes: rows 260..263 of the last block column are padding (code 8), the rest random.
    head = expected["model.head.weights"]
    assert (head.reshape(-1, 4)[-1] == 0x88888888).any() and len(np.unique(head)) > 1000


def test_a_synthetic_step_trains_the_python_runtimes_losses_bit_for_bit(native, synthetic_pte, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(4).integers(0, 260, size=600).astype(np.int32))
    hyper = ["--lr", "2e-3", "--schedule", "constant", "--seed", "3"]
    env = dict(os.environ, VKTRAIN_VALIDATION="1", PYTHONPATH=str(REPO))
    ours = subprocess.run([str(native / "vktrain-train"), str(synthetic_pte), "--data", str(tokens), "--steps",
                           str(STEPS), "--json", str(tmp_path / "native.json"), *hyper],
                          capture_output=True, text=True, timeout=300, env=env)
    assert ours.returncode == 0, ours.stderr
    theirs = subprocess.run([sys.executable, "-m", "vktrain.cli", "train", str(synthetic_pte), "--data", str(tokens),
                             "--steps", str(STEPS), "--json", str(tmp_path / "python.json"), "--no-progress", *hyper],
                            capture_output=True, text=True, timeout=300, env=env)
    assert theirs.returncode == 0, theirs.stderr
    native_records = json.loads((tmp_path / "native.json").read_text())
    python_records = json.loads((tmp_path / "python.json").read_text())
    assert len(native_records) == len(python_records) == STEPS
    for mine, other in zip(native_records, python_records):
        assert mine["loss_bits"] == f"0x{np.float32(other['loss']).view(np.uint32):08x}", (mine, other)

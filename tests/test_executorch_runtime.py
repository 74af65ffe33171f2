"""The stock ExecuTorch runtime (the executorch wheel's `executorch.runtime`) runs vktrain .pte files
through vktrain.executorch_backend's Python fallback (VKTRAIN_EXECUTORCH_BACKEND=python: the trampoline into
the Python runtime; the native backend is tests/test_executorch_native.py's): the same training as vktrain's
TrainingRunner, bad blobs refused with a non-Ok error instead of a crash, a missing compiler reported clearly.
A .pte without embedded schedules, as here, is what the fallback is kept for: it plans at load.

Parity is exact (==): both paths build the same GraphExecutor from the same blob and run the same
kernels on the same device with the same inputs; only the host side around the delegate differs
(ExecuTorch's C++ runtime vs vktrain's interpreter), and it copies the inputs and the loss unchanged.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("executorch.runtime")

from vktrain.contract import hparams_values  # noqa: E402
from vktrain.backend.kernel_planning import plan_schedule

BATCH, SEQ, VOCAB, STEPS = 2, 8, 64, 5


@pytest.fixture(scope="module")
def backend(vk_device):
    """The trampoline, loaded (built on first use), its delegates running on the session's device."""
    import os

    os.environ["VKTRAIN_EXECUTORCH_BACKEND"] = "python"  # read once, at the import that registers the backend
    import vktrain.executorch_backend as backend

    assert backend.IMPLEMENTATION == "python", "another test registered the native backend in this process"

    backend.use_device(vk_device)
    yield backend
    gc.collect()  # drop ExecuTorch methods a failing test left, so their executors close before the device
    backend.use_device(None)


def _export(path, named_data_min_bytes):
    """The small mlp-lora training step as a .pte; with `named_data_min_bytes`, constants of that size
    or more live in the .pte's named data (blob header flag NAMED_DATA) instead of the blob."""
    from vktrain.backend.preprocess import named_data_spec
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.partitioner import VktrainPartitioner

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2, activation="relu")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    specs = [] if named_data_min_bytes is None else [named_data_spec(named_data_min_bytes)]
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ)), VktrainPartitioner(compile_specs=specs)))
    return path


@pytest.fixture(scope="module", params=[None, 256], ids=["blob-constants", "named-data-constants"])
def step_pte(request, tmp_path_factory):
    path = _export(tmp_path_factory.mktemp("pte") / "step.pte", request.param)
    from vktrain.serialization.pte import PteFile

    assert bool(PteFile.load(path).named_data) == (request.param is not None)
    return path


def _batches(count: int):
    rng = np.random.default_rng(7)
    for _ in range(count):
        token_ids = rng.integers(0, VOCAB, (BATCH, SEQ))
        labels = rng.integers(0, VOCAB, (BATCH, SEQ))
        labels[0, :3] = -100  # some ignored labels: n_valid is not the whole batch
        yield token_ids, labels


HPARAMS = np.array(hparams_values(lr=5e-2), dtype=np.float32)


def test_executorch_runtime_trains_like_the_training_runner(backend, vk_device, step_pte):
    from executorch.runtime import Runtime

    from vktrain.contract import BACKEND_ID
    from vktrain.runtime.program.runner import TrainingRunner

    runtime = Runtime.get()
    assert BACKEND_ID in runtime.backend_registry.registered_backend_names
    program = runtime.load_program(str(step_pte))
    method = program.load_method("forward")
    (executor,) = backend.executors()
    initial_lora = {name: executor.read_state(name) for name in executor.state_names if ".lora_" in name}

    et_losses, runner_losses = [], []
    with TrainingRunner.from_pte(step_pte, vk_device, planner=plan_schedule) as runner:
        for token_ids, labels in _batches(STEPS):
            et_losses.append(float(method.execute(_inputs(token_ids, labels))[0]))
            runner_losses.append(runner.step(token_ids, labels, HPARAMS))
        runner_state = runner.state_dict()

    assert et_losses == runner_losses
    assert all(np.isfinite(et_losses)) and len(set(et_losses)) == STEPS
    et_state = {name: executor.read_state(name) for name in executor.state_names}
    assert sorted(et_state) == sorted(runner_state)
    for name, value in runner_state.items():
        np.testing.assert_array_equal(et_state[name], value, err_msg=name)
    # The delegate trained: its LoRA tensors moved (B starts at zero, A at its init) and the step counted.
    assert any(not np.array_equal(et_state[name], initial) for name, initial in initial_lora.items())
    assert float(et_state["optimizer.step"]) == STEPS

    del method, program
    gc.collect()
    assert backend.executors() == [], "ExecuTorch's destroy did not reach the bridge"


README_SNIPPET = """
import sys
import numpy as np, torch
import vktrain.executorch_backend          # VKTRAIN_EXECUTORCH_BACKEND=python: builds (once) and loads the trampoline
from executorch.runtime import Runtime
program = Runtime.get().load_program(sys.argv[1])
method = program.load_method("forward")
batches = np.load(sys.argv[2])
for token_ids, labels, hparams, n_valid in zip(batches["token_ids"], batches["labels"], batches["hparams"], batches["n_valid"]):
    inputs = [torch.from_numpy(token_ids), torch.from_numpy(labels), torch.from_numpy(hparams), torch.tensor(n_valid)]
    print(repr(float(method.execute(inputs)[0])))
"""


def test_readme_snippet_runs_in_a_fresh_process_and_exits_cleanly(request, vk_device, step_pte, tmp_path):
    """No use_device: the first init opens its own Device; the delegate is destroyed at exit without a crash."""
    import os
    import subprocess
    import sys

    from vktrain.runtime.program.runner import TrainingRunner

    if request.node.callspec.params["step_pte"] is not None:
        pytest.skip("one .pte is enough: the snippet's path does not depend on where the constants live")
    batches = list(_batches(2))
    n_valid = [np.float32(np.count_nonzero(labels >= 0)) for _, labels in batches]
    np.savez(tmp_path / "batches.npz", token_ids=[t for t, _ in batches], labels=[l for _, l in batches],
             hparams=[HPARAMS] * 2, n_valid=n_valid)
    run = subprocess.run([sys.executable, "-c", README_SNIPPET, str(step_pte), str(tmp_path / "batches.npz")],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, VKTRAIN_EXECUTORCH_BACKEND="python"))
    assert run.returncode == 0, run.stderr[-3000:]
    with TrainingRunner.from_pte(step_pte, vk_device, planner=plan_schedule) as runner:
        expected = [runner.step(token_ids, labels, HPARAMS) for token_ids, labels in batches]
    assert [float(line) for line in run.stdout.split()] == expected


def _corrupt_graph(pte_bytes: bytes) -> bytes:
    """The .pte with one byte of its delegate's graph flatbuffer flipped (the blob's checksum catches it)."""
    from vktrain.serialization.pte import PteFile
    from vktrain.serialization.blob_header import BlobHeader

    blob = bytes(PteFile.from_bytes(pte_bytes).execution_plan("forward").delegates[0].data)
    start = pte_bytes.find(blob)
    assert start >= 0 and pte_bytes.find(blob, start + 1) < 0
    header = BlobHeader.parse(memoryview(blob))
    position = start + header.flatbuffer_offset + header.flatbuffer_size // 2
    data = bytearray(pte_bytes)
    data[position] ^= 0xFF
    return bytes(data)


def test_corrupted_blob_fails_load_method_with_an_error(backend, step_pte, tmp_path):
    from executorch.runtime import Runtime

    bad = tmp_path / "corrupt.pte"
    bad.write_bytes(_corrupt_graph(step_pte.read_bytes()))
    program = Runtime.get().load_program(str(bad))
    with pytest.raises(RuntimeError, match=r"error: 0x:?23"):  # Error::InvalidProgram (pybindings print "0x:23")
        program.load_method("forward")
    assert "graph checksum mismatch" in backend.last_error()
    assert backend.executors() == []
    # The process and the backend are fine: the intact file still loads and runs.
    method = Runtime.get().load_program(str(step_pte)).load_method("forward")
    assert np.isfinite(float(method.execute(_inputs(*next(_batches(1))))[0]))
    del method
    gc.collect()


def _inputs(token_ids, labels):
    import torch

    n_valid = float(np.count_nonzero(labels >= 0))
    return [torch.from_numpy(token_ids), torch.from_numpy(labels), torch.from_numpy(HPARAMS),
            torch.tensor(n_valid, dtype=torch.float32)]


def test_bad_input_fails_execute_with_an_error_and_changes_nothing(backend, step_pte):
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(step_pte)).load_method("forward")
    (executor,) = backend.executors()
    before = {name: executor.read_state(name) for name in executor.state_names}
    token_ids, labels = next(_batches(1))
    token_ids[1, 3] = VOCAB  # outside the embedding: vktrain's executor refuses it before the step
    with pytest.raises(RuntimeError, match=r"0x:?12"):  # Error::InvalidArgument
        method.execute(_inputs(token_ids, labels))
    assert "input 'token_ids' holds 64 at [1, 3]" in backend.last_error()
    for name, value in before.items():
        np.testing.assert_array_equal(executor.read_state(name), value, err_msg=name)
    token_ids[1, 3] = 0
    assert np.isfinite(float(method.execute(_inputs(token_ids, labels))[0]))  # the method still works
    del method
    gc.collect()


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from vktrain.errors import VktrainError
    from vktrain.executorch_backend import build

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))  # an empty cache: the library must be built
    monkeypatch.setenv(build.COMPILER_ENV, str(tmp_path / "no-such-g++"))
    with pytest.raises(build.TrampolineBuildError, match=r"install g\+\+ \(apt-get install g\+\+\)") as caught:
        build.library_path()
    assert isinstance(caught.value, VktrainError) and "no-such-g++" in str(caught.value)
    assert not any(tmp_path.rglob("*.so"))


def test_library_is_cached_and_keyed_by_its_source(monkeypatch, tmp_path):
    from vktrain.executorch_backend import build

    built = build.library_path()
    assert build.library_path() == built == build.library_target() and built.is_file()  # cached: no rebuild
    source = tmp_path / "trampoline.cpp"
    source.write_text(build.SOURCE.read_text())
    monkeypatch.setattr(build, "SOURCE", source)
    first = build.library_target()
    source.write_text(source.read_text() + "\n// edited\n")
    assert build.library_target() != first  # an edited source is a different library: a stale one is rebuilt


def test_failing_compiler_leaves_no_library(monkeypatch, tmp_path):
    from vktrain.executorch_backend import build

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(build.COMPILER_ENV, "false")  # found, exits 1 without output
    with pytest.raises(build.TrampolineBuildError, match=r"trampoline\.cpp failed \(exit 1\)"):
        build.library_path()
    assert not any(tmp_path.rglob("*.so"))

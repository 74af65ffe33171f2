"""The native ExecuTorch backend (native/executorch/backend.cc): the executorch wheel's runtime, and a C++
program on ExecuTorch's Program / Method API, train tiny-llama's .pte (exported with its eval method and the
schedules embedded for lavapipe) with no vktrain Python runtime in the loop, against vktrain's TrainingRunner on
the same .pte: every loss of 10 steps and the eval method's loss before and after them are bit-identical (==),
so the eval method sees the state its forward trained. The native side reads the same embedded schedule and
replays the same kernels on the same device with the same inputs (tests/test_native_train.py shows the native
interpreter trains bit for bit like the Python runtime).

Every ExecuTorch run is a fresh process: one process holds one registration of the backend's name, and
tests/test_executorch_runtime.py registers the Python trampoline in this one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("executorch.runtime")

from _helpers import build_native  # noqa: E402

from vktrain.contract import hparams_values  # noqa: E402

BATCH, SEQ, STEPS = 2, 16, 10
HPARAMS = np.array(hparams_values(lr=3e-3), dtype=np.float32)


@pytest.fixture(scope="module")
def native_build():
    folder = build_native()
    if not (folder / "libvktrain_executorch_backend.so").is_file():
        pytest.fail("scripts/native_build.sh built no ExecuTorch backend although the executorch wheel is installed: "
                    f"see {folder / 'build.log'}")
    return folder


@pytest.fixture(scope="module")
def llama_pte(tmp_path_factory):
    """tiny-llama's training step and eval method, with lavapipe's schedules embedded (`vktrain export --target
    lavapipe`'s program)."""
    from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
    from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (BATCH, SEQ))))
    path = tmp_path_factory.mktemp("et_native") / "tiny_llama.pte"
    path.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: VktrainPartitioner()},
                                          rewrite_blobs=TargetEmbedder(resolve_targets("lavapipe"))))
    return path


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS):
        token_ids = rng.integers(0, 256, (BATCH, SEQ))
        labels = rng.integers(0, 256, (BATCH, SEQ))
        labels[0, :5] = -100  # some ignored labels: n_valid is not the whole batch
        out.append((token_ids, labels))
    return out


@pytest.fixture(scope="module")
def reference(vk_device, llama_pte, batches):
    """TrainingRunner's eval loss sum of batch 0, its 10 losses, then the eval loss sum again (float32 values)."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime.program.runner import TrainingRunner

    with TrainingRunner.from_pte(llama_pte, vk_device, planner=plan_schedule) as runner:
        assert runner.executor.target_profile is not None  # it runs the embedded schedule too
        before = runner.evaluate(*batches[0])[0]
        losses = [runner.step(token_ids, labels, HPARAMS) for token_ids, labels in batches]
        after = runner.evaluate(*batches[0])[0]
    return {"eval_before": before, "losses": losses, "eval_after": after}


# Runs in a fresh process: argv = .pte, batches.npz, a corrupted copy of the .pte. Prints one JSON object.
SCRIPT = r"""
import gc, json, sys
import numpy as np, torch
import vktrain.executorch_backend as backend
from executorch.runtime import Runtime

pte, data, corrupt = sys.argv[1:4]
batches = np.load(data)
out = {"implementation": backend.IMPLEMENTATION, "errors": {}}

def attempt(what, call):
    try:
        call()
        out["errors"][what] = None
    except RuntimeError as exc:
        out["errors"][what] = [str(exc), backend.last_error()]

def inputs(t, token_ids=None, n_valid=None):
    labels = batches["labels"][t]
    token_ids = batches["token_ids"][t] if token_ids is None else token_ids
    n_valid = float(np.count_nonzero(labels >= 0)) if n_valid is None else n_valid
    return [torch.from_numpy(token_ids), torch.from_numpy(labels), torch.from_numpy(batches["hparams"]),
            torch.tensor(n_valid, dtype=torch.float32)]

def eval_inputs(t):
    return [torch.from_numpy(batches["token_ids"][t]), torch.from_numpy(batches["labels"][t]),
            torch.tensor(1.0, dtype=torch.float32)]

runtime = Runtime.get()
attempt("corrupt", lambda: runtime.load_program(corrupt).load_method("forward"))
program = runtime.load_program(pte)
attempt("eval_first", lambda: program.load_method("eval"))
forward = program.load_method("forward")
evaluation = program.load_method("eval")
out["eval_before"] = float(evaluation.execute(eval_inputs(0))[0])
bad = batches["token_ids"][0].copy()
bad[1, 3] = 256  # outside the embedding: refused before the step, nothing changes
attempt("bad_token", lambda: forward.execute(inputs(0, token_ids=bad)))
out["losses"] = [float(forward.execute(inputs(t))[0]) for t in range(len(batches["labels"]))]
out["eval_after"] = float(evaluation.execute(eval_inputs(0))[0])
out["modules"] = sorted(name for name in sys.modules if name.startswith(("vktrain.runtime", "vktrain.serialization",
                        "vktrain.backend", "vktrain.executorch_backend.bridge", "vulkan", "wgpu")))
out["live"] = backend.live_delegates()
del forward, evaluation, program
gc.collect()
out["live_after_del"] = backend.live_delegates()
print(json.dumps(out))
"""


def _corrupt(pte_bytes: bytes) -> bytes:
    """The .pte with one byte of its forward delegate's graph flatbuffer flipped (the blob's checksum catches it)."""
    from vktrain.serialization.blob_header import BlobHeader
    from vktrain.serialization.pte import PteFile

    blob = bytes(PteFile.from_bytes(pte_bytes).execution_plan("forward").delegates[0].data)
    start = pte_bytes.find(blob)
    header = BlobHeader.parse(memoryview(blob))
    data = bytearray(pte_bytes)
    data[start + header.flatbuffer_offset + header.flatbuffer_size // 2] ^= 0xFF
    return bytes(data)


def _env(**extra):
    env = dict(os.environ, VKTRAIN_VALIDATION="1", **extra)
    env.pop("VKTRAIN_EXECUTORCH_BACKEND", None)  # the default: native
    return env


def test_executorch_runtime_trains_natively_like_the_training_runner(native_build, llama_pte, batches, reference, tmp_path):
    np.savez(tmp_path / "batches.npz", token_ids=np.stack([t for t, _ in batches]),
             labels=np.stack([l for _, l in batches]), hparams=HPARAMS)
    corrupt = tmp_path / "corrupt.pte"
    corrupt.write_bytes(_corrupt(llama_pte.read_bytes()))
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(llama_pte), str(tmp_path / "batches.npz"), str(corrupt)],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["implementation"] == "native"

    assert out["losses"] == reference["losses"]
    assert all(np.isfinite(out["losses"])) and len(set(out["losses"])) == STEPS
    # The eval method reads the adapters as trained: as exported before the steps, moved after them.
    assert out["eval_before"] == reference["eval_before"]
    assert out["eval_after"] == reference["eval_after"]
    assert out["eval_after"] != out["eval_before"]

    assert out["modules"] == [], "a vktrain Python runtime module or a Vulkan binding was imported"
    assert out["live"] == 2 and out["live_after_del"] == 0, "ExecuTorch's destroy did not reach the backend"

    # Refusals: a non-Ok error from ExecuTorch with the reason; the bad step changed nothing (loss 1 is the reference's).
    message, reason = out["errors"]["corrupt"]
    assert "0x23" in message.replace(":", "") and "graph checksum mismatch" in reason  # Error::InvalidProgram
    message, reason = out["errors"]["eval_first"]
    assert "load the program's training method ('forward') first" in reason
    message, reason = out["errors"]["bad_token"]
    assert "0x12" in message.replace(":", "") and "input 'token_ids' holds 256 at flat position" in reason  # InvalidArgument


def test_cpp_program_on_executorch_program_method_api(native_build, llama_pte, batches, reference, tmp_path):
    """native/examples/executorch_train.cc (vktrain-executorch-train): ExecuTorch's C++ runtime and the native
    backend, no Python in the process."""
    with open(tmp_path / "batches.bin", "wb") as f:
        for token_ids, labels in batches:
            f.write(token_ids.astype("<i8").tobytes() + labels.astype("<i8").tobytes() + HPARAMS.astype("<f4").tobytes())
    run = subprocess.run([str(native_build / "vktrain-executorch-train"), str(llama_pte), str(tmp_path / "batches.bin"),
                          str(STEPS)], capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split("\n")
    losses = [np.float32(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert losses == [np.float32(loss) for loss in reference["losses"]]
    (eval_line,) = [line for line in lines if line.startswith("eval ")]
    assert np.float32(eval_line.split()[-1]) == np.float32(reference["eval_after"])


@pytest.mark.parametrize("env, expected", [
    ({"VKTRAIN_EXECUTORCH_BACKEND_LIBRARY": "/nonexistent/libvktrain_executorch_backend.so"},
     r"\$VKTRAIN_EXECUTORCH_BACKEND_LIBRARY names /nonexistent/libvktrain_executorch_backend.so, which is not there: "
     r"build it with scripts/native_build.sh .* VKTRAIN_EXECUTORCH_BACKEND=python"),
    ({"VKTRAIN_EXECUTORCH_BACKEND": "cuda"}, r"\$VKTRAIN_EXECUTORCH_BACKEND is 'cuda'; expected one of native, python"),
], ids=["no-library", "unknown-implementation"])
def test_import_refuses_clearly(env, expected):
    import re

    full = dict(os.environ, **env)
    if "VKTRAIN_EXECUTORCH_BACKEND" not in env:
        full.pop("VKTRAIN_EXECUTORCH_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", "import vktrain.executorch_backend"], capture_output=True, text=True,
                         timeout=300, env=full)
    assert run.returncode != 0
    assert re.search(expected, run.stderr), run.stderr[-2000:]


README_SNIPPET = """
import sys
import numpy as np, torch
import vktrain.executorch_backend          # loads the native backend into this process
from executorch.runtime import Runtime
program = Runtime.get().load_program(sys.argv[1])
method = program.load_method("forward")
batches = np.load(sys.argv[2])
token_ids, labels, hparams = (torch.from_numpy(batches[k][0]) for k in ("token_ids", "labels", "hparams"))
n_valid = torch.tensor(float((labels >= 0).sum()))
loss = method.execute([token_ids, labels, hparams, n_valid])[0]
evaluation = program.load_method("eval")
loss_sum = evaluation.execute([token_ids, labels, torch.tensor(1.0)])[0]
print(repr(float(loss)), repr(float(loss_sum)))
"""


def test_readme_snippet_runs_and_exits_with_its_methods_alive(native_build, llama_pte, batches, reference, tmp_path):
    """The README's lines, the methods never deleted: ExecuTorch destroys them (or not) at exit without a crash."""
    np.savez(tmp_path / "batches.npz", token_ids=batches[0][0][None], labels=batches[0][1][None], hparams=HPARAMS[None])
    run = subprocess.run([sys.executable, "-c", README_SNIPPET, str(llama_pte), str(tmp_path / "batches.npz")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    loss, loss_sum = map(float, run.stdout.split())
    assert loss == reference["losses"][0]
    assert np.isfinite(loss_sum) and loss_sum != reference["eval_before"]  # evaluated after the step

"""The C API (native/include/vktrain.h, libvktrain.so) against the Python runtime: a C program
(tests/native_c_api_check.c, compiled here against the header and the shared library as an app would be)
trains tiny-llama from its .pte for a few steps, as a run (vktrain_start_run + vktrain_train_step) and step by
step with inputs given by name from the .pte's bytes; `vktrain train` (the Python runtime) trains the same
steps. The losses, the final state, the checkpoint and the PEFT adapter directory must be the Python ones bit
for bit (the adapter files byte for byte). The program checks by itself that state written by name, and the
checkpoint, resume exactly, and that bad calls are refused with their status and a message.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _helpers import build_native

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
HYPER = ["--lr", 3e-3, "--schedule", "cosine", "--warmup", 2, "--min-lr-ratio", 0.1, "--beta1", 0.85,
         "--weight-decay", 0.05, "--seed", 7]  # what native_c_api_check.c's run config says


def export_tiny_llama(folder: Path) -> tuple[Path, Path]:
    """tiny-llama's training step with its lavapipe schedule embedded and its adapters recorded in the blob's
    metadata as `vktrain export` records them (lora_alpha, target modules, layers, base model), and a token file."""
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.export.training import adapter_metadata_specs
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=6.0, targets="*_proj", group_size=32, seed=0))
    pte = folder / "tiny_llama.pte"
    pte.write_bytes(lower_to_pte(export_training_step(model, (2, 16)),
                                 VktrainPartitioner(compile_specs=adapter_metadata_specs(model, "tiny-llama")),
                                 rewrite_blobs=TargetEmbedder(resolve_targets("lavapipe"))))
    tokens = folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(3).integers(0, 256, size=1500).astype(np.int32))
    return pte, tokens


def compile_c_program(out: Path, build: Path, *flags: str) -> Path:
    """native_c_api_check.c compiled and linked against `build`'s libvktrain.so (C99, warnings as errors)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    subprocess.run([compiler, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", *flags,
                    f"-I{REPO / 'native' / 'include'}", str(REPO / "tests" / "native_c_api_check.c"), f"-L{build}",
                    "-lvktrain", "-lm", f"-Wl,-rpath,{build}", "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def c_program(tmp_path_factory) -> Path:
    return compile_c_program(tmp_path_factory.mktemp("c_api") / "native_c_api_check", build_native())


@pytest.fixture(scope="module")
def c_inputs(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(.pte, tokens.npy, tokens.i64, batches.i64): the C program's inputs (vktrain train's first STEPS batches of
    the stream, by the Python TokenBatcher)."""
    from vktrain.train.data import TokenBatcher, load_tokens

    folder = tmp_path_factory.mktemp("c_api_inputs")
    pte, tokens = export_tiny_llama(folder)
    stream = load_tokens(tokens)
    (folder / "tokens.i64").write_bytes(np.asarray(stream, dtype="<i8").tobytes())
    batcher = TokenBatcher(stream, 2, 16, seed=7)
    (folder / "batches.i64").write_bytes(b"".join(np.asarray(part, dtype="<i8").tobytes()
                                                   for p in range(STEPS) for part in batcher.batch(p)[:2]))
    return pte, tokens, folder / "tokens.i64", folder / "batches.i64"


def run_c_program(program: Path, inputs, out: Path) -> subprocess.CompletedProcess:
    pte, _, stream, batches = inputs
    out.mkdir()
    env = dict(os.environ, VKTRAIN_VALIDATION="1")
    return subprocess.run([str(program), str(pte), str(stream), str(batches), str(STEPS), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)


def test_a_c_program_trains_like_vktrain_train_bit_for_bit(c_program, c_inputs, tmp_path):
    from vktrain.train.checkpoint import load_checkpoint

    pte, tokens = c_inputs[:2]
    native_dir = tmp_path / "native"
    result = run_c_program(c_program, c_inputs, native_dir)
    env = dict(os.environ, VKTRAIN_VALIDATION="1", PYTHONPATH=str(REPO))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert ["failures", "0"] in lines

    python_dir = tmp_path / "python"
    python = subprocess.run([sys.executable, "-m", "vktrain.cli", "train", str(pte), "--data", str(tokens), "--steps",
                             str(STEPS), "--json", str(python_dir / "records.json"), "--checkpoint",
                             str(python_dir / "checkpoint.safetensors"), "--out-adapters", str(python_dir / "adapters"),
                             "--no-progress", *map(str, HYPER)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert python.returncode == 0, python.stderr
    records = json.loads((python_dir / "records.json").read_text())
    expected = [f"0x{np.float32(r['loss']).view(np.uint32):08x}" for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    run = [line for line in lines if line[0] == "run"]
    assert [line[2] for line in run] == expected
    assert [float(line[3]) for line in run] == [r["lr"] for r in records]
    assert [line[2] for line in lines if line[0] == "manual"] == expected

    # The final state, read by name through the API: the Python run's (its checkpoint) bit for bit.
    theirs = load_checkpoint(python_dir / "checkpoint.safetensors")
    state = (native_dir / "state.bin").read_bytes()
    named = {line[1]: (int(line[3]), int(line[4])) for line in lines if line[0] == "state"}
    assert sorted(named) == sorted(theirs.tensors)
    for name, tensor in theirs.tensors.items():
        size, offset = named[name]
        assert state[offset:offset + size] == np.ascontiguousarray(tensor).tobytes(), name
    # The checkpoint it wrote is vktrain train's: the same state, step, records and run settings.
    ours = load_checkpoint(native_dir / "checkpoint.safetensors")
    assert (ours.step, ours.data_position, ours.data_seed, ours.program_sha256, ours.data_sha256, ours.config) == (
        theirs.step, theirs.data_position, theirs.data_seed, theirs.program_sha256, theirs.data_sha256, theirs.config)
    assert [(r["step"], r["loss"], r["lr"]) for r in ours.records] == [(r["step"], r["loss"], r["lr"]) for r in theirs.records]
    for name, tensor in theirs.tensors.items():
        assert ours.tensors[name].dtype == tensor.dtype and ours.tensors[name].tobytes() == tensor.tobytes(), name
    # The PEFT adapter directory: vktrain train --out-adapters's files, byte for byte (alpha, target modules and
    # base model as the .pte records them).
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (native_dir / "adapters" / name).read_bytes() == (python_dir / "adapters" / name).read_bytes(), name
    config = json.loads((native_dir / "adapters" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 6.0 and config["r"] == 4 and config["base_model_name_or_path"] == "tiny-llama"


def test_the_trainer_and_the_library_link_no_python():
    """vktrain-train and libvktrain.so need no Python (`ldd`: the Vulkan loader and the C/C++ runtime), and the
    library exports the C API's functions only."""
    build = build_native()
    for binary in (build / "vktrain-train", build / "libvktrain.so"):
        listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        libraries = [line.split()[0] for line in listed.splitlines() if line.strip()]
        assert any(name.startswith("libvulkan.so") for name in libraries), listed
        assert not [name for name in libraries if "python" in name or "torch" in name], listed
    assert (build / "vktrain-native-train").resolve() == (build / "vktrain-train").resolve()  # the old name, kept
    exported = subprocess.run(["nm", "-D", "--defined-only", str(build / "libvktrain.so")], capture_output=True,
                              text=True, check=True).stdout
    names = [line.split()[-1] for line in exported.splitlines() if line.split()[1:2] == ["T"]]
    header = (REPO / "native" / "include" / "vktrain.h").read_text()
    assert names and all(name.startswith("vktrain_") and f"{name}(" in header for name in names), names
    assert "vktrain_open" in names and "vktrain_save_adapters" in names


def test_the_c_program_runs_clean_under_the_sanitizers(c_program, c_inputs, tmp_path):
    """The same C program on the AddressSanitizer + UBSan build of libvktrain.so (LeakSanitizer on): its own
    checks pass (bytes open, named inputs, state written and read, checkpoint resume, refusals) with no
    report, and its losses are the plain build's."""
    sanitized = compile_c_program(tmp_path / "native_c_api_check_asan", build_native("--sanitize"),
                                  "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
    results = [run_c_program(program, c_inputs, tmp_path / name) for name, program in (("asan", sanitized), ("plain", c_program))]
    for result in results:
        assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr[-3000:]
        assert result.returncode == 0 and "failures 0" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    losses = [[line for line in result.stdout.splitlines() if line.split()[0] in ("run", "manual", "resumed")]
              for result in results]
    assert losses[0] == losses[1] and len(losses[0]) == 2 * STEPS + 1

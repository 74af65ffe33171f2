"""vktrain-train (native/: the C++ schedule interpreter on the native Vulkan layer, driven through the C API) against the Python
runtime: tiny-llama trained 20 steps by each, from the same .pte, the same planned schedule, the same batches
and hyper-parameters (float32 on both sides), must give the same loss at every step and the same state after
the last, bit for bit. The Python
side is `vktrain train`'s own loop (vktrain.train.train_loop.train over a TrainingRunner), so the native
trainer is checked against how the project feeds a step (batch order, n_valid, lr schedule, AdamW hparams),
not against a re-implementation of it. Both run on the Vulkan device with the validation layer on.

Then what the trainer refuses: bad input exits 2 naming the file or flag, and a dispatch its shader does
not take is refused at load, where the Python runtime refuses it too. Last, the staging path (a discrete
GPU's) trains the same bits, and the whole trainer runs clean under AddressSanitizer + UBSan.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import subprocess
from pathlib import Path

import numpy as np
import pytest

from _helpers import build_native, export_mlp_lora_training_step

REPO = Path(__file__).resolve().parents[1]
STEPS = 20


@pytest.fixture(scope="module")
def trainer() -> Path:
    return build_native() / "vktrain-train"


@pytest.fixture(scope="module")
def spirv_dir() -> Path:
    from vktrain.runtime_shaders.build import SPIRV_DIR

    return SPIRV_DIR


def _plan(graph):
    """`graph` planned on lavapipe's built-in profile (what both runtimes then run)."""
    from vktrain.backend.kernel_planning.planner import plan_schedule
    from vktrain.serialization.device_profile import LAVAPIPE

    return plan_schedule(graph, LAVAPIPE)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """tiny-llama's training step (.pte, with its schedule for lavapipe embedded: `vktrain export --target
    lavapipe`), the same schedule as a file (.vks) and a token file (int32, as a user may save it)."""
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model
    from vktrain.runtime.program import fuzz
    from vktrain.serialization.schedule import serialize_schedule
    from vktrain.train.targets import TargetEmbedder, resolve_targets

    folder = tmp_path_factory.mktemp("native_train")
    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    pte = folder / "tiny_llama.pte"
    pte.write_bytes(lower_to_pte(export_training_step(model, (2, 16)),
                                 rewrite_blobs=TargetEmbedder(resolve_targets("lavapipe"))))
    schedule = _plan(fuzz.load(pte.read_bytes())[1].graph)
    vks = folder / "tiny_llama.vks"
    vks.write_bytes(serialize_schedule(schedule))
    tokens = folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(3).integers(0, 256, size=1500).astype(np.int32))
    return pte, vks, tokens


def _run(trainer: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, VKTRAIN_VALIDATION="1")
    return subprocess.run([str(trainer), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def test_twenty_steps_give_the_python_runtimes_losses_and_state_bit_for_bit(trainer, spirv_dir, llama, vk_device, tmp_path):
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.serialization.schedule import deserialize_schedule
    from vktrain.train.data import TokenBatcher, load_tokens
    from vktrain.train.lr_schedule import LRSchedule
    from vktrain.train.train_loop import AdamWConfig, train

    pte, vks, tokens = llama
    # Warmup then cosine, non-default AdamW and data seed: every hyper-parameter path is exercised.
    hyper = dict(lr=3e-3, warmup=4, beta1=0.85, beta2=0.99, eps=1e-6, weight_decay=0.05, seed=7)
    native_json, native_state = tmp_path / "native.json", tmp_path / "state"
    result = _run(trainer, pte, "--schedule-file", vks, "--spirv-dir", spirv_dir, "--data", tokens, "--steps", STEPS,
                  "--json", native_json, "--state-out", native_state, *[x for k, v in hyper.items() for x in (f"--{k.replace('_', '-')}", v)])
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]  # --log-every 1
    assert [line.split()[1] for line in progress] == [str(t) for t in range(1, STEPS + 1)]

    with TrainingRunner.from_pte(pte, vk_device, schedule=deserialize_schedule(vks.read_bytes())) as runner:
        batches = TokenBatcher(load_tokens(tokens), 2, 16, seed=hyper["seed"])
        python_json = tmp_path / "python.json"
        train(runner, batches, STEPS, LRSchedule("cosine", hyper["lr"], STEPS, warmup_steps=hyper["warmup"]),
              AdamWConfig(hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"]),
              json_path=python_json, progress=False)
        # The same recording: as many vkCmdDispatch and barriers as vk/commands.py Program records.
        program = runner.executor.program
        header = re.search(r"(\d+) dispatches, (\d+) barriers", result.stdout)
        assert header and (int(header[1]), int(header[2])) == (program.recorded_dispatch_count, sum(program.barriers))
        python_state = runner.state_dict()

    python = json.loads(python_json.read_text())
    native = json.loads(native_json.read_text())
    assert [r["step"] for r in native] == [r["step"] for r in python] == list(range(1, STEPS + 1))
    for ours, theirs in zip(native, python):
        assert np.float32(ours["loss"]).tobytes() == np.float32(theirs["loss"]).tobytes(), (ours, theirs)
        assert ours["loss_bits"] == f"0x{np.float32(theirs['loss']).view(np.uint32):08x}"
        assert ours["lr"] == theirs["lr"]
    losses = [r["loss"] for r in native]
    assert losses[-1] < losses[0]  # it trains: the loss falls
    # The state after step 20 (adapters, AdamW moments, step counter), read back by name: the same bits.
    assert sorted(p.stem for p in native_state.glob("*.npy")) == sorted(python_state)
    for name, theirs in python_state.items():
        ours = np.load(native_state / f"{name}.npy")
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        assert ours.tobytes() == theirs.tobytes(), name


def test_the_pte_alone_trains_like_vktrain_train_bit_for_bit(trainer, llama, tmp_path):
    """No Python-made files: the schedule and the SPIR-V come from the .pte's blob (its lavapipe schedule,
    chosen by the matching rule), and 20 steps give `vktrain train`'s losses and learning rates, bit for bit;
    the native trainer reads the tokens from a *.tokens.txt file (the same ids as vktrain train's .npy, by
    vktrain's own reader), logs every --log-every steps, and its --out-adapters directory is vktrain train's
    byte for byte."""
    import sys

    from vktrain.train.data import load_tokens

    pte, _, tokens = llama
    ids = np.load(tokens)
    text = tmp_path / "corpus.tokens.txt"  # spacing and spellings Python's int() takes: +7, 007, 1_0
    words = [("+" if i % 7 == 0 else "") + (f"{v:03d}" if i % 5 == 0 else "_".join(str(v)) if i % 11 == 0 and v > 9 else str(v))
             for i, v in enumerate(ids.tolist())]
    text.write_text("".join(w + ("\n" if i % 13 == 12 else "\t " if i % 3 == 0 else " ") for i, w in enumerate(words)))
    assert np.array_equal(load_tokens(text), ids)
    hyper = ["--lr", 2e-3, "--schedule", "cosine", "--warmup", 3, "--min-lr-ratio", 0.1, "--beta1", 0.8,
             "--weight-decay", 0.02, "--seed", 5, "--lora-alpha", 8, "--base-model", "hf/tiny-llama-\u00fc\U0001f600"]
    native_json, python_json = tmp_path / "native.json", tmp_path / "python.json"
    native = _run(trainer, pte, "--data", text, "--steps", STEPS, "--json", native_json, "--log-every", 5,
                  "--out-adapters", tmp_path / "native_adapters", *hyper)
    assert native.returncode == 0, native.stderr
    assert "(the embedded schedule for profile 'lavapipe')" in native.stdout, native.stdout
    assert [line.split()[1] for line in native.stdout.splitlines() if line.startswith("step ")] == ["5", "10", "15", "20"]
    env = dict(os.environ, VKTRAIN_VALIDATION="1", PYTHONPATH=str(REPO), PYTHONUTF8="1")
    python = subprocess.run([sys.executable, "-m", "vktrain.cli", "train", str(pte), "--data", str(tokens), "--steps",
                             str(STEPS), "--json", str(python_json), "--no-progress", "--out-adapters",
                             str(tmp_path / "python_adapters"), *map(str, hyper)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert python.returncode == 0, python.stderr
    ours, theirs = json.loads(native_json.read_text()), json.loads(python_json.read_text())
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    for mine, other in zip(ours, theirs):
        assert mine["loss_bits"] == f"0x{np.float32(other['loss']).view(np.uint32):08x}", (mine, other)
        assert mine["lr"] == other["lr"]
        assert 0 < mine["gpu_seconds"] <= mine["seconds"], mine  # timestamps around the step's commands
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        native_file, python_file = tmp_path / "native_adapters" / name, tmp_path / "python_adapters" / name
        assert native_file.read_bytes() == python_file.read_bytes(), name
    assert json.loads((tmp_path / "native_adapters" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "hf/tiny-llama-\u00fc\U0001f600")


def test_a_checkpoint_of_either_runtime_resumes_exactly_in_the_other(trainer, llama, tmp_path):
    """`--checkpoint` / `--resume` in vktrain train's safetensors format: 10 steps by one runtime, the next 10 by
    the other from its checkpoint, give the uninterrupted native run's 20 losses bit for bit, both ways; the two
    final checkpoints hold the same state and the same run."""
    import sys

    from vktrain.train.checkpoint import load_checkpoint

    pte, _, tokens = llama
    hyper = ["--lr", 3e-3, "--schedule", "constant", "--warmup", 4, "--seed", 5, "--beta2", 0.99]
    env = dict(os.environ, VKTRAIN_VALIDATION="1", PYTHONPATH=str(REPO))

    def python(*args):
        result = subprocess.run([sys.executable, "-m", "vktrain.cli", "train", str(pte), "--data", str(tokens),
                                 "--no-progress", *map(str, args), *map(str, hyper)],
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        assert "warning" not in result.stderr, result.stderr  # the native checkpoint records the same run
        return result

    def native(*args):
        result = _run(trainer, pte, "--data", tokens, *args, *hyper)
        assert result.returncode == 0, result.stderr
        return result

    native("--steps", STEPS, "--json", tmp_path / "whole.json")
    whole = [r["loss_bits"] for r in json.loads((tmp_path / "whole.json").read_text())]
    half = STEPS // 2
    native("--steps", half, "--checkpoint", tmp_path / "native.safetensors", "--checkpoint-every", 4)
    python("--steps", STEPS, "--resume", tmp_path / "native.safetensors", "--checkpoint", tmp_path / "p2.safetensors",
           "--json", tmp_path / "python_resumed.json")
    python("--steps", half, "--checkpoint", tmp_path / "python.safetensors")
    native("--steps", STEPS, "--resume", tmp_path / "python.safetensors", "--checkpoint", tmp_path / "n2.safetensors",
           "--json", tmp_path / "native_resumed.json")

    python_resumed = json.loads((tmp_path / "python_resumed.json").read_text())
    assert [f"0x{np.float32(r['loss']).view(np.uint32):08x}" for r in python_resumed] == whole
    assert [r["loss_bits"] for r in json.loads((tmp_path / "native_resumed.json").read_text())] == whole
    by_python, by_native = load_checkpoint(tmp_path / "p2.safetensors"), load_checkpoint(tmp_path / "n2.safetensors")
    assert by_python.step == by_native.step == STEPS and by_python.data_position == by_native.data_position == STEPS
    assert (by_python.config, by_python.data_sha256, by_python.program_sha256, by_python.data_seed) == (
        by_native.config, by_native.data_sha256, by_native.program_sha256, by_native.data_seed)
    assert [r["loss"] for r in by_python.records] == [r["loss"] for r in by_native.records]
    assert sorted(by_python.tensors) == sorted(by_native.tensors)
    for name, tensor in by_python.tensors.items():
        assert tensor.dtype == by_native.tensors[name].dtype and tensor.tobytes() == by_native.tensors[name].tobytes()

    # Refusals: a corrupted checkpoint, and an existing file a new run would replace.
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray((tmp_path / "n2.safetensors").read_bytes())
    data[-3] ^= 0x40
    corrupt.write_bytes(bytes(data))
    result = _run(trainer, pte, "--data", tokens, "--steps", STEPS + 1, "--resume", corrupt, *hyper)
    assert result.returncode == 2 and "does not match its checksum" in result.stderr, result.stderr
    result = _run(trainer, pte, "--data", tokens, "--steps", 2, "--checkpoint", tmp_path / "n2.safetensors", *hyper)
    assert result.returncode == 2 and "exists; continue it with --resume" in result.stderr, result.stderr


def test_a_non_finite_loss_stops_the_run_as_vktrain_train_stops_it(trainer, llama, tmp_path):
    """An absurd learning rate makes step 2's loss NaN: both trainers exit 1 naming the step, their --json logs
    hold step 1 alone, and the native checkpoint written after step 1 stays the last good one."""
    import sys

    from vktrain.train.checkpoint import load_checkpoint

    pte, _, tokens = llama
    hyper = ["--data", tokens, "--steps", 4, "--lr", 1e30, "--schedule", "constant"]
    native = _run(trainer, pte, *hyper, "--json", tmp_path / "native.json", "--checkpoint", tmp_path / "ck.safetensors",
                  "--checkpoint-every", 1)
    assert native.returncode == 1, native.stderr
    assert "the loss became nan at step 2 (lr 1e+30); training stopped" in native.stderr, native.stderr
    env = dict(os.environ, VKTRAIN_VALIDATION="1", PYTHONPATH=str(REPO))
    python = subprocess.run([sys.executable, "-m", "vktrain.cli", "train", str(pte), *map(str, hyper), "--no-progress",
                             "--json", str(tmp_path / "python.json")], capture_output=True, text=True, timeout=300, env=env)
    assert python.returncode == 1 and "the loss became nan at step 2" in python.stderr, python.stderr
    ours, theirs = json.loads((tmp_path / "native.json").read_text()), json.loads((tmp_path / "python.json").read_text())
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1]
    assert ours[0]["loss_bits"] == f"0x{np.float32(theirs[0]['loss']).view(np.uint32):08x}"
    assert load_checkpoint(tmp_path / "ck.safetensors").step == 1


def test_a_progress_line_on_a_terminal_and_log_lines_every_n_steps(trainer, llama, tmp_path):
    """stderr a terminal: one progress line rewritten in place (train t/N, loss, lr, ms/step); --log-every 0
    prints no step lines; --no-progress, or stderr not a terminal, no progress line."""
    import pty

    pte, _, tokens = llama
    args = [str(trainer), str(pte), "--data", str(tokens), "--steps", "2", "--lr", "1e-3", "--log-every", "0"]
    for extra, shown in (([], True), (["--no-progress"], False)):
        parent, child = pty.openpty()
        result = subprocess.run(args + extra, stdout=subprocess.PIPE, stderr=child, text=True, timeout=300,
                                env=dict(os.environ, VKTRAIN_VALIDATION="1"))
        os.close(child)
        terminal = b""
        while True:
            try:
                chunk = os.read(parent, 65536)
            except OSError:
                break
            if not chunk:
                break
            terminal += chunk
        os.close(parent)
        assert result.returncode == 0, terminal.decode(errors="replace")
        assert not [line for line in result.stdout.splitlines() if line.startswith("step ")], result.stdout
        assert (b"\rtrain 2/2  loss " in terminal) == shown and (b"\rtrain 1/2  loss " in terminal) == shown, terminal
    piped = _run(trainer, pte, "--data", tokens, "--steps", 2, "--lr", 1e-3)
    assert "train 1/2" not in piped.stderr and [line.split()[1] for line in piped.stdout.splitlines()
                                                if line.startswith("step ")] == ["1", "2"]


def test_a_pte_without_a_schedule_for_this_device_is_refused_naming_what_it_lacks(trainer, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(200) % 64)
    plain, tensor_cores = tmp_path / "plain.pte", tmp_path / "coopmat.pte"
    export_mlp_lora_training_step(plain, (2, 8), 64)
    export_mlp_lora_training_step(tensor_cores, (2, 8), 64, target="nvidia-coopmat")
    args = ["--data", tokens, "--steps", 1, "--lr", 1e-3]

    result = _run(trainer, plain, *args)
    assert result.returncode == 2, result.stderr
    assert f"error: {plain} embeds no dispatch schedules (exported without --target)" in result.stderr
    result = _run(trainer, tensor_cores, *args)
    assert result.returncode == 2, result.stderr
    assert f"error: {tensor_cores} embeds schedules for the device profiles nvidia-coopmat, and " in result.stderr
    assert "nvidia-coopmat: " in result.stderr and "16x16x16 float16 x float16 + float32 cooperative matrices" in result.stderr
    # --schedule-profile: the schedule embedded for that profile, refused when absent or unmet (the same words).
    absent = _run(trainer, tensor_cores, *args, "--schedule-profile", "desktop-gpu")
    assert absent.returncode == 2, absent.stderr
    assert "has no embedded schedule for profile 'desktop-gpu' (it has nvidia-coopmat)" in absent.stderr
    unmet = _run(trainer, tensor_cores, *args, "--schedule-profile", "nvidia-coopmat")
    assert unmet.returncode == 2 and "float16 + float32 cooperative matrices" in unmet.stderr, unmet.stderr
    half = _run(trainer, tensor_cores, "--schedule-file", tmp_path / "s.vks", *args)
    assert half.returncode == 2 and "--schedule-file needs --spirv-dir DIR too" in half.stderr, half.stderr
    lr = _run(trainer, tensor_cores, *args, "--schedule", "linear")
    assert lr.returncode == 2 and "--schedule must be constant or cosine, got 'linear'" in lr.stderr, lr.stderr


def test_bad_input_exits_2_naming_what_is_wrong(trainer, spirv_dir, llama, tmp_path):
    pte, vks, tokens = llama
    common = ["--schedule-file", vks, "--spirv-dir", spirv_dir, "--data", tokens, "--steps", 2, "--lr", 1e-3]

    missing = _run(trainer, pte, *common[:-2])
    assert missing.returncode == 2 and "error: --lr is required" in missing.stderr, missing.stderr
    unknown = _run(trainer, pte, *common, "--learning-rate", 1)
    assert unknown.returncode == 2 and "unknown option --learning-rate" in unknown.stderr, unknown.stderr

    out_of_vocab = tmp_path / "big.npy"
    np.save(out_of_vocab, np.array([1, 2, 300, 4] * 50, dtype=np.int64))
    result = _run(trainer, pte, *common[:4], "--data", out_of_vocab, *common[6:])
    assert result.returncode == 2, result.stderr
    assert f"{out_of_vocab}: token id 300 at position 2 is outside the model's vocabulary [0, 256)" in result.stderr

    text = tmp_path / "tokens.txt"  # text, not token ids: it needs the model's tokenizer
    text.write_text("1 2 3")
    result = _run(trainer, pte, *common[:4], "--data", text, *common[6:])
    assert result.returncode == 2 and f"{text}: the native trainer reads token ids" in result.stderr, result.stderr
    not_npy = tmp_path / "tokens.npy"
    not_npy.write_text("1 2 3")
    result = _run(trainer, pte, *common[:4], "--data", not_npy, *common[6:])
    assert result.returncode == 2 and f"{not_npy}: not a .npy file" in result.stderr, result.stderr
    words = tmp_path / "bad.tokens.txt"
    words.write_text("1 2 x3 4")
    result = _run(trainer, pte, *common[:4], "--data", words, *common[6:])
    assert result.returncode == 2 and f"{words}: .tokens.txt files hold whitespace-separated integers; word 2 is 'x3'" in result.stderr, result.stderr

    absent = _run(trainer, pte, "--schedule-file", tmp_path / "absent.vks", *common[2:])
    assert absent.returncode == 2 and "absent.vks" in absent.stderr, absent.stderr

    empty = tmp_path / "no_spirv"
    empty.mkdir()
    result = _run(trainer, pte, *common[:2], "--spirv-dir", empty, *common[4:])
    assert result.returncode == 2 and f"in {empty}" in result.stderr and ".spv" in result.stderr, result.stderr


def _bad_dispatches(schedule):
    """(what, schedule, native message) of dispatches their shaders do not take: the reader and the schedule
    verifier accept each; planning the step against the shader's SPIR-V refuses it."""
    index = next(i for i, d in enumerate(schedule.dispatches) if d.push_constants and d.bindings)
    first = schedule.dispatches[index]

    def with_dispatch(**changes):
        dispatches = list(schedule.dispatches)
        dispatches[index] = dataclasses.replace(first, **changes)
        return dataclasses.replace(schedule, dispatches=tuple(dispatches))

    yield ("push constants of the wrong size", with_dispatch(push_constants=first.push_constants + bytes(4)),
           "bytes of push constants")
    yield ("a binding fewer than the shader declares", with_dispatch(bindings=first.bindings[:-1]),
           f"storage buffers but the Dispatch binds {len(first.bindings) - 1}")
    yield ("a specialization constant the shader lacks", with_dispatch(spec_constants=((97, 1),)),
           "has no specialization constant with id 97")


def test_a_shader_needing_what_the_device_lacks_never_reaches_the_driver(trainer, spirv_dir, llama, tmp_path):
    """A module whose SPIR-V declares the cooperative-matrix capability (adamw's own module with an `OpCapability
    CooperativeMatrixKHR` added: its interface unchanged, as a hostile or mismatched shader cache could serve it)
    is refused before vkCreateShaderModule on a device without VK_KHR_cooperative_matrix, naming the shader and
    the feature (the driver, or the validation layer, would otherwise meet it)."""
    import struct

    pte, vks, tokens = llama
    cache = tmp_path / "spirv"
    cache.mkdir()
    capability = struct.pack("<II", (2 << 16) | 17, 6022)  # OpCapability CooperativeMatrixKHR
    for file in spirv_dir.glob("*.spv"):
        target = cache / file.name
        if file.name.startswith("adamw."):
            code = file.read_bytes()
            target.write_bytes(code[:20] + capability + code[20:])  # after the 5-word header: capabilities come first
        else:
            target.symlink_to(file)
    result = _run(trainer, pte, "--schedule-file", vks, "--spirv-dir", cache, "--data", tokens, "--steps", 1, "--lr", 1e-3)
    assert result.returncode == 2, result.stderr
    assert "shader 'adamw" in result.stderr and "needs the cooperativeMatrix feature (VK_KHR_cooperative_matrix" in result.stderr, (
        result.stderr)


def test_dispatches_their_shaders_do_not_take_are_refused_at_load_like_the_python_runtime(
        trainer, spirv_dir, vk_device, tmp_path):
    from vktrain.runtime.delegate.executor import GraphExecutor
    from vktrain.runtime.program import fuzz
    from vktrain.serialization.dispatch import ScheduleError
    from vktrain.serialization.schedule import serialize_schedule

    pte = tmp_path / "mlp.pte"
    export_mlp_lora_training_step(pte, (2, 8), 64)
    graph = fuzz.load(pte.read_bytes())[1].graph
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(200) % 64)
    for number, (what, bad, message) in enumerate(_bad_dispatches(_plan(graph))):
        path = tmp_path / f"bad{number}.vks"
        path.write_bytes(serialize_schedule(bad))
        result = _run(trainer, pte, "--schedule-file", path, "--spirv-dir", spirv_dir, "--data", tokens, "--steps", 1,
                      "--lr", 1e-3)
        assert result.returncode == 2, (what, result.stdout, result.stderr)
        assert f"error: {path}: dispatch #" in result.stderr and message in result.stderr, (what, result.stderr)
        with pytest.raises(ScheduleError):
            GraphExecutor(vk_device, graph, schedule=bad).close()


def test_staging_copies_give_the_same_training(trainer, spirv_dir, llama, tmp_path):
    """--staging: every host access through a staging buffer and a transfer (a discrete GPU's path), here on
    lavapipe's unified memory: the same losses and state as mapped access."""
    pte, vks, tokens = llama
    runs = {}
    for mode in ("mapped", "staging"):
        out = tmp_path / mode
        result = _run(trainer, pte, "--schedule-file", vks, "--spirv-dir", spirv_dir, "--data", tokens, "--steps", 3,
                      "--lr", 1e-3, "--json", f"{out}.json", "--state-out", out, "--summary-json", f"{out}.summary.json",
                      *(["--staging"] if mode == "staging" else []))
        assert result.returncode == 0, result.stderr
        runs[mode] = ([r["loss_bits"] for r in json.loads(Path(f"{out}.json").read_text())],
                      {p.name: p.read_bytes() for p in out.glob("*.npy")})
        # --summary-json: the run, and the trainer's peak RSS, which the kernel's count of its children's bounds.
        summary = json.loads(Path(f"{out}.summary.json").read_text())
        records = json.loads(Path(f"{out}.json").read_text())
        assert (summary["steps"], summary["last_step"], summary["pte_bytes"]) == (3, 3, pte.stat().st_size)
        assert summary["final_loss"] == records[-1]["loss"] and summary["schedule"] == str(vks)
        children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        assert summary["buffer_bytes"] < summary["peak_rss_bytes"] <= children_peak
        _check_rss_parts(summary, pte, mapped=mode == "mapped")
    assert runs["staging"] == runs["mapped"] and len(runs["mapped"][1]) > 100


def _check_rss_parts(summary: dict, pte: Path, mapped: bool) -> None:
    """--summary-json's split of the resident set (sampled from /proc/self/smaps) into the .pte's file pages, device
    memory mapped into the process and host memory: the parts add up to each sample, no part is negative, the .pte
    part is at most the file's pages, and with mapped buffers (lavapipe: host-visible, zeroed through the mapping at
    creation, alive at every sample) the device part holds at least every buffer's bytes."""
    page = os.sysconf("SC_PAGESIZE")
    # A sample's total is a page-table walk; getrusage's peak is the kernel's RSS counters, which may trail the
    # page tables by a batch of pages per thread (64 before Linux 6.2; since then the per-CPU counters' batch,
    # max(32, 2 * CPUs), per CPU): the slack is that many pages for every thread or CPU lavapipe may run.
    tasks = 4 * (os.cpu_count() or 1) + 8
    slack = max(64, 2 * (os.cpu_count() or 1)) * page * tasks
    samples = summary["rss_samples"]
    assert [s["at"] for s in samples] == ["opened", "run started", "last step", "end"]
    for s in samples:
        parts = (s["host_rss_bytes"], s["pte_resident_bytes"], s["device_resident_bytes"])
        assert all(0 <= x <= s["rss_bytes"] for x in parts), s
        assert sum(parts) == s["rss_bytes"] <= summary["peak_rss_bytes"] + slack, (s, summary["peak_rss_bytes"], slack)
        assert s["pte_resident_bytes"] <= -(-pte.stat().st_size // page) * page, s
        if mapped:
            assert s["device_resident_bytes"] >= summary["buffer_bytes"], (s, summary["buffer_bytes"])
    worst = max(samples, key=lambda s: s["host_rss_bytes"])
    assert (summary["host_rss_bytes"], summary["host_rss_at"]) == (worst["host_rss_bytes"], worst["at"])
    assert (summary["pte_resident_bytes"], summary["device_resident_bytes"]) == (
        worst["pte_resident_bytes"], worst["device_resident_bytes"])


def test_the_trainer_runs_clean_under_the_sanitizers(spirv_dir, llama, tmp_path):
    """The whole trainer (load, plan, Vulkan objects, staging copies, replays, state read-back, the C API, the
    adapter writer) built with AddressSanitizer + UBSan (LeakSanitizer on) trains 2 steps with no report, the
    same bits as the plain build."""
    pte, vks, tokens = llama
    sanitized, plain = build_native("--sanitize") / "vktrain-train", build_native() / "vktrain-train"
    losses = []
    for binary in (sanitized, plain):
        out = tmp_path / binary.parent.name
        result = _run(binary, pte, "--schedule-file", vks, "--spirv-dir", spirv_dir, "--data", tokens, "--steps", 2,
                      "--lr", 1e-3, "--json", f"{out}.json", "--state-out", out, "--staging",
                      "--checkpoint", f"{out}.safetensors", "--checkpoint-every", 1,
                      "--out-adapters", f"{out}.adapters", "--lora-alpha", 8)
        assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr[-3000:]
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append([r["loss_bits"] for r in json.loads(Path(f"{out}.json").read_text())])
    assert losses[0] == losses[1]
    adapters = [(tmp_path / f"{b.parent.name}.adapters" / "adapter_model.safetensors").read_bytes() for b in (sanitized, plain)]
    assert adapters[0] == adapters[1]
    # A checkpoint read back and resumed (the embedded schedule this time) under the sanitizers too.
    resumed = _run(sanitized, pte, "--data", tokens, "--steps", 3, "--lr", 1e-3,
                   "--resume", tmp_path / f"{sanitized.parent.name}.safetensors")
    assert "Sanitizer" not in resumed.stderr and "runtime error" not in resumed.stderr, resumed.stderr[-3000:]
    assert resumed.returncode == 0 and "step      3  loss" in resumed.stdout, resumed.stderr[-3000:]

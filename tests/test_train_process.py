"""`vktrain train` as a process (a subprocess on a tiny-llama step).

SIGINT and SIGTERM sent to a real run: the step in flight finishes, the checkpoint and records are
written, the message names the checkpoint and the exact command that resumes it, the exit code is
130 / 143; the resumed run's losses are an uninterrupted run's. A second signal stops at once and leaves
every file whole. Its output to a pipe: plain lines, no progress-bar frames, no driver noise."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vktrain.train.checkpoint import TEMP_SUFFIX, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 60  # the interrupted runs stop well before (a step takes ~10 ms on lavapipe)
TRAIN = ["--schedule", "constant", "--log-every", "1"]  # constant: --steps changes no step's result


def vktrain(*argv: str) -> list[str]:
    return [sys.executable, "-m", "vktrain.cli", *map(str, argv)]


@pytest.fixture(scope="module")
def step_pte(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("interrupts") / "step.pte"
    model_args = [x for a in ("dim=64", "n_layers=1", "hidden=128", "vocab_size=256", "max_seq_len=16")
                  for x in ("--model-arg", a)]
    subprocess.run(vktrain("export", "--model", "tiny-llama", *model_args, "--lora-rank", "4", "--batch", "2",
                           "--seq", "16", "--out", path), check=True, capture_output=True, timeout=300, cwd=ROOT)
    return path


@pytest.fixture(scope="module")
def reference(step_pte) -> subprocess.CompletedProcess:
    """An uninterrupted run of REFERENCE_STEPS; its stderr is a pipe, as in a log file."""
    records = step_pte.parent / "reference.json"
    done = subprocess.run(vktrain("train", step_pte, "--steps", REFERENCE_STEPS, *TRAIN, "--json", records),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    done.losses = [r["loss"] for r in json.loads(records.read_text())]
    return done


def _signalled(command: list[str], cwd: Path, signals: list[int], ready: str, stream: str = "stdout"):
    """Start `command` in `cwd`, wait until a line of `stream` starts with `ready`, send `signals`; (the
    ended process, the lines of `stream` read before signalling)."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    watched, lines, deadline = getattr(process, stream), [], time.monotonic() + 120
    try:
        while not any(line.startswith(ready) for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, (lines, process.communicate())
            lines.append(watched.readline())
        for signum in signals:
            process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()  # a no-op once it ended
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), lines


def _signalled_run(cwd: Path, argv: list[str], signals: list[int]) -> tuple[subprocess.CompletedProcess, int]:
    """`vktrain train ARGV` signalled once it has printed step 2; (the ended process, the last step it printed)."""
    ended, lines = _signalled(vktrain("train", *argv), cwd, signals, "step      2 ")
    steps = [int(line.split()[1]) for line in lines + ended.stdout.splitlines() if line.startswith("step ")]
    return ended, steps[-1]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_the_run_and_its_resume_command_continues_it_exactly(step_pte, reference, tmp_path,
                                                                                  signum, code):
    run = tmp_path / "run"
    run.mkdir()
    argv = [str(step_pte), "--steps", "5000", *TRAIN, "--checkpoint", "run.ckpt", "--json", "run.json"]
    ended, last = _signalled_run(run, argv, [signum])
    assert ended.returncode == code, ended.stderr
    assert 2 <= last < REFERENCE_STEPS - 5
    assert f"stopped by {signal.Signals(signum).name} after step {last} of 5000" in ended.stderr
    assert f"saved checkpoint run.ckpt (step {last})" in ended.stderr
    assert f"saved records run.json (steps 1..{last})" in ended.stderr
    resume = ended.stderr.split("resume with:\n", 1)[1].splitlines()[0].strip()
    assert resume == shlex.join(["vktrain", "train", *argv, "--resume", "run.ckpt"])
    assert load_checkpoint(run / "run.ckpt").step == last
    assert [r["loss"] for r in json.loads((run / "run.json").read_text())] == reference.losses[:last]

    command = shlex.split(resume)[1:]
    command[command.index("--steps") + 1] = str(REFERENCE_STEPS)  # the same run, to the reference's end
    resumed = subprocess.run(vktrain(*command), cwd=run, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["loss"] for r in json.loads((run / "run.json").read_text())] == reference.losses


def test_a_signal_without_checkpoint_says_nothing_was_saved_and_how_to_get_saving(step_pte, tmp_path):
    ended, last = _signalled_run(tmp_path, [str(step_pte), "--steps", "5000", *TRAIN], [signal.SIGTERM])
    assert ended.returncode == 143, ended.stderr
    assert f"stopped by SIGTERM after step {last} of 5000" in ended.stderr
    assert "nothing to resume from was saved: pass --checkpoint PATH" in ended.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_second_signal_stops_at_once_and_a_write_in_flight_leaves_the_old_file(tmp_path):
    """While the loop defers signals, the first only asks it to stop; a second raises Interrupted at once,
    and a checkpoint being written when it lands is abandoned: the previous file stays whole, no
    temporary file is left. The previous handlers are back afterwards."""
    from vktrain.train.checkpoint import atomic_write
    from vktrain.train.interrupts import Interrupted, StopOnSignal

    target = tmp_path / "run.ckpt"
    target.write_bytes(b"the previous checkpoint")

    def half_written_then_signalled(file):
        file.write(b"half of the next one")
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopOnSignal("train") as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested() and stop.exit_code == 143
            with pytest.raises(Interrupted) as caught:
                atomic_write(target, half_written_then_signalled)
        assert caught.value.exit_code == 130
        with pytest.raises(Interrupted):  # outside the loop a signal stops at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert target.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]


def test_progress_to_a_pipe_is_plain_lines_without_bar_frames(reference):
    """stderr not a terminal: no tqdm frames (carriage returns, rates), one line per --log-every steps."""
    assert "\r" not in reference.stderr and "step/s" not in reference.stderr and "it/s" not in reference.stderr
    step_lines = [line for line in reference.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == REFERENCE_STEPS


def test_a_webgpu_run_without_xdg_runtime_dir_prints_no_driver_errors(step_pte, reference):
    """wgpu's Vulkan driver prints "error: XDG_RUNTIME_DIR is invalid or not set" once per adapter in an
    environment without one (ssh, cron, containers) although nothing is wrong: a successful run's stderr
    holds no "error"; its losses are the Vulkan runtime's, to float32 rounding of other kernels."""
    pytest.importorskip("wgpu")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    done = subprocess.run(vktrain("train", step_pte, "--steps", 2, *TRAIN, "--runtime", "webgpu"), env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode == 2 and "WebGPU" in done.stderr and "adapter" in done.stderr:
        pytest.skip(f"no usable WebGPU adapter: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr.lower(), done.stderr
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert np.allclose(losses, reference.losses[:2], rtol=1e-4)


def test_a_signal_during_federate_keeps_the_last_round_and_its_resume_command_continues_it_exactly(step_pte,
                                                                                                    tmp_path):
    """`vktrain federate` (the sequential engine: the Ray one behaves the same, at ~20 s of start-up):
    SIGTERM abandons the round in flight; the checkpoint holds the last completed round, named with the
    command that resumes it; resumed to round R, the adapters are an uninterrupted R-round run's."""
    from vktrain.fleet.checkpoint import load_federation_checkpoint

    rounds = 10
    common = ["--clients", "2", "--local-steps", "8", "--engine", "sequential"]
    reference = subprocess.run(vktrain("federate", step_pte, "--rounds", rounds, *common, "--checkpoint", "ref"),
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    argv = ["federate", str(step_pte), "--rounds", "1000", *common, "--checkpoint", "run", "--json", "run.json"]
    ended, _ = _signalled(vktrain(*argv), tmp_path, [signal.SIGTERM], "round 2/", stream="stderr")
    assert ended.returncode == 143, ended.stderr
    done = load_federation_checkpoint(tmp_path / "run").round
    assert 2 <= done < rounds
    assert f"stopped by SIGTERM after round {done} of 1000 (the round in flight abandoned)" in ended.stderr
    assert f"saved checkpoint run (round {done})" in ended.stderr
    resume = ended.stderr.split("resume with:\n", 1)[1].splitlines()[0].strip()
    assert resume == shlex.join(["vktrain", *argv, "--resume"])
    assert [r["round"] for r in json.loads((tmp_path / "run.json").read_text())["rounds"]] == list(range(done + 1))

    command = shlex.split(resume)[1:]
    command[command.index("--rounds") + 1] = str(rounds)
    resumed = subprocess.run(vktrain(*command), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    expected, got = load_federation_checkpoint(tmp_path / "ref"), load_federation_checkpoint(tmp_path / "run")
    assert got.round == expected.round == rounds and sorted(got.arrays) == sorted(expected.arrays)
    for name, array in expected.arrays.items():
        assert np.array_equal(got.arrays[name], array), name


def test_the_resume_command_is_the_command_given_with_one_resume_flag():
    from vktrain.train.interrupts import resume_command

    assert resume_command(["train", "a b.pte", "--steps", "9", "--resume", "old.ckpt", "--checkpoint", "new.ckpt"],
                          "new.ckpt") == "vktrain train 'a b.pte' --steps 9 --checkpoint new.ckpt --resume new.ckpt"
    assert resume_command(["train", "s.pte", "--resume=old.ckpt", "--steps", "9"], "old.ckpt") == \
        "vktrain train s.pte --steps 9 --resume old.ckpt"

"""`vktrain fleet certs|server|node` on Flower's deployment engine over 127.0.0.1 (lavapipe): TLS and node
authentication on; 3 allowed nodes train 2 rounds and the global held-out loss falls, then end by themselves
once the server has gone, leaving no process behind; a node whose key the server does not hold, and a node
without TLS, are refused. Every process is bounded in time and stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[1]


TAG = "VKTRAIN_TEST_FLEET_TAG"  # in the environment of every process this test starts, and of theirs


def _spawn(args: list[str], log: Path, tag: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), TAG: tag}
    with open(log, "wb") as out:  # its own session (a node puts its SuperNode in another one: see _tagged)
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stat(entry: Path) -> list[str]:
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
    except OSError:
        return []


def _tagged(tag: str) -> list[str]:
    """The live processes (not zombies) whose environment carries `tag`: "pid command line" each."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or _stat(entry)[:1] in ([], ["Z"]):
                continue
            if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name} {command}")
        except OSError:  # ended meanwhile
            continue
    return found


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_three_authenticated_nodes_train_over_tls_and_strangers_are_refused(tmp_path):
    from vktrain.cli import main
    from vktrain.fleet.deployment import _free_port

    program = tmp_path / "step.pte"
    assert main(["export", "--model", "tiny-llama", "--model-arg", "dim=32", "--model-arg", "n_layers=1",
                 "--model-arg", "hidden=64", "--model-arg", "n_heads=2", "--model-arg", "n_kv_heads=1",
                 "--lora-rank", "2", "--batch", "2", "--seq", "16", "--out", str(program)]) == 0
    rng = np.random.default_rng(0)
    stream = np.cumsum(np.where(rng.random(2000) < 0.9, 1, rng.integers(0, 256, 2000))) % 256
    for i in range(3):
        np.save(tmp_path / f"train{i}.npy", stream[i * 500:(i + 1) * 500])
    np.save(tmp_path / "heldout.npy", stream[1500:])
    certs, allowed = tmp_path / "certs", tmp_path / "allowed"
    assert main(["fleet", "certs", str(certs), "--nodes", "4"]) == 0
    allowed.mkdir()
    for i in range(3):  # node3's key is not among them
        (allowed / f"node{i}.pub").write_bytes((certs / f"node{i}.pub").read_bytes())

    address, tag = f"127.0.0.1:{_free_port()}", str(tmp_path)
    cli = [sys.executable, "-m", "vktrain.cli", "fleet"]
    server = _spawn([*cli, "server", str(program), "--nodes", "3", "--rounds", "2", "--local-steps", "2", "--lr",
                     "1e-2", "--eval-data", str(tmp_path / "heldout.npy"), "--json", str(tmp_path / "rounds.json"),
                     "--address", address, "--certificates", str(certs), "--allowed-keys", str(allowed),
                     "--workdir", str(tmp_path / "work")], tmp_path / "server.log", tag)
    node = lambda i, key, wait: [*cli, "node", str(program), "--data", str(tmp_path / f"train{i % 3}.npy"),  # noqa: E731
                                 "--server", address, "--partition-id", str(i % 3), "--key", str(certs / f"{key}.key"),
                                 "--root-certificates", str(certs / "ca.crt"), "--max-wait-time", str(wait)]
    nodes = [_spawn(node(i, f"node{i}", 240), tmp_path / f"node{i}.log", tag) for i in range(3)]
    stranger = _spawn(node(3, "node3", 30), tmp_path / "stranger.log", tag)
    plain = _spawn([str(Path(sys.executable).parent / "flower-supernode"), "--superlink", address, "--insecure",
                    "--host", "127.0.0.1", "--port", str(_free_port()), "--max-wait-time", "30"],
                   tmp_path / "plain.log", tag)
    try:
        assert server.wait(timeout=420) == 0, (tmp_path / "server.log").read_text()[-3000:]
        server_gone = time.monotonic()
        for i, process in enumerate(nodes):  # by themselves, long before their --max-wait-time (240 s)
            log = tmp_path / f"node{i}.log"
            assert process.wait(timeout=max(1.0, server_gone + 60 - time.monotonic())) == 0, log.read_text()[-3000:]
            assert "vktrain fleet node: the federation ended (this node's last round, 2 of 2" in log.read_text()
        assert stranger.wait(timeout=120) == 1
        assert plain.wait(timeout=120) != 0
        # The plain SuperNode's SuperExec notices its parent gone (0.2 s polls) once it has started: under a loaded
        # CPU (the suite runs a worker per core) its interpreter can take tens of seconds to get there.
        deadline = time.monotonic() + 60
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _tagged(tag), _tagged(tag)  # no SuperNode, SuperExec, ClientApp or SuperLink left running
    finally:
        for process in (server, *nodes, stranger, plain):
            _stop(process)
        for line in _tagged(tag):  # what a failed run left
            os.kill(int(line.split()[0]), signal.SIGKILL)
    records = json.loads((tmp_path / "rounds.json").read_text())["rounds"]
    assert [r["round"] for r in records] == [0, 1, 2]
    losses = [r["global_eval_loss"] for r in records]
    assert losses[2] < losses[1] < losses[0], losses
    assert all(r["client_train_loss"].keys() == {"0", "1", "2"} and not r["failed"] for r in records[1:])
    superlink = (tmp_path / "work" / "superlink.log").read_text()
    assert "No SuperNode found with the given public key" in superlink  # the stranger, in the server's log
    assert "flower-supernode ended with exit code 1 for 30 s" in (tmp_path / "stranger.log").read_text()
    assert len(set(re.findall(r"Activated node_id=(\d+)", superlink))) == 3  # the plain node never got in
    assert json.loads((tmp_path / "work" / "outcome.json").read_text())["completed"] is True


def test_fleet_commands_refuse_bad_input_before_starting_anything(tmp_path, capsys):
    from vktrain.cli import main

    program = tmp_path / "step.pte"
    program.write_bytes(b"not read")
    assert main(["fleet", "certs", str(tmp_path / "certs"), "--nodes", "1"]) == 0
    (tmp_path / "keys").mkdir()
    server = ["fleet", "server", str(program), "--nodes", "2", "--rounds", "1", "--local-steps", "1"]
    for extra, message in (
            (["--certificates", str(tmp_path), "--allowed-keys", str(tmp_path / "certs")], "--certificates: "),
            (["--certificates", str(tmp_path / "certs"), "--allowed-keys", str(tmp_path / "keys")], "no *.pub file"),
            (["--certificates", str(tmp_path / "certs"), "--allowed-keys", str(tmp_path / "certs"), "--address",
              "9091"], "--address expects HOST:PORT"),
            (["--certificates", str(tmp_path / "certs"), "--allowed-keys", str(tmp_path / "certs"), "--aggregation",
              "mode"], "mean, median or trimmed-mean")):
        assert main([*server, *extra]) == 2, extra
        assert message in capsys.readouterr().err
    node = ["fleet", "node", str(program), "--data", str(program), "--server", "127.0.0.1:9091", "--partition-id",
            "0", "--root-certificates", str(tmp_path / "certs" / "ca.crt")]
    assert main([*node, "--key", str(tmp_path / "certs" / "node7.key")]) == 2
    assert "--key: " in capsys.readouterr().err


def test_a_server_whose_serverapp_fails_exits_1(tmp_path, capsys):
    """`flwr run` exits 0 when the ServerApp raised; vktrain fleet server does not: here its program is no
    program, so the ServerApp fails at load, before any node is needed."""
    from vktrain.cli import main
    from vktrain.fleet.deployment import _free_port

    program = tmp_path / "step.pte"
    program.write_bytes(b"not a program")
    assert main(["fleet", "certs", str(tmp_path / "certs"), "--nodes", "1"]) == 0
    assert main(["fleet", "server", str(program), "--nodes", "1", "--rounds", "1", "--local-steps", "1",
                 "--certificates", str(tmp_path / "certs"), "--allowed-keys", str(tmp_path / "certs"),
                 "--address", f"127.0.0.1:{_free_port()}", "--workdir", str(tmp_path / "work")]) == 1
    assert "the federation did not complete" in capsys.readouterr().err
    assert not (tmp_path / "work" / "outcome.json").exists()


def test_a_supernode_hung_after_giving_up_is_killed_with_what_it_started(monkeypatch):
    """Flower 1.42's SuperNode never exits after "Giving up reconnection" in its message loop (its main
    thread ends, its Runtime API thread does not): a process doing the same, with a child of its own (as
    its SuperExec), is killed and its whole process group stopped."""
    from vktrain.fleet import supernode
    from vktrain.fleet.supernode import SuperNode

    monkeypatch.setattr(supernode, "HUNG_SECONDS", 2.0)  # 15 s in use

    script = ("import subprocess, sys, threading\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print('WARNING: Giving up reconnection after 9.10 seconds and 5 tries.', flush=True)\n"
              "threading.Thread(target=threading.Event().wait).start()\n"
              "raise ConnectionRefusedError(111, 'Connection refused')\n")
    node = SuperNode([sys.executable, "-c", script], dict(os.environ))
    group, started = node.process.pid, time.monotonic()
    while not node.hung():
        assert not node.exited() and time.monotonic() - started < 60
        time.sleep(0.2)
    assert time.monotonic() - started > supernode.HUNG_SECONDS and not node.exited()  # it would stay forever
    assert node.stop() is None and node.process.returncode == -signal.SIGKILL
    members = [entry.name for entry in Path("/proc").iterdir() if entry.name.isdigit()
               and (stat := _stat(entry))[2:3] == [str(group)] and stat[0] != "Z"]
    assert not members, members  # its child, in its group, stopped too


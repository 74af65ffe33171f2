"""`vktrain fleet certs|server|node`: a federation over the network on Flower 1.42's deployment engine,
TLS on and SuperNode authentication on (the server registers the allowed public keys; any other node is
refused and the SuperLink's log says so).

  fleet certs DIR --nodes N   local test credentials (the `cryptography` package): DIR/ca.crt, a server
                              certificate for 127.0.0.1/localhost (and --host names) server.pem +
                              server.key, and nodeI.key / nodeI.pub (EC P-384, OpenSSH format)
  fleet server STEP.pte ...   starts flower-superlink (TLS, --enable-supernode-auth; its Fleet, Control
                              and runtime APIs on one HTTPS port), registers every *.pub of --allowed-keys
                              (`flwr supernode register`), runs vktrain's ServerApp (vktrain/fleet/deploy.py)
                              with `flwr run` and the federate options as its run config, and stops the
                              SuperLink when the run ends; its log is WORKDIR/superlink.log
  fleet node STEP.pte ...     runs flower-supernode with the node's private key and the CA certificate;
                              its ClientApp trains the node's program on its --data; it ends (exit 0) when
                              the server has gone after the node's last round, stopping flower-supernode
                              and every process it started (vktrain/fleet/supernode.py)

Flower's processes are this Python's console scripts (flower-superlink, flower-supernode, flwr), found
next to sys.executable.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vktrain.errors import VktrainError
from vktrain.train.outputs import add_overwrite_argument

SERVER_START_SECONDS = 90
NODE_RETRY_SECONDS = 3.0
SERVER_PROBE_SECONDS = 1.0  # once the node's last round is done: is the SuperLink still there?
SERVER_GONE_PROBES = 2      # refused connections in a row that mean it has gone


class DeploymentError(VktrainError, RuntimeError):
    """A deployment that cannot start: missing certificates or keys, a port in use, Flower's tools missing."""


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise DeploymentError(f"{name} not found next to {sys.executable} (pip install vktrain[fleet])")
    return str(path)


def _environment(flwr_home: Path | None = None) -> dict:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1", "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                               os.environ.get("PATH", "")])}
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise DeploymentError(f"{flag} expects HOST:PORT, got {text!r}")
    return host, int(port)


def _existing(path: str | None, flag: str) -> Path:
    if not path or not Path(path).is_file():
        raise DeploymentError(f"{flag}: {path} does not exist (or is not a file)")
    return Path(path).absolute()


# ------------------------------------------------------------------------------------------------ certs

def add_certs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write ca.crt, server.pem, server.key, nodeI.key/.pub")
    parser.add_argument("--nodes", type=int, default=3, metavar="N", help="node key pairs to write (default 3)")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="another DNS name or IP address the server certificate is valid for (repeatable)")
    parser.add_argument("--days", type=int, default=30, help="validity of the certificates (default 30)")


def run_certs(args: argparse.Namespace) -> int:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from vktrain.train.checkpoint import atomic_write_bytes

    if args.nodes < 0 or args.days < 1:
        raise DeploymentError(f"--nodes must be >= 0 and --days >= 1, got {args.nodes}, {args.days}")
    out = Path(args.directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    until = now + datetime.timedelta(days=args.days)
    pkcs8 = dict(encoding=serialization.Encoding.PEM, format=serialization.PrivateFormat.PKCS8,
                 encryption_algorithm=serialization.NoEncryption())
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vktrain fleet test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in args.host:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vktrain fleet server")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now).not_valid_after(until)
              .add_extension(x509.SubjectAlternativeName(names), critical=False).sign(ca_key, hashes.SHA256()))
    atomic_write_bytes(out / "ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(out / "server.pem", server.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(out / "server.key", server_key.private_bytes(**pkcs8))
    for i in range(args.nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        atomic_write_bytes(out / f"node{i}.key", key.private_bytes(serialization.Encoding.PEM,
                                                                   serialization.PrivateFormat.OpenSSH,
                                                                   serialization.NoEncryption()))
        atomic_write_bytes(out / f"node{i}.pub", key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                               serialization.PublicFormat.OpenSSH))
    print(f"{out}: ca.crt, server.pem, server.key, {args.nodes} node key pair(s) (test credentials: keep the .key files "
          f"private)")
    return 0


# ------------------------------------------------------------------------------------------------ server

def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    from vktrain.contract import PRECISION_AUTO, PRECISION_CHOICES
    from vktrain.fleet import FEDAVG, STRATEGIES
    from vktrain.fleet.robust import DEFAULT_MAX_NORM_RATIO

    parser.add_argument("program", metavar="STEP.pte", help="the training step (the server's copy: initial adapters, "
                                                            "held-out loss)")
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes taking part (partition ids 0..N-1)")
    parser.add_argument("--rounds", type=int, required=True, metavar="R")
    parser.add_argument("--local-steps", type=int, required=True, metavar="K")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per local AdamW step, accumulated on each node's device (default 1; the "
                             "program needs the accumulate method: vktrain export --grad-accum)")
    parser.add_argument("--fraction", type=float, default=1.0, metavar="F")
    parser.add_argument("--strategy", choices=STRATEGIES, default=FEDAVG)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-data", metavar="FILE", help="held-out data: the global loss after every round")
    parser.add_argument("--eval-batches", type=int, default=0, metavar="N")
    parser.add_argument("--json", metavar="FILE", help="the per-round records (as vktrain federate --json)")
    parser.add_argument("--checkpoint", metavar="DIR", help="the global adapters after every round")
    parser.add_argument("--resume", action="store_true", help="continue the federation in --checkpoint DIR")
    add_overwrite_argument(parser)
    parser.add_argument("--aggregation", default="mean", metavar="mean|median|trimmed-mean[:FRACTION]")
    parser.add_argument("--max-update-norm-ratio", default=str(DEFAULT_MAX_NORM_RATIO), metavar="R")
    parser.add_argument("--min-clients", type=int, default=1, metavar="M")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a round waits for its nodes")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO)
    parser.add_argument("--address", default="127.0.0.1:9091", metavar="HOST:PORT",
                        help="where the SuperLink listens (HTTPS; default 127.0.0.1:9091)")
    parser.add_argument("--certificates", required=True, metavar="DIR",
                        help="DIR/ca.crt, DIR/server.pem, DIR/server.key (vktrain fleet certs writes test ones)")
    parser.add_argument("--allowed-keys", required=True, metavar="DIR",
                        help="the public keys (DIR/*.pub, OpenSSH EC) of the nodes allowed to join")
    parser.add_argument("--workdir", metavar="DIR", help="the SuperLink's state, app and log (default: a temporary "
                                                         "directory, removed afterwards)")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def _run_config(args: argparse.Namespace) -> dict:
    from vktrain.fleet.robust import Aggregation, parse_norm_ratio

    Aggregation.parse(args.aggregation)
    parse_norm_ratio(args.max_update_norm_ratio)
    for flag, value in (("--nodes", args.nodes), ("--rounds", args.rounds), ("--local-steps", args.local_steps),
                        ("--grad-accum", args.grad_accum), ("--min-clients", args.min_clients)):
        if value < 1:
            raise DeploymentError(f"{flag} must be >= 1, got {value}")
    if args.resume and not args.checkpoint:
        raise DeploymentError("--resume needs --checkpoint DIR")
    absolute = lambda path: str(Path(path).absolute()) if path else ""  # noqa: E731 (the ServerApp runs elsewhere)
    return {"program": absolute(args.program), "nodes": args.nodes, "rounds": args.rounds,
            "local-steps": args.local_steps, "grad-accum": args.grad_accum, "lr": float(args.lr), "fraction": float(args.fraction),
            "strategy": args.strategy, "seed": args.seed, "eval-data": absolute(args.eval_data),
            "eval-batches": args.eval_batches, "json": absolute(args.json), "checkpoint": absolute(args.checkpoint),
            "resume": bool(args.resume), "aggregation": args.aggregation,
            "max-update-norm-ratio": str(args.max_update_norm_ratio), "min-clients": args.min_clients,
            "timeout": float(args.timeout), "precision": args.precision}


def write_app(directory: Path, run_config: dict) -> Path:
    """A Flower App project whose components are vktrain's apps, its run config the server's options."""
    (directory / "vktrain_fleet_app").mkdir(parents=True, exist_ok=True)
    (directory / "vktrain_fleet_app" / "__init__.py").write_text('"""vktrain fleet: the apps are vktrain.fleet.deploy."""\n')
    config = "\n".join(f"{key} = {_toml_value(value)}" for key, value in run_config.items())
    (directory / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "vktrain-fleet"
version = "1.0.0"
description = "vktrain fleet fine-tuning"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "vktrain"

[tool.flwr.app.components]
serverapp = "vktrain.fleet.deploy:server_app"
clientapp = "vktrain.fleet.deploy:client_app"

[tool.flwr.app.config]
{config}
""")
    return directory


def _wait_for_port(host: str, port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeploymentError(f"flower-superlink exited with {process.returncode} at start (its log: {log}):\n"
                                  + log.read_text()[-2000:])
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise DeploymentError(f"flower-superlink did not listen on {host}:{port} within {SERVER_START_SECONDS} s (log: {log})")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_server(args: argparse.Namespace) -> int:
    from vktrain.fleet.command import FEDERATION_CHECKPOINT, ROUND_RECORDS
    from vktrain.train.outputs import Output, check_outputs

    run_config = _run_config(args)
    host, port = _host_port(args.address, "--address")
    _existing(args.program, "STEP.pte")
    if args.grad_accum > 1:  # refused here, not by the ServerApp after the SuperLink and the nodes are up
        from vktrain.fleet.command import check_grad_accum
        from vktrain.serialization.pte import PteFile

        check_grad_accum(args.grad_accum, PteFile.load(args.program).method_names, args.program)
    check_outputs([Output("--checkpoint", args.checkpoint, FEDERATION_CHECKPOINT,  # federate's outputs, its rules
                          continues=args.checkpoint if args.resume else None),
                   Output("--json", args.json, ROUND_RECORDS)],
                  inputs=[("the program", args.program), ("--eval-data", args.eval_data)], overwrite=args.overwrite)
    if args.checkpoint:
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
    certificates = Path(args.certificates)
    ca, cert, key = (_existing(str(certificates / name), "--certificates") for name in ("ca.crt", "server.pem", "server.key"))
    keys = sorted(Path(args.allowed_keys).glob("*.pub"))
    if not keys:
        raise DeploymentError(f"--allowed-keys {args.allowed_keys}: no *.pub file (the nodes' public keys)")
    with tempfile.TemporaryDirectory(prefix="vktrain-fleet-server-") as temporary:
        workdir = Path(args.workdir or temporary).absolute()
        home = workdir / "flwr"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(f'[superlink]\ndefault = "vktrain"\n\n[superlink.vktrain]\naddress = '
                                          f'{json.dumps(f"{host}:{port}")}\nroot-certificates = {json.dumps(str(ca))}\n')
        env, log = _environment(home), workdir / "superlink.log"
        with open(log, "ab") as log_file:
            superlink = subprocess.Popen(
                [_tool("flower-superlink"), "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile",
                 str(key), "--enable-supernode-auth", "--host", host, "--port", str(port), "--database",
                 str(workdir / "state.db"), "--disable-runtime-dependency-installation"],
                env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_for_port(host, port, superlink, log)
            print(f"vktrain fleet server: SuperLink on https://{host}:{port} (log {log})", file=sys.stderr, flush=True)
            for public in keys:
                deadline = time.monotonic() + SERVER_START_SECONDS
                while True:  # the port opens before the Control API answers
                    done = subprocess.run([_tool("flwr"), "supernode", "register", str(public.absolute())], env=env,
                                          capture_output=True, text=True, timeout=120)
                    if done.returncode == 0 or "unavailable" not in done.stdout + done.stderr \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(1.0)
                if done.returncode != 0:
                    raise DeploymentError(f"--allowed-keys: registering {public} failed:\n{done.stdout}{done.stderr}")
                print(f"vktrain fleet server: allowed {public.name}: {done.stdout.strip().splitlines()[-1]}",
                      file=sys.stderr, flush=True)
            outcome = workdir / "outcome.json"
            outcome.unlink(missing_ok=True)
            app = write_app(workdir / "app", {**run_config, "outcome": str(outcome)})
            run = subprocess.run([_tool("flwr"), "run", str(app), "vktrain", "--stream"], env=env)
            if run.returncode != 0 or not outcome.is_file():  # `flwr run` exits 0 when the ServerApp failed
                print(f"vktrain fleet server: error: the federation did not complete (flwr run exit code "
                      f"{run.returncode}; the ServerApp's log above says why)", file=sys.stderr)
                return 1
            return 0
        finally:
            _stop(superlink)


# ------------------------------------------------------------------------------------------------ node

def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    from vktrain.contract import PRECISION_AUTO, PRECISION_CHOICES

    parser.add_argument("program", metavar="STEP.pte", help="this node's copy of the training step")
    parser.add_argument("--data", required=True, metavar="FILE", help="this node's training data")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the SuperLink (vktrain fleet server)")
    parser.add_argument("--partition-id", type=int, required=True, metavar="I", help="this node's index, 0..N-1")
    parser.add_argument("--key", required=True, metavar="FILE", help="this node's private key (OpenSSH EC; its .pub "
                                                                     "must be among the server's --allowed-keys)")
    parser.add_argument("--root-certificates", required=True, metavar="ca.crt",
                        help="the CA certificate the server's TLS certificate is checked against")
    parser.add_argument("--max-wait-time", type=float, metavar="S",
                        help="give up (exit 1) after S seconds without a message from the server: refused, no "
                             "server, or the server gone before this node's last round (default: never)")
    parser.add_argument("--seed", type=int, default=0, help="the data order's seed (the server's --seed)")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def run_node(args: argparse.Namespace) -> int:
    from vktrain.fleet.node_progress import PROGRESS_KEY

    server = _host_port(args.server, "--server")
    program, data = _existing(args.program, "STEP.pte"), _existing(args.data, "--data")
    key, ca = _existing(args.key, "--key"), _existing(args.root_certificates, "--root-certificates")
    if args.partition_id < 0:
        raise DeploymentError(f"--partition-id must be >= 0, got {args.partition_id}")
    with tempfile.TemporaryDirectory(prefix="vktrain-fleet-node-") as progress:
        node_config = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in (
            ("partition-id", args.partition_id), ("program", str(program)), ("data", str(data)), ("seed", args.seed),
            ("precision", args.precision), (PROGRESS_KEY, progress)))
        command = [_tool("flower-supernode"), "--superlink", args.server, "--root-certificates", str(ca),
                   "--auth-supernode-private-key", str(key), "--node-config", node_config,
                   "--host", "127.0.0.1", "--port", str(_free_port())]  # its local ClientApp API
        return _supervise(command, server, progress, args.max_wait_time)


def _supervise(command: list[str], server: tuple[str, int], progress: str, max_wait: float | None) -> int:
    """Run flower-supernode until the federation has ended for this node (0), or --max-wait-time has passed
    without taking part (1).

    flower-supernode exits when the SuperLink refuses it (its key not registered yet: a node may start before
    the server has registered the keys; or its node still marked online after a crash, until its heartbeat
    expires) or is gone: it is started again until --max-wait-time is spent (a node that reconnects); every
    message the node answers starts that wait again. Once the ClientApp has answered the last train message
    due to this node (vktrain/fleet/node_progress.py), the SuperLink going away is the federation's end: the
    SuperNode is stopped (it would retry for --max-wait-time, then hang: vktrain/fleet/supernode.py)."""
    from vktrain.fleet.node_progress import read_progress
    from vktrain.fleet.supernode import POLL_SECONDS, SuperNode

    deadline = None if max_wait is None else time.monotonic() + max_wait
    seen = None  # the ClientApp's last progress record
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        node = SuperNode(command + ([] if remaining is None else ["--max-wait-time", f"{max(remaining, 1.0):.1f}"]),
                         _environment())
        gone, next_probe = 0, 0.0
        try:
            while not (node.exited() or node.hung() or gone >= SERVER_GONE_PROBES):
                time.sleep(POLL_SECONDS)
                record, now = read_progress(progress), time.monotonic()
                if record != seen:
                    seen, deadline = record, None if max_wait is None else now + max_wait
                if seen and seen["last"] and now >= next_probe:
                    gone, next_probe = 0 if _reachable(*server) else gone + 1, now + SERVER_PROBE_SECONDS
        finally:
            code = node.stop()
        if seen and seen["last"]:
            print(f"vktrain fleet node: the federation ended (this node's last round, {seen['round']} of "
                  f"{seen['rounds']}, is done and the server has gone); flower-supernode stopped", flush=True)
            return 0
        if code == 0:
            return 0
        ended = "gave up reconnecting (stopped)" if code is None else f"ended with exit code {code}"
        if deadline is not None and time.monotonic() + NODE_RETRY_SECONDS >= deadline:
            break
        print(f"vktrain fleet node: flower-supernode {ended}; starting it again in {NODE_RETRY_SECONDS:g} s",
              file=sys.stderr, flush=True)
        time.sleep(NODE_RETRY_SECONDS)
    if seen:
        print(f"vktrain fleet node: error: the server went away after round {seen['round']} of {seen['rounds']} "
              f"(rounds are still due to this node) and did not take this node back within {max_wait:g} s",
              file=sys.stderr)
    else:
        print(f"vktrain fleet node: error: flower-supernode {ended} for {max_wait:g} s (not allowed by the server, "
              f"no TLS connection, or no server; its log above says which)", file=sys.stderr)
    return 1


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="action", required=True)
    for name, add, run, text in (
            ("certs", add_certs_arguments, run_certs, "write local test TLS certificates and node key pairs"),
            ("server", add_server_arguments, run_server, "a federation's server: SuperLink (TLS, node authentication) "
                                                         "and vktrain's ServerApp"),
            ("node", add_node_arguments, run_node, "a node: SuperNode running vktrain's ClientApp on this device")):
        sub = commands.add_parser(name, help=text)
        add(sub)
        sub.set_defaults(run=run)


__all__ = ["DeploymentError", "add_fleet_arguments", "run_certs", "run_node", "run_server", "write_app"]

#!/usr/bin/env python
"""Benchmark a federation: N clients, fraction F, SmolLM2-135M's training step, through `vktrain federate`.

    python scripts/bench_federate.py export [--shape 1x64]     # here (needs executorch): the step with
                                                               # SYNTHETIC constants (bench_step.py's export)
    python scripts/bench_federate.py run bench/step_smollm2-135m_1x64.pte --clients 100 --fraction 0.1 \\
        --rounds 3 --local-steps 4 --client-gpus 0.1 \\
        --out bench/results/federate_h200_smollm2-135m.json    # GPU machine (an engine's run joins the file's)
    python scripts/bench_federate.py run STEP.pte --clients 8 --fraction 1 --client-cpus 0.5 ...  # lavapipe

export: SmolLM2-135M's shapes (hidden 576, 30 layers, vocab 49152, LoRA rank 16 on q/k/v/o/gate/up/down)
with the weights generated from seeds at load (scripts/bench_step.py), so the .pte travels as a few MiB:
the numbers measure speed, not a trained model.

run: random token data (the program's vocabulary) split into --clients shards, then `vktrain federate`
with the engine asked for. `--engine auto` (default) takes Flower's Ray simulation when `flwr` and `ray`
import, else the SEQUENTIAL engine (the same strategy, messages and ClientApp in this process, one client
after another, no Ray): the JSON's "engine" says which ran, and a sequential run's seconds are the
clients' compute in a row, NOT a simulation's (no concurrency, no Ray start-up, no serialization
between processes). Written: the settings, the machine, and per round the wall seconds, the clients'
own seconds, how many clients ran at once (their wall-clock intervals overlapped) in how many
processes, the bytes each way; and the whole run's client steps per second.

What needs what: export needs torch + executorch; run needs numpy, vulkan, flatbuffers, safetensors,
tqdm and flwr (its Message API: the sequential engine uses Flower's strategy too), ray for --engine ray.
On the GPU machine (no network), what `import vktrain.fleet.command, vktrain.fleet.server` loads beyond
its image's packages travels as wheels (the device README's recipe): flwr==1.42.0, vulkan, pycryptodome,
cryptography (+ cffi), grpcio-health-checking, iterators (installed with --no-deps: the server-side
extras flwr declares, sqlalchemy, fastapi, uvicorn, uv..., are not imported by a simulation's apps).
ray==2.55.1 is 220 MB installed, a wheel over the 64 MiB a call carries: without it, --engine auto
falls back to the sequential engine and says so.

The H200 plan (the lead's run): export here, carry the .pte (14.3 MiB at 1x64), the SPIR-V cache, .gl and
the wheels, then
    python3 scripts/bench_federate.py run bench/step_smollm2-135m_1x64.pte --clients 100 --fraction 0.1 \
        --rounds 3 --local-steps 4 --client-gpus 0.1 --client-cpus 1 --out bench/results/federate_h200_smollm2-135m.json
With Ray, 10 clients of a round share the GPU (0.1 each; 16 CPUs allow 16 at once), each in its own
worker process with its own Vulkan device and runner (~0.2 GiB of generated constants plus the step's
activations); the JSON's max_concurrent_clients and client_processes say what happened.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def export(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import bench_step

    batch, seq = bench_step.parse_shapes(args.shape)[0]
    written = bench_step.export_configs("smollm2-135m", [(batch, seq)], args.out_dir, bench_step.FULL_SYNTHETIC_MIN_BYTES,
                                        prefix="step_smollm2-135m")
    print(json.dumps(written, indent=1))
    return 0


def _engine(requested: str) -> str:
    if requested != "auto":
        return requested
    has_ray = all(importlib.util.find_spec(name) is not None for name in ("flwr", "ray"))
    return "ray" if has_ray else "sequential"


def _device_name() -> str:
    from vktrain.runtime.vk.device import Device

    device = Device()
    try:
        return str(getattr(device, "name", "") or device)
    finally:
        device.close()


def run(args: argparse.Namespace) -> int:
    from vktrain.cli import main as vktrain_main
    from vktrain.serialization.pte import PteFile
    from vktrain.runtime.program.interpreter import verify_training_program

    engine = _engine(args.engine)
    graph = verify_training_program(PteFile.load(args.pte), verify_constants=False).graph
    vocab = next(int(graph.tensor(op.args[0]).shape[-1]) for op in graph.ops if op.name == "vktrain.fused_ce.default")
    batch, seq = next(graph.tensor(v).shape for v in graph.inputs if graph.tensor(v).name == "token_ids")
    with tempfile.TemporaryDirectory(prefix="vktrain-bench-federate-") as scratch:
        data = Path(scratch) / "tokens.npy"
        # Enough windows that every client's shard holds a batch for each of its local steps in every round.
        windows = args.clients * max(batch * args.local_steps * args.rounds, batch) + args.clients
        np.save(data, np.random.default_rng(0).integers(0, vocab, windows * (seq + 1), dtype=np.int64))
        records_path = Path(scratch) / "rounds.json"
        command = ["federate", str(args.pte), "--clients", str(args.clients), "--fraction", str(args.fraction),
                   "--rounds", str(args.rounds), "--local-steps", str(args.local_steps), "--data", str(data),
                   "--engine", engine, "--json", str(records_path), "--client-cpus", str(args.client_cpus),
                   "--client-gpus", str(args.client_gpus), "--precision", args.precision]
        if args.ray_cpus:
            command += ["--ray-cpus", str(args.ray_cpus)]
        started = time.perf_counter()
        code = vktrain_main(command)
        wall = time.perf_counter() - started
        if code != 0:
            print(f"vktrain federate exited with {code}", file=sys.stderr)
            return code
        rounds = json.loads(records_path.read_text())["rounds"]
    trained = [r for r in rounds if r["round"] > 0]
    client_steps = sum(len(r["client_train_loss"]) for r in trained) * args.local_steps
    seconds = sum(r["seconds"] for r in trained)
    report = {
        "engine": engine if engine == "ray" else
        "sequential (NO Ray: one client after another in one process; not a simulation's timing)",
        "program": str(args.pte), "batch": batch, "seq": seq, "vocab": vocab,
        "clients": args.clients, "fraction": args.fraction, "rounds": args.rounds, "local_steps": args.local_steps,
        "client_cpus": args.client_cpus, "client_gpus": args.client_gpus, "ray_cpus": args.ray_cpus,
        "precision": args.precision,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": _device_name(),
                    "load_average": os.getloadavg()},
        "command_seconds": wall,  # start-up (program load, shards, Ray) included
        "round_seconds": seconds, "client_steps": client_steps,
        "client_steps_per_second": client_steps / seconds if seconds else None,
        "tokens_per_second": client_steps * batch * seq / seconds if seconds else None,
        "rounds_detail": [{key: r.get(key) for key in ("round", "sampled", "seconds", "train_seconds", "client_seconds",
                                                       "max_concurrent_clients", "client_processes", "bytes_down",
                                                       "bytes_up", "failed")} for r in trained],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:  # one file per machine and model: this engine and client share replace their run, others stay
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
        from bench_results import write_run
        write_run(args.out, report, key=lambda r: (r["engine"].split()[0], r["client_cpus"], r["client_gpus"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="export SmolLM2-135M's step with synthetic constants (executorch)")
    exporting.add_argument("--shape", default="1x64", help="BATCHxSEQ (default 1x64)")
    exporting.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench")
    exporting.set_defaults(run=export)
    running = commands.add_parser("run", help="run the federation and write the measurements")
    running.add_argument("pte", type=Path)
    running.add_argument("--clients", type=int, default=100)
    running.add_argument("--fraction", type=float, default=0.1)
    running.add_argument("--rounds", type=int, default=3)
    running.add_argument("--local-steps", type=int, default=4)
    running.add_argument("--engine", choices=("auto", "ray", "sequential"), default="auto")
    running.add_argument("--client-cpus", type=float, default=1.0)
    running.add_argument("--client-gpus", type=float, default=0.0, help="e.g. 0.1 on one GPU: 10 clients at once")
    running.add_argument("--ray-cpus", type=int, default=None)
    running.add_argument("--precision", default="fp32")
    running.add_argument("--out", type=Path)
    running.set_defaults(run=run)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from bench_results import out_error
    if out_error(getattr(args, "out", None)):
        parser.error(out_error(args.out))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

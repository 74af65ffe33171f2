#!/usr/bin/env python
"""A 1,000-client federation in one process (issue 28): speed against one process training the same
step, the server's aggregation time, and the global model under a fraction of Byzantine clients.

    python scripts/bench_fleet_scale.py run STEP.pte --clients 1000 --fraction 0.05 --rounds 3 --local-steps 4 \\
        --byzantine 0.1 --out bench/results/fleet_scale_<machine>_<model>.json     # + the .png beside it
    python scripts/bench_fleet_scale.py plot bench/results/fleet_scale_<machine>_<model>.json   # the .png again

On the GPU machine (the lead's run): SmolLM2-135M's step with synthetic constants from
`scripts/bench_federate.py export` (bench/step_smollm2-135m_1x64.pte), with the wheels that script's
docstring lists (flwr's Message API; no Ray needed), then `run` as above with --out
bench/results/fleet_scale_h200_<model>.json (model smollm2-135m).

What runs: vktrain's ServerApp (FederationServer: Flower's strategy loop, screening, aggregation, the
global held-out loss) and ClientApp on the SEQUENTIAL engine (vktrain/fleet/sequential.py): every
sampled client is served in this process, one after another, by ONE resident TrainingRunner (loaded once;
each client writes the global adapters in, resets AdamW's state, trains its local steps on its own shard
and replies). So the numbers are compute and per-client overhead (state writes and reads, Flower's
messages and records, serialization of the arrays as Flower does it), with no concurrency, no network and
no process start: what a resident-program simulation costs, not Ray's simulation nor a deployment.

Measured, written to --out (and plotted beside it):
  baseline     one TrainingRunner stepping the same program on the same data, alone: tokens/s
  scale        the clean federation: rounds/s, client steps/s, tokens/s and its ratio to the baseline (the
               issue's target: >= 0.5 on the H200 with SmolLM2 1x64), per round the clients' own seconds,
               `aggregate_seconds` (the strategy's screening + combining), the held-out eval and the rest;
               `per_client_seconds`: a served client's share of the rounds split into swap_in (adapters
               written, AdamW moments zeroed), train (its local steps; train_at_baseline: the same steps at
               the baseline's speed), swap_out (adapters read back), serialize (the client decoding and
               encoding the arrays), aggregate (the server reading, screening and combining its reply) and
               rest (Flower's messages, sampling)
  aggregation  screen_updates + each aggregator on n synthetic updates shaped like the program's adapters
               (numpy only, no device): what a server pays at n = 50 .. 1000 clients a round
  byzantine    the same federation with a fraction --byzantine of the clients (drawn by the seed) replying
               a poisoned update every round they are sampled (--attack: faults.py's norm = 1e6-norm update,
               nan, shape), for each aggregator with the norm screen on (--max-update-norm-ratio 10) and
               off (inf): the final global held-out loss against the clean run's, updates dropped. A run
               whose global model stops being finite is recorded as diverged with the error. Not run with
               --byzantine 0 (a speed measurement: the clean federation alone).
The data is a learnable synthetic stream (next token = token + 1 mod the vocabulary, 10% noise), split iid
into the clients' shards; --eval-batches bounds the global held-out loss's cost.
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO_ROOT / "scripts"))


def _stream(vocab: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (np.cumsum(np.where(rng.random(size) < 0.9, 1, rng.integers(0, vocab, size))) % vocab).astype(np.int64)


def baseline(program: str, device, data: np.ndarray, steps: int, lr: float, precision: str) -> dict:
    """One runner training the program alone on `data`'s batches: its steady tokens/s."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.train.data import TokenBatcher
    from vktrain.train.train_loop import AdamWConfig, run_step

    with TrainingRunner.from_pte(program, device, planner=plan_schedule, precision=precision, timing=False) as runner:
        batch, seq = runner.batch_shape
        batches = TokenBatcher(data, batch, seq, seed=0)
        hparams = AdamWConfig().hparams(lr)
        run_step(runner, batches.batch(0), hparams)  # warm: pipelines, first dispatches
        started = time.perf_counter()
        for i in range(steps):
            run_step(runner, batches.batch(1 + i), hparams)
        seconds = time.perf_counter() - started
    return {"steps": steps, "seconds": seconds, "tokens_per_second": steps * batch * seq / seconds,
            "steps_per_second": steps / seconds}


def federation(program: str, device, shards: list[str], eval_data: str, args, aggregation: str,
               max_norm_ratio, byzantine: list[int]) -> dict:
    """One sequential federation; its records, wall seconds and the clients' seconds."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.errors import VktrainError
    from vktrain.fleet.client import ClientSettings, close_trainers, local_trainer, make_client_app
    from vktrain.fleet.sequential import SequentialGrid
    from vktrain.fleet.server import FederationServer, FederationSettings
    from vktrain.runtime.program.runner import TrainingRunner

    failures = frozenset((client, r, args.attack) for client in byzantine for r in range(1, args.rounds + 1))
    settings = FederationSettings(program=program, strategy="fedavg", n_clients=len(shards), rounds=args.rounds,
                                  local_steps=args.local_steps, fraction=args.fraction, lr=args.lr, seed=args.seed,
                                  eval_data=eval_data, eval_batches=args.eval_batches, precision=args.precision,
                                  engine="sequential", aggregation=aggregation, max_norm_ratio=max_norm_ratio)
    client_settings = ClientSettings(program, tuple(shards), seed=args.seed, precision=args.precision,
                                     failures=failures)
    outcome: dict = {"aggregation": aggregation, "max_update_norm_ratio": max_norm_ratio,
                     "byzantine_clients": len(byzantine)}
    with TrainingRunner.from_pte(program, device, planner=plan_schedule, precision=args.precision) as runner:
        server = FederationServer(settings, runner, progress=False)
        grid = SequentialGrid(make_client_app(client_settings), len(shards))
        trainer = local_trainer(client_settings)  # the one the clients of this process use (loaded before the clock)
        started = time.perf_counter()
        try:
            server.run(grid)
        except VktrainError as exc:  # e.g. a poisoned global model whose held-out loss is not finite
            outcome["diverged"] = str(exc)
        finally:
            outcome["client_phase_seconds"], outcome["client_messages"] = dict(trainer.seconds), trainer.served
            close_trainers()
        outcome["wall_seconds"] = time.perf_counter() - started  # includes round 0's held-out loss
        outcome["client_seconds"] = grid.client_seconds
    outcome["rounds"] = server.result.records
    return outcome


def scale_summary(run: dict, batch: int, seq: int, local_steps: int, baseline_tps: float,
                  baseline_sps: float) -> dict:
    from vktrain.fleet.client import PHASES

    trained = [r for r in run["rounds"] if r["round"] > 0]
    if not trained:  # the federation stopped before its first round ended: say why instead of dividing by 0
        raise SystemExit(f"bench_fleet_scale: no round completed (diverged: {run.get('diverged')!r}; "
                         f"round records: {run['rounds']!r})")
    seconds = sum(r["seconds"] for r in trained)
    client_steps = sum(len(r["client_train_loss"]) for r in trained) * local_steps
    tokens = client_steps * batch * seq
    train_seconds = sum(r["seconds_before_eval"] for r in trained)  # the rounds without the held-out loss
    served = sum(len(r["sampled"]) for r in trained)
    phases = {phase: run["client_phase_seconds"][phase] / run["client_messages"] for phase in PHASES}
    split = {"swap_in": phases["swap_in"], "train": phases["train"], "swap_out": phases["swap_out"],
             "serialize": phases["receive"] + phases["send"],
             "aggregate": sum(r.get("aggregate_seconds") or 0.0 for r in trained) / served}
    split["rest"] = train_seconds / served - sum(split.values())  # Flower's messages, sampling, the ClientApp's call
    return {"rounds": len(trained), "round_seconds": seconds, "rounds_per_second": len(trained) / seconds,
            "client_steps": client_steps, "client_steps_per_second": client_steps / seconds,
            "tokens_per_second": tokens / seconds,
            "tokens_per_second_without_eval": tokens / train_seconds,
            "ratio_to_one_process": tokens / train_seconds / baseline_tps,
            "clients_seconds": run["client_seconds"],
            # what serving a client costs beyond its steps at the baseline's speed (state in and out, messages)
            "per_client_overhead_seconds": (run["client_seconds"] - client_steps / baseline_sps) / served,
            # where a served client's share of the rounds (without the held-out eval) goes: its state written in
            # (adapters, AdamW moments zeroed), its local steps (`train_at_baseline`: those steps at the baseline's
            # speed), the adapters read back, the client's decoding + encoding of the arrays, the server's
            # reading, screening and combining of its reply, and the rest
            "per_client_seconds": {**split, "train_at_baseline": local_steps / baseline_sps, "client_phases": phases},
            "aggregate_seconds": [r.get("aggregate_seconds") for r in trained],
            "screen_seconds": [r.get("screen_seconds") for r in trained],  # of aggregate_seconds: replies read, screened
            "combine_seconds": [r.get("combine_seconds") for r in trained],
            "eval_seconds": [r["seconds"] - r["seconds_before_eval"] for r in trained]}


def aggregation_costs(shapes: dict[str, tuple], counts: list[int], aggregations: list[str], seed: int,
                      memory_gib: float) -> list[dict]:
    """Screening and each aggregator on n synthetic float32 updates of the program's adapter shapes; a count
    whose updates alone would pass `memory_gib` (the median stacks them all, and copies) is skipped."""
    from vktrain.fleet.robust import DEFAULT_MAX_NORM_RATIO, Aggregation, screen_updates

    rng = np.random.default_rng(seed)
    global_arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    parameters = sum(a.size for a in global_arrays.values())
    rows = []
    for n in counts:
        if n * parameters * 4 > memory_gib * 2**30:
            rows.append({"clients": n, "skipped": f"{n} x {parameters} float32 updates exceed --aggregation-memory-gib "
                                                  f"{memory_gib:g}"})
            continue
        updates = {p: ({name: a + 1e-3 * rng.standard_normal(a.shape).astype(np.float32)
                        for name, a in global_arrays.items()}, 100.0 + p, 1.0) for p in range(n)}
        started = time.perf_counter()
        screened = screen_updates(updates, global_arrays, DEFAULT_MAX_NORM_RATIO)
        screen_seconds = time.perf_counter() - started
        for text in aggregations:
            started = time.perf_counter()
            Aggregation.parse(text).combine([updates[p][0] for p in screened.accepted],
                                            [updates[p][1] for p in screened.accepted])
            rows.append({"clients": n, "aggregation": text, "screen_seconds": screen_seconds,
                         "combine_seconds": time.perf_counter() - started})
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    clean = report["scale"]["run"]["rounds"]
    left.plot([r["round"] for r in clean], [r["global_eval_loss"] for r in clean], "k-o", label="clean (mean)")
    for run in report["byzantine"]:
        if run.get("diverged"):
            continue
        label = f"{run['aggregation']}, screen {'off' if run['max_update_norm_ratio'] is None else 'on'}"
        left.plot([r["round"] for r in run["rounds"]], [r["global_eval_loss"] for r in run["rounds"]], "--.",
                  label=label)
    left.set_xticks([r["round"] for r in clean])
    left.set(xlabel="round", ylabel="global held-out loss",
             title=f"{report['byzantine_fraction']:g} Byzantine ({report['attack']}); diverged runs not drawn")
    left.legend(fontsize=7)
    summary = report["scale"]["summary"]
    middle.bar(["one process", "federation\n(no eval)", "federation\n(with eval)"],
               [report["baseline"]["tokens_per_second"], summary["tokens_per_second_without_eval"],
                summary["tokens_per_second"]], color=["grey", "tab:blue", "tab:cyan"])
    middle.set(ylabel="trained tokens/s", title=f"{report['clients']} clients, fraction {report['fraction']:g}: "
                                                f"{summary['ratio_to_one_process']:.2f} of one process")
    for text in report["aggregation_args"]:
        rows = [r for r in report["aggregation"] if r.get("aggregation") == text]
        right.plot([r["clients"] for r in rows], [r["screen_seconds"] + r["combine_seconds"] for r in rows], "-o",
                   label=text)
    right.set(xscale="log", yscale="log", xlabel="updates aggregated", ylabel="seconds (screen + combine)",
              title=f"server aggregation, {report['adapter_parameters']:,} adapter parameters")
    right.legend(fontsize=7)
    figure.suptitle(f"vktrain fleet at scale, sequential engine, {report['machine']['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.fleet.client import trained_names
    from vktrain.fleet.partition import PartitionScheme, write_shards
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.runtime.vk.device import Device
    from bench_results import write_run

    from vktrain.fleet.command import quiet_flower_and_ray

    quiet_flower_and_ray()  # Flower's per-round log (federate's default)
    program = str(args.pte.absolute())
    device = Device()
    try:
        with TrainingRunner.from_pte(program, device, planner=plan_schedule, timing=False) as probe:
            (batch, seq), vocab = probe.batch_shape, probe.vocab_size
            shapes = {name: probe.read_state(name).shape for name in trained_names(probe.state_names)}
        per_client = args.local_steps * batch + 1  # windows a shard holds (a client sampled again cycles them)
        with tempfile.TemporaryDirectory(prefix="vktrain-fleet-scale-") as scratch:
            stream = _stream(vocab, args.clients * per_client * (seq + 1) + 20 * batch * (seq + 1), args.seed)
            held_out_tokens = 20 * batch * (seq + 1)
            np.save(Path(scratch) / "train.npy", stream[:-held_out_tokens])
            np.save(Path(scratch) / "heldout.npy", stream[-held_out_tokens:])
            shards = [str(p) for p in write_shards(Path(scratch) / "train.npy", scratch, args.clients,
                                                   PartitionScheme.parse("iid"), args.seed, vocab_size=vocab,
                                                   unit_tokens=seq + 1, min_documents=batch)]
            eval_data = str(Path(scratch) / "heldout.npy")
            base = baseline(program, device, stream[:50 * batch * (seq + 1)], args.baseline_steps, args.lr,
                            args.precision)
            print(f"one process: {base['tokens_per_second']:.0f} tokens/s", file=sys.stderr, flush=True)
            clean = federation(program, device, shards, eval_data, args, "mean", 10.0, [])
            summary = scale_summary(clean, batch, seq, args.local_steps, base["tokens_per_second"],
                                    base["steps_per_second"])
            print(f"clean federation: {summary['rounds_per_second']:.3f} rounds/s, {summary['tokens_per_second']:.0f} "
                  f"tokens/s ({summary['ratio_to_one_process']:.2f} of one process without the eval); a client: "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in summary["per_client_seconds"].items()
                              if isinstance(v, float)), file=sys.stderr, flush=True)
            attackers = sorted(int(c) for c in np.random.default_rng([args.seed, 1]).choice(
                args.clients, size=int(round(args.byzantine * args.clients)), replace=False))
            byzantine = []
            for text in args.aggregations if attackers else ():
                for ratio in (10.0, None):
                    outcome = federation(program, device, shards, eval_data, args, text, ratio, attackers)
                    final = outcome["rounds"][-1] if outcome["rounds"] else {}
                    outcome["final_global_eval_loss"] = None if outcome.get("diverged") else final.get("global_eval_loss")
                    outcome["dropped_updates"] = sum(len(r.get("dropped", {})) for r in outcome["rounds"])
                    outcome["sampled_byzantine"] = sum(len(set(r.get("sampled", [])) & set(attackers))
                                                       for r in outcome["rounds"])
                    print(f"{text}, screen {'on' if ratio else 'off'}: final loss {outcome['final_global_eval_loss']}, "
                          f"{outcome['dropped_updates']} dropped" + (f", diverged: {outcome['diverged'][:120]}"
                                                                     if outcome.get("diverged") else ""),
                          file=sys.stderr, flush=True)
                    byzantine.append(outcome)
        report = {
            "engine": "sequential (one process, one resident runner; no Ray, no network: not a simulation's "
                      "or a deployment's timing)",
            "program": str(args.pte), "batch": batch, "seq": seq, "vocab": vocab, "clients": args.clients,
            "fraction": args.fraction, "rounds": args.rounds, "local_steps": args.local_steps, "lr": args.lr,
            "precision": args.precision, "eval_batches": args.eval_batches, "seed": args.seed,
            "adapter_parameters": int(sum(np.prod(s) for s in shapes.values())),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device.info.describe(),
                        "load_average": os.getloadavg()},
            "baseline": base,
            "scale": {"summary": summary, "run": clean},
            "aggregation_args": args.aggregations,
            "aggregation": aggregation_costs(shapes, args.aggregation_counts, args.aggregations, args.seed,
                                             args.aggregation_memory_gib),
            "byzantine_fraction": args.byzantine, "attack": args.attack, "byzantine_clients": attackers,
            "byzantine": byzantine,
        }
    finally:
        device.close()
    if args.out:
        write_run(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
        try:
            plot(report, args.out.with_suffix(".png"))
            print(f"wrote {args.out.with_suffix('.png')}", file=sys.stderr)
        except ImportError as exc:  # the GPU machine may lack matplotlib: plot the JSON here afterwards
            print(f"no plot ({exc}): python scripts/bench_fleet_scale.py plot {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from vktrain.fleet.faults import CORRUPTIONS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    running = commands.add_parser("run", help="run the federations and write the measurements")
    running.add_argument("pte", type=Path, help="a token model's training step with an eval method")
    running.add_argument("--clients", type=int, default=1000)
    running.add_argument("--fraction", type=float, default=0.05)
    running.add_argument("--rounds", type=int, default=3)
    running.add_argument("--local-steps", type=int, default=4)
    running.add_argument("--lr", type=float, default=1e-2)
    running.add_argument("--seed", type=int, default=0)
    running.add_argument("--precision", default="fp32")
    running.add_argument("--eval-batches", type=int, default=8, help="batches of the global held-out loss")
    running.add_argument("--baseline-steps", type=int, default=40)
    running.add_argument("--byzantine", type=float, default=0.1, help="fraction of poisoning clients (default 0.1)")
    running.add_argument("--attack", choices=CORRUPTIONS, default="norm")
    running.add_argument("--aggregations", nargs="+", default=["mean", "median", "trimmed-mean:0.2"])
    running.add_argument("--aggregation-counts", type=int, nargs="+", default=[50, 200, 1000])
    running.add_argument("--aggregation-memory-gib", type=float, default=16.0,
                         help="skip aggregation counts whose updates exceed this (default 16)")
    running.add_argument("--out", type=Path, help="bench/results/fleet_scale_<machine>_<model>.json (+ .png)")
    running.set_defaults(run=run)
    plotting = commands.add_parser("plot", help="draw the .png of a results JSON (beside it)")
    plotting.add_argument("json", type=Path)
    plotting.set_defaults(run=lambda a: plot(json.loads(a.json.read_text()), a.json.with_suffix(".png")) or 0)
    args = parser.parse_args(argv)
    from bench_results import out_error
    if out_error(getattr(args, "out", None)):
        parser.error(out_error(args.out))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

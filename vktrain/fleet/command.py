"""`vktrain federate STEP.pte --clients N --rounds R --local-steps K ...`: a federated fine-tuning run of
N simulated clients through Flower's simulation engine (Ray backend), or sequentially in this process
without Ray (`--engine sequential`, same strategy, messages and ClientApp; no concurrency).

Before anything runs: the arguments, every output path, the program (the server's runner loads it), the
split of --data (and --eval-data) into client shards, each checked to hold a batch (a held-out shard a
target); with --resume, the checkpoint against the program and the settings.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import re
import shlex
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

from vktrain.contract import ACCUMULATE_METHOD, ADAMW_DEFAULTS, PRECISION_AUTO, PRECISION_CHOICES
from vktrain.fleet.partition import PartitionError, PartitionScheme, write_shards
from vktrain.fleet import FEDAVG, STRATEGIES
from vktrain.fleet.checkpoint import FILE_NAME, FORMAT, checkpoint_path
from vktrain.train.outputs import (PEFT_DIRECTORY, PNG, Output, OutputKind, add_overwrite_argument, check_outputs,
                                   json_object, safetensors_metadata)
from vktrain.fleet.robust import DEFAULT_MAX_NORM_RATIO, Aggregation, parse_norm_ratio
from vktrain.train.data import DataError, TokenBatcher, default_dataset_path, load_data
from vktrain.train.interrupts import Interrupted, StopOnSignal, signal_name
from vktrain.train.train_loop import AdamWConfig, TrainConfigError, describe_program
from vktrain.backend.kernel_planning import plan_schedule

RAY, SEQUENTIAL = "ray", "sequential"
ENGINES = (RAY, SEQUENTIAL)


def add_federate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("program", metavar="STEP.pte", help="training-step program (vktrain export; for --strategy "
                                                            "ffa exported with --freeze-lora-a)")
    parser.add_argument("--clients", type=int, required=True, metavar="N", help="number of simulated clients")
    parser.add_argument("--fraction", type=float, default=1.0, metavar="F",
                        help="fraction of the clients sampled per round (at least one; default 1)")
    parser.add_argument("--rounds", type=int, required=True, metavar="R", help="federated rounds (a resumed run "
                                                                               "continues up to round R)")
    parser.add_argument("--local-steps", type=int, required=True, metavar="K", help="local AdamW steps per round")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per local AdamW step, accumulated on the client's device (default 1; "
                             "the program needs the accumulate method: vktrain export --grad-accum)")
    parser.add_argument("--strategy", choices=STRATEGIES, default=FEDAVG,
                        help="fedavg: FedAvg over lora_A and lora_B (FedIT); ffa: FFA-LoRA, lora_B only (the program "
                             "must be exported with --freeze-lora-a)")
    parser.add_argument("--data", metavar="FILE", help="training data, split into the client shards (any format "
                                                       "`vktrain train --data` reads; default: the built-in corpus)")
    parser.add_argument("--eval-data", metavar="FILE",
                        help="held-out data: its loss under the global adapters after every round (the server), "
                             "and split into the clients' local held-out shards for --fraction-evaluate")
    parser.add_argument("--eval-batches", type=int, metavar="N", help="global held-out loss on the first N batches")
    parser.add_argument("--fraction-evaluate", type=float, default=0.0, metavar="F",
                        help="fraction of the clients evaluating the global adapters on their held-out shard each "
                             "round (needs --eval-data; default 0)")
    parser.add_argument("--partition", default="iid", metavar="iid|dirichlet:ALPHA",
                        help="how documents are split among the clients (default iid)")
    parser.add_argument("--lr", type=float, default=1e-3, help="local AdamW learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=float, default=ADAMW_DEFAULTS["weight_decay"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the sampling and the data order")
    parser.add_argument("--json", metavar="FILE", help="write the per-round records as JSON (rewritten every round)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the global held-out and client losses per round")
    parser.add_argument("--out-adapters", metavar="DIR",
                        help="write the final global adapters in PEFT format (with FFA-LoRA, lora_A from the program)")
    parser.add_argument("--checkpoint", metavar="DIR", help="write the global adapters after every round (atomic)")
    parser.add_argument("--resume", action="store_true", help="continue the federation checkpointed in --checkpoint DIR")
    parser.add_argument("--engine", choices=ENGINES, default=RAY,
                        help="ray: Flower's simulation engine (default); sequential: the same rounds in this "
                             "process, one client after another, without Ray")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="CPUs Ray reserves per client (default 1)")
    parser.add_argument("--client-gpus", type=float, default=0.0,
                        help="GPUs Ray reserves per client, fractional (e.g. 0.1: ten clients share a GPU; default 0)")
    parser.add_argument("--ray-cpus", type=int, help="CPUs Ray may use (default: all of this machine's)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a round waits for its clients")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION_AUTO,
                        help="GEMM precision policy (docs/PRECISION.md; default auto: fp16-tc where the device has tensor cores)")
    parser.add_argument("--inject-failure", action="append", default=[], metavar="CLIENT:ROUND[:KIND]",
                        help="make client CLIENT misbehave in round ROUND (repeatable; to see failures tolerated): "
                             "KIND raise (default: fail after its first local step), kill (its process dies then; "
                             "with --engine sequential that is this process: a server crash mid-round), nan, shape "
                             "or norm (reply a NaN, wrong-shape or 1e6-norm update)")
    parser.add_argument("--aggregation", default="mean", metavar="mean|median|trimmed-mean[:FRACTION]",
                        help="how the accepted updates are combined: mean (num-examples-weighted, FedAvg; default), "
                             "coordinate-wise median, or coordinate-wise mean without the FRACTION (default 0.2) "
                             "smallest and largest values")
    parser.add_argument("--max-update-norm-ratio", default=str(DEFAULT_MAX_NORM_RATIO), metavar="R",
                        help="drop an update whose norm ||client - global|| exceeds R times the round's median "
                             f"update norm (default {DEFAULT_MAX_NORM_RATIO:g}; inf: no bound)")
    parser.add_argument("--min-clients", type=int, default=1, metavar="M",
                        help="a round changes the global adapters only with at least M accepted updates (default 1)")
    parser.add_argument("--verbose", action="store_true", help="show Flower's and Ray's own log")
    add_overwrite_argument(parser)
    return parser


def check_grad_accum(grad_accum: int, method_names: list[str], program: str) -> None:
    """--grad-accum N > 1 needs the program's accumulate method (`federate` and `fleet server`)."""
    if grad_accum > 1 and ACCUMULATE_METHOD not in method_names:
        raise TrainConfigError(f"--grad-accum {grad_accum}: {program} has no {ACCUMULATE_METHOD!r} method; export "
                               f"it with vktrain export --grad-accum")


def _failures(items: list[str]) -> frozenset:
    from vktrain.fleet.faults import parse_failures

    return parse_failures(items)


def check_arguments(args: argparse.Namespace) -> None:
    for flag, value in (("--clients", args.clients), ("--rounds", args.rounds), ("--local-steps", args.local_steps),
                        ("--grad-accum", args.grad_accum)):
        if value < 1:
            raise TrainConfigError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--fraction", args.fraction), ("--fraction-evaluate", args.fraction_evaluate)):
        if not 0.0 <= value <= 1.0:
            raise TrainConfigError(f"{flag} must lie in [0, 1], got {value}")
    if args.fraction == 0.0:
        raise TrainConfigError("--fraction must be > 0 (at least one client trains each round)")
    if args.fraction_evaluate and not args.eval_data:
        raise TrainConfigError("--fraction-evaluate needs --eval-data FILE (the clients' held-out shards)")
    if args.resume and not args.checkpoint:
        raise TrainConfigError("--resume needs --checkpoint DIR (the federation to continue)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise TrainConfigError(f"--lr must be a positive number, got {args.lr}")
    if not (0 <= args.seed < 2**32):
        raise TrainConfigError(f"--seed must lie in [0, 2**32), got {args.seed}")
    if args.client_cpus <= 0 or args.client_gpus < 0:
        raise TrainConfigError(f"--client-cpus must be > 0 and --client-gpus >= 0, got {args.client_cpus}, "
                               f"{args.client_gpus}")
    for item in _failures(args.inject_failure):
        if item[0] >= args.clients:
            raise TrainConfigError(f"--inject-failure {item[0]}:{item[1]}: there are clients 0..{args.clients - 1}")
        _check_injected_kind(args, *item)
    Aggregation.parse(args.aggregation)
    parse_norm_ratio(args.max_update_norm_ratio)
    if args.min_clients < 1:
        raise TrainConfigError(f"--min-clients must be >= 1, got {args.min_clients}")


def _check_injected_kind(args: argparse.Namespace, client: int, server_round: int, kind: str) -> None:
    from vktrain.fleet.faults import CORRUPTIONS

    where = f"--inject-failure {client}:{server_round}:{kind}"
    if kind not in CORRUPTIONS and args.local_steps < 2:
        raise TrainConfigError(f"{where} fails after the first local step: it needs --local-steps >= 2")


def shards_fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def program_adapter_record(runner, program: str):
    """What the program records about its adapters, checked to be enough for a PEFT adapter_config.json."""
    from vktrain.train.adapters import ProgramAdapters

    recorded = ProgramAdapters.from_metadata(describe_program(runner).metadata, program)
    if recorded.lora_alpha is None:
        raise TrainConfigError(f"--out-adapters: {program} does not record its LoRA alpha (exported by an older "
                               f"vktrain); use vktrain train --out-adapters --lora-alpha with the checkpoint")
    return recorded


def write_adapters(runner, program: str, arrays: dict[str, np.ndarray], directory: str) -> None:
    """The global adapters (and the program's frozen lora_A, for FFA-LoRA) as a PEFT adapter directory."""
    from vktrain.train.adapters import adapters_from_state, frozen_lora_tensors, save_adapters

    recorded = program_adapter_record(runner, program)
    adapters = adapters_from_state({**frozen_lora_tensors(runner.graph), **arrays})
    recorded.check_layers(adapters, program)
    save_adapters(directory, adapters, recorded.lora_alpha, recorded.base_model or recorded.source_model,
                  recorded.target_modules)


def prepare_shards(runner, data: Path, eval_data: Path | None, n_clients: int, scheme: PartitionScheme, seed: int,
                   directory: Path) -> tuple[list[Path], list[Path]]:
    """The client shards of the training and held-out data, each checked to be usable."""
    from vktrain.serialization.tokenizer import program_tokenizer

    info = describe_program(runner)
    tokenizer = program_tokenizer(runner, str(data))
    options = dict(vocab_size=info.vocab_size, tokenizer=tokenizer, unit_tokens=info.seq_len + 1)
    train = write_shards(data, directory, n_clients, scheme, seed, min_documents=info.batch_size, prefix="train",
                         **options)
    for client, shard in enumerate(train):
        shard_data = load_data(shard, info.vocab_size, tokenizer)
        try:
            TokenBatcher(shard_data.tokens, info.batch_size, info.seq_len, labels=shard_data.labels, source=str(shard))
        except DataError as exc:
            raise PartitionError(f"client {client}'s shard of {data} is too small ({exc}); use fewer clients, a "
                                 f"larger Dirichlet ALPHA or more data") from None
    held_out = [] if eval_data is None else write_shards(eval_data, directory, n_clients, scheme, seed,
                                                         prefix="heldout", **options)
    return train, held_out


# What federate writes: --json the per-round records, --checkpoint DIR the global adapters after a round.
ROUND_RECORDS = OutputKind("vktrain federate's JSON records", json_object("settings", "rounds"))
FEDERATION_CHECKPOINT = OutputKind(
    "a federation checkpoint", lambda path: safetensors_metadata(checkpoint_path(path)).get("format") == FORMAT,
    directory=True, writes=(FILE_NAME,), holds_a_run=True)


def check_federate_outputs(args: argparse.Namespace) -> None:
    """Every output (vktrain.train.outputs' rules); --checkpoint DIR with --resume continues its federation."""
    check_outputs([Output("--checkpoint", args.checkpoint, FEDERATION_CHECKPOINT,
                          continues=args.checkpoint if args.resume else None),
                   Output("--json", args.json, ROUND_RECORDS), Output("--plot", args.plot, PNG),
                   Output("--out-adapters", args.out_adapters, PEFT_DIRECTORY)],
                  inputs=[("the program", args.program), ("--data", args.data), ("--eval-data", args.eval_data)],
                  overwrite=args.overwrite)


def run_federate(args: argparse.Namespace) -> int:
    """0 when the rounds ran; a signal (Ctrl-C, SIGTERM) abandons the round in flight and ends in
    Interrupted (exit 130 / 143) after saying which round the checkpoint holds and how to resume."""
    server: list = []  # the FederationServer, once made: what an interrupted run kept
    with StopOnSignal("federate"):
        try:
            return _run_federate(args, server)
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            if server:
                server[0].stopped = True  # a round finishing in Flower's server thread now saves nothing
            _report_interrupt(args, server[0].result.records if server else [], signal_name(signum))
            if args.engine == RAY and server:
                # Flower's ServerApp thread (not a daemon) waits for the abandoned round's replies up to
                # --timeout, and would hold the process that long; Ray itself is already shut down.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(Interrupted(signum).exit_code)
            raise Interrupted(signum, reported=True) from None


def _report_interrupt(args: argparse.Namespace, records: list[dict], name: str) -> None:
    """What a signal left of the federation: the checkpointed round and the command that continues it."""
    rounds = [r["round"] for r in records]
    lines = [f"vktrain federate: stopped by {name}" + (f" after round {rounds[-1]} of {args.rounds} (the round in "
                                                       f"flight abandoned)" if rounds else " before round 1")]
    if args.checkpoint and rounds:
        argv = [a for a in (getattr(args, "command_line", None) or sys.argv[1:]) if a != "--resume"]
        lines.append(f"saved checkpoint {args.checkpoint} (round {rounds[-1]}); resume with:")
        lines.append(f"  {shlex.join(['vktrain', *argv, '--resume'])}")
    elif not args.checkpoint:
        lines.append("nothing to resume from was saved: pass --checkpoint DIR to keep every round's adapters "
                     "(and --resume to continue)")
    if args.json and rounds:
        lines.append(f"saved records {args.json} (rounds {rounds[0]}..{rounds[-1]})")
    if args.plot and len(records) > 1:
        from vktrain.fleet.report import plot_rounds

        plot_rounds(records, args.plot, title=f"vktrain federate {Path(args.program).name} (interrupted)")
        lines.append(f"saved plot {args.plot}")
    if args.out_adapters:
        lines.append(f"not written: --out-adapters {args.out_adapters} (the federation did not finish)")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _run_federate(args: argparse.Namespace, server_made: list) -> int:
    check_arguments(args)
    scheme = PartitionScheme.parse(args.partition)
    program = Path(args.program)
    if not program.is_file():
        raise TrainConfigError(f"program {program} does not exist (or is not a file)")
    check_federate_outputs(args)
    from vktrain.runtime.program.runner import TrainingRunner  # opens Vulkan

    data = Path(args.data) if args.data else default_dataset_path()
    with TrainingRunner.from_pte(program, planner=plan_schedule, precision=args.precision) as runner, \
            tempfile.TemporaryDirectory(prefix="vktrain-federate-") as work:
        check_grad_accum(args.grad_accum, runner.pte.method_names, args.program)
        if args.out_adapters:
            program_adapter_record(runner, args.program)  # refused now, not after the rounds
        train_shards, held_out_shards = prepare_shards(runner, data, Path(args.eval_data) if args.eval_data else None,
                                                       args.clients, scheme, args.seed, Path(work))
        result = _federate(args, runner, program, scheme, train_shards, held_out_shards, server_made)
        if args.out_adapters:
            write_adapters(runner, args.program, result.arrays, args.out_adapters)
    records = result.records
    if args.plot and len(records) > 1:
        from vktrain.fleet.report import plot_rounds

        plot_rounds(records, args.plot, title=f"vktrain federate {program.name} ({args.strategy}, {args.clients} clients)")
    print(summarize(records, result.resumed_from))
    for label, value in (("checkpoint", args.checkpoint), ("records", args.json), ("plot", args.plot),
                         ("adapters", args.out_adapters)):
        if value:
            print(f"{label}: {value}")
    return 0


def _federate(args, runner, program: Path, scheme: PartitionScheme, train_shards: list[Path],
              held_out_shards: list[Path], server_made: list):
    from vktrain.fleet.client import ClientSettings, make_client_app
    from vktrain.fleet.server import FederationServer, FederationSettings, make_server_app

    settings = FederationSettings(
        program=str(program), strategy=args.strategy, n_clients=args.clients, rounds=args.rounds,
        local_steps=args.local_steps, grad_accum=args.grad_accum, fraction=args.fraction, fraction_evaluate=args.fraction_evaluate, lr=args.lr,
        optimizer=AdamWConfig(weight_decay=args.weight_decay), seed=args.seed, partition=str(scheme),
        data_fingerprint=shards_fingerprint(train_shards), eval_data=args.eval_data, eval_batches=args.eval_batches,
        checkpoint_dir=args.checkpoint, resume=args.resume, json_path=args.json, precision=args.precision,
        timeout=args.timeout, engine=args.engine, aggregation=str(Aggregation.parse(args.aggregation)),
        max_norm_ratio=parse_norm_ratio(args.max_update_norm_ratio), min_clients=args.min_clients)
    client_settings = ClientSettings(str(program.absolute()), tuple(str(p) for p in train_shards),
                                     tuple(str(p) for p in held_out_shards), args.seed, args.precision,
                                     _failures(args.inject_failure))
    if not args.verbose:  # after Flower's import, which sets its logger up
        quiet_flower_and_ray()
    server = FederationServer(settings, runner)
    server_made.append(server)
    client_app = make_client_app(client_settings)
    print(f"{program}: {args.clients} clients ({scheme}), {args.strategy}, fraction {args.fraction:g}, "
          f"{args.local_steps} local step(s) per round, rounds up to {args.rounds}; engine {args.engine}",
          file=sys.stderr)
    if args.engine == SEQUENTIAL:
        from vktrain.fleet.client import close_trainers
        from vktrain.fleet.sequential import SequentialGrid

        try:
            server.run(SequentialGrid(client_app, args.clients))
        finally:
            close_trainers()
    else:
        from flwr.simulation import run_simulation

        # max_restarts: Ray restarts a client process that died (Flower 1.42's actor pool would otherwise
        # keep handing the dead actor messages, failing every client it is given for the rest of the run);
        # max_task_retries: a message sent to it while it restarts is run once more (clients are stateless, so
        # a retry gives the same reply), and the one that killed it too: a client that dies twice has failed.
        resources = {"num_cpus": args.client_cpus, "num_gpus": args.client_gpus, "max_restarts": -1,
                     "max_task_retries": 1}
        # Without --verbose the workers' output (each client's device line, Ray's colour-coded prefixes) stays
        # in Ray's logs; a client's failure is recorded and printed with its round either way.
        init = {"include_dashboard": False, "logging_level": logging.WARNING if not args.verbose else logging.INFO,
                "log_to_driver": args.verbose}
        if args.ray_cpus:
            init["num_cpus"] = args.ray_cpus
        run_simulation(server_app=make_server_app(server), client_app=client_app, num_supernodes=args.clients,
                       backend_config={"client_resources": resources, "init_args": init},
                       verbose_logging=args.verbose)
    return server.result


# What Flower and Ray print although nothing is wrong (shown with --verbose): Flower's deprecation notice
# for run_simulation and its note that federated evaluation is off at --fraction-evaluate 0 (WARNING
# records); its two colour-coded tracebacks of a failed client, a failure the round tolerates and prints
# with its reason, and the traceback of a killed client's Ray actor (ActorUnavailableError when Ray sees the
# socket close before the death; the line naming the actor stays); Ray's tip about a future default for
# accelerator variables.
RAY_NOISE_WARNING = r"Tip: In future versions of Ray"
_CLIENT_FAILURE_LOG = re.compile(r"An exception was raised when processing a message by|ClientAppException"
                                 r"|^Traceback \(most recent call last\):.*\bray\.exceptions\.Actor(Unavailable|Died)Error",
                                 re.DOTALL)


class _DropClientFailureTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _CLIENT_FAILURE_LOG.search(record.getMessage())


def quiet_flower_and_ray() -> None:
    """Flower's log down to its errors but a tolerated client's, and Ray's known FutureWarning off."""
    import warnings

    flower = logging.getLogger("flwr")
    flower.setLevel(logging.ERROR)
    if not any(isinstance(f, _DropClientFailureTracebacks) for f in flower.filters):
        flower.addFilter(_DropClientFailureTracebacks())
    warnings.filterwarnings("ignore", message=RAY_NOISE_WARNING, category=FutureWarning)


def summarize(records: list[dict], resumed_from: int | None = None) -> str:
    """One line on the rounds this run trained (after `resumed_from`, the checkpoint's round)."""
    trained = [r for r in records if r["round"] > (resumed_from or 0)]
    if not trained:
        return f"nothing to do (the federation had already reached round {resumed_from})"
    failed = sum(len(r["failed"]) + len(r.get("dropped", {})) for r in trained)
    before = next(r for r in records if r["round"] == trained[0]["round"] - 1).get("global_eval_loss")
    after = trained[-1].get("global_eval_loss")
    text = f"federated rounds {trained[0]['round']}..{trained[-1]['round']}"
    if before is not None and after is not None:
        text += f": global held-out loss {before:.4f} -> {after:.4f}"
    return text + f"; {failed} client failure(s) or dropped update(s) tolerated"


__all__ = ["ENGINES", "add_federate_arguments", "check_arguments", "check_grad_accum", "prepare_shards", "run_federate",
           "summarize", "write_adapters"]

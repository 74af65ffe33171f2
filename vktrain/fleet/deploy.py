"""vktrain's ServerApp and ClientApp on Flower's deployment engine (`vktrain fleet server` / `fleet node`;
vktrain/fleet/deployment.py starts the processes).

The SuperLink runs `server_app` in a `flwr-serverapp` process with the run config of `vktrain fleet server`
(the options of `federate`, below); each SuperNode runs `client_app` in a `flwr-clientapp` process per
message, with its node config: `program` (the node's copy of the training step), `data` (its own data
file), `partition-id` (its index: the server samples and orders clients by it), `progress` (a folder where
the ClientApp records each message it answered: vktrain/fleet/node_progress.py). The apps are the
simulation's: FederationServer (screening, aggregation, checkpoints, records) and make_client_app.
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from vktrain.fleet.client import CONFIG, PARTITION_ID
from vktrain.fleet.node_progress import PROGRESS_KEY, train_due_after, write_progress
from vktrain.backend.kernel_planning import plan_schedule

# Run config keys of the ServerApp and their defaults (TOML values: "" stands for unset).
RUN_CONFIG = {"program": "", "nodes": 1, "rounds": 1, "local-steps": 1, "grad-accum": 1, "lr": 1e-3, "fraction": 1.0,
              "strategy": "fedavg", "seed": 0, "eval-data": "", "eval-batches": 0, "json": "", "checkpoint": "",
              "resume": False, "aggregation": "mean", "max-update-norm-ratio": "10", "min-clients": 1,
              "timeout": 3600.0, "precision": "auto", "outcome": ""}

server_app = ServerApp()
client_app = ClientApp()


def federation_settings(config: dict):
    from vktrain.fleet.robust import Aggregation, parse_norm_ratio
    from vktrain.fleet.server import FederationSettings

    c = {**RUN_CONFIG, **config}
    return FederationSettings(
        program=str(c["program"]), strategy=str(c["strategy"]), n_clients=int(c["nodes"]), rounds=int(c["rounds"]),
        local_steps=int(c["local-steps"]), grad_accum=int(c["grad-accum"]), fraction=float(c["fraction"]), lr=float(c["lr"]), seed=int(c["seed"]),
        partition="nodes", eval_data=str(c["eval-data"]) or None, eval_batches=int(c["eval-batches"]) or None,
        checkpoint_dir=str(c["checkpoint"]) or None, resume=bool(c["resume"]), json_path=str(c["json"]) or None,
        precision=str(c["precision"]), timeout=float(c["timeout"]), engine="deployment",
        aggregation=str(Aggregation.parse(str(c["aggregation"]))),
        max_norm_ratio=parse_norm_ratio(str(c["max-update-norm-ratio"])), min_clients=int(c["min-clients"]))


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    from vktrain.fleet.server import FederationServer
    from vktrain.runtime.program.runner import TrainingRunner

    from vktrain.fleet.command import summarize
    from vktrain.train.checkpoint import atomic_write_json

    config = dict(context.run_config)
    settings = federation_settings(config)
    with TrainingRunner.from_pte(settings.program, planner=plan_schedule, precision=settings.precision) as runner:
        result = FederationServer(settings, runner).run(grid)
    summary = summarize(result.records, result.resumed_from)
    print(summary, flush=True)
    if config.get("outcome"):  # `vktrain fleet server` learns the rounds completed from it (flwr run's exit does not say)
        atomic_write_json(str(config["outcome"]), {"completed": True, "summary": summary})


_APPS: dict = {}


def _node_app(context: Context) -> ClientApp:
    """The simulation's ClientApp over this node's program and data (one per process and node config)."""
    from vktrain.fleet.client import ClientSettings, make_client_app

    config = context.node_config
    partition, program, data = int(config[PARTITION_ID]), str(config["program"]), str(config["data"])
    key = (partition, program, data, str(config.get("precision", "auto")))
    if key not in _APPS:
        shards = tuple(data if p == partition else "" for p in range(partition + 1))  # indexed by partition id
        _APPS[key] = make_client_app(ClientSettings(program, shards, seed=int(config.get("seed", 0)),
                                                    precision=key[3]))
    return _APPS[key]


def _answer(message: Message, context: Context, server_round: int) -> Message:
    try:
        return _node_app(context)(message, context)
    finally:  # answered or failed, this round's message has come: `vktrain fleet node` learns what is still due
        if context.node_config.get(PROGRESS_KEY):
            config, partition = {**RUN_CONFIG, **context.run_config}, int(context.node_config[PARTITION_ID])
            write_progress(str(context.node_config[PROGRESS_KEY]), message.metadata.run_id, server_round,
                           int(config["rounds"]), last=not train_due_after(partition, server_round, config))


@client_app.query()
def query(message: Message, context: Context) -> Message:
    return _answer(message, context, 0)  # the start-up query, before round 1


@client_app.train()
def train(message: Message, context: Context) -> Message:
    return _answer(message, context, int(message.content[CONFIG]["server-round"]))


__all__ = ["RUN_CONFIG", "client_app", "federation_settings", "server_app"]

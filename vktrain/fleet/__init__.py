"""Fleet fine-tuning on Flower: many clients train one vktrain step on their own data, a server averages
their adapters (`vktrain federate`).

  client.py      the ClientApp around TrainingRunner (torch-free, like vktrain/train)
  arrays.py      adapters in Flower's ArrayRecords: Flower's .npy bytes, made and read without np.save/np.load
  strategy.py    FedAvg (FedIT: lora_A and lora_B) / FFA-LoRA (lora_B only) with seeded sampling
  robust.py      every update screened (names, shapes, finite, norm vs the round's median); mean, median,
                 trimmed mean
  faults.py      clients misbehaving on purpose (--inject-failure: raise, kill, nan, shape, norm)
  server.py      the ServerApp: handshake, Flower's strategy loop, global held-out loss, records
  checkpoint.py  the global adapters after every round, atomic, resumable
  partition.py   client shards: iid or Dirichlet over documents
  sequential.py  the same rounds without Ray (a Grid delivering messages in this process)
  command.py     the `vktrain federate` command
  deploy.py      the ServerApp and ClientApp on Flower's deployment engine (run config / node config)
  deployment.py  `vktrain fleet certs|server|node`: SuperLink and SuperNodes with TLS and node authentication
  supernode.py   a node's flower-supernode in its own process group: output watched, stopped with all it started
  node_progress.py  what a node's ClientApp has answered: whether a train message is still due to it
"""
import os

# Flower reads these when first imported: no telemetry from vktrain's runs (the machines may have no network).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The strategies (vktrain/fleet/strategy.py): FedAvg over lora_A and lora_B (FedIT), FFA-LoRA over lora_B.
FEDAVG = "fedavg"
FFA = "ffa"
STRATEGIES = (FEDAVG, FFA)

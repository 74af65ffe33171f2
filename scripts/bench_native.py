#!/usr/bin/env python
"""The native runtime (vktrain-train, native/) against the Python runtime on the same .pte, in one run (issue 26):
ms/step (median), host time per step (wall minus the GPU's time), peak host RSS of vktrain-train, and whether
both give the same losses, per model and per embedded schedule (fp32 `desktop-gpu`, fp16-tc `nvidia-coopmat`).

    # here (executorch, a compiler): the steps with synthetic constants and both schedules, and the trainer
    python scripts/bench_step.py export --model smollm2-135m --shapes 1x512 --target desktop-gpu,nvidia-coopmat \\
        --out-dir build/bench_native --prefix smollm2-135m
    python scripts/bench_step.py export --shapes 1x128 --target desktop-gpu,nvidia-coopmat \\
        --out-dir build/bench_native --prefix llama-3.2-1b
    bash scripts/native_build.sh && python scripts/bench_native.py stage     # the trainer, stripped, its ldd checked
    # the GPU machine (numpy, the vulkan binding; no executorch, no compiler), carrying build/bench_native:
    python3 scripts/bench_native.py run build/bench_native/*.pte --machine h100
    python scripts/bench_native.py plot bench/results/native_<machine>_<model>.json      # again here, if it drew none there

run: per .pte (its model from the blob's bench_config) and per schedule it embeds, first the Python runtime
(TrainingRunner; the desktop-gpu schedule through VKTRAIN_DEVICE_PROFILE=desktop-gpu, since the matching rule takes
the tensor-core one where the device has tensor cores; the runner's chosen profile is checked), then vktrain-train
--schedule-profile NAME on the same token file, batches, constant learning rate and AdamW. Each side: --warmup
steps, then --steps timed. Wall time per step is the runtime's own (runner.step; the trainer's per-step record);
the GPU's time comes from timestamps: the native trainer writes two around the step's command buffer, the Python
runtime one pair per dispatch (their sum: gaps between dispatches count as host time there, so its host time is an
upper bound). Memory: peak RSS is vktrain-train's getrusage maximum (a high-water mark of the whole resident set).
Its parts are sampled from /proc/self/smaps after loading, after the run starts, after the last step and at the end:
the .pte's resident file pages (the file is mapped; synthetic constants are generated in 16 MiB pieces, never
whole), the resident pages of device memory mapped into the process (vkMapMemory's ranges, /dev/nvidia* and
/dev/dri/* mappings: on a GPU whose device-local memory is host-visible, resizable BAR, and on lavapipe, the
constants written through the mapping count in RSS), and host RSS = the rest; `host_rss_mb` is the largest host
part of the samples (taken at those points, not a high-water mark). Goals (issue 26): host time < 0.2 ms/step,
host RSS (beyond the mapped constants and device memory) < 100 MB. Writes bench/results/native_<machine>_<model>.json
and a plot beside it (matplotlib, where installed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

STAGE_DIR = REPO_ROOT / "build" / "bench_native"
PROFILES = ("desktop-gpu", "nvidia-coopmat")  # fp32, fp16-tc (the order of the report)
LR = 1e-4
ADAMW = (0.9, 0.999, 1e-8, 0.0)  # beta1, beta2, eps, weight_decay
DATA_SEED = 0
GOAL_HOST_MS, GOAL_RSS_MB = 0.2, 100.0


def bench_config(pte: Path) -> dict:
    """The BenchConfig bench_step.py export stored in the blob, and the embedded schedules' profile names."""
    from vktrain.serialization import deserialize_blob
    from vktrain.serialization.pte import PteFile

    graph = deserialize_blob(PteFile.load(pte).execution_plan("forward").delegates[0].data)
    config = json.loads(graph.metadata.get("bench_config", "{}"))
    config["profiles"] = [embedded.profile.name for embedded in graph.schedules]
    return config


def model_name(config: dict, pte: Path) -> str:
    model = config.get("model", {})
    return "smollm2-135m" if model.get("dim") == 576 else config.get("preset") or pte.stem


def token_file(folder: Path, vocab: int, count: int) -> Path:
    path = folder / "tokens.npy"
    np.save(path, np.random.default_rng(DATA_SEED).integers(0, vocab, size=count).astype(np.int32))
    return path


def run_python(pte: Path, profile: str, tokens: Path, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """The Python runtime on `profile`'s embedded schedule: losses, wall and GPU seconds per timed step."""
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.train.data import TokenBatcher, load_tokens

    emulate = profile != "nvidia-coopmat"  # the matching rule prefers tensor cores: ask for the other explicitly
    saved = os.environ.get("VKTRAIN_DEVICE_PROFILE")
    if emulate:
        os.environ["VKTRAIN_DEVICE_PROFILE"] = profile
    try:
        start = time.perf_counter()
        runner = TrainingRunner.from_pte(pte)
        load_s = time.perf_counter() - start
    finally:
        if emulate:
            os.environ.pop("VKTRAIN_DEVICE_PROFILE", None)
            if saved is not None:
                os.environ["VKTRAIN_DEVICE_PROFILE"] = saved
    with runner:
        chosen = runner.target.profile.name if runner.target is not None else "planned at load"
        if chosen != profile:
            return {"skipped": f"the Python runtime chose {chosen!r} on {runner.device.name}"}
        batches = TokenBatcher(load_tokens(tokens), batch, seq, seed=DATA_SEED)
        hparams = np.array([LR, *ADAMW], dtype=np.float32)
        losses, wall, gpu = [], [], []
        for t in range(warmup + steps):
            token_ids, labels = batches.batch(t)
            begin = time.perf_counter()
            losses.append(runner.step(token_ids, labels, hparams))
            elapsed = time.perf_counter() - begin
            if t >= warmup:
                wall.append(elapsed)
                timings = runner.timings()
                if timings:
                    gpu.append(sum(seconds for _, seconds in timings))
        device = runner.device.name
    return dict(summarize(wall, gpu), device=device, load_s=load_s, losses=[float(x) for x in losses],
                gpu_timing="sum of per-dispatch timestamps")


def run_native(trainer: Path, pte: Path, profile: str, tokens: Path, warmup: int, steps: int, folder: Path) -> dict:
    records, summary = folder / f"native_{profile}.json", folder / f"native_{profile}_summary.json"
    command = [str(trainer), str(pte), "--data", str(tokens), "--steps", str(warmup + steps), "--lr", repr(LR),
               "--schedule", "constant", "--beta1", repr(ADAMW[0]), "--beta2", repr(ADAMW[1]), "--eps", repr(ADAMW[2]),
               "--weight-decay", repr(ADAMW[3]), "--seed", str(DATA_SEED), "--schedule-profile", profile,
               "--json", str(records), "--summary-json", str(summary), "--no-progress", "--log-every", "0"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    total_s = time.perf_counter() - start
    if result.returncode != 0:
        return {"skipped": f"vktrain-train exited {result.returncode}: {result.stderr.strip()[-600:]}"}
    steps_done = json.loads(records.read_text())[warmup:]
    info = json.loads(summary.read_text())
    wall = [r["seconds"] for r in steps_done]
    gpu = [r["gpu_seconds"] for r in steps_done if r["gpu_seconds"] > 0]
    pte_bytes = pte.stat().st_size
    memory = {"host_rss_mb": None, "pte_resident_mb": None, "device_resident_mb": None, "host_rss_at": None,
              "rss_samples": info.get("rss_samples", [])}
    if info.get("host_rss_bytes") is not None:  # null where the trainer could not read /proc/self/smaps
        memory.update(host_rss_mb=info["host_rss_bytes"] / 1e6, pte_resident_mb=info["pte_resident_bytes"] / 1e6,
                      device_resident_mb=info["device_resident_bytes"] / 1e6, host_rss_at=info["host_rss_at"])
    return dict(summarize(wall, gpu), device=info["device"], schedule=info["schedule"], process_s=total_s,
                losses=[r["loss"] for r in json.loads(records.read_text())], peak_rss_mb=info["peak_rss_bytes"] / 1e6,
                pte_mb=pte_bytes / 1e6, rss_beyond_mapped_mb=(info["peak_rss_bytes"] - pte_bytes) / 1e6, **memory,
                host_rss_goal_met=None if memory["host_rss_mb"] is None else memory["host_rss_mb"] < GOAL_RSS_MB,
                buffer_mb=info["buffer_bytes"] / 1e6, dispatches=info["dispatches"], barriers=info["barriers"],
                gpu_timing="timestamps around the step's command buffer", stdout=result.stdout.strip()[-400:])


def summarize(wall: list[float], gpu: list[float]) -> dict:
    out = {"steps_timed": len(wall), "ms_per_step": 1e3 * statistics.median(wall),
           "ms_per_step_min": 1e3 * min(wall), "gpu_ms_per_step": None, "host_ms_per_step": None}
    if gpu and len(gpu) == len(wall):
        out["gpu_ms_per_step"] = 1e3 * statistics.median(gpu)
        out["host_ms_per_step"] = 1e3 * statistics.median(w - g for w, g in zip(wall, gpu))
    return out


def same_losses(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(np.float32(x).tobytes() == np.float32(y).tobytes() for x, y in zip(a, b))


def run_command(args) -> int:
    trainer = Path(args.trainer)
    if not trainer.is_file():
        print(f"bench_native run: error: --trainer {trainer} does not exist (python scripts/bench_native.py stage)",
              file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for pte in map(Path, args.pte):
        config = bench_config(pte)
        model, batch, seq = model_name(config, pte), config["batch"], config["seq"]
        report = {"model": model, "pte": pte.name, "batch": batch, "seq": seq, "machine": args.machine,
                  "host": platform.node(), "warmup": args.warmup, "steps": args.steps, "lr": LR, "adamw": ADAMW,
                  "goals": {"host_ms_per_step": GOAL_HOST_MS, "host_rss_mb": GOAL_RSS_MB}, "runs": {}}
        with tempfile.TemporaryDirectory() as folder:
            tokens = token_file(Path(folder), config["model"]["vocab_size"], batch * seq * (args.warmup + args.steps + 2) + 1)
            for profile in (p for p in args.profiles if p in config["profiles"]):
                print(f"{model} {batch}x{seq} {profile}: Python runtime ...", flush=True)
                python = run_python(pte, profile, tokens, batch, seq, args.warmup, args.steps)
                print(f"{model} {batch}x{seq} {profile}: vktrain-train ...", flush=True)
                native = run_native(trainer, pte, profile, tokens, args.warmup, args.steps, Path(folder))
                entry = {"python": python, "native": native}
                if "losses" in python and "losses" in native:
                    entry["losses_bit_identical"] = same_losses(python["losses"], native["losses"])
                    entry["max_rel_loss_diff"] = max(abs(a - b) / max(abs(a), 1e-30)
                                                     for a, b in zip(python["losses"], native["losses"]))
                report["runs"][profile] = entry
                print_entry(model, profile, entry)
        path = args.out_dir / f"native_{args.machine}_{model}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        written.append(path)
        print(f"wrote {path}")
    if not args.no_plot:
        plot(written)
    return 0


def print_entry(model: str, profile: str, entry: dict) -> None:
    for side in ("python", "native"):
        r = entry[side]
        if "skipped" in r:
            print(f"  {side:6s} skipped: {r['skipped']}")
            continue
        host = f"{r['host_ms_per_step']:.3f}" if r["host_ms_per_step"] is not None else "n/a"
        print(f"  {side:6s} {r['ms_per_step']:.2f} ms/step, host {host} ms/step")
        if side == "native":
            print(f"         peak RSS {r['peak_rss_mb']:.0f} MB ({r['rss_beyond_mapped_mb']:.0f} beyond the .pte's size); "
                  + memory_line(r))
    if "losses_bit_identical" in entry:
        print(f"  losses bit-identical: {entry['losses_bit_identical']} (max rel diff {entry['max_rel_loss_diff']:.2e})")


def memory_line(r: dict) -> str:
    if r.get("host_rss_mb") is None:
        return "host RSS unknown (no /proc/self/smaps)"
    verdict = "met" if r["host_rss_mb"] < GOAL_RSS_MB else "missed"
    return (f"host RSS {r['host_rss_mb']:.1f} MB at {r['host_rss_at']} (goal < {GOAL_RSS_MB:.0f} MB: {verdict}), "
            f"besides {r['pte_resident_mb']:.1f} MB of the .pte and {r['device_resident_mb']:.1f} MB of device memory resident")


def plot(paths: list[Path]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (run `bench_native.py plot` where it is installed)")
        return
    for path in paths:
        report = json.loads(Path(path).read_text())
        labels, bars = [], {"python": [], "native": []}
        hosts = {"python": [], "native": []}
        for profile, entry in report["runs"].items():
            labels.append(profile)
            for side in bars:
                r = entry[side]
                bars[side].append(r.get("ms_per_step", 0.0) if "skipped" not in r else 0.0)
                hosts[side].append((r.get("host_ms_per_step") or 0.0) if "skipped" not in r else 0.0)
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        x = np.arange(len(labels))
        for offset, side in ((-0.2, "python"), (0.2, "native")):
            left.bar(x + offset, bars[side], 0.4, label=side)
            right.bar(x + offset, hosts[side], 0.4, label=side)
        right.axhline(GOAL_HOST_MS, color="k", linestyle="--", linewidth=1, label=f"goal {GOAL_HOST_MS} ms")
        for axis, title in ((left, "ms / step (median)"), (right, "host ms / step (wall - GPU)")):
            axis.set_xticks(x, labels)
            axis.set_title(title)
            axis.legend()
        fig.suptitle(f"{report['model']} {report['batch']}x{report['seq']} on {report['machine']}: native vs Python runtime")
        fig.tight_layout()
        out = Path(path).with_suffix(".png")
        fig.savefig(out, dpi=100)
        plt.close(fig)
        print(f"wrote {out}")


def stage_command(args) -> int:
    """Copy build/native's vktrain-train, stripped, into build/bench_native and check it needs only libraries the
    GPU machine has (glibc, libstdc++, libgcc, libm, libvulkan)."""
    source = REPO_ROOT / "build" / "native" / "vktrain-train"
    if not source.is_file():
        print("bench_native stage: error: build/native/vktrain-train is missing (bash scripts/native_build.sh)", file=sys.stderr)
        return 2
    STAGE_DIR.mkdir(parents=True, exist_ok=True)
    target = STAGE_DIR / "vktrain-train"
    shutil.copy2(source, target)
    if shutil.which("strip"):
        subprocess.run(["strip", str(target)], check=True)
    needed = subprocess.run(["ldd", str(target)], capture_output=True, text=True).stdout
    print(needed.strip())
    allowed = ("linux-vdso", "libvulkan.so", "libstdc++.so", "libm.so", "libgcc_s.so", "libc.so", "ld-linux")
    extra = [line.split()[0] for line in needed.splitlines()
             if line.strip() and not Path(line.split()[0]).name.startswith(allowed)]
    if extra:
        print(f"bench_native stage: error: vktrain-train needs {extra}, which the GPU machine may lack", file=sys.stderr)
        return 1
    print(f"staged {target} ({target.stat().st_size / 1e6:.1f} MB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="time both runtimes on each .pte (the GPU machine)")
    run.add_argument("pte", nargs="+", help=".pte files of `bench_step.py export --target desktop-gpu,nvidia-coopmat`")
    run.add_argument("--trainer", default=str(STAGE_DIR / "vktrain-train"), help="vktrain-train (default: the staged one)")
    run.add_argument("--machine", default="gpu", help="names the results: native_<machine>_<model>.json")
    run.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--steps", type=int, default=20, help="timed steps per runtime and schedule (median reported)")
    run.add_argument("--no-plot", action="store_true")
    run.add_argument("--profiles", type=lambda text: [p.strip() for p in text.split(",") if p.strip()],
                     default=list(PROFILES), help="the embedded schedules to run, in order (default "
                     f"{','.join(PROFILES)}; e.g. lavapipe for a smoke run on the CPU)")
    commands.add_parser("stage", help="copy the built vktrain-train into build/bench_native and check its libraries")
    draw = commands.add_parser("plot", help="draw the plot of results JSON files")
    draw.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.steps < 1 or args.warmup < 0:
            parser.error("--steps must be >= 1 and --warmup >= 0")
        return run_command(args)
    if args.command == "stage":
        return stage_command(args)
    plot(args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

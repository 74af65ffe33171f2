"""vktrain command line.

    vktrain export --model tiny-llama|HF_DIR|FILE.gguf --lora-rank 8 --batch 4 --seq 64 --out step.pte
    vktrain inspect step.pte [--json]
    vktrain train step.pte --steps 100 [--data FILE --lr 1e-3 --schedule cosine --warmup 10 ...]
    vktrain bench kernels|step [benchmark args]

`export` and `inspect` run on the host (torch + executorch); `train` is the on-device runner and
imports neither.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vktrain.quant.q4gsw import SCALE_RULES  # numpy only
from vktrain.runtime.checkpoint import atomic_write_bytes  # torch-free; the one atomic writer

PROGRAMS = ("train-step", "forward", "forward-base")


def _parse_model_args(items: list[str]) -> dict:
    """KEY=VALUE strings -> config overrides; values parse as JSON when they can (ints, floats, bools)."""
    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"vktrain: --model-arg expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import available_models, build_model, load

    overrides = _parse_model_args(args.model_arg)
    if args.model in available_models() or not Path(args.model).exists():  # unknown names are refused there
        model = build_model(args.model, **overrides)
    else:
        loaded = load(args.model, **overrides)
        model = loaded.model
        print(f"loaded {args.model}: {loaded.describe()}")
    config = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.targets, group_size=args.group_size,
                        scale_rule=args.scale_rule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_lora(model, config)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"adapting {len(report.replaced)} layer(s) with LoRA rank {config.rank}, alpha {config.alpha:g} over a "
          f"q4gsw base ({config.scale_rule} scales): {', '.join(report.replaced)}")
    if report.excluded_heads:
        print(f"not adapted (output head; name it in --targets to adapt it): {', '.join(report.excluded_heads)}")

    # executorch is imported only once the model and adapters are known to be valid (it is slow to import).
    from vktrain.export import export_forward, export_training_step, lower_to_pte
    from vktrain.partitioner import VktrainPartitioner

    batch_shape = (args.batch, args.seq)
    if args.program == "train-step":
        program = export_training_step(model, batch_shape)
    else:
        program = export_forward(model, batch_shape, with_adapters=args.program == "forward")
    partitioner = VktrainPartitioner()
    pte = lower_to_pte(program, partitioner)
    atomic_write_bytes(Path(args.out), pte)
    print(f"wrote {args.out}: {len(pte)} bytes, {args.program} of {args.model} "
          f"(LoRA on {len(report.replaced)} layer(s): {', '.join(report.replaced)}; "
          f"{partitioner.num_partitions} delegate(s), {len(partitioner.refusals)} refused node(s))")
    for refusal in partitioner.refusals:
        print(f"refused: {refusal.reason}", file=sys.stderr)
    return 0


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_report(path: str, report: dict) -> str:
    lines = [f"{path}: {report['pte_bytes']} bytes",
             f"instructions: {report['delegate_calls']} delegate call(s), {report['kernel_calls']} kernel call(s)",
             f"operator table: {', '.join(report['operators']) if report['operators'] else '(empty)'}"]
    for i, d in enumerate(report["delegates"]):
        lines.append(f"delegate {i}: {d['backend_id']}, payload {_format_bytes(d['payload_bytes'])}")
        if "ops" not in d:
            continue
        c, m = d["constants"], d["memory"]
        lines.append(f"  ops: {d['ops']}")
        for name, count in d["op_histogram"].items():
            lines.append(f"    {count:5d}  {name}")
        lines.append(f"  constants: {c['count']}, {_format_bytes(c['bytes'])} "
                     f"({_format_bytes(c['deduplicated_bytes'])} deduplicated); layouts {c['tensor_layouts']}")
        lines.append(f"  planned GPU memory: {_format_bytes(m['planned_bytes'])} in {m['memory_objects']} object(s) "
                     f"(unplanned {_format_bytes(m['unplanned_bytes'])}); state {_format_bytes(m['state_bytes'])}")
        lines.append("  inputs: " + ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in d["inputs"]))
        lines.append("  outputs: " + ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in d["outputs"]))
        lines.append(f"  mutable state: {len(d['mutable_state'])} tensor(s)")
        for s in d["mutable_state"]:
            lines.append(f"    {s['name']} {s['dtype']}{s['shape']} (initial: {s['initial']})")
    lines.append(f"refused nodes: {len(report['refusals'])}")
    for r in report["refusals"]:
        lines.append(f"  {r['node']}: {r['reason']}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        data = Path(args.file).read_bytes()
    except OSError as e:
        print(f"vktrain inspect: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    from vktrain.export.pte import summarize_pte

    report = summarize_pte(data)
    print(json.dumps(report, indent=2) if args.json else format_report(args.file, report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vktrain", description="LoRA training through a frozen q4gsw base on Vulkan")
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="export a model's training step (or forward) to a .pte")
    export.add_argument("--model", required=True,
                        help="built-in model name (e.g. tiny-llama), a Hugging Face model directory or a .gguf file")
    export.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model config field (repeatable), e.g. --model-arg dim=32")
    export.add_argument("--program", choices=PROGRAMS, default="train-step",
                        help="train-step (forward+backward+AdamW), forward (logits with adapters), "
                             "forward-base (logits of the q4gsw base alone)")
    export.add_argument("--lora-rank", type=int, default=8)
    export.add_argument("--lora-alpha", type=float, default=16.0)
    export.add_argument("--targets", default="all-linear",
                        help="module-name glob(s), comma-separated; 're:' prefix for a regex; 'all-linear' (default): "
                             "every linear layer but the output head")
    export.add_argument("--scale-rule", choices=SCALE_RULES, default="mse",
                        help="q4gsw scale rule for the frozen base: mse (default: per-group least squared error) or "
                             "absmax (absmax/7); GGUF Q4_0 weights keep their own codes and scales")
    export.add_argument("--group-size", type=int, default=32)
    export.add_argument("--batch", type=int, default=4)
    export.add_argument("--seq", type=int, default=64)
    export.add_argument("--out", required=True, help="output .pte path (written atomically)")
    export.set_defaults(run=cmd_export)

    inspect = sub.add_parser("inspect", help="describe a .pte: delegates, ops, constants, memory, state, refusals")
    inspect.add_argument("file")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=cmd_inspect)

    from vktrain.runtime.train_loop import add_train_arguments, run_train  # torch-free

    train = sub.add_parser("train", help="train the LoRA adapters of a training-step .pte on the Vulkan device")
    add_train_arguments(train)
    train.set_defaults(run=run_train)

    bench = sub.add_parser("bench", help="run a benchmark script (kernels: per-kernel GPU times; step: training steps)")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    bench.set_defaults(run=cmd_bench)
    return parser


BENCHMARKS = {"kernels": "bench_kernels.py", "step": "bench_step.py"}


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmarks live in scripts/ of the checkout (they compare against PyTorch and are not part of the runtime)."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "scripts" / BENCHMARKS[args.which]
    if not script.is_file():
        print(f"vktrain bench: {script} not found (benchmarks need a source checkout of vktrain)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (`vktrain inspect x.pte | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as e:  # bad model / LoRA / shape configuration: a clear message, not a traceback
        print(f"vktrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from vktrain.export.lower import LoweringError  # only lowering errors get the short form
        if not isinstance(e, LoweringError):
            raise
        print(f"vktrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Fuzz .pte loading: N seeded mutants of an exported training step, a table of outcomes, the bugs.

    python scripts/fuzz_pte.py                         # exports mlp-lora (needs torch + executorch), 20,000 mutants
    python scripts/fuzz_pte.py --pte step.pte --count 50000 --seed 3 --show 20

Outcomes (vktrain/runtime/program/fuzz.py): `refused: <check>` (a clean VktrainError and what raised
it), `accepted-unchanged` (loaded and means what the original means), `accepted-changed` (a BUG, except
in the `resigned` family, whose mutants edit the blob graph and recompute its checksum: those measure
what per-op shape re-inference would still have to catch), `BUG: <exception>` (a traceback).
Exits 1 when any mutant is a bug.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vktrain.runtime.program import fuzz  # noqa: E402


def export_mlp_lora(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "vktrain.cli", "export", "--model", "mlp-lora", "--lora-rank", "4",
                    "--batch", "2", "--seq", "8", "--out", str(path)], check=True, cwd=REPO_ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pte", type=Path, help="the .pte to mutate (default: export mlp-lora to a temp dir)")
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=10, help="bugs (and re-signed changes) to describe")
    parser.add_argument("--resigned-share", type=float, default=0.1,
                        help="share of mutants in the blob's graph flatbuffer with its checksum recomputed (1.0 "
                             "reaches the embedded schedules' tables of a .pte exported with --target)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="vktrain-fuzz-") as scratch:
        path = args.pte
        if path is None:
            path = Path(scratch) / "mlp-lora.pte"
            export_mlp_lora(path)
        original = path.read_bytes()

    bugs, resigned_changes = [], []

    def keep(outcome: fuzz.Outcome) -> None:
        if outcome.is_bug:
            bugs.append(outcome)
        elif outcome.label == fuzz.ACCEPTED_CHANGED:
            resigned_changes.append(outcome)

    start = time.perf_counter()
    table = fuzz.campaign(original, args.count, args.seed, on_outcome=keep, resigned_share=args.resigned_share)
    elapsed = time.perf_counter() - start
    print(f"{args.count} mutants of {path} ({len(original)} bytes), seed {args.seed}, in {elapsed:.1f} s "
          f"({args.count / elapsed:.0f}/s)\n")
    print(fuzz.format_table(table))
    if resigned_changes:
        print("\nre-signed graphs that load with another meaning, by what differs:")
        for detail, count in Counter(o.detail for o in resigned_changes).most_common():
            print(f"  {count:>6}  {detail}")
    for title, outcomes in (("BUGS", bugs), ("re-signed graphs that load with another meaning", resigned_changes)):
        if outcomes:
            print(f"\n{title} ({len(outcomes)}; first {min(args.show, len(outcomes))}):")
            for outcome in outcomes[:args.show]:
                print(f"  {outcome.label} [{outcome.mutant.family} in {outcome.mutant.region}: "
                      f"{outcome.mutant.description}] {outcome.detail}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())

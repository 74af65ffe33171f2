#!/usr/bin/env python
"""Preference pairs from the bundled unit conversions, for trying DPO / SimPO on them:

    python scripts/conversion_pairs.py vktrain/data/unit_conversions.train.jsonl pairs.train.jsonl [--limit N]

Each chat becomes {"prompt": [the user turn], "chosen": [the reference answer], "rejected": [the same answer
with its result wrong by a factor of ten]}: the wording is alike, only the number tells them apart.
"""
from __future__ import annotations

import argparse
import json
import re
from decimal import Decimal
from pathlib import Path

_LAST_NUMBER = re.compile(r"(-?\d+(?:,\d{3})*(?:\.\d+)?)(?!.*\d)")


def wrong_by_ten(answer: str) -> str:
    """The answer with its last number multiplied by ten (written as the reference writes numbers)."""
    match = _LAST_NUMBER.search(answer)
    value = Decimal(match[1].replace(",", "")) * 10
    decimals = len(match[1].partition(".")[2])
    text = f"{value:,.{decimals}f}"
    return answer[:match.start()] + text + answer[match.end():]


def conversion_pairs(chats: Path, limit: int | None = None) -> list[dict]:
    """The pairs of the first `limit` chats of a chat .jsonl (module docstring)."""
    rows = []
    for line in chats.read_text(encoding="utf-8").splitlines()[:limit]:
        messages = json.loads(line)["messages"]
        answer = messages[-1]["content"]
        rows.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                     "rejected": [{"role": "assistant", "content": wrong_by_ten(answer)}]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chats", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    rows = conversion_pairs(args.chats, args.limit)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {args.out}: {len(rows)} pairs")


if __name__ == "__main__":
    main()

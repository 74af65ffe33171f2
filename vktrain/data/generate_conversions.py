"""Writes the main job's chat data set: unit-conversion questions answered in one fixed format.

    python -m vktrain.data.generate_conversions      # rewrites unit_conversions.{train,heldout}.jsonl

Why this task: a 135M instruct model answers such questions at length and often wrongly; a short LoRA
run teaches it the one-line format `<value> <unit> = <result> <unit>.` and the factors, which shows in
the held-out loss and in a generation sample after a few minutes of training on a CPU. Deterministic
(seeded): re-running reproduces the committed files byte for byte.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TRAIN_FILE = HERE / "unit_conversions.train.jsonl"
HELDOUT_FILE = HERE / "unit_conversions.heldout.jsonl"
N_TRAIN, N_HELDOUT, SEED = 480, 48, 2026

# (from unit, to unit, factor): result = value * factor
LINEAR_UNITS = [
    ("kilometers", "meters", 1000.0), ("meters", "centimeters", 100.0), ("centimeters", "millimeters", 10.0),
    ("miles", "kilometers", 1.609344), ("feet", "inches", 12.0), ("inches", "centimeters", 2.54),
    ("yards", "feet", 3.0), ("kilograms", "grams", 1000.0), ("pounds", "ounces", 16.0),
    ("kilograms", "pounds", 2.2046226), ("liters", "milliliters", 1000.0), ("gallons", "liters", 3.785412),
    ("hours", "minutes", 60.0), ("minutes", "seconds", 60.0), ("days", "hours", 24.0),
    ("weeks", "days", 7.0), ("megabytes", "kilobytes", 1000.0), ("tons", "kilograms", 1000.0),
]
QUESTIONS = [
    "How many {to} are in {value} {frm}?",
    "Convert {value} {frm} to {to}.",
    "What is {value} {frm} in {to}?",
    "{value} {frm} is how many {to}?",
    "Please convert {value} {frm} into {to}.",
    "I have {value} {frm}. How much is that in {to}?",
]


def _number(x: float) -> str:
    """Up to 3 decimals, no trailing zeros, thousands separators: 3500 -> '3,500', 1.5 -> '1.5'."""
    text = f"{x:,.3f}".rstrip("0").rstrip(".")
    return text if text != "-0" else "0"


def _temperature(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        c = rng.choice(range(-20, 101, 5))
        return (rng.choice(QUESTIONS).format(value=c, frm="degrees Celsius", to="degrees Fahrenheit"),
                f"{c} degrees Celsius = {_number(c * 9 / 5 + 32)} degrees Fahrenheit.")
    f = rng.choice(range(-4, 213, 9))
    return (rng.choice(QUESTIONS).format(value=f, frm="degrees Fahrenheit", to="degrees Celsius"),
            f"{f} degrees Fahrenheit = {_number((f - 32) * 5 / 9)} degrees Celsius.")


def example(rng: random.Random) -> dict:
    if rng.random() < 0.1:
        question, answer = _temperature(rng)
    else:
        frm, to, factor = rng.choice(LINEAR_UNITS)
        value = rng.choice([rng.randint(1, 20), rng.randint(2, 500), round(rng.uniform(0.5, 50), 1)])
        question = rng.choice(QUESTIONS).format(value=_number(value), frm=frm, to=to)
        answer = f"{_number(value)} {frm} = {_number(value * factor)} {to}."
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def generate() -> tuple[list[dict], list[dict]]:
    """Train and held-out examples; no held-out question appears in the training set."""
    rng = random.Random(SEED)
    questions, rows = set(), []
    while len(rows) < N_TRAIN + N_HELDOUT:
        item = example(rng)
        question = item["messages"][0]["content"]
        if question not in questions:
            questions.add(question)
            rows.append(item)
    return rows[N_HELDOUT:], rows[:N_HELDOUT]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    train_rows, heldout_rows = generate()
    write_jsonl(TRAIN_FILE, train_rows)
    write_jsonl(HELDOUT_FILE, heldout_rows)
    print(f"wrote {TRAIN_FILE.name} ({len(train_rows)} chats) and {HELDOUT_FILE.name} ({len(heldout_rows)} chats)")

"""Generate vktrain's built-in training corpus (default_corpus.txt) from a small hand-written grammar.

The corpus is original text composed for vktrain (no downloaded data): short village tales, weather
notes, workshop instructions, letters, dialogue and simple arithmetic facts, about 300 KB of plain
ASCII English. It is generated deterministically (Python's `random.Random(seed)`, whose `choice` /
`randrange` sequences are stable across CPython versions) and the generated file is shipped, so
training runs never need this script; tests check the shipped file still matches it.

    python -m vktrain.data.generate_corpus [OUT] [--bytes N] [--seed S]
"""
from __future__ import annotations

import argparse
import random
import sys
import textwrap
from pathlib import Path

DEFAULT_SEED = 20261129
DEFAULT_BYTES = 300_000

NAMES = ["Ada", "Bram", "Celia", "Dov", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Leo",
         "Mara", "Nils", "Oona", "Pavel", "Quinn", "Rosa", "Sami", "Tove", "Ugo", "Vera", "Wim", "Yara"]
TRADES = ["baker", "miller", "weaver", "smith", "potter", "fisher", "carpenter", "beekeeper", "shepherd",
          "glassblower", "clockmaker", "gardener", "ferryman", "bookbinder", "lamplighter", "cooper"]
PLACES = ["the mill by the river", "the market square", "the old stone bridge", "the orchard on the hill",
          "the harbour wall", "the lighthouse", "the village well", "the edge of the pine wood",
          "the salt marsh", "the north road", "the workshop behind the inn", "the school house"]
OBJECTS = ["a copper kettle", "a wooden spoon", "a basket of apples", "a coil of rope", "a brass key",
           "a jar of honey", "a lantern", "a loaf of rye bread", "a wool blanket", "a small blue boat",
           "a map of the coast", "a sack of flour", "a box of nails", "a clay pot", "a fiddle", "a kite"]
ADJECTIVES = ["quiet", "bright", "patient", "stubborn", "cheerful", "careful", "tired", "curious", "clever",
              "gentle", "restless", "proud", "kind", "brave"]
WEATHER = ["a cold wind came down from the hills", "rain fell all morning", "the fog lay thick on the water",
           "the sun was warm on the stones", "snow covered the roofs", "a storm gathered over the sea",
           "the air smelled of cut grass", "frost silvered the fields"]
TIMES = ["At dawn", "In the morning", "By noon", "In the afternoon", "At dusk", "Late that night",
         "On the first day of spring", "One autumn evening", "Before the market opened", "After the harvest"]
FEELINGS = ["glad", "worried", "surprised", "grateful", "puzzled", "relieved", "hopeful"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
                "twenty"]
TASKS = [("bread", ["Mix the flour, water and salt in a wide bowl.", "Knead the dough until it is smooth.",
                    "Let it rest in a warm place for two hours.", "Shape the loaf and cut a line across the top.",
                    "Bake it in a hot oven until the crust is brown."]),
         ("a kite", ["Cut two thin sticks, one longer than the other.", "Tie them together in the shape of a cross.",
                     "Stretch paper over the frame and glue the edges.", "Fix a tail of ribbons to the bottom.",
                     "Wait for a steady wind and let out the string slowly."]),
         ("a fence", ["Mark the line of the fence with pegs and string.", "Dig a hole for each post.",
                      "Set the posts straight and pack the earth around them.", "Nail the rails from post to post.",
                      "Paint the wood so the rain does not rot it."]),
         ("honey", ["Wear the veil and light the smoker.", "Open the hive slowly and calmly.",
                    "Lift out a frame that is capped with wax.", "Cut the caps and spin the frame in the extractor.",
                    "Pour the honey through a cloth into clean jars."]),
         ("a boat", ["Choose dry planks of good oak.", "Bend the ribs over a fire until they take the curve.",
                     "Fasten the planks to the ribs with copper nails.", "Fill the seams with tar and cotton.",
                     "Launch her at high tide and check for leaks."])]


def _sentence_tale(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    trade = rng.choice(TRADES)
    place, place2 = rng.sample(PLACES, 2)
    thing = rng.choice(OBJECTS)
    lines = [
        f"{rng.choice(TIMES)}, {rng.choice(WEATHER)}.",
        f"{name} the {trade} walked to {place} with {thing}.",
        f"{name} was {rng.choice(ADJECTIVES)} and a little {rng.choice(FEELINGS)}.",
        f"There {name} met {other}, who said, \"I have been looking for {thing} since {rng.choice(MONTHS)}.\"",
        f"\"Then take it,\" said {name}, \"and bring it back to {place2} when you are done.\"",
        f"{other} thanked {name} and went home {rng.choice(['singing', 'whistling', 'in silence', 'smiling'])}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"The next day {other} came to {place2} and returned {thing}, just as promised.")
    else:
        lines.append(f"Weeks later, {name} found {thing} waiting at {place2}, with a note that said thank you.")
    return " ".join(lines)


def _degrees(value: int) -> str:
    return f"{value} degree" if abs(value) == 1 else f"{value} degrees"


def _weather_log(rng: random.Random) -> str:
    day = rng.randrange(1, 29)
    month = rng.choice(MONTHS)
    low = rng.randrange(-5, 15)
    high = low + rng.randrange(2, 12)
    wind = rng.choice(["calm", "light from the west", "strong from the north", "gusty from the sea"])
    return (f"Weather log, {day} {month}: low {_degrees(low)}, high {_degrees(high)}, wind {wind}. "
            f"{rng.choice(WEATHER).capitalize()}.")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(0, 11), rng.randrange(0, 11)
    if rng.random() < 0.5:
        return (f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}. "
                f"In figures: {a} + {b} = {a + b}.")
    big, small = max(a, b), min(a, b)
    return (f"{NUMBER_WORDS[big].capitalize()} minus {NUMBER_WORDS[small]} is {NUMBER_WORDS[big - small]}. "
            f"In figures: {big} - {small} = {big - small}.")


def _instructions(rng: random.Random) -> str:
    what, steps = rng.choice(TASKS)
    numbered = " ".join(f"{i}. {s}" for i, s in enumerate(steps, 1))
    return f"How to make {what}, as the {rng.choice(TRADES)} teaches it: {numbered}"


def _letter(rng: random.Random) -> str:
    sender, reader = rng.sample(NAMES, 2)
    return (f"Dear {reader}, the {rng.choice(TRADES)} at {rng.choice(PLACES)} asked me to write. "
            f"We need {rng.choice(OBJECTS)} and {rng.choice(OBJECTS)} before {rng.choice(MONTHS)}. "
            f"Please send word if you can help. Yours, {sender}.")


def _dialogue(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    count = rng.randrange(2, 13)
    thing = rng.choice(OBJECTS).split(" ", 1)[1]
    return (f"\"How many are left?\" asked {a}.\n\"{NUMBER_WORDS[count].capitalize()},\" said {b}. "
            f"\"If we sell {NUMBER_WORDS[count // 2]}, we keep {NUMBER_WORDS[count - count // 2]}.\"\n"
            f"\"Then keep the best {thing} for the winter,\" said {a}.")


_PARAGRAPH_KINDS = [(_sentence_tale, 5), (_weather_log, 2), (_arithmetic, 2), (_instructions, 1), (_letter, 2),
                    (_dialogue, 2)]


def generate(n_bytes: int = DEFAULT_BYTES, seed: int = DEFAULT_SEED) -> str:
    """About `n_bytes` of corpus text (whole paragraphs; the result is at least n_bytes long)."""
    rng = random.Random(seed)
    kinds = [kind for kind, weight in _PARAGRAPH_KINDS for _ in range(weight)]
    paragraphs, size = [], 0
    while size < n_bytes:
        text = rng.choice(kinds)(rng)
        # Wrap prose to 78 columns; dialogue keeps its own line breaks.
        text = "\n".join(textwrap.fill(line, 78) for line in text.split("\n"))
        paragraphs.append(text)
        size += len(text) + 2
    return "\n\n".join(paragraphs) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).with_name("default_corpus.txt")))
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    Path(args.out).write_text(generate(args.bytes, args.seed), encoding="ascii")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Seeded mutational fuzzing of .pte loading (tests/test_fuzz_pte.py, scripts/fuzz_pte.py); torch-free.

Each mutant of an exported training-step .pte goes through everything the runner does before it
allocates (`verify_training_program`: the .pte reader, the plan checks, the delegate blob with its
checksums, the delegate I/O) and lands in one outcome:

    refused: <check>        a VktrainError; <check> names what refused it
    accepted-unchanged      loaded, and what the runtime reads equals the original's (`program_meaning`)
    accepted-changed        loaded with another meaning. A BUG, except for the `resigned` family (below)
    BUG: <exception type>   anything outside the error family (a traceback)

Mutations (each picks a region of the file first: the .pte header, the Program flatbuffer, the blob
header, the blob's graph flatbuffer, the constants, anywhere): bit flips, byte rewrites, truncations,
rewrites of 4- and 8-byte words with values chosen to break offsets, lengths and scalars (0, +-1, x2,
2^31, all ones, ...), and swaps of two equal-size chunks (segment swaps). The `resigned` family edits the
blob's graph flatbuffer and recomputes its checksum, as a writer of inconsistent graphs would: it tests
the parser and checks behind the checksum, and a changed meaning there is reported, not a bug, until
per-op shape re-inference (verify.check_op_shapes) is wired in.

A .pte exported with --target embeds schedules and shader modules in the blob's graph flatbuffer: `load`
verifies them (verify_schedule.py verify_embedded) and `program_meaning` includes them, so the re-signed
family reaches their parsers and checks (`campaign(..., resigned_share=1.0)`).

Schedules (vktrain/serialization/schedule.py) get the same mutations over their whole bytes
(`schedule_campaign`): each mutant goes through deserialize_schedule and verify_schedule against its graph.
A schedule carries no checksum yet (it is not in the .pte), so accepted-changed is expected there; what
must not happen is a BUG, or an accepted schedule that breaks what the verifier guarantees (bindings
inside their buffers, known shaders, push and group limits).
"""
from __future__ import annotations

import random
import struct
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from vktrain.errors import VktrainError
from vktrain.serialization.pte import DelegateCall, KernelCall, PteFile, PteFormatError, Tensor
from vktrain.contract import EVAL_METHOD
from vktrain.runtime.program.evaluation import verify_eval_method
from vktrain.runtime.program.interpreter import VerifiedTrainingProgram, verify_training_program
from vktrain.serialization.verify import VerificationError
from vktrain.serialization import BlobFormatError, BlobHeader
from vktrain.serialization import graph as g
from vktrain.serialization.schedule import Schedule, deserialize_schedule
from vktrain.serialization.verify_schedule import verify_embedded, verify_schedule

ACCEPTED_UNCHANGED = "accepted-unchanged"
ACCEPTED_CHANGED = "accepted-changed"
RESIGNED = "resigned"


@dataclass(frozen=True)
class Region:
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class Mutant:
    data: bytes
    family: str  # e.g. "bit-flip", "word-rewrite", RESIGNED
    region: str
    description: str


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    label: str  # "refused: <check>", ACCEPTED_UNCHANGED, ACCEPTED_CHANGED, "BUG: <type>"
    detail: str

    @property
    def is_bug(self) -> bool:
        return self.label.startswith("BUG") or (self.label == ACCEPTED_CHANGED and self.mutant.family != RESIGNED)


# ---------------------------------------------------------------------------------------------------
# What a program means to the runtime
# ---------------------------------------------------------------------------------------------------

def _tensor_meaning(pte: PteFile, tensor: Tensor) -> tuple:
    planned = tensor.allocation_info is not None
    data = None if planned else pte.tensor_data(tensor)
    return (tensor.scalar_type, tensor.sizes, tensor.dim_order, tensor.data_buffer_idx, planned,
            tensor.extra_tensor_info, None if data is None else bytes(data))


def _aliasing(plan) -> frozenset:
    """Pairs of planned tensor values whose bytes overlap: what a memory plan means to the program (where
    in an arena a tensor lies does not matter, only which tensors share bytes)."""
    placed = [(index, v.allocation_info.memory_id, v.allocation_info.memory_offset,
               v.allocation_info.memory_offset + v.nbytes) for index, v in enumerate(plan.values)
              if isinstance(v, Tensor) and v.allocation_info is not None and v.nbytes]
    return frozenset((a, b) for a, memory_a, start_a, end_a in placed for b, memory_b, start_b, end_b in placed
                     if a < b and memory_a == memory_b and start_a < end_b and start_b < end_a)


def _resolve_inputs(instruction, input_names: dict[int, str]):
    """A call's arguments with each plan input replaced by its name: the runner binds inputs by name, so
    which plan input position holds token_ids does not change what the program computes."""
    if not isinstance(instruction, (KernelCall, DelegateCall)):
        return instruction
    return type(instruction), tuple(input_names.get(arg, arg) for arg in instruction.args)


def program_meaning(pte: PteFile, program: VerifiedTrainingProgram) -> dict:
    """`method_meaning` of the training step and, when the file has one, of its eval method (keys prefixed
    "eval "): a mutant that changes only the eval method changes what `TrainingRunner.evaluate` computes."""
    meaning = method_meaning(pte, program)
    if EVAL_METHOD in pte.method_names:
        evaluation = verify_eval_method(pte, verify_constants=False)  # `load` verified it, constants included
        meaning.update({f"eval {key}": value for key, value in method_meaning(pte, evaluation).items()})
    return meaning


_EVAL_KEY = "eval graph ops"  # in a program's meaning when it has an eval method


def method_meaning(pte: PteFile, program: VerifiedTrainingProgram) -> dict:
    """Everything the interpreter and the executor read: the plan's values (tensor records and constant
    bytes, scalars), inputs, outputs, instructions and the operators they call; the delegate graph and its
    constant bytes. Left out, because nothing at run time reads them: requires_grad, chain-level I/O
    lists, container metadata, compile specs, the program version, the declared arena sizes (only
    whether they suffice matters, and verify.check_arenas checks that) and where in its arena a tensor
    lies (only which tensors share bytes matters: `_aliasing`)."""
    plan, graph = program.plan, program.graph
    input_names = dict(zip(plan.inputs, program.input_names))
    return {
        "plan values": tuple(_tensor_meaning(pte, v) if isinstance(v, Tensor) else v for v in plan.values),
        "plan aliasing": _aliasing(plan),
        "plan inputs": plan.inputs, "plan outputs": plan.outputs,
        "plan instructions": tuple(_resolve_inputs(instruction, input_names) for instruction in plan.instructions),
        "plan operators called": tuple(plan.operators[i.op_index] for i in plan.instructions if isinstance(i, KernelCall)),
        "graph values": tuple(graph.values), "graph ops": tuple(graph.ops), "graph inputs": tuple(graph.inputs),
        "graph outputs": tuple(graph.outputs), "graph mutable state": tuple(graph.mutable_state),
        "graph memory objects": tuple(graph.memory_objects), "graph metadata": dict(graph.metadata),
        "graph constants": tuple(c if isinstance(c, g.SyntheticConstant)
                                 else (getattr(c, "stored_form", None), bytes(g.stored_bytes(c)))
                                 for c in graph.constants),
        "graph embedded schedules": tuple(graph.schedules), "graph shader modules": tuple(graph.shader_modules),
    }


def classify(exc: BaseException) -> str:
    """The outcome label of a refusal: which check (or which reader) refused."""
    if isinstance(exc, VerificationError):
        return f"refused: verify.{exc.check}"
    if isinstance(exc, BlobFormatError):
        text = str(exc)
        if "graph checksum" in text:
            return "refused: blob graph checksum"
        if "crc32" in text:
            return "refused: blob constant checksum"
        return "refused: blob format"
    if isinstance(exc, PteFormatError):
        return "refused: pte format"
    if isinstance(exc, VktrainError):
        return f"refused: {type(exc).__name__}"
    return f"BUG: {type(exc).__name__}"


def load(data: bytes, eval_method: Optional[bool] = None) -> tuple[PteFile, VerifiedTrainingProgram]:
    """What the runner reads before it allocates: the program verified, and its embedded schedules (when it
    has them: the tables' checks and the read of every schedule, as the runner's selection does); and the
    eval method, as EvalMethod checks it when TrainingRunner.evaluate first uses it. `eval_method`: True,
    the file must have one (a mutant of a file that had one); None, when it has one."""
    pte = PteFile.from_bytes(data, source="<mutant.pte>")
    program = verify_training_program(pte)
    verify_embedded(program.graph, "<mutant.pte>")
    if eval_method or (eval_method is None and EVAL_METHOD in pte.method_names):
        verify_embedded(verify_eval_method(pte).graph, "<mutant.pte>")
    return pte, program


# ---------------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------------

def file_regions(data: bytes) -> dict[str, Region]:
    """The parts of an exported training-step .pte that mutations target."""
    pte = PteFile.from_bytes(data)
    delegate = pte.execution_plan().delegates[0]
    if delegate.location != 1:  # DataLocation.SEGMENT: the exporter always puts the blob in a segment
        raise ValueError("the fuzzer expects the delegate blob in a segment")
    segment = pte.segments[delegate.index]
    blob_start = pte.header.segment_base_offset + segment.offset
    blob = BlobHeader.parse(memoryview(data)[blob_start:blob_start + segment.size])
    regions = [
        Region("pte header", 0, 32),
        Region("pte program", 32, pte.header.program_size),
        Region("blob header", blob_start, blob_start + blob.size),
        Region("blob graph", blob_start + blob.flatbuffer_offset,
               blob_start + blob.flatbuffer_offset + blob.flatbuffer_size),
        Region("blob constants", blob_start + blob.segment_offset,
               blob_start + blob.segment_offset + blob.segment_size),
        Region("anywhere", 0, len(data)),
    ]
    return {region.name: region for region in regions if region.end > region.start}


def _interesting_words(original: int, bits: int) -> list[int]:
    mask = (1 << bits) - 1
    return [value & mask for value in (0, 1, mask, original + 1, original - 1, original + 4, original - 4,
                                       original + 16, original * 2, original ^ (1 << (bits - 1)), 1 << 31,
                                       (1 << 31) - 1, 1 << (bits - 2), original << 8)]


def _bit_flip(rng: random.Random, data: bytearray, region: Region) -> str:
    position = rng.randrange(region.start, region.end)
    bit = rng.randrange(8)
    data[position] ^= 1 << bit
    return f"flip bit {bit} of byte {position}"


def _byte_rewrite(rng: random.Random, data: bytearray, region: Region) -> str:
    position = rng.randrange(region.start, region.end)
    value = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    data[position] = value
    return f"byte {position} = {value:#04x}"


def _word_rewrite(rng: random.Random, data: bytearray, region: Region) -> str:
    size = rng.choice((4, 8))
    first = (region.start + 3) // 4 * 4  # flatbuffer offsets, lengths and scalars are 4-byte aligned
    if first + size > region.end:
        return _byte_rewrite(rng, data, region)
    position = first + 4 * rng.randrange((region.end - size - first) // 4 + 1)
    code = "<I" if size == 4 else "<Q"
    (original,) = struct.unpack_from(code, data, position)
    value = rng.choice(_interesting_words(original, 8 * size))
    struct.pack_into(code, data, position, value)
    return f"{size}-byte word at {position}: {original:#x} -> {value:#x}"


def _swap(rng: random.Random, data: bytearray, region: Region) -> str:
    size = rng.choice((4, 8, 16, 64, 256))
    if region.end - region.start < 2 * size:
        return _bit_flip(rng, data, region)
    first = region.start + rng.randrange((region.end - region.start - 2 * size) + 1)
    second = rng.randrange(first + size, region.end - size + 1)
    data[first:first + size], data[second:second + size] = data[second:second + size], data[first:first + size]
    return f"swap {size} bytes at {first} and {second}"


def _truncate(rng: random.Random, data: bytearray, region: Region) -> str:
    cut = rng.randrange(region.start, region.end)
    del data[cut:]
    return f"truncate to {cut} bytes"


MUTATORS: dict[str, Callable[[random.Random, bytearray, Region], str]] = {
    "bit-flip": _bit_flip, "byte-rewrite": _byte_rewrite, "word-rewrite": _word_rewrite, "swap": _swap,
    "truncate": _truncate,
}


def _resign_blob(data: bytearray, regions: dict[str, Region]) -> None:
    """Recompute the blob's graph_crc32 over its (mutated) header fields and flatbuffer."""
    header, graph = regions["blob header"], regions["blob graph"]
    crc = zlib.crc32(bytes(data[graph.start:graph.end]), zlib.crc32(bytes(data[header.start:header.start + 48])))
    struct.pack_into("<I", data, header.start + BlobHeader.SIZE, crc)


def mutants(original: bytes, seed: int, resigned_share: float = 0.1) -> Iterator[Mutant]:
    """An endless, seeded stream of mutants of `original`."""
    rng = random.Random(seed)
    regions = file_regions(original)
    names = sorted(regions)
    families = sorted(MUTATORS)
    while True:
        data = bytearray(original)
        if rng.random() < resigned_share:
            region = regions["blob graph"]
            family = rng.choice([f for f in families if f != "truncate"])
            description = MUTATORS[family](rng, data, region) + ", graph checksum recomputed"
            _resign_blob(data, regions)
            yield Mutant(bytes(data), RESIGNED, region.name, f"{family}: {description}")
            continue
        region = regions[rng.choice(names)]
        family = rng.choice(families)
        description = MUTATORS[family](rng, data, region)
        if bytes(data) == original:
            continue
        yield Mutant(bytes(data), family, region.name, description)


def run_one(mutant: Mutant, original_meaning: dict) -> Outcome:
    try:
        pte, program = load(mutant.data, eval_method=_EVAL_KEY in original_meaning)
        meaning = program_meaning(pte, program)
    except Exception as exc:  # the point: every exception is classified, none escapes
        return Outcome(mutant, classify(exc), f"{type(exc).__name__}: {exc}"[:300])
    changed = [key for key in {**original_meaning, **meaning} if meaning.get(key) != original_meaning.get(key)]
    if not changed:
        return Outcome(mutant, ACCEPTED_UNCHANGED, "")
    return Outcome(mutant, ACCEPTED_CHANGED, f"loaded, but its {', '.join(changed)} differ from the original's")


def campaign(original: bytes, count: int, seed: int = 0,
             on_outcome: Optional[Callable[[Outcome], None]] = None, resigned_share: float = 0.1) -> Counter:
    """Run `count` mutants; returns how many fell in each (family, label). Keep outcomes through
    `on_outcome` (e.g. the bugs). `resigned_share`: the share of re-signed blob-graph mutants (1.0: only
    those, which reach the parsers and checks behind the checksum: the embedded schedules' tables)."""
    pte, program = load(original)
    original_meaning = program_meaning(pte, program)
    table: Counter = Counter()
    stream = mutants(original, seed, resigned_share)
    for _ in range(count):
        outcome = run_one(next(stream), original_meaning)
        table[outcome.mutant.family == RESIGNED, outcome.label] += 1
        if on_outcome is not None:
            on_outcome(outcome)
    return table


def schedule_mutants(original: bytes, seed: int) -> Iterator[Mutant]:
    """An endless, seeded stream of mutants of a serialised schedule (every family, the whole bytes)."""
    rng = random.Random(seed)
    region = Region("schedule", 0, len(original))
    families = sorted(MUTATORS)
    while True:
        data = bytearray(original)
        family = rng.choice(families)
        description = MUTATORS[family](rng, data, region)
        if bytes(data) != original:
            yield Mutant(bytes(data), family, region.name, description)


def run_schedule_one(mutant: Mutant, original: Schedule, graph: g.VkGraph, shader_sources) -> Outcome:
    try:
        schedule = deserialize_schedule(mutant.data)
        verify_schedule(schedule, graph, shader_sources, "<mutant schedule>")
    except Exception as exc:  # the point: every exception is classified, none escapes
        return Outcome(mutant, classify(exc), f"{type(exc).__name__}: {exc}"[:300])
    return Outcome(mutant, ACCEPTED_UNCHANGED if schedule == original else ACCEPTED_CHANGED, "")


def schedule_campaign(original: bytes, graph: g.VkGraph, shader_sources, count: int, seed: int = 0,
                      on_outcome: Optional[Callable[[Outcome], None]] = None) -> Counter:
    """Run `count` mutants of the serialised schedule `original` of `graph`; how many fell in each label."""
    schedule = deserialize_schedule(original)
    table: Counter = Counter()
    stream = schedule_mutants(original, seed)
    for _ in range(count):
        outcome = run_schedule_one(next(stream), schedule, graph, shader_sources)
        table[outcome.label] += 1
        if on_outcome is not None:
            on_outcome(outcome)
    return table


def format_table(table: Counter) -> str:
    rows = sorted(table.items(), key=lambda item: (item[0][0], item[0][1].startswith("BUG"), -item[1]))
    width = max([len(label) for (_, label), _ in rows] + [10])
    lines = [f"{'family':<10} {'outcome':<{width}} {'mutants':>8}"]
    for (resigned, label), count in rows:
        lines.append(f"{'resigned' if resigned else 'plain':<10} {label:<{width}} {count:>8}")
    return "\n".join(lines)


__all__ = ["ACCEPTED_CHANGED", "ACCEPTED_UNCHANGED", "MUTATORS", "Mutant", "Outcome", "RESIGNED", "campaign",
           "classify", "file_regions", "format_table", "load", "method_meaning", "mutants", "program_meaning", "run_one",
           "run_schedule_one", "schedule_campaign", "schedule_mutants"]

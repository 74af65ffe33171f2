"""Run a generation .pte (methods `prefill` and `decode`, vktrain/export/decode.py) on the Vulkan device.

    with GenerationRunner.from_pte("gen.pte") as runner:
        result = runner.generate(prompt_ids, max_new_tokens=32, sampler=Sampler(), stop_ids={eos})

Each method is verified like a training step (verify.py) and gets its own executor; the two share their
device buffers (GraphExecutor's `shared`): decode binds prefill's weights (the constants it holds byte for
byte under the same names), so they are on the device once, and prefill's KV caches (state by name), so
what prefill writes the decode step reads. Positions are checked against the cache before anything runs (a kernel cannot
refuse them).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from vktrain.errors import VktrainError
from vktrain.opdefs.decode_ops import CachePositionError, check_cache_positions
from vktrain.backend.kernel_planning import plan_schedule
from vktrain.runtime.delegate.executor import GraphExecutor, SharedTensor
from vktrain.runtime.program.schedules import method_schedule
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.interpreter import ProgramInterpreter
from vktrain.serialization.verify import (
    UnsupportedProgramError,
    check_device_memory,
    device_memory_bytes,
    load_delegate_graph,
)

PREFILL, DECODE = "prefill", "decode"  # method names, as vktrain/export/decode.py writes them
TOKEN_IDS, INPUT_POS = "token_ids", "input_pos"
KV_CACHE_PREFIX = "kv_cache."


@dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]  # the new ids, a stop id included when one ended the generation
    prefill_seconds: float
    decode_seconds: float

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of prefill + decode (the first new token comes from the prefill)."""
        seconds = self.prefill_seconds + self.decode_seconds
        return len(self.tokens) / seconds if seconds > 0 else float("inf")


class _Method:
    """One method of the program: its plan interpreted on the host, its delegate on `device`."""

    def __init__(self, pte: PteFile, name: str, device, verify_constants: bool,
                 shares_with: Optional["_Method"] = None, max_binding_bytes: Optional[int] = None):
        if name not in pte.method_names:
            raise UnsupportedProgramError(f"{pte.source}: no method {name!r} (methods: {pte.method_names}); "
                                          f"a generation program has {PREFILL!r} and {DECODE!r}")
        self.plan = pte.execution_plan(name)
        call, self.graph = load_delegate_graph(pte, self.plan, verify_constants=verify_constants)
        graph_inputs = {value: self.graph.tensor(self.graph.inputs[i]).name
                        for i, value in enumerate(call.args[:len(self.graph.inputs)])}
        self.input_names = [graph_inputs.get(value) for value in self.plan.inputs]
        if sorted(map(str, self.input_names)) != sorted((INPUT_POS, TOKEN_IDS)) or len(self.plan.outputs) != 1:
            raise UnsupportedProgramError(f"{pte.source}: method {name!r} takes {self.input_names} and returns "
                                          f"{len(self.plan.outputs)} value(s); a generation method takes "
                                          f"{TOKEN_IDS} and {INPUT_POS} and returns the logits")
        self.interpreter = ProgramInterpreter(pte, self.plan, self._run_delegate)
        check_device_memory(pte.source, self.graph, device_memory_bytes(device))
        shared: dict[str, SharedTensor] = {}
        if shares_with is not None:
            shared.update(shares_with.executor.constants_matching(self.graph))
            shared.update(shares_with.executor.shared_state())
        obtained = method_schedule(self.graph, device, planner=plan_schedule, embedded=None, source=str(pte.source),
                                   shared=shared, max_binding_bytes=max_binding_bytes)
        # Against an emulated profile's memory budget decode counts prefill's buffers with its own.
        self.executor = GraphExecutor(device, self.graph, obtained.schedule, verify=obtained.verify, timing=False,
                                      shared=shared,
                                      resident_bytes=shares_with.executor.program_bytes if shares_with else 0)
        self.rows = int(self.plan.values[self.plan.inputs[self.input_names.index(TOKEN_IDS)]].sizes[1])

    def _run_delegate(self, index: int, args: list) -> list[np.ndarray]:
        return self.executor.run(*args[:len(self.graph.inputs)])

    def __call__(self, token_ids: np.ndarray, input_pos: np.ndarray) -> np.ndarray:
        by_name = {TOKEN_IDS: token_ids.reshape(1, -1), INPUT_POS: input_pos}
        (logits,) = self.interpreter.run([by_name[name] for name in self.input_names])
        return logits


class GenerationRunner:
    """The prefill and decode methods of one .pte over one KV cache. Build with `from_pte`. Each method's
    schedule is planned at load (vktrain.backend.kernel_planning.plan_schedule); `max_binding_bytes`: a lower max
    storage binding size to plan for."""

    def __init__(self, pte: PteFile, device=None, *, verify_constants: bool = True, runtime: str | None = None,
                 max_binding_bytes: int | None = None):
        from vktrain.runtime.runtimes import device_for

        device, self._owns_device = device_for(device, runtime)
        self.device = device
        self._methods: list[_Method] = []
        try:
            self.prefill_method = self._add(_Method(pte, PREFILL, device, verify_constants,
                                                    max_binding_bytes=max_binding_bytes))
            self.decode_method = self._add(_Method(pte, DECODE, device, verify_constants,
                                                   shares_with=self.prefill_method, max_binding_bytes=max_binding_bytes))
            self.cache_names = [n for n in self.decode_method.executor.state_names if n.startswith(KV_CACHE_PREFIX)]
            if not self.cache_names or self.prefill_method.executor.state_names != self.decode_method.executor.state_names:
                raise UnsupportedProgramError(f"{pte.source}: prefill and decode must share their KV-cache state "
                                              f"({KV_CACHE_PREFIX}*)")
            self.cache_length = int(self.decode_method.executor.read_state(self.cache_names[0]).shape[1])
            self.vocab_size = int(self.decode_method.executor.index_limits[TOKEN_IDS])
        except BaseException:
            self.close()
            raise

    def _add(self, method: _Method) -> _Method:
        self._methods.append(method)
        return method

    @classmethod
    def from_pte(cls, path: Union[str, os.PathLike], device=None, **options) -> "GenerationRunner":
        return cls(PteFile.load(path), device, **options)

    @property
    def prefill_length(self) -> int:
        return self.prefill_method.rows

    # ------------------------------------------------------------------------------ steps
    def prefill(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Logits [P, V] of every prompt position; the prompt's k/v fill the cache from position 0, in
        chunks of prefill_length. The last chunk's pad rows take the positions after the prompt (clamped
        to the cache's last row, which the prompt never reaches): decode writes those rows before
        anything reads them."""
        prompt = self._check_ids(prompt_ids, "prompt")
        count = len(prompt)
        if count == 0:
            raise VktrainError("the prompt has no tokens; generation starts from at least one")
        if count >= self.cache_length:
            raise CachePositionError(f"a prompt of {count} tokens leaves no position for the next token in the "
                                     f"program's KV cache of {self.cache_length} positions")
        rows, logits = self.prefill_length, []
        for start in range(0, count, rows):
            chunk = prompt[start:start + rows]
            positions = np.minimum(np.arange(start, start + rows, dtype=np.int64), self.cache_length - 1)
            padded = np.concatenate([chunk, np.zeros(rows - len(chunk), np.int64)])
            logits.append(self.prefill_method(padded, positions)[0, :len(chunk)])
        return np.concatenate(logits)

    def decode(self, token_id: int, position: int) -> np.ndarray:
        """Logits [V] after `token_id` at `position` (its k/v written to the cache there)."""
        check_cache_positions([position], self.cache_length, "the decode position")
        (token,) = self._check_ids([token_id], "token")
        return self.decode_method(np.array([token], np.int64), np.array([position], np.int64))[0, 0]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampler: Callable[[np.ndarray], int],
                 stop_ids: Iterable[int] = ()) -> GenerationResult:
        """Prompt -> up to max_new_tokens new ids (stopping after a stop id)."""
        prompt = [int(t) for t in prompt_ids]
        if max_new_tokens < 1:
            raise VktrainError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # Positions 0 .. P + N - 2 are written (the last new token is never fed back); one spare row keeps
        # the prefill's pad rows off the prompt (see prefill).
        if len(prompt) + max_new_tokens > self.cache_length:
            raise CachePositionError(f"{len(prompt)} prompt tokens + {max_new_tokens} new tokens need "
                                     f"{len(prompt) + max_new_tokens} cache positions; the program's KV cache has "
                                     f"{self.cache_length} (export it with a longer cache, or ask for fewer tokens)")
        stops = set(int(s) for s in stop_ids)
        start = time.perf_counter()
        tokens = [sampler(self.prefill(prompt)[-1])]
        prefilled = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            position = len(prompt) + len(tokens) - 1
            tokens.append(sampler(self.decode(tokens[-1], position)))
        return GenerationResult(prompt, tokens, prefilled - start, time.perf_counter() - prefilled)

    def _check_ids(self, ids: Sequence[int], what: str) -> np.ndarray:
        array = np.asarray(list(ids), dtype=np.int64)
        bad = array[(array < 0) | (array >= self.vocab_size)]
        if bad.size:
            raise VktrainError(f"{what} holds token id(s) {bad[:8].tolist()} outside the vocabulary "
                               f"[0, {self.vocab_size})")
        return array

    # ------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for method in reversed(self._methods):  # decode borrows prefill's buffers: it goes first
            method.executor.close()
        self._methods = []
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> "GenerationRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

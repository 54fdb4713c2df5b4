"""Structured outputs on the engine-core side (mirrors vllm/v1/structured_output/__init__.py).

``StructuredOutputManager`` (one per scheduler) compiles each constrained request's
grammar on a background thread (the busy loop goes on; the request waits in
``RequestStatus.WAITING_FOR_FSM`` meanwhile), and fills the token bitmask of a step's
constrained rows on the host. The grammar state of a request (``StructuredOutputRequest``)
advances only with the tokens the scheduler accepts, so preemption (tokens kept) and
async scheduling (a token dropped for a preempted request was never accepted) leave it
consistent. Front-end validation lives in ``backend_xgrammar.validate_structured_outputs``.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pyengine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pyengine.config import EngineConfig
    from pyengine.core.sched.output import SchedulerOutput
    from pyengine.request import Request

logger = logging.getLogger("pyengine")


@dataclass
class GrammarOutput:
    """A step's grammar constraint, handed to the model runner (vLLM's ``GrammarOutput``).

    ``rows``: the sampled rows (indices into the step's rows with ``sample=True``) that are
    constrained; ``bitmask``: int32 [>= B, ceil(V / 32)] host tensor whose row ``r`` holds
    the allowed tokens of sampled row ``r`` (other rows are not read)."""
    rows: list[int]
    bitmask: torch.Tensor


REASONING, CONTENT, UNDECIDED = "reasoning", "content", "undecided"


class StructuredOutputRequest:
    """One request's constraint: its params, then (once compiled) its grammar state, and
    the phase of its output (``phase``): ``"content"`` is constrained; ``"reasoning"``
    (until ``params.reasoning_end_token_id``) is not; ``"undecided"`` (the first token
    decides, ``params.reasoning_start_token_id`` opens the reasoning) is constrained with
    that token allowed as well. The phase advances only with accepted tokens (``advance``)."""

    __slots__ = ("params", "_future", "grammar", "phase")

    def __init__(self, params: StructuredOutputsParams, future: concurrent.futures.Future):
        self.params = params
        self._future = future
        self.grammar = None  # XgrammarGrammar once ready
        if params.reasoning_end_token_id is None:
            self.phase = CONTENT
        else:
            self.phase = REASONING if params.reasoning_start_token_id is None else UNDECIDED

    def advance(self, token: int) -> bool:
        """The phase after accepted output token ``token``; True when the grammar takes
        it (content), False when it is reasoning or a reasoning tag."""
        if self.phase == CONTENT:
            return True
        if self.phase == UNDECIDED:
            if token == self.params.reasoning_start_token_id:
                self.phase = REASONING
                return False
            self.phase = CONTENT
            return True
        if token == self.params.reasoning_end_token_id:
            self.phase = CONTENT
        return False

    def is_ready(self) -> bool:
        """True once the grammar compiled (or failed: ``take_grammar`` then raises)."""
        return self.grammar is not None or self._future.done()

    def take_grammar(self, backend_fn) -> None:
        """Build the grammar matcher from the compiled grammar; raises the compile error."""
        if self.grammar is None:
            compiled = self._future.result()
            self.grammar = backend_fn().new_grammar(compiled)


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token ``token``'s bit in row ``row`` of an int32 ``[B, ceil(V / 32)]`` bitmask
    (bit ``token % 32`` of word ``token // 32``; bit 31 is the int32 sign bit)."""
    bit = token % 32
    bitmask[row, token // 32] |= (1 << bit) if bit < 31 else -(1 << 31)


class StructuredOutputManager:
    """Engine-side grammars for ``config``'s model. The xgrammar backend (tokenizer,
    compiler) is built on first use, on the compile thread, so an engine that never sees a
    constrained request pays nothing."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._backend = None
        self._backend_lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._bitmasks: list[torch.Tensor] = []  # two host buffers, used in turn
        self._turn = 0
        self.num_live = 0  # constrained requests in the engine (0: skip all grammar work)
        # Cumulative figures of grammar_bitmask (SchedulerStats.grammar_bitmask_*): host
        # seconds spent, steps and rows that got a bitmask.
        self.bitmask_time_s = 0.0
        self.bitmask_steps = 0
        self.bitmask_rows = 0

    def backend(self):
        with self._backend_lock:
            if self._backend is None:
                from pyengine.structured_output.backend_xgrammar import XgrammarBackend
                from pyengine.tokenizer import eos_token_ids, load_tokenizer

                tok = load_tokenizer(self.config)
                self._backend = XgrammarBackend(tok, self.config.hf_config.vocab_size,
                                                eos_token_ids(self.config, tok))
            return self._backend

    def _compile(self, params: StructuredOutputsParams):
        return self.backend().compile(params)

    def grammar_init(self, request: Request) -> None:
        """Start compiling ``request``'s grammar (cached by the compiler: a schema seen
        before is ready at once)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        params = request.sampling_params.structured_outputs
        request.structured_output_request = StructuredOutputRequest(params, self._executor.submit(self._compile, params))
        self.num_live += 1

    def finish_request(self, request: Request) -> None:
        """``request`` left the engine (finished, aborted, failed)."""
        if request.structured_output_request is not None:
            request.structured_output_request = None
            self.num_live -= 1

    def wait_for_compile(self, requests: list, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until one of these requests' grammars is compiled (the
        engine has nothing else to do meanwhile)."""
        futs = [r.structured_output_request._future for r in requests if r.structured_output_request is not None]
        if futs:
            concurrent.futures.wait(futs, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of ``so``'s constrained sampled rows, from their grammars' current
        state (every token sampled before this step must have been accepted). Rows of
        requests that finished or were preempted since ``so`` was scheduled are left
        unconstrained: their tokens are dropped. None when no row is constrained."""
        if not self.num_live:
            return None
        t0 = time.perf_counter()
        rows: list[int] = []
        grammars = []
        also: list[tuple[int, int]] = []  # (row, token) allowed besides the grammar's (an undecided start)
        row = 0
        for s in so.scheduled:
            if not s.sample:
                continue
            req = s.request
            sor = req.structured_output_request
            if (sor is not None and sor.grammar is not None and not req.is_finished()
                    and s.epoch == req.num_preemptions and not sor.grammar.is_terminated()
                    and sor.phase != REASONING):  # reasoning is not constrained
                if sor.phase == UNDECIDED:
                    also.append((row, sor.params.reasoning_start_token_id))
                rows.append(row)
                grammars.append(sor.grammar)
            row += 1
        if not rows:
            return None
        if not self._bitmasks:
            pin = self.config.device.type == "cuda"
            n = self.config.max_num_seqs
            self._bitmasks = [self.backend().allocate_token_bitmask(n, pin) for _ in range(2)]
        bitmask = self._bitmasks[self._turn]
        self._turn ^= 1  # the other buffer may still be copying to the device
        self.backend().fill_bitmasks(grammars, bitmask, rows)
        for r, tok in also:
            allow_token(bitmask, r, tok)
        self.bitmask_time_s += time.perf_counter() - t0
        self.bitmask_steps += 1
        self.bitmask_rows += len(rows)
        return GrammarOutput(rows, bitmask)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

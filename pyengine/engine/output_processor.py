"""Turns EngineCoreOutputs into RequestOutputs: incremental detokenization, stop strings,
finish reasons, logprobs, metrics, and n > 1 fan-in (mirrors
vllm/v1/engine/output_processor.py and vllm/v1/engine/parallel_sampling.py)."""
from __future__ import annotations

import logging
import threading
from typing import Any

from pyengine.engine.detokenizer import (
    DecoderTraits,
    FastIncrementalDetokenizer,
    TokenTexts,
    decode_logprob_token,
    decode_output,
    make_incremental_detokenizer,
)
from pyengine.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pyengine.metrics.stats import IterationStats
from pyengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams

# Module aliases: enum member access is slow on Python 3.11 and these run per request per step.
_CUMULATIVE, _DELTA, _FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
_STOP, _ABORT, _ERROR = FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """Single-slot hand-off of one request's outputs from the output-handler thread to one
    reader. ``put`` never blocks: if the reader lags, DELTA outputs are merged (text
    concatenated, token ids and logprobs appended, finish state kept), other kinds are
    replaced by the newer one. Mirrors vllm/v1/engine/output_processor.py's collector."""

    def __init__(self, request_id: str, output_kind: RequestOutputKind):
        self.request_id = request_id
        self.aggregate = output_kind == RequestOutputKind.DELTA
        # put() takes the bare lock (a C-level context manager) and notifies only when a
        # blocking reader waits: Condition.notify_all's Python-level ownership check costs
        # more than the rest of a put, once per request per step.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocked = 0  # readers waiting in get()
        self._output: RequestOutput | BaseException | None = None
        self._aio_waiter: tuple[Any, Any] | None = None  # (loop, asyncio.Event) of a waiting asyncio reader
        self.finished = False  # the final output has been taken

    def put(self, output: RequestOutput | BaseException, wake_asyncio: bool = True):
        """Hand ``output`` over (merging into an unread DELTA output). With
        ``wake_asyncio=False`` a waiting asyncio reader is not woken but returned as a
        ``(loop, future)`` pair, for ``wake_asyncio_readers`` to wake many with one
        cross-thread call per event loop."""
        with self._lock:
            cur = self._output
            if cur is None:
                self._output = output
            elif isinstance(output, BaseException) or isinstance(cur, BaseException):
                self._output = output if not isinstance(cur, BaseException) else cur
            elif self.aggregate:
                _merge_delta(cur, output)
            else:
                self._output = output
            if self._blocked:
                self._cond.notify_all()
            waiter, self._aio_waiter = self._aio_waiter, None
        if waiter is None or not wake_asyncio:
            return waiter
        wake_asyncio_readers([waiter])
        return None

    def _take(self) -> RequestOutput | None:
        out, self._output = self._output, None
        if isinstance(out, BaseException):
            self._output = out  # stays: every later read fails too
            raise out
        if out is not None and out.finished:
            self.finished = True
        return out

    def get_nowait(self) -> RequestOutput | None:
        """The pending output or None. Raises EngineDeadError if the engine died."""
        with self._lock:
            return self._take()

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Blocks for the next output. Raises EngineDeadError, or TimeoutError after timeout seconds."""
        with self._lock:
            self._blocked += 1
            try:
                if not self._cond.wait_for(lambda: self._output is not None, timeout):
                    raise TimeoutError(f"no output for request {self.request_id} within {timeout} s")
            finally:
                self._blocked -= 1
            return self._take()  # type: ignore[return-value] # waited for an output

    async def get_async(self) -> RequestOutput:
        import asyncio
        while True:
            with self._lock:
                if self._output is not None:
                    return self._take()  # type: ignore[return-value] # there is an output
                # a bare future (cheaper than an asyncio.Event), resolved by _set_events
                fut = asyncio.get_running_loop().create_future()
                waiter = self._aio_waiter = (fut.get_loop(), fut)
            try:
                await fut  # put() took the waiter off before resolving it
            except BaseException:
                with self._lock:
                    if self._aio_waiter is waiter:  # cancelled: do not leave a stale waiter
                        self._aio_waiter = None
                raise

    def __iter__(self):
        while not self.finished:
            yield self.get()


def _set_events(futures) -> None:
    for f in futures:
        if not f.done():  # a cancelled reader's future
            f.set_result(None)


def wake_asyncio_readers(waiters) -> None:
    """Wake ``(loop, asyncio.Future)`` waiters: one ``call_soon_threadsafe`` per event
    loop (each is a write to the loop's self-pipe), not one per request."""
    by_loop: dict = {}
    for loop, event in waiters:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_events, events)
        except RuntimeError:  # the reader's event loop is gone; nobody to wake
            pass


def _merge_delta(cur: RequestOutput, new: RequestOutput) -> None:
    """Fold ``new`` into the unread ``cur`` (the collector owns both: lists are extended
    in place)."""
    outs, news = cur.outputs, new.outputs
    if len(outs) == 1 and len(news) == 1 and outs[0].index == news[0].index:  # n == 1
        old, c = outs[0], news[0]
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob, old.finish_reason, old.stop_reason, old.error = (
            c.cumulative_logprob, c.finish_reason, c.stop_reason, c.error)
        cur.finished, cur.metrics = new.finished, new.metrics
        cur.num_cached_tokens = max(cur.num_cached_tokens, new.num_cached_tokens)
        return
    by_index = {c.index: c for c in cur.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            cur.outputs.append(c)
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
        prev.error = c.error
    cur.outputs.sort(key=lambda c: c.index)
    cur.finished = new.finished
    cur.metrics = new.metrics
    cur.num_cached_tokens = max(cur.num_cached_tokens, new.num_cached_tokens)


class _Child:
    """State of one of the n completions (one engine-core request)."""

    def __init__(self, parent: _Parent, index: int, core_req: EngineCoreRequest, tokenizer,
                 token_texts: TokenTexts | None = None, traits: DecoderTraits | None = None):
        self.parent = parent
        self.index = index
        self.core_id = core_req.request_id
        params = core_req.sampling_params
        # FINAL_ONLY without stop strings needs no incremental text: decode once at the end
        # (keeps per-step detokenization off the hot path of offline generation).
        self.deferred = (params.detokenize and tokenizer is not None and not params.stop
                         and params.output_kind == RequestOutputKind.FINAL_ONLY)
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.include_stop = params.include_stop_str_in_output
        self.final_text: str | None = None
        self.prompt_token_ids = core_req.prompt_token_ids
        self.detok = make_incremental_detokenizer(tokenizer if params.detokenize and not self.deferred else None,
                                                  core_req.prompt_token_ids, params, token_texts, traits)
        self.want_logprobs = params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if self.want_logprobs else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.failed = False  # its output could not be processed: it ends without more text
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.emitted_tokens = 0  # output tokens when this child was last reported (stream_interval)
        # The streamed common case (set by OutputProcessor.add_request): the only child of
        # a DELTA request, no logprobs, no stop strings, fast detokenizer, every token
        # reported. Its mid-stream one-token steps skip the general bookkeeping.
        self.fast = False

    def finish_deferred(self, stop_terminated: bool) -> None:
        ids = self.detok.output_token_ids
        if stop_terminated and not self.include_stop:
            ids = ids[:-1]
        self.final_text = decode_output(self.tokenizer, self.prompt_token_ids, ids, self.skip_special_tokens)

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        delta = kind == _DELTA
        finished = self.finish_reason is not None
        if self.failed:
            text = ""
        else:
            text = self.final_text or "" if self.deferred else self.detok.get_next_output_text(finished, delta)
        ids = self.detok.output_token_ids
        lps = self.logprobs
        if delta:
            ids, self.sent_tokens = ids[self.sent_tokens:], len(ids)
            if lps is not None:
                lps, self.sent_logprobs = lps[self.sent_logprobs:], len(lps)
        else:
            ids = list(ids)
            lps = list(lps) if lps is not None else None
        return CompletionOutput(self.index, text, ids, self.cumulative_logprob, lps,
                                self.finish_reason, self.stop_reason, self.error)


class _Parent:
    """One user request (n completions), its collector and metrics."""

    def __init__(self, request_id, prompt, prompt_token_ids, params: SamplingParams, collector, arrival):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = params.output_kind
        self.collector = collector
        self.children: list[_Child] = []
        self.num_finished = 0
        self.finished = False  # every child finished
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.num_cached_tokens = 0
        self.changed: list[_Child] = []  # children with news in the step being processed

    def child_finished(self) -> None:
        self.num_finished += 1
        self.finished = self.num_finished == len(self.children)

    def make_output(self, changed: list[_Child], stream_interval: int = 1) -> RequestOutput | None:
        if stream_interval > 1 and self.kind != _FINAL_ONLY and not self.finished:
            # Report a child only every stream_interval tokens, its first token at once.
            due = [c for c in changed if c.emitted_tokens == 0 and c.detok.num_output_tokens > 0
                   or c.detok.num_output_tokens - c.emitted_tokens >= stream_interval
                   or c.finish_reason is not None]
            if not due:
                return None
            for c in due:
                c.emitted_tokens = c.detok.num_output_tokens
            changed = due
        if self.kind == _FINAL_ONLY:
            if not self.finished:
                return None
            outs = [c.completion(_CUMULATIVE) for c in self.children]
        elif self.kind == _DELTA:
            outs = [c.completion(self.kind) for c in changed]
            outs = [o for o in outs if o.text or o.token_ids or o.finish_reason]
            if not outs and not self.finished:
                return None
        else:
            outs = [c.completion(self.kind) for c in self.children]
        m = self.metrics  # a snapshot: a reader may hold this output while the request goes on
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             RequestMetrics(m.arrival_time, m.first_token_time, m.last_token_time,
                                            m.finished_time, m.first_scheduled_time), self.num_cached_tokens)


class OutputProcessor:
    """Not thread-safe; the owner serializes calls (AsyncLLM holds a lock).
    ``stream_interval``: streamed outputs every this many tokens of a request (its first
    token and its end at once)."""

    def __init__(self, tokenizer, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.parents: dict[str, _Parent] = {}
        self.children: dict[str, _Child] = {}
        self.token_texts = TokenTexts.for_tokenizer(tokenizer) if tokenizer is not None else None
        self.decoder_traits = DecoderTraits.of(tokenizer) if tokenizer is not None else None

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, core_reqs: list[EngineCoreRequest], collector: Any = None) -> None:
        """Raises ValueError for a duplicate request id."""
        if request_id in self.parents or any(r.request_id in self.children for r in core_reqs):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        parent = _Parent(request_id, prompt, prompt_token_ids, params, collector, core_reqs[0].arrival_time)
        for i, r in enumerate(core_reqs):
            child = _Child(parent, i, r, self.tokenizer, self.token_texts, self.decoder_traits)
            parent.children.append(child)
            self.children[r.request_id] = child
        if len(core_reqs) == 1 and self.stream_interval <= 1 and parent.kind == _DELTA:
            child = parent.children[0]
            child.fast = (not child.want_logprobs and not child.deferred
                          and type(child.detok) is FastIncrementalDetokenizer and not child.detok.stop)
        self.parents[request_id] = parent

    def core_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.core_id for c in parent.children if c.finish_reason is None] if parent else []

    def abort_requests(self, request_ids, timestamp: float
                       ) -> tuple[list[str], list[tuple[Any, RequestOutput]]]:
        """Finish these requests here and now (vLLM frees the id in its output
        processor at abort time): each unfinished completion ends with finish_reason
        "abort", the request id is free again at once, and the engine core's own abort
        outputs, arriving later, are ignored. Unknown or finished ids are skipped.
        Returns (core request ids to abort in the engine core, [(collector, final
        RequestOutput)])."""
        core_ids: list[str] = []
        deliveries = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            changed = [c for c in parent.children if c.finish_reason is None]
            for child in changed:
                core_ids.append(child.core_id)
                del self.children[child.core_id]
                child.finish_reason = _ABORT
                if child.deferred:
                    child.finish_deferred(False)
                parent.child_finished()
            parent.metrics.finished_time = timestamp
            out = parent.make_output(changed)
            if out is not None:
                deliveries.append((parent.collector, out))
        return core_ids, deliveries

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float,
                        iteration_stats: IterationStats | None = None
                        ) -> tuple[list[tuple[Any, RequestOutput]], list[str]]:
        """Returns ([(collector, RequestOutput)] in arrival order of outputs, core request
        ids to abort because a stop string finished them). Adds this step's token counts
        to ``iteration_stats`` when one is given."""
        # parents with news, in order of their first output this step; a (collector,
        # RequestOutput) pair where the fast path built the output at once
        changed: list = []
        to_abort: list[str] = []
        children = self.children
        for eco in outputs:
            child = children.get(eco.request_id)
            if child is None:
                continue  # already finished here (stop string) or unknown
            parent = child.parent
            try:
                if child.fast and eco.finish_reason is None and eco.new_logprobs is None and not parent.changed:
                    # A mid-stream step of the streamed common case: the same RequestOutput the
                    # general path makes (see _Child.completion and _Parent.make_output).
                    ids = eco.new_token_ids
                    m = parent.metrics
                    if len(ids) == 1 and m.first_token_time is not None:
                        text = child.detok.step_delta(ids[0])  # type: ignore[attr-defined] # fast: a FastIncrementalDetokenizer
                        if text is not None:
                            m.last_token_time = timestamp
                            child.sent_tokens += 1
                            if iteration_stats is not None:
                                iteration_stats.num_generation_tokens += 1
                            changed.append((parent.collector, RequestOutput(
                                parent.request_id, parent.prompt, parent.prompt_token_ids,
                                [CompletionOutput(child.index, text, ids)], False,
                                RequestMetrics(m.arrival_time, m.first_token_time, timestamp, None,
                                               m.first_scheduled_time), parent.num_cached_tokens)))
                            continue
                self._update_child(child, eco, timestamp, iteration_stats, to_abort)
            except Exception as e:  # one request's failure ends that request, not the engine
                self._fail_child(child, eco, e, timestamp, to_abort)
            if not parent.changed:
                changed.append(parent)
            parent.changed.append(child)
        deliveries = []
        interval = self.stream_interval
        for parent in changed:
            if type(parent) is tuple:
                deliveries.append(parent)
                continue
            try:
                out = parent.make_output(parent.changed, interval)
            except Exception as e:  # as in _fail_child: this request ends, the rest go on
                logger.exception("Output processing failed for request %s", parent.request_id)
                out = self._fail_parent(parent, e, timestamp, to_abort)
            parent.changed = []
            if parent.finished:
                del self.parents[parent.request_id]
            if out is not None:
                deliveries.append((parent.collector, out))
        return deliveries, to_abort

    def _update_child(self, child: _Child, eco: EngineCoreOutput, timestamp: float,
                      iteration_stats: IterationStats | None, to_abort: list[str]) -> None:
        """One engine-core output of one completion: metrics, logprobs, text, stop
        strings, finish."""
        parent = child.parent
        if eco.new_token_ids:
            m = parent.metrics
            if m.first_token_time is None:
                m.first_token_time = timestamp
                m.first_scheduled_time = eco.first_scheduled_time
                parent.num_cached_tokens = eco.num_cached_tokens
                if iteration_stats is not None:
                    iteration_stats.num_prompt_tokens += len(parent.prompt_token_ids) - eco.num_cached_tokens
            m.last_token_time = timestamp
            if iteration_stats is not None:
                iteration_stats.num_generation_tokens += len(eco.new_token_ids)
        finish = eco.finish_reason
        finished = finish is not None
        want_lps = child.want_logprobs and eco.new_logprobs
        num_before = child.detok.num_output_tokens if want_lps else 0
        stop_str = child.detok.update(eco.new_token_ids, finish == _STOP, finished)
        if want_lps:
            # (a stop string inside several new tokens drops those after it, logprobs too)
            for entry in eco.new_logprobs[:child.detok.num_output_tokens - num_before]:  # type: ignore[index] # set: want_lps
                child.logprobs.append(self._logprob_dict(entry))  # type: ignore[union-attr] # lists when want_logprobs
                child.cumulative_logprob += entry.logprobs[0]  # type: ignore[operator]
        if stop_str is not None and finish != _ABORT:
            child.finish_reason, child.stop_reason = _STOP, stop_str
            if not finished:
                to_abort.append(eco.request_id)
        elif finished:
            child.finish_reason, child.stop_reason = eco.finish_reason, eco.stop_reason
            child.error = eco.error
        if child.finish_reason is not None:
            if child.deferred:
                child.finish_deferred(finish == _STOP)
            del self.children[eco.request_id]
            parent.child_finished()
            if parent.finished:
                parent.metrics.finished_time = timestamp

    def _fail_child(self, child: _Child, eco: EngineCoreOutput, error: Exception, timestamp: float,
                    to_abort: list[str]) -> None:
        """``child`` could not be processed (a detokenizer, stop-string or logprob
        failure): it ends with finish_reason "error" and the message, its engine-core
        request is aborted, and every other request goes on."""
        logger.exception("Output processing failed for request %s", child.parent.request_id)
        child.error = f"Output processing failed: {type(error).__name__}: {error}"
        child.finish_reason, child.stop_reason = _ERROR, None
        child.failed = True
        if not eco.finished:
            to_abort.append(eco.request_id)
        if self.children.pop(eco.request_id, None) is not None:
            child.parent.child_finished()
            if child.parent.finished:
                child.parent.metrics.finished_time = timestamp

    def _fail_parent(self, parent: _Parent, error: Exception, timestamp: float,
                     to_abort: list[str]) -> RequestOutput:
        """Every completion of ``parent`` ends with "error" (its output could not be
        built); returns its final output, built without its text."""
        msg = f"Output processing failed: {type(error).__name__}: {error}"
        for c in parent.children:
            c.failed = True
            if c.finish_reason is None:
                c.finish_reason, c.error = _ERROR, msg
                to_abort.append(c.core_id)
                self.children.pop(c.core_id, None)
                parent.child_finished()
            elif c.finish_reason != _ERROR:
                c.finish_reason, c.error = _ERROR, msg
        parent.metrics.finished_time = timestamp
        return parent.make_output(parent.children)  # type: ignore[return-value] # finished: there is an output

    def _logprob_dict(self, entry) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for rank, (tid, lp) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if tid in d:
                continue
            d[tid] = Logprob(lp, entry.sampled_rank if rank == 0 else rank,
                             decode_logprob_token(self.tokenizer, tid) if self.tokenizer is not None else None)
        return d

    def fail_all(self, error: BaseException) -> list[Any]:
        """Engine died: returns every pending request's collector and forgets them."""
        collectors = [p.collector for p in self.parents.values()]
        self.parents.clear()
        self.children.clear()
        return collectors

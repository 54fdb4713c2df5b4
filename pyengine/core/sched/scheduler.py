"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption by
recompute (mirrors vllm/v1/core/sched/scheduler.py).

Each step gets a token budget (``max_num_batched_tokens``). Running requests are served
first (decodes and unfinished prefill chunks), then waiting ones, mixed in one batch.
When a running request cannot get a KV block, the policy's victim is preempted: its
blocks are freed and it goes back to the waiting queue keeping its tokens.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from pyengine.config import EngineConfig, SchedulingPolicy
from pyengine.core.kv_cache_manager import KVCacheManager, cdiv
from pyengine.core.sched.output import ScheduledRequest, SchedulerOutput
from pyengine.core.sched.request_queue import create_request_queue
from pyengine.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pyengine.request import Request, RequestStatus
from pyengine.structured_output import GrammarOutput, StructuredOutputManager

logger = logging.getLogger(__name__)

# Module aliases: enum member access is slow on Python 3.11 and these sit in per-request loops.
_RUNNING = RequestStatus.RUNNING
_PRIORITY = SchedulingPolicy.PRIORITY
# While only grammars are compiling, schedule() waits this long for one (instead of spinning).
_COMPILE_WAIT_S = 0.005
# _try_admit's answers when a waiting request is not admitted.
_NO_BUDGET, _NO_ROOM = -1, 0
# How many steps ahead a re-admitted request's reserve looks (see _readmission_reserve):
# one with more tokens to go may be preempted again after that much progress, so its
# preemptions stay under 1 + its remaining tokens / this; a request with a huge max_tokens
# (the room-left default) does not wait for the whole running set to drain.
READMISSION_HORIZON_STEPS = 256


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.policy = SchedulingPolicy.parse(config.scheduling_policy)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               config.kv_events_config is not None)
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []  # aborts, reported with the next outputs
        self.num_preemptions = 0
        self.num_steps = 0
        self.step_host_time_s = 0.0
        self.structured_output_manager = StructuredOutputManager(config)
        self._waiting_for_fsm: list[Request] = []  # grammars compiling, in arrival order
        # Speculative decoding: drafts fed as lookahead tokens; a draft-model / EAGLE-3
        # proposer also writes its own KV past the step's tokens (lookahead slots).
        spec = config.speculative_config
        self.spec_enabled = spec is not None
        # the runner fills the drafts in (AsyncScheduler: k placeholders per decode row)
        self.drafts_on_worker = False
        self.spec_disable_batch = spec.disable_by_batch_size if spec is not None else None
        self._spec_step = False  # this schedule() call's SchedulerOutput.speculative
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec is not None and spec.uses_draft_kv else 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Raises ValueError for a request id already in the scheduler."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine core.")
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
            self._waiting_for_fsm.append(request)
        else:
            self.waiting.add(request)
        self.requests[request.request_id] = request

    def fail_request(self, request_id: str, error: BaseException) -> None:
        """vLLM's per-request error path: end this one request with FinishReason.ERROR
        wherever it is (waiting, running, half-admitted), free its KV blocks, and report
        it with the next outputs. The other requests are untouched. Never raises."""
        logger.error("Request %s failed inside the engine core; only it is ended", request_id,
                     exc_info=(type(error), error, error.__traceback__))
        req = self.requests.get(request_id)
        if req is not None:
            if req in self.running:  # (half-admitted: in both)
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self._waiting_for_fsm:
                self._waiting_for_fsm.remove(req)
            req.status = RequestStatus.FINISHED_ERROR
            try:
                self._free_request(req)
            except Exception:  # noqa: BLE001 - the blocks' state is what failed; keep serving
                logger.exception("Freeing the blocks of failed request %s failed", request_id)
                self.requests.pop(request_id, None)
                self.finished_req_ids.add(request_id)
        self._pending_outputs.append(EngineCoreOutput(
            request_id, [], finish_reason=FinishReason.ERROR, error=f"{type(error).__name__}: {error}"))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                self._waiting_for_fsm.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._pending_outputs.append(EngineCoreOutput(
                rid, [], finish_reason=req.get_finished_reason(), stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0)))
            self._free_request(req)

    def _free_request(self, req: Request) -> None:
        self.structured_output_manager.finish_request(req)
        self.kv_cache_manager.free(req)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_pending_outputs(self) -> EngineCoreOutputs | None:
        """Outputs produced without a model step (aborts), or None."""
        if not self._pending_outputs:
            return None
        return self._make_outputs([])

    # ---- scheduling ----------------------------------------------------------------
    # (The per-request checks below, run for every running request at every step, read
    # ``len(req.all_token_ids)`` for ``req.num_tokens`` once instead of calling the
    # properties: a property is a Python call, several per request per step.)
    def _num_tokens_to_feed(self, req: Request) -> int:
        return len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens

    def wants_speculative_step(self) -> bool:
        """Speculative decoding would run in the next step: it is configured and fewer
        requests run than ``disable_by_batch_size`` (if set). Under async scheduling the
        engine consumes the batch in flight before scheduling only where this changes
        between two steps."""
        return self.spec_enabled and (self.spec_disable_batch is None or len(self.running) < self.spec_disable_batch)

    def _drafts_for_step(self, req: Request, n: int, budget: int) -> Sequence[int]:
        """The draft tokens ``req`` feeds this step (its ``spec_token_ids``, consumed):
        none for a prefill chunk, a constrained request, a request with a token in flight
        (async scheduling), or a step that is not speculative (``disable_by_batch_size``
        running requests or more); cut so that the step's tokens fit the
        budget and its 1 + k possible new tokens exceed neither ``max_tokens`` nor
        ``max_model_len``."""
        spec, req.spec_token_ids = req.spec_token_ids, []
        if n != 1 or req.structured_output_request is not None:
            return []
        if not self._spec_step or req.num_output_placeholders:
            return []
        k = min(len(spec), budget - 1, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1)
        return spec[:k] if k > 0 else []

    def _lookahead(self, req: Request, n: int) -> int:
        """Slots past the step's ``n`` tokens that the proposer writes its KV into: only
        when this step samples, and never past max_model_len."""
        if not self.num_lookahead_tokens or req.num_computed_tokens + n < req.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - req.num_computed_tokens - n))

    def _can_schedule_running(self, req: Request) -> bool:
        # Placeholders count against max_tokens and max_model_len: an in-flight token may finish it.
        ph = req.num_output_placeholders
        if ph:
            num_tokens = len(req.all_token_ids)
            if num_tokens - req.num_prompt_tokens + ph >= req.max_tokens:
                return False
            if num_tokens + ph >= self.max_model_len:
                return False
        return True

    def _pick_victim(self) -> Request:
        if self.policy is _PRIORITY:
            # Largest (priority, arrival_time), ties by request id exactly as the waiting queue
            # orders them (Request.__lt__): the n > 1 children of one request tie on both,
            # and breaking the tie the other way round made them preempt each other forever.
            return max(self.running)
        return self.running[-1]

    def _try_admit(self, req: Request, budget: int) -> int:
        """Admit the waiting request ``req`` for up to ``budget`` tokens of its prefill.

        Returns the number of tokens scheduled, ``_NO_BUDGET`` (chunked prefill is off and
        the prompt does not fit the budget) or ``_NO_ROOM`` (no free seat, not enough free
        KV blocks, or, for a request that was preempted before, not enough to keep the
        re-admission reserve free; see ``_readmission_reserve``)."""
        if len(self.running) >= self.max_num_seqs:
            return _NO_ROOM
        kv = self.kv_cache_manager
        hit_blocks: list = []  # KVCacheBlocks
        num_hit = 0
        if req.num_computed_tokens == 0:
            hit_blocks, num_hit = kv.get_computed_blocks(req)
        n = req.num_tokens - num_hit
        thr = self.long_prefill_token_threshold
        if 0 < thr < n:
            n = thr  # a long prefill advances by at most thr tokens a step
        if not self.config.enable_chunked_prefill and n > budget:
            return _NO_BUDGET
        n = min(n, budget)
        if req.num_preemptions and self.running:
            take = kv.num_blocks_to_take(req, n, hit_blocks)
            if take + self._readmission_reserve(req, num_hit + n) > kv.block_pool.get_num_free_blocks():
                return _NO_ROOM
        lookahead = self.num_lookahead_tokens and self._lookahead_admit(req, num_hit, n)
        if not kv.allocate_slots(req, n, hit_blocks, num_lookahead_tokens=lookahead):
            return _NO_ROOM
        if req.num_cached_tokens < 0:  # first admission
            req.num_cached_tokens = num_hit
            req.first_scheduled_time = time.monotonic()
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return n

    def _lookahead_admit(self, req: Request, num_hit: int, n: int) -> int:
        """``_lookahead`` for a waiting request admitted with ``num_hit`` cached tokens."""
        if num_hit + n < req.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_hit - n))

    def _final_len(self, req: Request) -> int:
        """The request's length once it generated all its max_tokens."""
        return min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)

    def _readmission_reserve(self, req: Request, num_tokens_admitted: int) -> int:
        """KV blocks that must stay free after re-admitting the preempted request ``req``
        (``num_tokens_admitted`` of its tokens get blocks now), so that it is not the next
        victim again (recompute thrash): its own growth over the steps it still needs
        (its remaining tokens plus its prefill chunks, at most READMISSION_HORIZON_STEPS),
        plus the growth over those steps of every running request that would be preempted
        after it (all of them under fcfs, whose victim is the latest admitted; the more
        urgent ones under priority), each capped at its final length. A first admission
        keeps no reserve (vLLM's optimistic admission); without KV pressure nothing is
        preempted, so this costs nothing."""
        bs = self.kv_cache_manager.block_size
        kv = self.kv_cache_manager
        steps = min((req.max_tokens - req.num_output_tokens) + cdiv(req.num_tokens, self.max_num_batched_tokens),
                    READMISSION_HORIZON_STEPS)
        own_target = min(req.num_tokens + steps, self._final_len(req))
        need = max(cdiv(own_target, bs) - cdiv(num_tokens_admitted, bs), 0)
        for r in self.running:
            if self.policy is _PRIORITY and not r < req:
                continue  # less urgent than req: preempted before it
            target = min(r.num_tokens + r.num_output_placeholders + steps, self._final_len(r))
            need += max(cdiv(target, bs) - kv.num_blocks(r.request_id), 0)
        return need

    def _priority_victim(self, req: Request, budget: int) -> Request | None:
        """Under the priority policy, the running request to preempt so that the waiting
        ``req`` can be admitted: the least urgent one, if ``req`` is strictly more urgent
        (lower priority value) and preempting every strictly less urgent running request
        would free enough seats and KV blocks. None otherwise."""
        if self.policy is not _PRIORITY or not self.running:
            return None
        victim = max(self.running)
        if victim.priority <= req.priority:
            return None
        kv = self.kv_cache_manager
        lower = [r for r in self.running if r.priority > req.priority]
        freeable = sum(kv.num_blocks(r.request_id) for r in lower)
        n = min(req.num_tokens, budget)
        reserve = self._readmission_reserve(req, n) if req.num_preemptions and len(lower) < len(self.running) else 0
        if kv.num_blocks_to_take(req, n) + reserve > kv.block_pool.get_num_free_blocks() + freeable:
            return None
        return victim

    def _unschedule(self, req: Request, scheduled: list[ScheduledRequest]) -> int:
        """Take ``req`` out of this step's batch if it is in it; returns its tokens."""
        for j, s in enumerate(scheduled):
            if s.request is req:
                return scheduled.pop(j).num_new_tokens
        return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar finished compiling to the waiting queue (a compile
        error ends only that request)."""
        if not self.running and not len(self.waiting):
            # Nothing else to run: wait briefly for a grammar instead of spinning.
            self.structured_output_manager.wait_for_compile(self._waiting_for_fsm, _COMPILE_WAIT_S)
        pending, self._waiting_for_fsm = self._waiting_for_fsm, []
        for req in pending:
            sor = req.structured_output_request
            if not sor.is_ready():
                self._waiting_for_fsm.append(req)
                continue
            try:
                sor.take_grammar(self.structured_output_manager.backend)
            except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                self.fail_request(req.request_id, e)
                continue
            req.status = RequestStatus.WAITING
            self.waiting.add(req)

    def get_grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The token bitmask of ``so``'s constrained rows (vLLM's
        ``Scheduler.get_grammar_bitmask``). Call it once every token sampled before ``so``
        went through ``update_from_output``; None when no row is constrained."""
        return self.structured_output_manager.grammar_bitmask(so)

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        if self._waiting_for_fsm:
            self._admit_compiled()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._spec_step = self.wants_speculative_step()
        kv = self.kv_cache_manager
        thr = self.long_prefill_token_threshold
        worker_drafts = self._spec_step and self.drafts_on_worker

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            try:
                n = self._num_tokens_to_feed(req)
                if 0 < thr < n:
                    n = thr  # a long prefill advances by at most thr tokens a step
                n = min(n, budget)
                if n <= 0 or not self._can_schedule_running(req):
                    i += 1
                    continue
                spec = self._drafts_for_step(req, n, budget) if req.spec_token_ids or worker_drafts else ()
                if spec:
                    n += len(spec)
                # (no call per request per step without speculative decoding)
                lookahead = self._lookahead(req, n) if self.num_lookahead_tokens else 0
                while not kv.allocate_slots(req, n, (), lookahead):
                    victim = self._pick_victim()
                    if self.running.index(victim) < i:
                        # Already scheduled this step (priority policy): take that back too.
                        i -= 1
                        budget += self._unschedule(victim, scheduled)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                if req.status != _RUNNING:
                    continue  # req itself was preempted; self.running shifted under index i
                scheduled.append(self._scheduled(req, n, spec))
            except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                self.fail_request(req.request_id, e)
                continue  # it left self.running: index i now holds the next request
            budget -= n
            i += 1

        num_prefill = 0
        if not preempted:  # a step that preempted for KV admits nothing (as vLLM)
            while len(self.waiting) and budget > 0:
                req = self.waiting.peek()
                try:
                    n = self._try_admit(req, budget)
                    if n == _NO_BUDGET:
                        break
                    if n == _NO_ROOM:
                        rival = self._priority_victim(req, budget)
                        if rival is None:
                            break
                        # A strictly more urgent request is waiting and the running set is full
                        # (seats or KV): make room by preempting the least urgent running one.
                        budget += self._unschedule(rival, scheduled)
                        self._preempt(rival)
                        preempted.append(rival.request_id)
                        continue
                    self.waiting.pop()
                    scheduled.append(self._scheduled(req, n))
                except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                    self.fail_request(req.request_id, e)
                    continue
                budget -= n
                num_prefill += 1

        out = SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, num_prefill, preempted,
                              self.finished_req_ids)
        out.speculative = self._spec_step
        if self.structured_output_manager.num_live:
            out.has_structured_output = any(s.sample and s.request.structured_output_request is not None
                                            for s in scheduled)
        if scheduled:  # an empty output is not run; keep the ids for the next one
            self.finished_req_ids = set()
        for s in scheduled:
            self._update_after_schedule(s)
        self.step_host_time_s += time.perf_counter() - t0
        return out

    def _scheduled(self, req: Request, n: int, spec: Sequence[int] = ()) -> ScheduledRequest:
        start, num_tokens, ph = req.num_computed_tokens, len(req.all_token_ids), req.num_output_placeholders
        sample = start + n >= num_tokens + ph
        placeholder = ph > 0 and start + n > num_tokens
        s = ScheduledRequest(req, n, start, self.kv_cache_manager.get_block_ids(req.request_id),
                             sample, placeholder, req.num_preemptions)
        if spec:
            s.spec_token_ids = spec
        return s

    def _update_after_schedule(self, s: ScheduledRequest) -> None:
        s.request.num_computed_tokens += s.num_new_tokens

    # ---- results -------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, runner_output) -> EngineCoreOutputs:
        """Append sampled tokens, check stop conditions, free finished requests.

        runner_output: ModelRunnerOutput with ``sampled_token_ids`` (host list, one per
        sampled row, in the order of ``so.scheduled`` rows with ``sample=True``) and
        ``logprobs`` (None or a list of LogprobsEntry per row). With constrained requests in
        the engine, their grammars first take the step's tokens in one call into the
        grammar backend.

        Speculative decoding: ``generated_token_ids`` (per sampled row the 1..k+1 tokens
        the verification produced: the accepted drafts, then the target's own token),
        ``generated_logprobs`` (per row, one entry per token), ``draft_token_ids`` (per
        row the drafts proposed for the next step; None under async scheduling, where the
        runner keeps them) and ``num_draft_tokens`` (per row the drafts fed, when fewer
        than the placeholders scheduled; None: all). The rejected drafts' KV is rolled back
        (``num_computed_tokens``); tokens after one that ends the request (a stop token,
        max_tokens, max_model_len) are dropped."""
        t0 = time.perf_counter()
        gen = getattr(runner_output, "generated_token_ids", None)
        if gen is not None:
            glps = runner_output.generated_logprobs
            drafts = runner_output.draft_token_ids
            fed = getattr(runner_output, "num_draft_tokens", None)
            tokens = [g[0] for g in gen]
        else:
            tokens = runner_output.sampled_token_ids
            lps = runner_output.logprobs
        rejected = self._accept_structured(so, tokens) if self.structured_output_manager.num_live else ()
        outputs: list[EngineCoreOutput] = []
        row = 0
        for s in so.scheduled:
            if not s.sample:
                continue
            if gen is not None:
                toks, lp_list = gen[row], (glps[row] if glps is not None else None)
                new_drafts = drafts[row] if drafts is not None else None
                num_fed = fed[row] if fed is not None else None
            else:  # one token (the lists for its output are made below)
                tok, lp = tokens[row], (lps[row] if lps is not None else None)
            row += 1
            req = s.request
            if req.is_finished() or req.request_id not in self.requests:
                continue  # finished while this batch was in flight
            if s.epoch != req.num_preemptions:
                # Preempted while this batch was in flight: the token is dropped (a seeded
                # request draws it again at the same position: the same draw, as in sync
                # scheduling; pyengine/worker/sampler.py draw_exponentials).
                continue
            try:
                self._on_token_consumed(req)
                if gen is None:
                    if s.spec_token_ids:
                        self._account_drafts(req, len(s.spec_token_ids), 1)
                    req.all_token_ids.append(tok)
                    finished = self._check_stop(req, tok)
                    toks, lp_list = [tok], ([lp] if lp is not None else None)
                else:
                    if s.spec_token_ids:
                        self._account_drafts(req, len(s.spec_token_ids), len(toks), num_fed)
                    appended = 0
                    for tok in toks:
                        req.all_token_ids.append(tok)
                        appended += 1
                        finished = self._check_stop(req, tok)
                        if finished:
                            break
                    # copies: the runner's lists are not the outputs' (cut after a stop)
                    toks = list(toks[:appended])
                    if lp_list is not None:
                        lp_list = list(lp_list[:appended])
                    if not finished and new_drafts:
                        req.spec_token_ids = new_drafts
                if req.request_id in rejected:
                    raise ValueError(f"the structured-output grammar rejected token {tok} (output token "
                                     f"{req.num_output_tokens}); this is a bug, please report it")
                sor = req.structured_output_request
                if sor is not None and not finished and sor.grammar.is_terminated():
                    # The grammar is complete and took a stop token that does not end the
                    # request (ignore_eos): nothing else may follow.
                    req.status = RequestStatus.FINISHED_STOPPED
                    finished = True
                first = len(req.all_token_ids) - req.num_prompt_tokens == len(toks)  # (num_output_tokens)
                out = EngineCoreOutput(
                    req.request_id, toks, lp_list,
                    finish_reason=req.get_finished_reason() if finished else None,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0) if first else 0,
                    first_scheduled_time=req.first_scheduled_time if first else None)
                if finished:
                    self.running.remove(req)
                    self._free_request(req)
            except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                self.fail_request(req.request_id, e)
                continue
            outputs.append(out)
        self.num_steps += 1
        self.step_host_time_s += time.perf_counter() - t0
        return self._make_outputs(outputs, so.total_num_scheduled_tokens)

    def _account_drafts(self, req: Request, num_drafts: int, num_generated: int, num_fed: int | None = None) -> None:
        """A verified run of ``num_drafts`` scheduled drafts gave ``num_generated``
        tokens (the accepted drafts and one more): the rejected drafts' KV is rolled back
        (it is overwritten when real tokens take those positions), and the counters
        advance. ``num_fed``: the drafts the runner actually fed (async scheduling: it
        fills ``num_drafts`` placeholders with up to that many proposed drafts; the rest
        count as rejected here, and not as drafts in the counters); None: all of them."""
        accepted = num_generated - 1
        req.num_computed_tokens -= num_drafts - accepted
        if num_fed is not None:
            num_drafts = num_fed
            if not num_drafts:
                return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += accepted
        per_pos = self.spec_accepted_per_pos
        for j in range(accepted):
            per_pos[j] += 1

    def _accept_structured(self, so: SchedulerOutput, tokens: list[int]) -> set:
        """Advance each constrained request's grammar by its token of this step; returns
        the ids whose grammar rejected it."""
        reqs: list[Request] = []
        grammars: list = []
        toks: list[int] = []
        row = 0
        for s in so.scheduled:
            if not s.sample:
                continue
            tok = tokens[row]
            row += 1
            req = s.request
            sor = req.structured_output_request
            # the rows update_from_output keeps (not finished meanwhile, not preempted since)
            if (sor is not None and not req.is_finished() and req.request_id in self.requests
                    and s.epoch == req.num_preemptions and sor.advance(tok)):  # reasoning: not the grammar's
                reqs.append(req)
                grammars.append(sor.grammar)
                toks.append(tok)
        if not grammars:
            return set()
        ok = self.structured_output_manager.backend().accept_tokens(grammars, toks)
        return {r.request_id for r, accepted in zip(reqs, ok) if not accepted}

    def _on_token_consumed(self, req: Request) -> None:
        pass  # async scheduler: one placeholder resolved

    def _check_stop(self, req: Request, tok: int) -> bool:
        sp = req.sampling_params
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        # stop_token_ids, plus EOS unless ignore_eos
        if num_output >= sp.min_tokens and tok in sp.all_stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok if tok in sp.stop_token_ids else None  # type: ignore[operator] # a list after __post_init__
            return True
        if num_output >= req.max_tokens or num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _make_outputs(self, outputs: list[EngineCoreOutput], num_batched_tokens: int = 0) -> EngineCoreOutputs:
        if self._pending_outputs:
            outputs = self._pending_outputs + outputs
            self._pending_outputs = []
        return EngineCoreOutputs(outputs, self.make_stats(num_batched_tokens), time.monotonic())

    def make_stats(self, num_batched_tokens: int = 0) -> SchedulerStats:
        """``num_batched_tokens``: the tokens of the step these stats go out with (0: none)."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.queries, prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions, num_gpu_blocks=kv.block_pool.num_blocks - 1,
            num_free_blocks=kv.block_pool.get_num_free_blocks(), num_steps=self.num_steps,
            step_host_time_s=self.step_host_time_s, num_batched_tokens=num_batched_tokens,
            grammar_bitmask_time_s=self.structured_output_manager.bitmask_time_s,
            grammar_bitmask_steps=self.structured_output_manager.bitmask_steps,
            grammar_bitmask_rows=self.structured_output_manager.bitmask_rows,
            engine_index=self.config.data_parallel_rank,
            spec_num_drafts=self.spec_num_drafts, spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos))

"""Per-request sampling state kept by the model runner across steps: where each
request with a ``thinking_token_budget`` stands in its reasoning (``ThinkingBudgetState``,
advanced over the output tokens the host has seen, O(new tokens) per step). Builds each
step's ``SamplingMetadata`` (mirrors the role of vllm/v1/worker/gpu_input_batch.py's
sampling state). A seeded request keeps no state here: its draws are a function of its
seed and each row's position (``pyengine.worker.sampler.draw_exponentials``).

A step whose rows read nothing that changes from step to step (no penalties, min_tokens,
bad words, thinking budget or seed: plain greedy / temperature / top-k / top-p rows, the
common case) gets the metadata built for the same rows before, if it is among the last
few built: at batch 1 that is every step but the first (and, with speculation, the
first of each row count), saving the per-row build and its host-to-device copy. A
request's ``SamplingParams`` are not changed while it runs."""
from __future__ import annotations

from operator import is_

import torch

from pyengine.worker.sampler import SamplingMetadata

__all__ = ["SamplingState", "ThinkingBudgetState"]

# static metadata kept (plain decode and a verification row count or two at batch 1)
_STATIC_KEPT = 4

_CONTENT, _REASONING, _UNDECIDED = 0, 1, 2


def _seed(sp) -> int | None:
    return sp.seed if sp.seed is not None and not sp.sampling_type_greedy else None


class ThinkingBudgetState:
    """One request's output against its thinking budget, after its first ``seen`` output
    tokens: its phase (the reasoning parsers' rules: an undecided start is opened by the
    start tag, ended by any other first token; the reasoning ends at the end tag) and
    ``count``, its reasoning tokens so far (tags not counted)."""

    __slots__ = ("phase", "count", "seen")

    def __init__(self, params):
        self.phase = _REASONING if params.thinking_open else _UNDECIDED
        self.count = 0
        self.seen = 0

    def copy(self) -> ThinkingBudgetState:
        c = ThinkingBudgetState.__new__(ThinkingBudgetState)
        c.phase, c.count, c.seen = self.phase, self.count, self.seen
        return c

    def feed(self, tokens, params) -> None:
        """Advance over these output tokens (the next ones after ``seen``)."""
        start, end = params.thinking_start_token_id, params.thinking_end_token_id
        for t in tokens:
            if self.phase == _UNDECIDED:
                self.phase = _REASONING if t == start else _CONTENT
            elif self.phase == _REASONING:
                if t == end:
                    self.phase = _CONTENT
                elif t != start:  # a repeated start tag is not reasoning
                    self.count += 1
        self.seen += len(tokens)

    def catch_up(self, request) -> None:
        """Advance over the output tokens of ``request`` the host has seen since last time
        (they only grow: preemption keeps them, dropped tokens were never appended)."""
        sp, first = request.sampling_params, request.num_prompt_tokens + self.seen
        if self.phase != _CONTENT and first < request.num_tokens:
            self.feed(request.all_token_ids[first:], sp)
        else:
            self.seen = request.num_tokens - request.num_prompt_tokens

    def row(self, params, placeholder: bool) -> tuple[int, int, int, int, int] | None:
        """This step's ``SamplingMetadata.build`` ``thinking`` entry: None when the next
        token is surely free, else ``(end, depends on the newest token, start or -1, forced
        if it is the start tag, forced if it is another token but the end tag)``.
        ``placeholder``: the newest output token is on the device only (not fed here)."""
        budget, end = params.thinking_token_budget, params.thinking_end_token_id
        if not placeholder:
            return (end, 0, -1, 1, 1) if self.phase == _REASONING and self.count >= budget else None
        if self.phase == _REASONING:
            if_start, if_other = self.count >= budget, self.count + 1 >= budget
        elif self.phase == _UNDECIDED:  # that token is the first: the start tag opens an empty reasoning
            if_start, if_other = budget <= 0, False
        else:
            return None
        if not (if_start or if_other):
            return None
        start = params.thinking_start_token_id
        return end, 1, -1 if start is None else start, int(if_start), int(if_other)



class SamplingState:
    """``device``: where the metadata lives; ``vocab_size``: the logits' width."""

    def __init__(self, device: torch.device, vocab_size: int):
        self.device, self.vocab_size = device, vocab_size
        self._thinking: dict[str, ThinkingBudgetState] = {}
        # metadata of steps whose rows read no per-step state, newest first:
        # (each request's params, each request's row count, metadata)
        self._static: list[tuple[tuple, tuple, SamplingMetadata]] = []

    def forget(self, request_ids) -> None:
        """These requests finished: drop their budget states."""
        for rid in request_ids:
            self._thinking.pop(rid, None)

    def clear(self) -> None:
        self._thinking.clear()
        self._static.clear()

    def thinking_state(self, request) -> ThinkingBudgetState:
        """``request``'s budget state, caught up with the output the host has seen."""
        st = self._thinking.get(request.request_id)
        if st is None:
            st = self._thinking[request.request_id] = ThinkingBudgetState(request.sampling_params)
        st.catch_up(request)
        return st

    def _cached(self, params: tuple, rows: tuple) -> SamplingMetadata | None:
        for p, r, meta in self._static:
            if r == rows and all(map(is_, p, params)):
                return meta
        return None

    def _keep(self, params: tuple, rows: tuple, meta: SamplingMetadata) -> SamplingMetadata:
        self._static.insert(0, (params, rows, meta))
        del self._static[_STATIC_KEPT:]
        return meta

    def metadata(self, sampled, ph_flags, spec: bool = False, pending=None) -> SamplingMetadata:
        """The step's ``SamplingMetadata`` for the ``sampled`` rows (``ScheduledRequest``s);
        ``ph_flags[i]``: row i's newest token is a placeholder (on the device only).

        ``spec`` (speculative decoding): a request with ``k`` draft tokens
        (``ScheduledRequest.spec_token_ids``) gets ``k + 1`` rows, row ``j`` with the
        request's parameters and seed and, as output tokens, its output followed by
        its first ``j`` drafts (so penalties, min_tokens, bad words and the thinking budget
        see the context that row is verified in). ``pending`` (async scheduling with
        speculation): request id -> the tokens the step in flight gave it, which the
        runner knows and the request does not hold yet; they come before the drafts."""
        params = tuple([s.request.sampling_params for s in sampled])  # (a list first: no generator step per row)
        # (async scheduling: rows after a step in flight take its tokens from ``pending``)
        spec = spec and (bool(pending) or any(s.spec_token_ids for s in sampled))
        rows = tuple(len(s.spec_token_ids) + 1 for s in sampled) if spec else (1,) * len(sampled)
        meta = self._cached(params, rows)
        if meta is not None:
            return meta
        if spec:
            return self._spec_metadata(sampled, params, rows, pending or {})
        need_tokens = any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                          for p in params)
        # bad words alone need only the last (longest banned sequence - 1) output tokens
        banned = [p.bad_words_token_ids for p in params if p.bad_words_token_ids]  # (no generator per row)
        tail = max(len(w) for words in banned for w in words) - 1 if banned else 0
        if need_tokens or tail:
            # A placeholder counts as one more output token (-1: its id is on the device only;
            # the penalties add it there, bad words compare it there).
            outs = []
            for s, ph in zip(sampled, ph_flags):
                r = s.request
                if need_tokens:
                    o = r.output_token_ids
                else:  # a slice of the tail only, not a copy of the whole output each step
                    o = r.all_token_ids[max(r.num_prompt_tokens, r.num_tokens - tail):]
                outs.append(o + [-1] if ph else o)
            prompts = [s.request.prompt_token_ids for s in sampled] if need_tokens else [()] * len(sampled)
        else:
            outs = prompts = [()] * len(sampled)
        seeds = [_seed(p) for p in params]
        thinking = None
        if any(p.thinking_token_budget is not None for p in params):
            thinking = [None if s.request.sampling_params.thinking_token_budget is None else
                        self.thinking_state(s.request).row(s.request.sampling_params, ph)
                        for s, ph in zip(sampled, ph_flags)]
        meta = SamplingMetadata.build(params, prompts, outs, seeds, self.vocab_size, self.device, thinking)
        if need_tokens or tail or thinking is not None or meta.seeds:
            return meta  # (per-step: a seeded row's positions are set on it)
        return self._keep(params, rows, meta)

    def _spec_metadata(self, sampled, req_params: tuple, rows: tuple, pending: dict) -> SamplingMetadata:
        params, prompts, outs, seeds = [], [], [], []
        thinking: list | None = [] if any(p.thinking_token_budget is not None for p in req_params) else None
        need_tokens = any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                          or p.bad_words_token_ids for p in req_params)
        for s in sampled:
            r, sp, rid = s.request, s.request.sampling_params, s.request.request_id
            seed = _seed(sp)
            new = pending.get(rid, ())
            o = r.output_token_ids + list(new) if need_tokens else ()
            # row j's budget state: the request's, fed the pending tokens and its first j drafts
            st = self.thinking_state(r).copy() if sp.thinking_token_budget is not None else None
            if st is not None and new:
                st.feed(new, sp)
            for j in range(len(s.spec_token_ids) + 1):
                params.append(sp)
                prompts.append(r.prompt_token_ids if need_tokens else ())
                outs.append(list(o) + list(s.spec_token_ids[:j]) if need_tokens else ())
                seeds.append(seed)
                if thinking is not None:
                    if st is not None and j:
                        st.feed(s.spec_token_ids[j - 1:j], sp)
                    thinking.append(None if st is None else st.row(sp, False))
        meta = SamplingMetadata.build(params, prompts, outs, seeds, self.vocab_size, self.device, thinking)
        if need_tokens or thinking is not None or meta.seeds:
            return meta
        return self._keep(req_params, rows, meta)

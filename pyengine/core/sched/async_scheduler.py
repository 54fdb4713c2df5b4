"""Scheduler for async (overlap) scheduling (mirrors vllm/v1/core/sched/async_scheduler.py).

Batch N+1 is scheduled before batch N's sampled tokens reach the host. A request whose
step will sample a token gets an output placeholder; the next step feeds that token
straight from the device. Placeholders count against the token budget, ``max_tokens``
and ``max_model_len``; outputs for requests finished or preempted meanwhile are dropped
(a seeded request draws a dropped token's position again with the same draw).

Speculative decoding: a speculative step gives each decode request ``k`` draft
placeholders (``ScheduledRequest.spec_token_ids``, ``-1`` each) after its newest token,
whatever the step in flight will accept: the drafts live in the model runner, which
proposes them from step N's result before it runs step N+1 and fills the placeholders
itself. Such a step counts ``1 + k`` output placeholders and advances
``num_computed_tokens`` by ``1 + k`` as if every draft were accepted; when its output
arrives, the ``k - accepted`` rejected ones are taken back from both (the runner has
already placed step N+1's tokens at the corrected positions). So the drafts' cut to
``max_tokens`` / ``max_model_len`` counts every in-flight placeholder as a token."""
from __future__ import annotations

from collections.abc import Sequence

from pyengine.core.sched.output import ScheduledRequest
from pyengine.core.sched.scheduler import Scheduler
from pyengine.request import Request


class AsyncScheduler(Scheduler):
    def __init__(self, config, num_blocks: int):
        super().__init__(config, num_blocks)
        # drafts filled in by the runner (every proposer under async scheduling)
        self.drafts_on_worker = self.spec_enabled
        spec = config.speculative_config
        self._spec_placeholders = (-1,) * (spec.num_speculative_tokens if spec is not None else 0)

    def _drafts_for_step(self, req: Request, n: int, budget: int) -> Sequence[int]:
        """``k`` draft placeholders for a request at its decode position in a speculative
        step (none for a prefill chunk or a constrained request), cut so that the step's
        tokens fit ``budget`` and its ``1 + k`` possible new tokens, on top of every
        placeholder still in flight, exceed neither ``max_tokens`` nor ``max_model_len``."""
        if n != 1 or req.structured_output_request is not None:
            return ()
        ph = req.num_output_placeholders
        if req.num_computed_tokens + 1 < req.num_tokens + ph:
            return ()  # (a one-token prefill chunk that does not reach the end)
        k = min(len(self._spec_placeholders), budget - 1, req.max_tokens - req.num_output_tokens - ph - 1,
                self.max_model_len - req.num_tokens - ph - 1)
        return self._spec_placeholders[:k] if k > 0 else ()

    def _update_after_schedule(self, s: ScheduledRequest) -> None:
        super()._update_after_schedule(s)
        if s.sample:
            s.request.num_output_placeholders += 1 + len(s.spec_token_ids)

    def _on_token_consumed(self, req: Request) -> None:
        req.num_output_placeholders -= 1

    def _account_drafts(self, req: Request, num_drafts: int, num_generated: int, num_fed: int | None = None) -> None:
        # the step's draft placeholders are resolved too (its first token: _on_token_consumed)
        req.num_output_placeholders -= num_drafts
        super()._account_drafts(req, num_drafts, num_generated, num_fed)

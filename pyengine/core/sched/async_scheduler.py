"""Scheduler for async (overlap) scheduling (mirrors vllm/v1/core/sched/async_scheduler.py).

Batch N+1 is scheduled before batch N's sampled tokens reach the host. A request whose
step will sample a token gets an output placeholder; the next step feeds that token
straight from the device. Placeholders count against the token budget, ``max_tokens``
and ``max_model_len``; outputs for requests finished or preempted meanwhile are dropped
(for a preempted request the runner also rewinds its seeded generator by that draw).
"""
from __future__ import annotations

from pyengine.core.sched.output import ScheduledRequest
from pyengine.core.sched.scheduler import Scheduler
from pyengine.request import Request


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, s: ScheduledRequest) -> None:
        super()._update_after_schedule(s)
        if s.sample:
            s.request.num_output_placeholders += 1

    def _on_token_consumed(self, req: Request) -> None:
        req.num_output_placeholders -= 1

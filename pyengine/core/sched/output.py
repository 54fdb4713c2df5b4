"""What the scheduler hands the model runner each step (mirrors vllm/v1/core/sched/output.py).

In-process, so the runner gets Request objects directly; they are read only at launch time,
on the engine thread.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pyengine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step
    num_computed_tokens: int  # tokens whose KV was computed before this step
    block_ids: list[int]
    sample: bool  # this chunk reaches the end of the sequence: sample one token
    placeholder_input: bool  # the last fed token was sampled by the previous step, still on device
    epoch: int  # request.num_preemptions at schedule time; stale outputs are dropped
    # draft tokens fed after the newest token (speculative decoding; their count is part of
    # num_new_tokens): the runner verifies them and samples len + 1 rows for this request.
    # An empty tuple by default: no list made per request per step without drafts.
    spec_token_ids: Sequence[int] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    num_prefill_reqs: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    # some row that samples is constrained by a grammar (structured outputs): its bitmask
    # comes from Scheduler.get_grammar_bitmask once the previous tokens are accepted
    has_structured_output: bool = False
    # speculative decoding runs in this step (fewer running requests than
    # disable_by_batch_size): rows may carry drafts, and the runner verifies and proposes
    speculative: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

"""Engine-side request state (mirrors vllm/v1/request.py)."""
from __future__ import annotations

import enum
import time
from typing import Any

from pyengine.messages import FinishReason
from pyengine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1  # its structured-output grammar is compiling; not in the waiting queue yet
    RUNNING = 2
    PREEMPTED = 3
    # Everything after this is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # this request failed inside the engine core; the others go on

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


# Plain ints for the hot path: enum member access is slow on Python 3.11 (descriptor lookup).
_FINISHED_MIN = int(RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                   RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
                   RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
                   RequestStatus.FINISHED_ERROR: FinishReason.ERROR}


class Request:
    """One sequence inside the engine core.

    Token accounting (all in tokens):
      num_tokens = len(prompt) + len(output) known on the host;
      num_output_placeholders: tokens sampled on the device but not yet seen by the host
        (async scheduling); num_computed_tokens: tokens whose KV is (or is being) written.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt  # prefix-cache salt (KVCacheManager: the first block's hash)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet admitted
        self.first_scheduled_time: float | None = None  # time.monotonic() at first admission
        self.num_output_placeholders = 0
        self.num_preemptions = 0  # also the "epoch": outputs scheduled before a preemption are dropped
        self.block_hashes: list[int] = []
        # Draft tokens proposed for the next step (speculative decoding; vLLM's
        # spec_token_ids): fed after the newest token and verified, never in all_token_ids.
        self.spec_token_ids: list[int] = []
        # Grammar state of a constrained request (pyengine.structured_output); set by the
        # scheduler's StructuredOutputManager, None for unconstrained requests.
        self.structured_output_request: Any = None  # a StructuredOutputRequest (a floor above) or None

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def is_finished(self) -> bool:
        return self.status >= _FINISHED_MIN

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

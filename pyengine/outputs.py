"""User-facing request outputs (mirrors vllm/outputs.py).

Slotted dataclasses: the output handler makes one ``RequestOutput`` per request per
engine step, and objects without a ``__dict__`` are cheaper to make and to garbage-collect."""
from __future__ import annotations

from dataclasses import dataclass, field

from pyengine.messages import FinishReason


@dataclass(slots=True)
class Logprob:
    """Log probability of one token; ``rank`` is 1 for the most likely token."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is None while running, else a ``FinishReason`` (a ``str``: ``"stop"``,
    ``"length"``, ``"abort"`` or ``"error"``; error: this request failed inside the engine
    and the others went on, vLLM's per-request error path); ``stop_reason`` is the stop
    string or stop token id that ended it (None for EOS); ``error`` says what failed when
    ``finish_reason`` is ``"error"``.
    """
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps in seconds from ``time.monotonic()`` (one clock for the engine core's
    process and the front end's, on one host): arrival at the front end, first admission
    by the scheduler (vLLM's ``first_scheduled_time``), first and last token seen by the
    front end, end. Queue time is ``first_scheduled_time - arrival_time``; prefill time
    ``first_token_time - first_scheduled_time``; decode time ``last_token_time -
    first_token_time``."""
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The output of one request as seen by a reader at one point of its stream."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None, repr=False)

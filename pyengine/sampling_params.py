"""Per-request sampling parameters (mirrors vllm/sampling_params.py)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Optional, Union


class RequestOutputKind(enum.IntEnum):
    """How a stream reports text: the whole text so far, only the new part, or once at the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling parameters for one request; defaults as vLLM's.

    Raises:
        ValueError: on any out-of-range value or unknown field name (see ``_verify``).
    """
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top logprobs per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, text stays ""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token ids that end generation by default (EOS etc.), filled from the model's
    # generation config by the engine; not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.output_kind = RequestOutputKind(self.output_kind)
        self._verify()
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(msg: str):
            raise ValueError(msg)
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers.")
        if self.n > 1 and self.sampling_type_greedy:
            bad(f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}.")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_tokens_is_default(self) -> bool:
        """True when ``max_tokens`` was not given and still holds the default (16): the
        engine then lowers it to the room the prompt leaves, whereas a given value that
        does not fit is an error (see ``Processor.process``)."""
        return not getattr(self, "_max_tokens_given", True) and self.max_tokens == _DEFAULT_MAX_TOKENS

    def clone(self, **changes) -> "SamplingParams":
        new = dataclasses.replace(self, **changes)
        if "max_tokens" not in changes:
            new._max_tokens_given = getattr(self, "_max_tokens_given", True)
        return new


_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.name != "all_stop_token_ids"}
_DEFAULT_MAX_TOKENS = SamplingParams.max_tokens
_MAX_TOKENS_POS = [f.name for f in dataclasses.fields(SamplingParams)].index("max_tokens")
_dataclass_init = SamplingParams.__init__


def _checked_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - _FIELDS - {"all_stop_token_ids"})
    if unknown:
        raise ValueError(f"Unknown SamplingParams field(s): {', '.join(unknown)}. "
                         f"Valid fields: {', '.join(sorted(_FIELDS))}.")
    _dataclass_init(self, *args, **kwargs)
    self._max_tokens_given = "max_tokens" in kwargs or len(args) > _MAX_TOKENS_POS


SamplingParams.__init__ = _checked_init

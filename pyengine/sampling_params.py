"""Per-request sampling parameters (mirrors vllm/sampling_params.py)."""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field

from pyengine.exceptions import VLLMValidationError


class RequestOutputKind(enum.IntEnum):
    """How a stream reports text: the whole text so far, only the new part, or once at the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_GREEDY_EPS = 1e-5

# Documented request limits (server/README.md, docs/capi.md), the same on every front end.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # OpenAI's documented maximum for n
MAX_LOGPROBS = 20  # OpenAI's top_logprobs maximum, vLLM's default max_logprobs (EngineArgs.max_logprobs)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # words per request (each may ban two tokenizations)
MAX_BAD_WORD_LEN = 1024  # characters
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # entries of allowed_token_ids, before the vocabulary check

# (name, min, max) of the integer fields; None allowed for those in _OPTIONAL.
_INT_FIELDS = (("n", 1, MAX_N), ("top_k", 0, INT64_MAX), ("seed", INT64_MIN, INT64_MAX),
               ("max_tokens", 1, INT64_MAX), ("min_tokens", 0, INT64_MAX), ("logprobs", 0, INT64_MAX))
_OPTIONAL = {"seed", "max_tokens", "logprobs"}
_INT_WHAT = {"top_k": f"0 or -1 (disabled), or an integer in [1, {INT64_MAX}]"}
# (name, min, max, min excluded) of the float fields: all must also be finite.
_FLOAT_FIELDS = (("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False),
                 ("repetition_penalty", 0.0, math.inf, True), ("temperature", 0.0, math.inf, False),
                 ("top_p", 0.0, 1.0, True), ("min_p", 0.0, 1.0, False))
# The sampler divides float32 logits by these two: a value a float32 cannot hold would become
# inf (or, for the penalty, 0) there and NaN the row. A temperature below its smallest is greedy.
FLOAT32_MAX, FLOAT32_MIN_NORMAL = 3.4028234663852886e38, 1.1754943508222875e-38
_FLOAT32_DIVISORS = (("repetition_penalty", FLOAT32_MIN_NORMAL), ("temperature", 0.0))


def _check_int(name: str, v, lo: int, hi: int, what: str = "") -> int:
    """``int(v)``, or ValueError naming the field unless v is an integer in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        what = what or f"an integer in [{lo}, {hi}]"
        raise VLLMValidationError(f"{name} must be {what}, got {v!r}.", parameter=name, value=v)
    return int(v)


def _check_float(name: str, v, lo: float, hi: float, lo_open: bool) -> float:
    """``float(v)``, or ValueError naming the field unless v is a finite real number in
    the range (NaN and +-Infinity are refused, with the same message on every front end)."""
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
    if ok:
        v = float(v)
        ok = (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf else (f"> {lo:g}" if lo_open else f">= {lo:g}")
        raise VLLMValidationError(f"{name} must be a finite number {'in ' if hi != math.inf else ''}{rng}, "
                                  f"got {v!r}.", parameter=name, value=v)
    return v


# The constraint fields of StructuredOutputsParams: exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (mirrors vllm/sampling_params.py's
    ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value that
      validates against it;
    - ``regex``: the output matches the regular expression (whole match);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: an EBNF (GBNF-style, xgrammar's dialect) grammar whose ``root`` rule the
      output matches;
    - ``json_object=True``: the output is a JSON object (any keys);
    - ``structural_tag``: not supported (refused).

    Options: ``disable_any_whitespace`` (JSON without whitespace between tokens, instead
    of any amount), ``disable_additional_properties`` (objects take only the schema's
    properties; vengine always does this unless the schema allows more), and
    ``whitespace_pattern`` (not supported with xgrammar: refused).

    Reasoning models (set by the front end from its ``--reasoning-parser``, vLLM's
    reasoner-aware grammar): with ``reasoning_end_token_id`` the output starts as reasoning,
    which is not constrained, and the constraint applies to the tokens after that token (the
    token itself is not fed to the grammar). With ``reasoning_start_token_id`` too, the first
    output token decides (Qwen3's optional ``<think>``): that token opens the reasoning, any
    other first token is already the constrained content (so the first token may be that
    token or one the grammar allows). Neither set: the constraint applies from the first
    token.

    Raises:
        ValueError (``VLLMValidationError``, ``parameter`` "structured_outputs"): none or
            more than one constraint set, or a field of the wrong type. Whether the
            schema / regex / grammar itself is valid is checked by the engine's input
            processing (``Processor.process``), which compiles nothing it cannot honour.
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None  # "not JSON mode" is no constraint
        set_ = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if len(set_) != 1:
            raise VLLMValidationError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"(got {', '.join(set_) if set_ else 'none'}).", parameter="structured_outputs")
        checks = {"json": (str, dict), "regex": str, "grammar": str, "json_object": bool,
                  "structural_tag": str, "whitespace_pattern": str}
        for name, types in checks.items():
            v = getattr(self, name)
            if v is not None and (not isinstance(v, types) or (types is str and not v)):
                what = "a JSON schema object or its JSON text" if name == "json" else (
                    "a boolean" if types is bool else "a non-empty string")
                raise VLLMValidationError(f"structured_outputs.{name} must be {what}, got {v!r:.200}.",
                                          parameter=f"structured_outputs.{name}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise VLLMValidationError("structured_outputs.choice must be a non-empty list of non-empty "
                                          f"strings, got {self.choice!r:.200}.",
                                          parameter="structured_outputs.choice")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise VLLMValidationError(f"structured_outputs.{name} must be a boolean.",
                                          parameter=f"structured_outputs.{name}")
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 0):
                raise VLLMValidationError(f"structured_outputs.{name} must be a token id (an int >= 0), got {v!r}.",
                                          parameter=f"structured_outputs.{name}")
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise VLLMValidationError("structured_outputs.reasoning_start_token_id needs reasoning_end_token_id.",
                                      parameter="structured_outputs.reasoning_start_token_id")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters for one request; defaults as vLLM's. Fields only (slots, as
    vLLM's ``msgspec.Struct``): setting any other attribute is an AttributeError. (Slots
    also keep the engine's per-row reads of these fields fast: past 30 attributes an
    instance ``__dict__`` stops sharing its keys and becomes a full dict per request.)

    Raises:
        ValueError: on any out-of-range value (``VLLMValidationError`` whose ``parameter``
            names the field) or unknown field name (see ``_verify``).
    """
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len (16: _DEFAULT_MAX_TOKENS)
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, text stays ""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding (JSON schema, regex, choice, grammar); see StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's per-token logit bias: not supported, so refused when given (never ignored).
    logit_bias: dict | None = None
    # Words never generated (vLLM's bad_words): each word's tokenization with and without a
    # leading space is banned; a word of several tokens only where its other tokens were
    # just generated. The engine tokenizes them (Processor.process -> bad_words_token_ids).
    bad_words: list[str] | None = None
    # Only these token ids may be generated (vLLM's allowed_token_ids); each must be in the
    # model's vocabulary (checked by the Processor).
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (vLLM's left truncation); -1: as many as fit next
    # to a given max_tokens. Applied by the Processor before the prompt length checks.
    truncate_prompt_tokens: int | None = None
    # At most this many reasoning tokens (vLLM's thinking_token_budget): once the output's
    # reasoning holds that many tokens and has not ended, the next token is forced to be
    # thinking_end_token_id and generation goes on with the answer. The reasoning is what lies
    # between the think tags: from the first output token when thinking_open (the prompt
    # opened it), else only when the first output token is thinking_start_token_id (Qwen3's
    # optional <think>); the tags themselves are not counted, and a repeated start tag inside
    # the reasoning is not counted either (the reasoning parsers' count). The server sets the
    # three tag fields from its --reasoning-parser; Python callers set them themselves (the
    # Processor refuses a budget without thinking_end_token_id).
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_id: int | None = None
    thinking_open: bool = True
    # Token ids that end generation by default (EOS etc.), filled from the model's
    # generation config by the engine; not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # bad_words tokenized (vLLM's _bad_words_token_ids): filled by the engine's Processor
    # from the model's tokenizer; not user-facing.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Whether the caller gave max_tokens, and the default it held if not (see
    # max_tokens_is_default); set by __init__ from the arguments, kept by clone, cross the
    # codec as fields.
    max_tokens_given: bool = field(default=True, repr=False, compare=False)
    max_tokens_default: int | None = field(default=None, repr=False, compare=False)

    def __init__(self, **kwargs) -> None:
        """Keyword arguments only, each a field name (an unknown one is a ValueError naming
        the valid ones, not a TypeError); a default for every field not given."""
        unknown = sorted(set(kwargs) - _FIELDS - _INTERNAL_FIELDS)
        if unknown:
            raise ValueError(f"Unknown SamplingParams field(s): {', '.join(unknown)}. "
                             f"Valid fields: {', '.join(sorted(_FIELDS))}.")
        kwargs.setdefault("max_tokens_given", "max_tokens" in kwargs)
        if not kwargs["max_tokens_given"]:
            kwargs["max_tokens_default"] = kwargs.get("max_tokens", _DEFAULT_MAX_TOKENS)
        for f in dataclasses.fields(self):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, f.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise VLLMValidationError("stop must be a string or a list of strings.", parameter="stop")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise VLLMValidationError("stop_token_ids must be a list of integers.", parameter="stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("bad_words", "allowed_token_ids"):
            v = getattr(self, name)
            if isinstance(v, tuple):
                setattr(self, name, list(v))
        if self.top_k == -1:
            self.top_k = 0
        self.output_kind = RequestOutputKind(self.output_kind)
        self._verify()
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        """Every field checked once, here, for every front end (Python, HTTP, C): integers
        are integers that fit in 64 bits, floats are finite, and each lies in its range.
        Normalizes numeric fields to built-in int / float."""
        for name, lo, hi in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            setattr(self, name, _check_int(name, v, lo, hi, _INT_WHAT.get(name, "")))
        for name, lo, hi, lo_open in _FLOAT_FIELDS:
            setattr(self, name, _check_float(name, getattr(self, name), lo, hi, lo_open))
        for name, smallest in _FLOAT32_DIVISORS:
            v = getattr(self, name)
            if v > FLOAT32_MAX or v < smallest:
                raise VLLMValidationError(f"{name} must fit a float32 ([{smallest:g}, {FLOAT32_MAX:g}]), "
                                          f"got {v!r}.", parameter=name, value=v)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                      f"got {self.min_tokens}.", parameter="min_tokens", value=self.min_tokens)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise VLLMValidationError(f"stop must list at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.",
                                      parameter="stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise VLLMValidationError("stop must be a non-empty string or a list of non-empty strings.",
                                      parameter="stop")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_LEN:
            raise VLLMValidationError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters long, "
                                      f"got one of {longest}.", parameter="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise VLLMValidationError(f"stop_token_ids must list at most {MAX_STOP_TOKEN_IDS} ids, "
                                      f"got {len(self.stop_token_ids)}.", parameter="stop_token_ids")
        self.stop_token_ids = [_check_int("stop_token_ids", t, 0, INT64_MAX, "a list of non-negative integers")
                               for t in self.stop_token_ids]
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "thinking_open"):
            if not isinstance(getattr(self, name), bool):
                raise VLLMValidationError(f"{name} must be a boolean, got {getattr(self, name)!r}.",
                                          parameter=name, value=getattr(self, name))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                unknown = sorted(set(self.structured_outputs) - _SO_FIELDS)
                if unknown:
                    raise VLLMValidationError(f"Unknown structured_outputs field(s): {', '.join(unknown)}. "
                                              f"Valid fields: {', '.join(sorted(_SO_FIELDS))}.",
                                              parameter="structured_outputs")
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            else:
                raise VLLMValidationError("structured_outputs must be a StructuredOutputsParams.",
                                          parameter="structured_outputs")
        if self.logit_bias:
            raise VLLMValidationError("logit_bias is not supported.", parameter="logit_bias")
        self._verify_token_fields()
        if self.n > 1 and self.sampling_type_greedy:
            raise VLLMValidationError(f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}.",
                                      parameter="n", value=self.n)

    def _verify_token_fields(self) -> None:
        """``bad_words``, ``allowed_token_ids`` and ``truncate_prompt_tokens``: their types
        and sizes (whether the ids are in the vocabulary is the Processor's check)."""
        bw = self.bad_words
        if bw is not None:
            if not isinstance(bw, list) or not all(isinstance(w, str) for w in bw):
                raise VLLMValidationError("bad_words must be a list of strings.", parameter="bad_words")
            if len(bw) > MAX_BAD_WORDS:
                raise VLLMValidationError(f"bad_words must list at most {MAX_BAD_WORDS} words, got {len(bw)}.",
                                          parameter="bad_words")
            if any(not w.strip() for w in bw):
                raise VLLMValidationError("bad_words must not contain empty or whitespace-only words.",
                                          parameter="bad_words")
            longest = max((len(w) for w in bw), default=0)
            if longest > MAX_BAD_WORD_LEN:
                raise VLLMValidationError(f"bad_words must be at most {MAX_BAD_WORD_LEN} characters long, "
                                          f"got one of {longest}.", parameter="bad_words")
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, list):
                raise VLLMValidationError("allowed_token_ids must be a list of token ids.",
                                          parameter="allowed_token_ids")
            if not ids:  # vLLM: an empty list would leave nothing to sample
                raise VLLMValidationError("allowed_token_ids must not be empty.", parameter="allowed_token_ids")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise VLLMValidationError(f"allowed_token_ids must list at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                                          f"got {len(ids)}.", parameter="allowed_token_ids")
            self.allowed_token_ids = [_check_int("allowed_token_ids", t, 0, INT64_MAX,
                                                 "a list of non-negative integers") for t in ids]
        self._verify_thinking()
        k = self.truncate_prompt_tokens
        if k is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", k, -1, INT64_MAX,
                                                     f"-1 or an integer in [1, {INT64_MAX}]")
            if k == 0:
                raise VLLMValidationError(f"truncate_prompt_tokens must be -1 or an integer in [1, {INT64_MAX}], "
                                          "got 0.", parameter="truncate_prompt_tokens", value=0)

    def _verify_thinking(self) -> None:
        """``thinking_token_budget`` and its tags: types and how they go together (whether a
        budget has its end tag, and the tags are in the vocabulary, is the Processor's check)."""
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _check_int("thinking_token_budget", self.thinking_token_budget, 0,
                                                    INT64_MAX)
        for name in ("thinking_start_token_id", "thinking_end_token_id"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, _check_int(name, v, 0, INT64_MAX, "a token id (an integer >= 0)"))
        if self.thinking_token_budget is None:
            given = [n for n in ("thinking_start_token_id", "thinking_end_token_id")
                     if getattr(self, n) is not None] + ([] if self.thinking_open else ["thinking_open"])
            if given:
                raise VLLMValidationError(f"{given[0]} is only used with thinking_token_budget.", parameter=given[0])
        elif not self.thinking_open and self.thinking_start_token_id is None:
            raise VLLMValidationError("thinking_open=False (the first output token decides whether the reasoning "
                                      "opens) needs thinking_start_token_id.", parameter="thinking_start_token_id")
        if (self.thinking_end_token_id is not None
                and self.thinking_end_token_id == self.thinking_start_token_id):
            raise VLLMValidationError("thinking_start_token_id and thinking_end_token_id must differ.",
                                      parameter="thinking_end_token_id")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_tokens_is_default(self) -> bool:
        """True when ``max_tokens`` was not given (it holds its default: 16, or the
        generation config's, see ``with_defaults``): the engine then lowers it to the
        room the prompt leaves, whereas a given value that does not fit is an error (see
        ``Processor.process``). A ``max_tokens`` set on the object later counts as given."""
        return not self.max_tokens_given and self.max_tokens == self.max_tokens_default

    @classmethod
    def with_defaults(cls, **defaults) -> SamplingParams:
        """``SamplingParams(**defaults)`` whose ``max_tokens``, if among them, is a default
        (as if not given) rather than the caller's. The engine's default parameters
        (``--generation-config``) are made this way. Raises ValueError as the
        constructor."""
        return cls(**defaults, max_tokens_given=False)

    def with_default_max_tokens(self, max_tokens: int | None) -> SamplingParams:
        """A copy whose ``max_tokens`` is a default rather than a request: the engine caps
        it at the room the prompt leaves instead of refusing a prompt it does not fit
        (e.g. OpenAI's 16 of a completion request without max_tokens)."""
        return self.clone(max_tokens=max_tokens, max_tokens_given=False)

    def clone(self, **changes) -> SamplingParams:
        """A copy with ``changes`` applied (validated as by the constructor); a changed
        ``max_tokens`` counts as given, the others keep whether they were."""
        if "max_tokens" in changes:
            changes.setdefault("max_tokens_given", True)
        return dataclasses.replace(self, **changes)


_DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens's default, vLLM's
_SO_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
# Filled by the engine, not by callers (still accepted by the constructor: the codec and clone pass them).
_INTERNAL_FIELDS = frozenset({"all_stop_token_ids", "bad_words_token_ids", "max_tokens_given", "max_tokens_default"})
_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.name not in _INTERNAL_FIELDS}

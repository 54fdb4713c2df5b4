"""What the chat and completions endpoints share (mirrors
vllm/entrypoints/openai/serving_engine.py): a request's sampling fields ->
``SamplingParams``, checked by the engine's own rules (``SamplingParams`` and the
``Processor``) so every front end refuses the same request with the same message; and the
response side's common parts (``usage``, logprobs objects, per-choice state, the
``ResponseBuilder`` base of each endpoint's response and chunk objects)."""
from __future__ import annotations

import json
import logging
import math
from typing import Any, Optional

from pydantic import ValidationError

from pyengine.entrypoints.openai.protocol import UNSUPPORTED_FIELDS
from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Request fields copied to SamplingParams as they are, when given.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                   "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "logit_bias",
                   "bad_words", "allowed_token_ids", "truncate_prompt_tokens")
# max_tokens not given on /v1/completions: OpenAI's 16 (or the engine's default if lower,
# --generation-config), as a default: the engine caps it at the room the prompt leaves.
ENGINE_DEFAULT: Any = object()
COMPLETION_DEFAULT_MAX_TOKENS = 16

_UNION_HINTS = {
    "prompt": "must be a non-empty string, a list of strings, a list of token ids or a list of lists of token ids.",
    "stop": "must be a string or a list of strings.",
    "messages": "must be a list of {role, content} objects; content is a string or a list of text parts.",
}


def validation_error(e: ValidationError) -> VLLMValidationError:
    """A request schema's ``pydantic.ValidationError`` as one message naming the field
    (the first error's location), as every front end reports it."""
    errs = e.errors(include_url=False)
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return VLLMValidationError(f"Invalid JSON body: {first.get('msg')}")
    field0 = str(first["loc"][0]) if first.get("loc") else None
    same = [er for er in errs if er.get("loc") and str(er["loc"][0]) == field0]
    if field0 in _UNION_HINTS and len(same) > 1:
        return VLLMValidationError(f"{field0}: {_UNION_HINTS[field0]}", parameter=field0)
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())) or 'body'}: {er.get('msg')}" for er in errs[:3])
    return VLLMValidationError(msg, parameter=loc or None)


def parse_request(schema, raw):
    """``schema`` validated from JSON text (``str`` or ``bytes``); fields the schema does
    not know are logged as ignored (as vLLM does). Raises ``VLLMValidationError``
    (``validation_error``)."""
    try:
        req = schema.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model_extra:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(req.model_extra))
    return req


def refuse_unsupported(req) -> None:
    """A 400 (``VLLMValidationError`` naming the field) for each vLLM field of ``req``'s
    schema that vengine does not implement and that asks for something
    (``protocol.UNSUPPORTED_FIELDS``)."""
    declared = type(req).model_fields
    for name, (unused, why) in UNSUPPORTED_FIELDS.items():
        if name in declared:
            v = getattr(req, name)
            if v not in unused:  # (strict schema types: no bool reaches a number field)
                raise VLLMValidationError(f"{name} is not supported: {why}.", parameter=name, value=v)


def check_stream_options(req, stream: Optional[bool] = None) -> None:
    """``stream_options`` only on a streamed request (``stream``: whether it is, where the
    front end decides that rather than the request's ``stream`` field)."""
    if req.stream_options is not None and not (req.stream if stream is None else stream):
        raise VLLMValidationError("stream_options can only be set when stream is true.", parameter="stream_options")


def to_sampling_params(processor, req, *, max_tokens, logprobs: Optional[int], structured_outputs=None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       logprobs_param: str = "logprobs") -> SamplingParams:
    """The request's ``SamplingParams``: the engine's defaults (``--generation-config``,
    ``Processor.get_default_sampling_params``) with the fields the request sets
    (``max_tokens``: a count, ``None`` for the room the prompt leaves, or
    ``ENGINE_DEFAULT``), and the engine's request rules that need no prompt applied now:
    logprobs under ``max_logprobs``, priority against the scheduling policy, stop token ids
    in the vocabulary. ``logprobs_param``: the request's name for the top-logprobs count
    (chat's ``top_logprobs``). Raises ``VLLMValidationError`` naming the field."""
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise VLLMValidationError("best_of is not supported (it must equal n).", parameter="best_of")
    kw = dict(n=n, logprobs=logprobs, output_kind=output_kind, structured_outputs=structured_outputs)
    defaults = processor.get_default_sampling_params()
    if max_tokens is ENGINE_DEFAULT:
        default = defaults.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        defaults = defaults.with_default_max_tokens(min(COMPLETION_DEFAULT_MAX_TOKENS, default))
    else:
        kw["max_tokens"] = max_tokens
    for name in SAMPLING_FIELDS:
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    try:
        params = defaults.clone(**kw)
    except VLLMValidationError as e:
        if e.parameter == "logprobs" and logprobs_param != "logprobs":
            raise VLLMValidationError(str(e), parameter=logprobs_param, value=e.value) from None
        raise
    processor.check_logprobs(params, logprobs_param)
    processor.check_priority(req.priority or 0)
    processor.check_stop_token_ids(params)
    return params


# ---------------------------------------------------------------------------------------
# Responses: what both endpoints' response and chunk objects share

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf
_TEXT_MARK = "\ue000vengine-delta-text\ue000"  # stands for the text in a chunk template


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(v) -> float:
    return _LOGPROB_FLOOR if v is None or math.isinf(v) or math.isnan(v) else float(v)


class ChoiceState:
    """Accumulated state of one choice (one ``CompletionOutput`` index of one prompt):
    text so far, tokens, the finish, and the text offset of the next logprobs entry."""

    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "offset", "started")

    def __init__(self, offset: int = 0):
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.offset = offset
        self.started = False  # a chunk of this choice was sent (return_token_ids: the prompt's ids go first)


class LogprobsFormatter:
    """The engine's per-token ``Logprob`` dicts -> OpenAI's logprobs objects (the
    completions and the chat shapes), the top ``num_top`` alternatives by rank.
    ``tokens_as_ids``: each token as ``"token_id:<id>"`` instead of its text (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text is not valid UTF-8 alone)."""

    def __init__(self, tokenizer, num_top: Optional[int], tokens_as_ids: bool = False):
        self.tok = tokenizer
        self.num_top = num_top
        self.tokens_as_ids = tokens_as_ids

    def token_str(self, tid: int, lp) -> str:
        if self.tokens_as_ids:
            return f"token_id:{tid}"
        s = getattr(lp, "decoded_token", None) if lp is not None else None
        return self.tok.decode([tid]) if s is None else s

    def _entries(self, token_ids, logprobs):
        """Yield (sampled_token_str, sampled_logprob, [(tok_str, logprob), ...top-k by rank])."""
        for tid, d in zip(token_ids, logprobs or []):
            d = d or {}
            sampled = d.get(tid)
            top = sorted(d.items(), key=lambda kv: (kv[1].rank or 1 << 30, -_lp(kv[1].logprob)))
            top = [(self.token_str(k, v), _lp(v.logprob)) for k, v in top[: self.num_top or 0]]
            yield self.token_str(tid, sampled), _lp(sampled.logprob) if sampled is not None else None, top

    def completion_logprobs(self, ch: ChoiceState, token_ids, logprobs, start_offset: int) -> dict:
        """The completions ``logprobs`` object of these tokens; ``text_offset`` counts the
        tokens' own text from ``start_offset``, so it does not depend on how much text a
        stream has released yet (stop-string hold-back). Sets ``ch.offset`` to the end."""
        toks, vals, tops, offs = [], [], [], []
        off = start_offset
        for s, v, top in self._entries(token_ids, logprobs):
            toks.append(s)
            vals.append(v)
            tops.append(dict(top) if self.num_top else None)
            offs.append(off)
            off += len(s)
        ch.offset = off
        return {"tokens": toks, "token_logprobs": vals, "top_logprobs": tops, "text_offset": offs}

    def chat_logprobs(self, token_ids, logprobs) -> dict:
        """The chat ``logprobs`` object (``{"content": [...]}``) of these tokens."""
        content = []
        for s, v, top in self._entries(token_ids, logprobs):
            content.append({"token": s, "logprob": v, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": lv, "bytes": list(t.encode("utf-8"))}
                                             for t, lv in top]})
        return {"content": content}


class ResponseBuilder:
    """One request's OpenAI response and stream chunks, for one endpoint (subclasses:
    ``ChatResponseBuilder``, ``CompletionResponseBuilder``). ``request_id``: the
    response ``id``; ``formatter``: its logprobs, or None when none were asked for;
    ``prompt_token_ids``: with vLLM's ``return_token_ids``, per prompt its token ids (the
    choices then carry ``token_ids``, and the prompt's ids go with the first chunk or the
    response), else None."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, formatter: Optional[LogprobsFormatter],
                 prompt_token_ids: Optional[list[list[int]]] = None):
        self.id, self.model, self.created = request_id, model, created
        self.formatter = formatter
        self.prompt_token_ids = prompt_token_ids

    @property
    def return_token_ids(self) -> bool:
        return self.prompt_token_ids is not None

    @property
    def needs_token_ids(self) -> bool:
        """``choice`` needs the choice's output token ids (else it may get none)."""
        return self.return_token_ids

    def head(self, chunk: bool = True) -> dict:
        return {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model}

    def chunk(self, choices: list, **extra) -> dict:
        return dict(self.head(), choices=choices, **extra)

    def first_chunks(self, num_choices: int) -> list[dict]:
        """Chunks sent before any output (chat: the assistant role of each choice)."""
        return []

    def delta_chunks(self, idx: int, ch: ChoiceState, text: str, token_ids, logprobs,
                     finish: Optional[str]) -> list[dict]:
        """The chunks of one output delta of choice ``idx`` (``ch``: its state before
        ``text`` is added); empty when there is nothing to send yet."""
        raise NotImplementedError

    def choice(self, idx: int, ch: ChoiceState, token_ids: list, logprobs: list) -> dict:
        """Choice ``idx`` of the whole (non-streamed) response."""
        raise NotImplementedError

    def text_delta_template(self, idx: int) -> Optional[tuple[str, str]]:
        """``(head, tail)``: ``head + json_string(text) + tail`` is the compact JSON of
        the one chunk ``delta_chunks`` gives for a text delta of choice ``idx`` that has
        no logprobs and no finish (the streamed common case, serialized without building
        the chunk each time); None where that chunk depends on more than the text (then
        ``delta_chunks``). Subclasses that allow it call ``_template_of``."""
        return None

    def _template_of(self, idx: int) -> Optional[tuple[str, str]]:
        chunks = self.delta_chunks(idx, ChoiceState(), _TEXT_MARK, (), None, None)
        if len(chunks) != 1:
            return None
        text = json.dumps(chunks[0], separators=(",", ":"))
        mark = json.dumps(_TEXT_MARK)
        if text.count(mark) != 1:
            return None
        head, tail = text.split(mark)
        return head, tail

    def response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return dict(self.head(chunk=False), choices=choices, usage=usage(prompt_tokens, completion_tokens))

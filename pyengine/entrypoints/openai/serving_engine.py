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
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from pyengine.engine.processor import ProcessedRequest
from pyengine.entrypoints.openai.errors import ClientDisconnected, RequestCancelled, RequestFailed, error_body
from pyengine.entrypoints.openai.protocol import UNSUPPORTED_FIELDS
from pyengine.entrypoints.openai.serving_models import OpenAIServingModels
from pyengine.exceptions import EngineDeadError, VLLMValidationError
from pyengine.outputs import CompletionOutput, RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")

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
    first: Any = errs[0] if errs else {}
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
    """``schema`` validated from JSON text (``str`` or ``bytes``; an instance of
    ``schema`` is returned as it is); fields the schema does not know are logged as
    ignored (as vLLM does). Raises ``VLLMValidationError`` (``validation_error``)."""
    if isinstance(raw, schema):
        return raw
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


def check_stream_options(req, stream: bool | None = None) -> None:
    """``stream_options`` only on a streamed request (``stream``: whether it is, where the
    front end decides that rather than the request's ``stream`` field)."""
    if req.stream_options is not None and not (req.stream if stream is None else stream):
        raise VLLMValidationError("stream_options can only be set when stream is true.", parameter="stream_options")


def to_sampling_params(processor, req, *, max_tokens, logprobs: int | None, structured_outputs=None,
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
    processor.check_params(params, req.priority or 0, logprobs_param)
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
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.offset = offset
        self.started = False  # a chunk of this choice was sent (return_token_ids: the prompt's ids go first)


class LogprobsFormatter:
    """The engine's per-token ``Logprob`` dicts -> OpenAI's logprobs objects (the
    completions and the chat shapes), the top ``num_top`` alternatives by rank.
    ``tokens_as_ids``: each token as ``"token_id:<id>"`` instead of its text (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text is not valid UTF-8 alone)."""

    def __init__(self, tokenizer, num_top: int | None, tokens_as_ids: bool = False):
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

    def __init__(self, request_id: str, model: str, created: int, formatter: LogprobsFormatter | None,
                 prompt_token_ids: list[list[int]] | None = None):
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

    @property
    def streams_token_ids(self) -> bool:
        """A delta of token ids without text changes the stream (``delta_chunks`` must see
        it even where a front end skips token-only deltas, ``DeltaDriver.token_only_chunks``)."""
        return False

    def head(self, chunk: bool = True) -> dict:
        return {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model}

    def chunk(self, choices: list, **extra) -> dict:
        return dict(self.head(), choices=choices, **extra)

    def first_chunks(self, num_choices: int) -> list[dict]:
        """Chunks sent before any output (chat: the assistant role of each choice)."""
        return []

    def delta_chunks(self, idx: int, ch: ChoiceState, text: str, token_ids, logprobs,
                     finish: str | None) -> list[dict]:
        """The chunks of one output delta of choice ``idx`` (``ch``: its state before
        ``text`` is added); empty when there is nothing to send yet."""
        raise NotImplementedError

    def choice(self, idx: int, ch: ChoiceState, token_ids: list, logprobs: list) -> dict:
        """Choice ``idx`` of the whole (non-streamed) response."""
        raise NotImplementedError

    def text_delta_template(self, idx: int) -> tuple[str, str] | None:
        """``(head, tail)``: ``head + json_string(text) + tail`` is the compact JSON of
        the one chunk ``delta_chunks`` gives for a text delta of choice ``idx`` that has
        no logprobs and no finish (the streamed common case, serialized without building
        the chunk each time); None where that chunk depends on more than the text (then
        ``delta_chunks``). Subclasses that allow it call ``_template_of``."""
        return None

    def _template_of(self, idx: int) -> tuple[str, str] | None:
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


# ---------------------------------------------------------------------------------------
# One request's run: the delta -> chunk driver, the SSE stream, the serving base

_SSE_DONE = "data: [DONE]\n\n"
# a str's JSON (what json.dumps gives for it: ASCII, escaped), the C function json uses
_json_str = json.encoder.encode_basestring_ascii
Chunk = dict | str  # a chunk object, or (the common text delta) its compact JSON already


def sse_event(obj: Chunk) -> str:
    """One SSE event: ``obj``'s compact JSON, or ``obj`` itself when it is that already."""
    return "data: " + (obj if type(obj) is str else json.dumps(obj, separators=(",", ":"))) + "\n\n"


def chunk_json(obj: Chunk) -> str:
    """A chunk's compact JSON (``obj`` itself when it is that already)."""
    return obj if type(obj) is str else json.dumps(obj, separators=(",", ":"))


@dataclass
class Delta:
    """One ``CompletionOutput`` delta of one choice, as the builder takes it: ``idx`` the
    choice (prompt * n + output index), ``text`` the new text (the echoed prompt first,
    on a choice's first delta), the new ``token_ids`` and their ``logprobs`` (or None),
    ``finish`` the finish reason once it ended."""
    idx: int
    choice: ChoiceState
    text: str
    token_ids: Any  # Sequence[int]
    logprobs: list | None
    finish: str | None


class DeltaDriver:
    """One request's ``RequestOutput`` deltas -> its OpenAI objects, through the
    endpoint's ``ResponseBuilder``: the per-choice state, and either the stream's chunks
    (``first_chunks``, ``feed``, ``last_chunks``) or the whole response (``accumulate``
    each output, then ``response``). Completions and chat, the HTTP server and the C
    ABI's ``vllm_chat`` all drive their builder through it.

    ``num_prompts`` × ``n`` choices; ``prompt_tokens``: the prompts' tokens (usage);
    ``echo_texts``: per prompt, the text its choices start with (completions' ``echo``);
    ``include_usage`` / ``continuous_usage``: ``stream_options``; ``token_only_chunks``:
    a delta of tokens without text yet still gets its chunk (vLLM's; the C ABI passes
    only text on, so it skips them)."""

    def __init__(self, builder: ResponseBuilder, num_prompts: int, n: int, prompt_tokens: int, *,
                 echo_texts: list[str] | None = None, include_usage: bool = False,
                 continuous_usage: bool = False, token_only_chunks: bool = True):
        self.builder, self.n = builder, n
        self.prompt_tokens = prompt_tokens
        self.echo_texts = echo_texts
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.token_only_chunks = token_only_chunks or builder.streams_token_ids
        self.choices = [ChoiceState(len(echo_texts[idx // n]) if echo_texts is not None else 0)
                        for idx in range(num_prompts * n)]
        self._plain = builder.formatter is None and not continuous_usage
        self._templates: dict[int, tuple[str, str] | None] = {}  # choice -> text chunk template
        self._keep_ids = builder.formatter is not None or builder.needs_token_ids
        self._parts: dict[int, list[tuple[Any, list | None]]] = {}  # choice -> (token_ids, logprobs), whole response

    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self, completion_tokens: int | None = None) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens() if completion_tokens is None else completion_tokens)

    def prompt_finish_reason(self, i: int) -> str | None:
        """The first finish reason among prompt ``i``'s choices (None: none finished)."""
        return next((ch.finish_reason for ch in self.choices[i * self.n:(i + 1) * self.n] if ch.finish_reason), None)

    def prompt_completion_tokens(self, i: int) -> int:
        return sum(ch.num_tokens for ch in self.choices[i * self.n:(i + 1) * self.n])

    def _delta(self, i: int, o: CompletionOutput) -> Delta:
        """Choice state updated by one output of prompt ``i``. Raises ``RequestFailed``
        for an output that ended with finish_reason "error"."""
        idx = i * self.n + o.index
        ch = self.choices[idx]
        text = o.text
        if self.echo_texts is not None and ch.num_tokens == 0 and not ch.text:
            text = self.echo_texts[i] + text
        ch.num_tokens += len(o.token_ids)
        if o.finish_reason == "error":
            raise RequestFailed(o.error)
        if o.finish_reason is not None:
            ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
        return Delta(idx, ch, text, o.token_ids, o.logprobs, o.finish_reason)

    def deltas(self, i: int, out: RequestOutput) -> list[Delta]:
        """The deltas of one ``RequestOutput`` of prompt ``i`` (every choice's state
        updated first; a failed one raises ``RequestFailed`` before any is used)."""
        return [self._delta(i, o) for o in out.outputs]

    def first_chunks(self) -> list[Chunk]:
        """The chunks before any output (chat: the assistant role of each choice)."""
        chunks: list[Chunk] = list(self.builder.first_chunks(len(self.choices)))
        if self.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self.usage(0)  # type: ignore[index]
        return chunks

    def feed(self, i: int, out: RequestOutput) -> list[Chunk]:
        """The stream's chunks of one ``RequestOutput`` of prompt ``i``; each choice's
        text is extended after its chunks are made. Raises ``RequestFailed``."""
        chunks: list[Chunk] = []
        for d in self.deltas(i, out):
            chunks += self.chunks(d)
            if d.text:
                d.choice.text.append(d.text)
        return chunks

    def chunks(self, d: Delta) -> list[Chunk]:
        """The chunks of one delta (its choice's text not yet extended by it)."""
        if not d.text and d.finish is None and (not d.token_ids or not self.token_only_chunks):
            return []  # nothing new; a token without text yet still has its chunk (vLLM)
        if self._plain and d.finish is None:
            # the common streamed delta: the builder's chunk JSON around the text's JSON
            templates = self._templates
            t = templates[d.idx] if d.idx in templates else templates.setdefault(
                d.idx, self.builder.text_delta_template(d.idx))
            if t is not None:
                return [t[0] + _json_str(d.text) + t[1]]
        chunks: list[Chunk] = list(self.builder.delta_chunks(d.idx, d.choice, d.text, d.token_ids, d.logprobs,
                                                             d.finish))
        if chunks and self.continuous_usage:
            chunks[-1]["usage"] = self.usage()  # type: ignore[index]
        return chunks

    def last_chunks(self) -> list[Chunk]:
        """The chunks after the last output (``usage``, with ``include_usage``)."""
        return [self.builder.chunk([], usage=self.usage())] if self.include_usage else []

    def accumulate(self, i: int, out: RequestOutput) -> None:
        """One ``RequestOutput`` of prompt ``i`` into the whole response. Raises
        ``RequestFailed``."""
        for d in self.deltas(i, out):
            if self._keep_ids and len(d.token_ids):
                self._parts.setdefault(d.idx, []).append((d.token_ids, d.logprobs))
            if d.text:
                d.choice.text.append(d.text)

    def response(self) -> dict:
        """The whole response object of what ``accumulate`` took."""
        choices = []
        for idx, ch in enumerate(self.choices):
            parts = self._parts.get(idx, [])
            tids = [t for p in parts for t in p[0]]
            lps = [x for p in parts for x in (p[1] or [None] * len(p[0]))]
            choices.append(self.builder.choice(idx, ch, tids, lps))
        return self.builder.response(choices, self.prompt_tokens, self.completion_tokens())


class Generation(Protocol):
    """A front end's reading of one request's engine requests (HTTP:
    ``server.bridge.RequestGroup``)."""

    def outputs(self) -> Iterator[tuple[int, RequestOutput]]:
        """``(prompt index, RequestOutput)`` as they arrive, until every request finished.
        Raises ``ClientDisconnected``, ``RequestCancelled`` or ``EngineDeadError``."""
        ...

    def close(self) -> None:
        """Abort what is still running (idempotent)."""
        ...


class Session(Protocol):
    """A front end's side of one request: how blocking work runs (HTTP: off the event
    loop) and how its engine requests are queued and read."""

    def run_blocking(self, fn: Callable[[], T]) -> T:
        ...

    def start(self, requests: list[ProcessedRequest]) -> Generation:
        """Queue these engine requests (all of one client request). Raises
        ``APIError``, ``VLLMValidationError`` or ``EngineDeadError``; nothing stays
        queued then."""
        ...


class SSEStream:
    """A streamed response: an iterable of SSE event strings (the chunks, then
    ``[DONE]``), and ``close()``, which the server calls when the response ends however it
    ended (its engine requests are then aborted, if still running)."""

    def __init__(self, events: Iterator[str], generation: Generation):
        self._events, self._generation = events, generation

    def __iter__(self) -> Iterator[str]:
        return self._events

    def close(self) -> None:
        try:
            close = getattr(self._events, "close", None)
            if close is not None:
                close()
        finally:
            self._generation.close()


@dataclass
class Prepared:
    """One client request checked and ready to queue: its engine requests, the driver of
    its response, and whether it is streamed."""
    requests: list[ProcessedRequest]
    driver: DeltaDriver
    stream: bool


class OpenAIServing:
    """What every endpoint's serving object shares (mirrors vLLM's ``OpenAIServing``):
    the engine (an ``AsyncLLM``), the served model names (``OpenAIServingModels``), and
    one request's run once it is ``Prepared``: its engine requests queued through the
    front end's ``Session``, then the whole response or an ``SSEStream``."""

    def __init__(self, engine, models: OpenAIServingModels):
        self.engine = engine
        self.processor = engine.processor
        self.tokenizer = engine.tokenizer
        self.models = models

    def check_model(self, model: str | None) -> str:
        """The served name a request's ``model`` names (``OpenAIServingModels.check_model``)."""
        return self.models.check_model(model)

    def is_engine_dead(self, exc: BaseException) -> bool:
        """True for ``EngineDeadError``, or any error once the engine died."""
        return isinstance(exc, EngineDeadError) or self.engine.errored

    @staticmethod
    def engine_request_id(response_id: str) -> str:
        """Engine request ids unique even when clients reuse a ``request_id`` (the response id)."""
        return f"{response_id}-{uuid.uuid4().hex[:12]}"

    def run(self, prepared: Prepared, session: Session, view=None) -> dict | SSEStream:
        """Queue the request's engine requests; the whole response once they finished, or
        the ``SSEStream`` that yields it. ``view``: an endpoint built on chat
        (``chat_job.ChatView``: ``serving_responses.ResponsesJob``,
        ``serving_messages.MessagesJob``) that frames the answer as its own: the response
        ``view.response(chat_completion)``, the stream ``view.sse_events(chunks)``. Raises
        what ``Session.start`` raises; the whole response also ``RequestFailed``,
        ``ClientDisconnected``, ``RequestCancelled`` and ``EngineDeadError``."""
        generation = session.start(prepared.requests)
        if prepared.stream:
            return SSEStream(self._sse(prepared.driver, generation, view), generation)
        try:
            driver = prepared.driver
            for i, out in generation.outputs():
                driver.accumulate(i, out)
            obj = driver.response()
            return obj if view is None else view.response(obj)
        finally:
            generation.close()

    @staticmethod
    def _chunks(driver: DeltaDriver, generation: Generation) -> Iterator[Chunk]:
        """The stream's chunks: dicts, or (the common text delta) their JSON text."""
        yield from driver.first_chunks()
        for i, out in generation.outputs():
            yield from driver.feed(i, out)
        yield from driver.last_chunks()

    def _sse(self, driver: DeltaDriver, generation: Generation, view=None) -> Iterator[str]:
        """The SSE stream: the chunks, then ``[DONE]``; an error once streaming began is an
        error event (OpenAI's error body) before ``[DONE]``. ``view``: the events, error
        event and last event are the view's (``run``)."""
        def error(status: int, msg: str) -> str:
            return sse_event(error_body(status, msg)) if view is None else view.sse_error(status, msg)
        try:
            if view is None:
                for chunk in self._chunks(driver, generation):
                    yield sse_event(chunk)
            else:
                yield from view.sse_events(self._chunks(driver, generation))
        except ClientDisconnected:
            return
        except RequestFailed as e:
            yield error(500, str(e))
        except RequestCancelled as e:
            yield error(503, str(e))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            if self.is_engine_dead(e):
                status, msg = 503, f"The engine is dead: {e}"
            else:
                logger.exception("error while streaming %s", driver.builder.id)
                status, msg = 500, f"Internal error while streaming: {type(e).__name__}: {e}"
            yield error(status, msg)
        done = _SSE_DONE if view is None else view.sse_done
        if done:
            yield done

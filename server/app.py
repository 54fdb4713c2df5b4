"""The Flask app: OpenAI-compatible routes over ``pyengine.AsyncLLM``.

``create_app(engine, args)`` builds a fresh app (no module-global mutable state). It is
meant to be served by gevent's ``pywsgi.WSGIServer`` (see ``server.wsgi``): handlers wait
for engine output on gevent Events woken through ``server.bridge``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from flask import Flask, Response, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from pyengine import envs

from .bridge import ClientDisconnected, GeventBridge, RequestGroup, ServerShuttingDown, is_engine_dead
from .metrics import RequestTimer, ServerMetrics
from .middleware import apply_http_options
from .page import create_page_blueprint
from .protocol import ChatCompletionRequest, CompletionRequest
from .tool_calling import (ToolCallingError, chat_tool_mode, make_extractor, refuse_tool_fields,
                           request_structured_outputs, template_messages)

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
DEFAULT_MAX_BODY_BYTES = 16 << 20
SOCKET_ENVIRON_KEY = "vengine.socket"
_COUNTED_ENVIRON_KEY = "vengine.counted"

# Used when neither the tokenizer nor --chat-template provides a chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                409: "ConflictError", 413: "RequestTooLargeError",
                415: "UnsupportedMediaTypeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}

_UNION_HINTS = {
    "prompt": "must be a non-empty string, a list of strings, a list of token ids or a list of lists of token ids.",
    "stop": "must be a string or a list of strings.",
    "messages": "must be a list of {role, content} objects; content is a string or a list of text parts.",
}

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf
# max_tokens not given on /v1/completions: OpenAI's 16 (or the engine's default if lower,
# --generation-config), which the engine caps at the room the prompt leaves; chat's absent
# max_tokens is None (the room, within the engine's default).
_ENGINE_DEFAULT = object()
_COMPLETION_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RequestFailed(Exception):
    """One engine request ended with finish_reason "error" (it failed inside the engine;
    the others go on): HTTP 500, or an error event then [DONE] once streaming began."""

    def __init__(self, error: Optional[str]):
        super().__init__(f"The request failed inside the engine: {error or 'unknown error'}")


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status=status,
                    mimetype="application/json")


def _json_response(obj) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), mimetype="application/json")


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


_SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    chat_template: Optional[str] = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_path: str = ""
    max_model_len: int = 0
    vocab_size: Optional[int] = None
    scheduling_policy: str = "fcfs"
    dev_mode: bool = False  # VENGINE_SERVER_DEV_MODE (vLLM's VLLM_SERVER_DEV_MODE): development endpoints (/reset_prefix_cache)
    tool_call_parser: Optional[str] = None  # --tool-call-parser (pyengine.tool_parsers)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice

    @classmethod
    def from_args(cls, engine, args) -> "ServerConfig":
        ecfg = getattr(engine, "config", None)
        names = getattr(args, "served_model_name", None) if args is not None else None
        if isinstance(names, str):
            names = [names]
        if not names:
            names = [getattr(ecfg, "served_model_name", None) or "vengine"]
        api_key = getattr(args, "api_key", None) if args is not None else None
        keys = [api_key] if isinstance(api_key, str) and api_key else list(api_key or [])
        template = getattr(args, "chat_template", None) if args is not None else None
        if template and "{" not in template:  # a path, as vLLM's --chat-template takes either
            with open(template, encoding="utf-8") as f:
                template = f.read()
        hf = getattr(ecfg, "hf_config", None)
        return cls(served_model_names=list(names), api_keys=keys, chat_template=template,
                   max_request_body_bytes=int(getattr(args, "max_request_body_bytes", None)
                                              or DEFAULT_MAX_BODY_BYTES),
                   model_path=str(getattr(ecfg, "model", "")),
                   max_model_len=int(getattr(ecfg, "max_model_len", 0) or 0),
                   vocab_size=getattr(hf, "vocab_size", None),
                   scheduling_policy=getattr(ecfg, "scheduling_policy", "fcfs"),
                   tool_call_parser=getattr(args, "tool_call_parser", None) if args is not None else None,
                   enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
                   dev_mode=envs.server_dev_mode())


class ServerState:
    """Everything one app instance owns."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.tokenizer = engine.tokenizer
        self.bridge = GeventBridge(engine)
        # fields a request leaves out take the engine's defaults (--generation-config);
        # a completion's absent max_tokens is OpenAI's 16 at most, as a default
        self.default_sampling_params = d = engine.get_default_sampling_params()
        self.completion_default_sampling_params = d.with_default_max_tokens(
            min(_COMPLETION_DEFAULT_MAX_TOKENS, d.max_tokens or _COMPLETION_DEFAULT_MAX_TOKENS))
        self.metrics = ServerMetrics(engine, cfg.served_model_names[0])
        self.created = int(time.time())
        # Shutdown drain (hub thread only): HTTP requests being served (admission and
        # tokenization included, until the response is closed), the generations among them
        # (jobs), and whether new requests are refused (draining) or the generations in
        # flight were cut (cut_message).
        self.active_requests = 0
        self.jobs: set = set()
        self.draining = False
        self.cut_message: Optional[str] = None

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); the ones in flight go on."""
        self.draining = True

    def cut_jobs(self, message: str) -> None:
        """End every request still in flight: its engine requests are aborted, a stream
        gets an error event then [DONE], a plain request a 503."""
        self.cut_message = message
        for job in list(self.jobs):
            job.cut(message)

    def close(self) -> None:
        self.bridge.close()
        self.metrics.close()


# ---------------------------------------------------------------------------------------
# Request -> engine inputs


def _parse(schema):
    if request.mimetype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.")
    body = request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
    req = schema.model_validate_json(body)
    if req.model_extra:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(req.model_extra))
    return req


def _check_model(st: ServerState, model: Optional[str]) -> str:
    if model is None:
        return st.cfg.served_model_names[0]
    if model not in st.cfg.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    return model


def _check_token_ids(st: ServerState, ids: list[int], param: str) -> None:
    v = st.cfg.vocab_size
    for t in ids:
        if t < 0 or (v is not None and t >= v):
            raise APIError(400, f"Token id {t} is out of vocabulary (valid ids: 0..{(v or 1) - 1}).", param)


def _engine_rule(check, value, param: str) -> None:
    """One of the engine's input rules (``Processor.check_*``): its ValueError is a 400."""
    try:
        check(value, param)
    except ValueError as e:
        raise APIError(400, str(e), param) from None


def _check_prompt_text(st: ServerState, text: str, param: str) -> None:
    """The engine's cheap bound on a text prompt's characters (``max_model_len`` times
    the most characters a token can cover), before it is tokenized."""
    _engine_rule(st.engine.processor.check_prompt_text, text, param)


def _check_prompt_length(st: ServerState, num_tokens: int, param: str) -> None:
    """The engine's rule: the prompt leaves room for one generated token."""
    _engine_rule(st.engine.processor.check_prompt_length, num_tokens, param)


def _tokenize(st: ServerState, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text (the engine's ``Processor.encode``), computed on a
    threadpool thread: the Rust tokenizer releases the GIL, so a long prompt does not
    stall the hub (other streams)."""
    encode = st.engine.processor.encode
    return st.bridge.run_blocking(lambda: [encode(t, add_special_tokens) for t in texts])


def _completion_prompts(st: ServerState, req: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif len(p) == 0:
        raise APIError(400, "prompt must not be empty.", "prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    for item in items:  # the cheap checks first, on every prompt
        if not item:
            raise APIError(400, "prompt must not be empty.", "prompt")
        if isinstance(item, str):
            _check_prompt_text(st, item, "prompt")
        else:
            _check_prompt_length(st, len(item), "prompt")
            _check_token_ids(st, item, "prompt")
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(_tokenize(st, texts) if texts else [])
    out = []
    for item in items:
        if isinstance(item, str):
            ids = next(encoded)
            if not ids:
                raise APIError(400, "The prompt encodes to no tokens.", "prompt")
            out.append((item, ids))
        else:
            out.append((None, list(item)))
    return out


def _sampling_params(st: ServerState, req, max_tokens: Optional[int], logprobs: Optional[int],
                     prompt_lens: list[int], stream: bool, structured_outputs=None):
    from pyengine import RequestOutputKind

    _check_prompt_length(st, max(prompt_lens), "prompt" if hasattr(req, "prompt") else "messages")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported.", "logit_bias")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n).", "best_of")
    if req.priority not in (None, 0) and st.cfg.scheduling_policy != "priority":
        raise APIError(400, "priority is only supported with --scheduling-policy priority.", "priority")
    kw = dict(n=n, logprobs=logprobs, output_kind=RequestOutputKind.DELTA, structured_outputs=structured_outputs)
    defaults = st.default_sampling_params
    if max_tokens is _ENGINE_DEFAULT:  # a default, capped at the room left (never refused)
        defaults = st.completion_default_sampling_params
    else:
        kw["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "min_tokens", "include_stop_str_in_output", "skip_special_tokens"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    if req.stop_token_ids:
        _check_token_ids(st, req.stop_token_ids, "stop_token_ids")
    try:
        return defaults.clone(**kw)
    except ValueError as e:  # the engine's one answer (VLLMValidationError names the field)
        param = getattr(e, "parameter", None)
        if param == "logprobs" and hasattr(req, "top_logprobs"):
            param = "top_logprobs"  # chat's name for the count
        raise APIError(400, str(e), param) from None


def _chat_prompt(st: ServerState, req: ChatCompletionRequest, tools: list) -> tuple[str, list[int]]:
    msgs = template_messages(req)
    tok = st.tokenizer
    template = st.cfg.chat_template or getattr(tok, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
    kwargs = dict(req.chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        text = st.bridge.run_blocking(  # off the hub, like the tokenization below
            tok.apply_chat_template, msgs, chat_template=template, tokenize=False,
            add_generation_prompt=bool(req.add_generation_prompt) and not req.continue_final_message,
            continue_final_message=bool(req.continue_final_message), **kwargs)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise APIError(400, f"Cannot apply the chat template: {e}", "messages") from None
    if not isinstance(text, str):
        text = str(text)
    _check_prompt_text(st, text, "messages")
    ids = _tokenize(st, [text], add_special_tokens=False)[0]
    if not ids:
        raise APIError(400, "messages render to an empty prompt.", "messages")
    return text, ids


# ---------------------------------------------------------------------------------------
# Output formatting


def _lp(v: float) -> float:
    return _LOGPROB_FLOOR if v is None or math.isinf(v) or math.isnan(v) else float(v)


class _Choice:
    """Accumulated state of one choice (one CompletionOutput index of one prompt)."""

    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "lp_tokens", "lp_values",
                 "lp_top", "lp_offsets", "chat_lp", "offset")

    def __init__(self):
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason = None
        self.stop_reason = None
        self.lp_tokens: list = []
        self.lp_values: list = []
        self.lp_top: list = []
        self.lp_offsets: list = []
        self.chat_lp: list = []
        self.offset = 0


class _Formatter:
    def __init__(self, st: ServerState, num_top: Optional[int]):
        self.tok = st.tokenizer
        self.num_top = num_top

    def token_str(self, tid: int, lp) -> str:
        s = getattr(lp, "decoded_token", None) if lp is not None else None
        if s is None:
            s = self.tok.decode([tid])
        return s

    def _entries(self, token_ids, logprobs):
        """Yield (sampled_token_str, sampled_logprob, [(tok_str, logprob), ...top-k by rank])."""
        for tid, d in zip(token_ids, logprobs or []):
            d = d or {}
            sampled = d.get(tid)
            top = sorted(((k, v) for k, v in d.items()), key=lambda kv: (kv[1].rank or 1 << 30, -_lp(kv[1].logprob)))
            top = [(self.token_str(k, v), _lp(v.logprob)) for k, v in top[: self.num_top or 0]]
            yield (self.token_str(tid, sampled), _lp(sampled.logprob) if sampled is not None else None, top)

    def completion_logprobs(self, ch: _Choice, token_ids, logprobs, start_offset: int):
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

    def chat_logprobs(self, token_ids, logprobs):
        content = []
        for s, v, top in self._entries(token_ids, logprobs):
            content.append({"token": s, "logprob": v, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": lv, "bytes": list(t.encode("utf-8"))}
                                             for t, lv in top]})
        return content


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------------------
# The generation driver shared by both endpoints


class _Job:
    """One HTTP request's generation: engine requests, per-choice state, metrics."""

    def __init__(self, st: ServerState, *, chat: bool, model: str, prompts, sp, priority: int,
                 want_logprobs: bool, num_top: Optional[int], echo_texts: Optional[list],
                 include_usage: bool, continuous_usage: bool, tool_mode=None):
        self.st, self.chat, self.model = st, chat, model
        self.prompts, self.sp, self.priority = prompts, sp, priority
        self.n = sp.n
        self.want_logprobs = want_logprobs
        self.fmt = _Formatter(st, num_top)
        self.echo_texts = echo_texts
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(prompts) * self.n)]
        # chat: content and tool calls of each choice (server.tool_calling)
        self.extractors = [make_extractor(tool_mode, st.cfg.tool_call_parser, st.tokenizer)
                           for _ in self.choices] if tool_mode is not None else None
        if echo_texts is not None:  # text offsets count the echoed prompt
            for idx, ch in enumerate(self.choices):
                ch.offset = len(echo_texts[idx // self.n])
        self.prompt_tokens = sum(len(ids) for _, ids in prompts)
        self.timers = [RequestTimer(st.metrics) for _ in prompts]
        self.group: Optional[RequestGroup] = None
        self._recorded: set[int] = set()

    def start(self, sock) -> None:
        st = self.st
        if st.cut_message is not None:
            raise APIError(503, st.cut_message)
        self.group = RequestGroup(st.bridge, st.engine, sock)
        st.jobs.add(self)
        try:
            for i, (_, ids) in enumerate(self.prompts):
                self.group.add(f"{self.id}-{i}", ids, self.sp, self.priority)
        except ValueError as e:  # the engine's input processing refused it
            self.close()
            param = getattr(e, "parameter", None)
            if param == "logprobs" and self.chat:
                param = "top_logprobs"  # chat's name for the count
            raise APIError(400, str(e), param) from None
        except Exception as e:
            self.close()
            if is_engine_dead(e, st.engine):
                raise APIError(503, f"The engine is dead: {e}") from None
            raise

    def cut(self, message: str) -> None:
        if self.group is not None:
            self.group.cancel(message)

    def close(self) -> None:
        self.st.jobs.discard(self)
        if self.group is not None:
            self.group.close()
            # requests whose end the handler never saw (client gone, engine dead)
            for i in range(len(self.group.request_ids)):
                if i not in self._recorded:
                    self._recorded.add(i)
                    self.st.metrics.finished("abort")

    def _record_finished(self, i: int, out) -> None:
        self._recorded.add(i)
        m = self.st.metrics
        m.prompt_tokens.inc(len(self.prompts[i][1]))
        m.req_prompt.observe(len(self.prompts[i][1]))
        reason = None
        gen = 0
        for k in range(self.n):
            ch = self.choices[i * self.n + k]
            gen += ch.num_tokens
            reason = reason or ch.finish_reason
        m.req_gen.observe(gen)
        m.finished(reason or "abort")
        if reason != "abort":
            self.timers[i].finish(out)

    def events(self):
        """Yield ``(choice_index, choice, delta_text, token_ids, logprobs, finish_reason)``
        for each CompletionOutput delta, in arrival order."""
        m = self.st.metrics
        for i, out in self.group.outputs():
            newest = 0
            for o in out.outputs:
                idx = i * self.n + o.index
                ch = self.choices[idx]
                text = o.text
                if self.echo_texts is not None and ch.num_tokens == 0 and not ch.text:
                    text = self.echo_texts[i] + text
                ntok = len(o.token_ids)
                ch.num_tokens += ntok
                newest = max(newest, ntok)
                if o.finish_reason == "error":
                    self._recorded.add(i)
                    m.finished("error")
                    raise RequestFailed(o.error)  # the job's close() aborts its other requests
                if o.finish_reason is not None:
                    ch.finish_reason = o.finish_reason
                    ch.stop_reason = o.stop_reason
                yield idx, ch, text, o.token_ids, o.logprobs, o.finish_reason
                if text:
                    ch.text.append(text)
            if newest:
                m.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
                self.timers[i].observe(out, newest)
            if out.finished:
                self._record_finished(i, out)

    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    # -- non-streaming ------------------------------------------------------------------
    def run_to_end(self) -> dict:
        lp_acc: dict[int, list] = {}
        for idx, ch, text, token_ids, logprobs, _ in self.events():
            if self.want_logprobs and token_ids:
                lp_acc.setdefault(idx, []).append((token_ids, logprobs))
        choices = []
        for idx, ch in enumerate(self.choices):
            text = "".join(ch.text)
            lp = None
            if self.want_logprobs:
                parts = lp_acc.get(idx, [])
                tids = [t for p in parts for t in p[0]]
                lps = [x for p in parts for x in (p[1] or [None] * len(p[0]))]
                if self.chat:
                    lp = {"content": self.fmt.chat_logprobs(tids, lps)}
                else:
                    start = len(self.echo_texts[idx // self.n]) if self.echo_texts is not None else 0
                    lp = self.fmt.completion_logprobs(ch, tids, lps, start)
            if self.chat:
                ext = self.extractors[idx]
                choices.append({"index": idx, "message": ext.message(text), "logprobs": lp,
                                "finish_reason": ext.finish_reason(ch.finish_reason), "stop_reason": ch.stop_reason})
            else:
                choices.append({"index": idx, "text": text, "logprobs": lp,
                                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": _usage(self.prompt_tokens, self.completion_tokens())}

    # -- streaming ------------------------------------------------------------------------
    def stream(self):
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}
        try:
            if self.chat:
                for idx in range(len(self.choices)):
                    chunk = dict(head, choices=[{"index": idx, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}])
                    if self.continuous_usage:
                        chunk["usage"] = _usage(self.prompt_tokens, 0)
                    yield _sse(chunk)
            for idx, ch, text, token_ids, logprobs, finish in self.events():
                if not text and finish is None and not (self.want_logprobs and token_ids):
                    continue
                lp = None
                if self.want_logprobs and token_ids:
                    lps = logprobs or [None] * len(token_ids)
                    if self.chat:
                        lp = {"content": self.fmt.chat_logprobs(token_ids, lps)}
                    else:
                        lp = self.fmt.completion_logprobs(ch, token_ids, lps, ch.offset)
                if self.chat:
                    ext = self.extractors[idx]
                    deltas = ext.stream(text) + (ext.finish() if finish is not None else [])
                    if finish is not None:
                        finish = ext.finish_reason(finish)
                    # every delta but the last goes in a chunk of its own
                    for d in deltas[:-1]:
                        yield _sse(dict(head, choices=[{"index": idx, "delta": d, "logprobs": None,
                                                        "finish_reason": None}]))
                    if not deltas and finish is None and lp is None:
                        continue  # held back (a tool call in progress)
                    c = {"index": idx, "delta": deltas[-1] if deltas else {}, "logprobs": lp,
                         "finish_reason": finish}
                else:
                    c = {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}
                if finish is not None:
                    c["stop_reason"] = ch.stop_reason
                chunk = dict(head, choices=[c])
                if self.continuous_usage:
                    chunk["usage"] = _usage(self.prompt_tokens, self.completion_tokens())
                yield _sse(chunk)
            if self.include_usage:
                yield _sse(dict(head, choices=[], usage=_usage(self.prompt_tokens, self.completion_tokens())))
        except ClientDisconnected:
            return
        except RequestFailed as e:
            yield _sse(error_body(500, str(e)))
        except ServerShuttingDown as e:
            yield _sse(error_body(503, str(e)))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            if is_engine_dead(e, self.st.engine):
                status, msg = 503, f"The engine is dead: {e}"
            else:
                logger.exception("error while streaming %s", self.id)
                status, msg = 500, f"Internal error while streaming: {type(e).__name__}: {e}"
            yield _sse(error_body(status, msg))
        yield _SSE_DONE


def _authorized(header: str, keys: list[str]) -> bool:
    """``Authorization: Bearer KEY``; the scheme is case-insensitive (RFC 9110), the key
    compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip().encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token, k.encode())
    return ok and scheme.lower() == "bearer"


def _check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be set when stream is true.", "stream_options")


def _run_job(job: _Job, stream: bool) -> Response:
    job.start(request.environ.get(SOCKET_ENVIRON_KEY))
    if stream:
        resp = Response(job.stream(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp.call_on_close(job.close)
        return resp
    try:
        return _json_response(job.run_to_end())
    except ClientDisconnected:
        return Response(status=499)
    except RequestFailed as e:
        return error_response(500, str(e))
    except ServerShuttingDown as e:
        return error_response(503, str(e))
    except Exception as e:
        if is_engine_dead(e, job.st.engine):
            return error_response(503, f"The engine is dead: {e}")
        raise
    finally:
        job.close()


# ---------------------------------------------------------------------------------------
# The app factory


def create_app(engine, args=None) -> Flask:
    """Build the Flask app over a started ``AsyncLLM``. ``args``: the CLI namespace (or any
    object with some of ``served_model_name``, ``api_key``, ``chat_template``,
    ``max_request_body_bytes``); ``None`` takes the defaults."""
    cfg = ServerConfig.from_args(engine, args)
    st = ServerState(engine, cfg)
    app = Flask("vengine.server", static_folder=None)  # the page's blueprint serves /static
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_request_body_bytes
    app.json.sort_keys = False
    app.extensions["vengine"] = st
    app.register_blueprint(create_page_blueprint())
    apply_http_options(app, args)

    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.errorhandler(ToolCallingError)
    def _tool_calling_error(e: ToolCallingError):
        return error_response(400, str(e), e.param)

    @app.errorhandler(ValidationError)
    def _validation_error(e: ValidationError):
        errs = e.errors(include_url=False)
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(400, f"Invalid JSON body: {first.get('msg')}")
        field0 = str(first.get("loc", ("body",))[0]) if first.get("loc") else None
        same = [er for er in errs if er.get("loc") and str(er["loc"][0]) == field0]
        if field0 in _UNION_HINTS and len(same) > 1:
            return error_response(400, f"{field0}: {_UNION_HINTS[field0]}", field0)
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())) or 'body'}: {er.get('msg')}"
                        for er in errs[:3])
        return error_response(400, msg, loc or None)

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        status = e.code or 500
        msg = e.description or e.name
        if status == 413:
            msg = f"Request body too large (limit: {cfg.max_request_body_bytes} bytes)."
        return error_response(status, msg)

    @app.errorhandler(Exception)
    def _internal_error(e: Exception):
        if is_engine_dead(e, engine):
            return error_response(503, f"The engine is dead: {e}")
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}")

    @app.before_request
    def _gate():  # shutdown drain, then the API key
        if st.draining and request.path != "/metrics":
            resp = error_response(503, "The server is shutting down.")
            resp.headers["Connection"] = "close"
            return resp
        if cfg.api_keys and request.method != "OPTIONS" and request.path.startswith("/v1") and not _authorized(
                request.headers.get("Authorization", ""), cfg.api_keys):
            return error_response(401, "Invalid or missing API key.")
        st.active_requests += 1
        request.environ[_COUNTED_ENVIRON_KEY] = True
        return None

    @app.after_request
    def _count_until_closed(resp: Response):
        # A streamed response is still being served after the view returned: the request
        # counts (for the shutdown drain) until the server closes the response.
        if request.environ.pop(_COUNTED_ENVIRON_KEY, False):
            def release() -> None:
                st.active_requests -= 1
            resp.call_on_close(release)
            # werkzeug runs no close hook on a direct-passthrough response (send_file: the
            # page's files); iterated like any other, it runs them.
            resp.direct_passthrough = False
        return resp

    @app.get("/health")
    def health():
        if getattr(engine, "errored", False):
            return error_response(503, f"The engine is dead: {getattr(engine, 'dead_error', None)!r}")
        return Response(status=200)

    @app.get("/version")
    def version():
        return _json_response({"version": VERSION})

    @app.get("/metrics")
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(st.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    if cfg.dev_mode:
        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            # vLLM's dev endpoint (VENGINE_SERVER_DEV_MODE=1): 200 when reset, 409 while
            # requests hold KV blocks
            if st.bridge.run_blocking(asyncio.run, engine.reset_prefix_cache()):
                return _json_response({"success": True})
            return error_response(409, "The prefix cache cannot be reset while requests hold KV blocks.")

    from .serving_models import register_model_routes
    from .serving_tokenization import register_tokenization_routes
    register_model_routes(app, st)  # GET /v1/models, /v1/models/<model>
    register_tokenization_routes(app, st)  # POST /tokenize, /detokenize

    @app.post("/v1/completions")
    def completions():
        req = _parse(CompletionRequest)
        model = _check_model(st, req.model)
        _check_stream_options(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported.", "suffix")
        refuse_tool_fields(req)
        prompts = _completion_prompts(st, req)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs).", "echo")
        max_tokens = _ENGINE_DEFAULT if req.max_tokens is None else req.max_tokens
        sp = _sampling_params(st, req, max_tokens, req.logprobs, [len(ids) for _, ids in prompts],
                              bool(req.stream), request_structured_outputs(req))
        echo = None
        if req.echo:
            from pyengine import prompt_text_for_echo
            echo = [text if text is not None else prompt_text_for_echo(st.tokenizer, ids) for text, ids in prompts]
        so = req.stream_options
        job = _Job(st, chat=False, model=model, prompts=prompts, sp=sp, priority=req.priority or 0,
                   want_logprobs=req.logprobs is not None, num_top=req.logprobs, echo_texts=echo,
                   include_usage=bool(so and so.include_usage),
                   continuous_usage=bool(so and so.continuous_usage_stats))
        return _run_job(job, bool(req.stream))

    @app.post("/v1/chat/completions")
    def chat_completions():
        req = _parse(ChatCompletionRequest)
        model = _check_model(st, req.model)
        _check_stream_options(req)
        tools, tool_mode = chat_tool_mode(req, cfg.tool_call_parser, cfg.enable_auto_tool_choice)
        constraint = request_structured_outputs(req, tool_mode)
        text, ids = _chat_prompt(st, req, tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true.", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        sp = _sampling_params(st, req, max_tokens, num_top, [len(ids)], bool(req.stream), constraint)
        so = req.stream_options
        job = _Job(st, chat=True, model=model, prompts=[(text, ids)], sp=sp, priority=req.priority or 0,
                   want_logprobs=bool(req.logprobs), num_top=num_top, echo_texts=None,
                   include_usage=bool(so and so.include_usage),
                   continuous_usage=bool(so and so.continuous_usage_stats), tool_mode=tool_mode)
        return _run_job(job, bool(req.stream))

    return app

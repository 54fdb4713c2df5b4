"""``/v1/responses`` on top of chat (mirrors vllm/entrypoints/openai/responses/utils.py and
the simple, non-harmony path of its serving and streaming_events): pure conversions, no
HTTP.

- ``responses_to_chat_request(req)``: a ``ResponsesRequest`` -> the ``/v1/chat/completions``
  body that asks the engine the same thing (messages, sampling fields, tools and
  ``tool_choice``, ``text.format`` as ``response_format``, ``reasoning.effort`` as chat
  template kwargs), so both endpoints go through one request path (``ChatCompletionRequest``
  -> ``serving_chat.chat_inputs``). ``RESPONSES_PARAMS`` renames the chat fields a refusal
  names back to the Responses ones.
- ``chat_to_response(req, chat_completion, ...)``: a finished chat result -> the
  ``Response`` object (reasoning item, message item, function_call items, status, usage).
- ``ResponsesStreamState``: one per stream; chat-style deltas (reasoning text, content
  text, tool-call pieces, the finish) -> the typed event sequence ``response.created``,
  ``response.in_progress``, per output item ``response.output_item.added`` …
  ``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when
  cut by ``max_output_tokens``, ``response.failed`` on an engine error).
"""
from __future__ import annotations

import json
import time
from typing import Any

from pyengine.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    function_call_item,
    message_item,
    output_text_part,
    random_id,
    reasoning_item,
    reasoning_text_part,
    response_object,
    usage,
)

# chat-completions field -> the Responses field a refusal should name
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice"}

# Copied to the chat request as they are (vLLM's extra sampling fields included).
_PASS_THROUGH = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
                 "priority", "request_id")


def responses_param(chat_param: str | None) -> str | None:
    """The Responses name of a chat request field (``VLLMValidationError.parameter``)."""
    if chat_param is None:
        return None
    head, dot, rest = chat_param.partition(".")
    return RESPONSES_PARAMS.get(head, head) + (dot + rest if dot else "")


def _messages(req: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages: ``developer`` as ``system``; an
    earlier turn's reasoning, message and function calls as one assistant message
    (``reasoning_content``, ``content``, ``tool_calls``); function outputs as ``tool``
    messages."""
    msgs: list[dict] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        msgs.append({"role": "user", "content": req.input})
        return msgs

    def assistant() -> dict:  # the assistant message this item belongs to
        if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("_closed"):
            return msgs[-1]
        msgs.append({"role": "assistant", "content": None})
        return msgs[-1]

    for item in req.input:
        if isinstance(item, MessageItem) and item.role != "assistant":
            msgs.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, MessageItem):
            m = assistant()
            if m["content"] is not None or m.get("tool_calls"):
                m["_closed"] = True
                m = assistant()
            m["content"] = item.text()
        elif isinstance(item, ReasoningItem):
            m = assistant()
            if m["content"] is not None or m.get("tool_calls"):
                m["_closed"] = True
                m = assistant()
            m["reasoning_content"] = m.get("reasoning_content", "") + item.text()
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    for m in msgs:
        m.pop("_closed", None)
    return msgs


def _chat_tools(req: ResponsesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    out = []
    for t in req.tools:
        assert isinstance(t, FunctionTool), "refused by check_responses_request"
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _chat_tool_choice(req: ResponsesRequest) -> Any:
    tc = req.tool_choice
    if tc is None or isinstance(tc, str):
        return tc
    return {"type": "function", "function": {"name": tc.name}}


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJSONSchema):
        js = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in js.items() if v is not None}}
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    return None


def _template_kwargs(req: ResponsesRequest) -> dict | None:
    """``reasoning.effort``: ``"none"`` turns thinking off (``enable_thinking``, Qwen3's
    switch); another effort turns it on and reaches the template as ``reasoning_effort``
    (as vLLM passes it). The request's own ``chat_template_kwargs`` win."""
    kw: dict = {}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort == "none":
        kw["enable_thinking"] = False
    elif effort is not None:
        kw.update(enable_thinking=True, reasoning_effort=effort)
    kw.update(req.chat_template_kwargs or {})
    return kw or None


def responses_to_chat_request(req: ResponsesRequest) -> dict:
    """The chat-completions request body (``ChatCompletionRequest`` fields) for ``req``
    (already checked by ``check_responses_request``). Note: earlier reasoning items ride
    on assistant messages as ``reasoning_content``, which chat templates (Qwen3's) read."""
    body: dict[str, Any] = {"messages": _messages(req), "max_tokens": req.max_output_tokens,
                            "tools": _chat_tools(req), "tool_choice": _chat_tool_choice(req),
                            "response_format": _response_format(req), "chat_template_kwargs": _template_kwargs(req),
                            "stream": bool(req.stream)}
    for name in _PASS_THROUGH:
        body[name] = getattr(req, name)
    return {k: v for k, v in body.items() if v is not None}


# ---------------------------------------------------------------------------------------
# Finished results


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "cancelled", None
    if finish_reason == "error":
        return "failed", None
    return "completed", None


def _usage_of(chat_usage: dict | None, reasoning_tokens: int) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    details = chat_usage.get("completion_tokens_details") or {}
    return usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"],
                 details.get("reasoning_tokens") or reasoning_tokens, cached)


def chat_to_response(req: ResponsesRequest, chat_completion: dict, *, response_id: str | None = None,
                     created_at: float | None = None, reasoning_tokens: int = 0,
                     error: str | None = None) -> dict:
    """A ``chat.completion`` object (one choice; its message's ``reasoning_content``,
    ``content`` and ``tool_calls``; ``finish_reason``; ``usage``) -> the ``Response``.
    Whitespace-only content next to tool calls is dropped (what the hermes parser leaves
    between ``</think>`` and a call). ``error``: the engine's message for
    ``finish_reason="error"``."""
    choice = chat_completion["choices"][0]
    msg = choice["message"]
    status, reason = _status(choice.get("finish_reason"))
    item_status = "incomplete" if status == "incomplete" else "completed"
    output = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        output.append(reasoning_item(random_id("rs"), reasoning, item_status))
    calls = msg.get("tool_calls") or []
    content = msg.get("content")
    if content and (content.strip() or not calls) or (not calls and not reasoning):
        output.append(message_item(random_id("msg"), content or "", item_status))
    for c in calls:
        output.append(function_call_item(random_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                         item_status))
    return response_object(req, response_id or random_id("resp"), chat_completion.get("model") or req.model or "",
                           created_at if created_at is not None else time.time(), output, status,
                           _usage_of(chat_completion.get("usage"), reasoning_tokens), reason,
                           {"code": "server_error", "message": error or "generation failed"}
                           if status == "failed" else None)


# ---------------------------------------------------------------------------------------
# Streams


class _Item:
    def __init__(self, kind: str, index: int, item_id: str, call_id: str = "", name: str = ""):
        self.kind, self.index, self.id = kind, index, item_id
        self.call_id, self.name = call_id, name
        self.text: list[str] = []


class ResponsesStreamState:
    """The event sequence of one streamed response. Feed chat-style deltas in output order
    (``chat_delta`` takes a chat chunk's ``delta`` dict; or ``reasoning`` / ``content`` /
    ``tool_call``), then ``finish``. Each call returns the events to send, in order, with
    their ``sequence_number``; ``sse(event)`` frames one for the wire."""

    def __init__(self, req: ResponsesRequest, model: str, prompt_tokens: int, *, response_id: str | None = None,
                 created_at: float | None = None):
        self.req, self.model, self.prompt_tokens = req, model, prompt_tokens
        self.response_id = response_id or random_id("resp")
        self.created_at = created_at if created_at is not None else time.time()
        self.seq = 0
        self.items: list[_Item] = []
        self.done: list[dict] = []  # finished items, in output order
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # chat tool-call index -> its item
        self.spaces = ""  # whitespace-only content held back: dropped if a tool call follows
        self.started = False

    def _ev(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _response(self, status: str, output: list[dict], usage_obj=None, reason=None, error=None) -> dict:
        return response_object(self.req, self.response_id, self.model, self.created_at, output, status, usage_obj,
                               reason, error)

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress`` (sent once, first)."""
        if self.started:
            return []
        self.started = True
        return [self._ev("response.created", response=self._response("in_progress", [])),
                self._ev("response.in_progress", response=self._response("in_progress", []))]

    def _close(self, status: str = "completed") -> list[dict]:
        it, self.open = self.open, None
        if it is None:
            return []
        text = "".join(it.text)
        loc = {"item_id": it.id, "output_index": it.index}
        if it.kind == "reasoning":
            item = reasoning_item(it.id, text, status)
            evs = [self._ev("response.reasoning_text.done", **loc, content_index=0, text=text),
                   self._ev("response.content_part.done", **loc, content_index=0, part=reasoning_text_part(text))]
        elif it.kind == "message":
            item = message_item(it.id, text, status)
            evs = [self._ev("response.output_text.done", **loc, content_index=0, text=text, logprobs=[]),
                   self._ev("response.content_part.done", **loc, content_index=0, part=output_text_part(text))]
        else:
            item = function_call_item(it.id, it.call_id, it.name, text, status)
            evs = [self._ev("response.function_call_arguments.done", **loc, arguments=text)]
        self.done.append(item)
        return evs + [self._ev("response.output_item.done", output_index=it.index, item=item)]

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[dict]:
        evs = self.start() + self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        it = _Item(kind, len(self.items), random_id(prefix), call_id, name)
        self.items.append(it)
        self.open = it
        loc = {"item_id": it.id, "output_index": it.index}
        if kind == "reasoning":
            return evs + [self._ev("response.output_item.added", output_index=it.index,
                                   item=reasoning_item(it.id, None, "in_progress")),
                          self._ev("response.content_part.added", **loc, content_index=0, part=reasoning_text_part(""))]
        if kind == "message":
            return evs + [self._ev("response.output_item.added", output_index=it.index,
                                   item=message_item(it.id, None, "in_progress")),
                          self._ev("response.content_part.added", **loc, content_index=0, part=output_text_part(""))]
        return evs + [self._ev("response.output_item.added", output_index=it.index,
                               item=function_call_item(it.id, call_id, name, "", "in_progress"))]

    def reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        evs = self._open("reasoning") if self.open is None or self.open.kind != "reasoning" else []
        assert self.open is not None  # _open set it
        self.open.text.append(text)
        return evs + [self._ev("response.reasoning_text.delta", item_id=self.open.id,
                               output_index=self.open.index, content_index=0, delta=text)]

    def content(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.open is None or self.open.kind != "message":
            if not (self.spaces + text).strip():
                self.spaces += text  # held: a tool call may follow
                return []
            text, self.spaces = self.spaces + text, ""
            evs = self._open("message")
        else:
            evs = []
        assert self.open is not None  # _open set it
        self.open.text.append(text)
        return evs + [self._ev("response.output_text.delta", item_id=self.open.id, output_index=self.open.index,
                               content_index=0, delta=text, logprobs=[])]

    def tool_call(self, delta: dict) -> list[dict]:
        """One chat ``tool_calls`` entry: ``{"index", "id", "type", "function": {"name",
        "arguments"}}`` to start a call (arguments may come whole), ``{"index",
        "function": {"arguments"}}`` for more of its arguments."""
        self.spaces = ""
        idx = delta.get("index", 0)
        fn = delta.get("function") or {}
        evs = []
        it = self.calls.get(idx)
        if it is None:
            evs = self._open("function_call", delta.get("id") or random_id("call"), fn.get("name") or "")
            assert self.open is not None  # _open set it
            it = self.calls[idx] = self.open
        elif self.open is not it:
            raise ValueError(f"tool call {idx} continued after another output item began")
        if fn.get("arguments"):
            it.text.append(fn["arguments"])
            evs.append(self._ev("response.function_call_arguments.delta", item_id=it.id, output_index=it.index,
                                delta=fn["arguments"]))
        return evs

    def chat_delta(self, delta: dict) -> list[dict]:
        """A chat chunk's ``delta``: ``reasoning_content`` (or ``reasoning``), ``content``,
        ``tool_calls``, in that order."""
        evs = self.start()
        evs += self.reasoning(delta.get("reasoning_content") or delta.get("reasoning") or "")
        evs += self.content(delta.get("content") or "")
        for tc in delta.get("tool_calls") or []:
            evs += self.tool_call(tc)
        return evs

    def finish(self, finish_reason: str | None, completion_tokens: int, *, reasoning_tokens: int = 0,
               cached_tokens: int = 0, error: str | None = None) -> list[dict]:
        """The last events: open items closed (``incomplete`` when cut by the length),
        held whitespace sent if no tool call came, then ``response.completed`` /
        ``response.incomplete`` / ``response.failed`` with the whole response and usage."""
        status, reason = _status(finish_reason)
        evs = self.start()
        if self.spaces and not self.calls:  # whitespace was the whole answer
            evs += self._open("message")
            assert self.open is not None  # _open set it
            self.open.text.append(self.spaces)
            evs.append(self._ev("response.output_text.delta", item_id=self.open.id, output_index=self.open.index,
                                content_index=0, delta=self.spaces, logprobs=[]))
            self.spaces = ""
        if not self.items and status != "failed":  # an empty answer is an empty message
            evs += self._open("message")
        evs += self._close("incomplete" if status == "incomplete" else "completed")
        u = usage(self.prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens)
        err = {"code": "server_error", "message": error or "generation failed"} if status == "failed" else None
        # (no event type for a cancelled response: an aborted one ends as incomplete)
        final = {"completed": "response.completed", "failed": "response.failed"}.get(status, "response.incomplete")
        return evs + [self._ev(final, response=self._response(status, list(self.done), u, reason, err))]


def sse(event: dict) -> str:
    """One event framed as OpenAI sends it: ``event: <type>`` and ``data: <json>``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

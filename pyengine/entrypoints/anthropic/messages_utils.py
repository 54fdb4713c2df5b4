"""``/v1/messages`` on top of chat (mirrors vllm/entrypoints/anthropic/serving.py's
conversions): pure functions, no HTTP.

- ``messages_to_chat_request(req)``: a ``MessagesRequest`` (or ``CountTokensRequest``) ->
  the ``/v1/chat/completions`` body that asks the engine the same thing: ``system`` and
  system messages, text, ``tool_use`` -> an assistant's ``tool_calls``, ``tool_result`` ->
  ``tool`` messages, ``thinking`` -> the assistant's ``reasoning_content``, a last assistant
  message -> ``continue_final_message``; sampling fields; tools and ``tool_choice``
  (``any`` -> ``required``, ``tool`` -> a named function, ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``); ``thinking`` -> ``enable_thinking``, and ``enabled``'s
  ``budget_tokens`` -> vLLM's ``thinking_token_budget``; ``output_config``.
  ``ANTHROPIC_PARAMS`` renames the chat fields a refusal names back.
- ``chat_to_message(req, chat_completion)``: a finished chat result -> the ``Message``
  (``thinking``, ``text``, ``tool_use`` blocks; ``stop_reason`` ``end_turn`` /
  ``max_tokens`` / ``stop_sequence`` / ``tool_use``; usage).
- ``MessagesStreamState``: one per stream; chat-style deltas -> ``message_start``,
  ``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` per block,
  ``message_delta`` (``stop_reason``, usage), ``message_stop``.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from pyengine.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    error_body,
    usage,
)

# chat-completions field -> the Messages field a refusal should name
ANTHROPIC_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
                    "response_format": "output_config.format", "user": "metadata.user_id",
                    "thinking_token_budget": "thinking.budget_tokens"}


def anthropic_param(chat_param: str | None) -> str | None:
    """The Messages name of a chat request field (``VLLMValidationError.parameter``)."""
    if chat_param is None:
        return None
    head, dot, rest = chat_param.partition(".")
    return ANTHROPIC_PARAMS.get(head, head) + (dot + rest if dot else "")


def random_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _system_text(system) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b.text for b in system) or None


def _message(role: str, content) -> list[dict]:
    """One Anthropic message -> chat messages (a user message's tool results first, as
    ``tool`` messages, then its text)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out, texts, calls, reasoning = [], [], [], []
    for b in content:
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif not isinstance(b, RedactedThinkingBlock):
            raise AssertionError(f"refused by check_messages_request: {b!r}")
    if role == "assistant":
        m: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
        if reasoning:
            m["reasoning_content"] = "".join(reasoning)
        if calls:
            m["tool_calls"] = calls
        return out + [m]
    if texts or not out:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def _tool_choice(req) -> tuple[Any, bool | None]:
    tc = req.tool_choice
    if tc is None:
        return None, None
    parallel = False if getattr(tc, "disable_parallel_tool_use", None) else None
    if isinstance(tc, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(tc, ToolChoiceAny):
        return "required", parallel
    if isinstance(tc, ToolChoiceTool):
        return {"type": "function", "function": {"name": tc.name}}, parallel
    assert isinstance(tc, ToolChoiceNone)
    return "none", None


def _template_kwargs(req) -> dict | None:
    kw: dict = {}
    if isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)):
        kw["enable_thinking"] = True
    elif isinstance(req.thinking, ThinkingDisabled):
        kw["enable_thinking"] = False
    if req.output_config is not None and req.output_config.effort is not None:
        kw["reasoning_effort"] = req.output_config.effort  # for templates that read it, as vLLM passes it
    kw.update(req.chat_template_kwargs or {})
    return kw or None


def messages_to_chat_request(req: MessagesRequest | CountTokensRequest) -> dict:
    """The chat-completions request body (``ChatCompletionRequest`` fields) for ``req``
    (already checked by ``check_messages_request``)."""
    msgs: list[dict] = []
    system = _system_text(req.system)
    if system:
        msgs.append({"role": "system", "content": system})
    for m in req.messages:
        msgs += _message(m.role, m.content)
    prefill = req.messages[-1].role == "assistant"
    tool_choice, parallel = _tool_choice(req)
    tools = None if req.tools is None else [
        {"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                            ("parameters", t.input_schema)) if v is not None}}
        for t in req.tools]
    fmt = req.output_config.format if req.output_config is not None else None
    body: dict[str, Any] = {
        "model": req.model, "messages": msgs, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "chat_template_kwargs": _template_kwargs(req),
        "response_format": None if fmt is None else {"type": "json_schema",
                                                     "json_schema": {"name": "output", "schema": fmt.schema_}},
    }
    if prefill:  # Anthropic's prefill: the answer continues the last assistant message
        body.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=bool(req.stream), priority=req.priority,
                    request_id=req.request_id, seed=req.seed,
                    user=req.metadata.user_id if req.metadata is not None else None)
        if isinstance(req.thinking, ThinkingEnabled):  # the engine enforces it (count_tokens generates nothing)
            body["thinking_token_budget"] = req.thinking.budget_tokens
    return {k: v for k, v in body.items() if v is not None}


# ---------------------------------------------------------------------------------------
# Finished results


def stop_reason_of(req: MessagesRequest, finish_reason: str | None, stop_reason: Any,
                   tools_called: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat finish: ``tool_use`` when tools were
    called, ``max_tokens`` for the length, ``stop_sequence`` when one of the request's
    ``stop_sequences`` ended it (``stop_reason``: the engine's matched stop), else
    ``end_turn``. Raises ValueError for ``abort`` / ``error`` (an error body, not a message)."""
    if finish_reason in ("abort", "error"):
        raise ValueError(f"finish_reason {finish_reason!r} is answered with an error body (error_body)")
    if finish_reason == "length":
        return "max_tokens", None
    if tools_called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (req.stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def chat_to_message(req: MessagesRequest, chat_completion: dict, *, message_id: str | None = None,
                    reasoning_tokens: int = 0) -> dict:
    """A ``chat.completion`` object (one choice; its message's ``reasoning_content``,
    ``content``, ``tool_calls``; ``finish_reason`` and vLLM's ``stop_reason``; ``usage``)
    -> the ``Message``. A call whose arguments are not a JSON object (cut short by
    ``max_tokens``) comes back as text; whitespace-only text next to tool calls is dropped."""
    choice = chat_completion["choices"][0]
    msg = choice["message"]
    blocks: list[dict] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    calls = msg.get("tool_calls") or []
    content = msg.get("content")
    if content and (content.strip() or not calls):
        blocks.append({"type": "text", "text": content})
    for c in calls:
        args = _tool_input(c["function"]["arguments"])
        if args is None:
            blocks.append({"type": "text", "text": c["function"]["arguments"]})
        else:
            blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args})
    reason, sequence = stop_reason_of(req, choice.get("finish_reason"), choice.get("stop_reason"),
                                      any(b["type"] == "tool_use" for b in blocks))
    u = chat_completion.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    usage_obj = usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), cached)
    thinking = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or reasoning_tokens
    if thinking:
        usage_obj["output_tokens_details"] = {"thinking_tokens": thinking}
    return {"id": message_id or random_id(), "type": "message", "role": "assistant",
            "model": chat_completion.get("model") or req.model, "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage_obj}


# ---------------------------------------------------------------------------------------
# Streams


class MessagesStreamState:
    """The event sequence of one streamed message. Feed chat-style deltas in output order
    (``chat_delta`` takes a chat chunk's ``delta`` dict; or ``thinking`` / ``text`` /
    ``tool_call``), then ``finish``. Each call returns the events to send, in order;
    ``sse(event)`` frames one for the wire."""

    def __init__(self, req: MessagesRequest, model: str, prompt_tokens: int, *, message_id: str | None = None,
                 cached_tokens: int = 0):
        self.req, self.model = req, model
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.id = message_id or random_id()
        self.index = -1  # of the open block
        self.kind: str | None = None  # "thinking", "text", "tool_use" (open block), or None
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.spaces = ""  # whitespace-only text held back: dropped if a tool call follows
        self.started = False
        self.tools_called = False

    def start(self) -> list[dict]:
        """``message_start`` (sent once, first)."""
        if self.started:
            return []
        self.started = True
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens, 0, self.cached_tokens)}}]

    def _close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict) -> list[dict]:
        evs = self.start() + self._close()
        self.index += 1
        self.kind = kind
        return evs + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def thinking(self, text: str) -> list[dict]:
        if not text:
            return []
        evs = [] if self.kind == "thinking" else self._open("thinking", {"type": "thinking", "thinking": "",
                                                                          "signature": ""})
        return evs + [{"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "thinking_delta", "thinking": text}}]

    def text(self, text: str) -> list[dict]:
        if not text:
            return []
        evs: list[dict] = []
        if self.kind != "text":
            if not (self.spaces + text).strip():
                self.spaces += text  # held: a tool call may follow
                return []
            text, self.spaces = self.spaces + text, ""
            evs = self._open("text", {"type": "text", "text": ""})
        return evs + [{"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "text_delta", "text": text}}]

    def tool_call(self, delta: dict) -> list[dict]:
        """One chat ``tool_calls`` entry (a call's start with ``id`` and ``function.name``,
        or more of its ``function.arguments``)."""
        self.spaces = ""
        idx = delta.get("index", 0)
        fn = delta.get("function") or {}
        evs: list[dict] = []
        if idx not in self.calls:
            evs = self._open("tool_use", {"type": "tool_use", "id": delta.get("id") or random_id("toolu"),
                                          "name": fn.get("name") or "", "input": {}})
            self.calls[idx] = self.index
            self.tools_called = True
        elif self.calls[idx] != self.index or self.kind != "tool_use":
            raise ValueError(f"tool call {idx} continued after another content block began")
        if fn.get("arguments"):
            evs.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return evs

    def chat_delta(self, delta: dict) -> list[dict]:
        """A chat chunk's ``delta``: ``reasoning_content`` (or ``reasoning``), ``content``,
        ``tool_calls``, in that order."""
        evs = self.start()
        evs += self.thinking(delta.get("reasoning_content") or delta.get("reasoning") or "")
        evs += self.text(delta.get("content") or "")
        for tc in delta.get("tool_calls") or []:
            evs += self.tool_call(tc)
        return evs

    def finish(self, finish_reason: str | None, completion_tokens: int, stop_reason: Any = None, *,
               reasoning_tokens: int = 0) -> list[dict]:
        """The open block closed (held whitespace sent first if no tool call came), then
        ``message_delta`` with ``stop_reason`` and the output token count, and
        ``message_stop``. For ``abort`` / ``error`` finishes use ``error_event``."""
        evs = self.start()
        if self.spaces and not self.calls:
            spaces, self.spaces = self.spaces, ""
            evs += self._open("text", {"type": "text", "text": ""})
            evs.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": spaces}})
        evs += self._close()
        reason, sequence = stop_reason_of(self.req, finish_reason, stop_reason, self.tools_called)
        u: dict[str, Any] = {"output_tokens": completion_tokens}
        if reasoning_tokens:
            u["output_tokens_details"] = {"thinking_tokens": reasoning_tokens}
        return evs + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": u}, {"type": "message_stop"}]

    @staticmethod
    def error_event(message: str, status: int = 500) -> dict:
        """The stream's ``error`` event (an engine failure after the stream began)."""
        return error_body(status, message)


def sse(event: dict) -> str:
    """One event framed as Anthropic sends it: ``event: <type>`` and ``data: <json>``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

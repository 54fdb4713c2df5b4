"""The OpenAI Responses API (``POST /v1/responses``) wire format (mirrors
vllm/entrypoints/openai/responses/protocol.py): the request model, pydantic with the field
names the ``openai`` SDK sends (``ResponseCreateParams``), unknown fields kept in
``model_extra``; ``unsupported_fields`` lists the known fields this server cannot honour
(``check_responses_request`` refuses both kinds); and builders of the response side as
plain dicts (the shapes of ``openai.types.responses.Response``, its output items, usage
and typed stream events; dicts because stream events are built once per token).

Supported: ``input`` (a string, or messages with text parts, ``function_call`` /
``function_call_output`` items and earlier ``reasoning`` items), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``, ``tool_choice``
(``none`` / ``auto`` / ``required`` / a named function), ``parallel_tool_calls``,
``text.format`` (``text`` / ``json_schema`` / ``json_object``), ``reasoning.effort``,
``stream``, ``metadata``, ``user``, ``safety_identifier`` and ``prompt_cache_key`` (echoed:
end-user ids for the caller's records; prefix caching needs no key), ``store: false``, ``truncation:
"disabled"``, and vLLM's extra sampling fields (``top_k``, ``min_p``, ``seed``, ``stop``,
penalties, ``priority``, ``request_id``, ``chat_template_kwargs``, ...). Refused: stored
responses (``store: true``, ``previous_response_id``, ``conversation``, ``background``),
hosted tools, images and files, ``include``, logprobs, ``reasoning.summary``, ...
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from pyengine.entrypoints.request_fields import CaptureModel, check_fields, tagged

# ---------------------------------------------------------------------------------------
# Request


class InputTextPart(CaptureModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict | None = None  # a caching hint: the prefix cache is automatic


class OutputTextPart(CaptureModel):
    """An earlier assistant message's text, as a client sends ``response.output`` back."""
    type: Literal["output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class RefusalPart(CaptureModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = tagged({"input_text": InputTextPart, "output_text": OutputTextPart, "refusal": RefusalPart})


class MessageItem(CaptureModel):
    """``EasyInputMessageParam`` / ``Message`` / an earlier ``ResponseOutputMessage``."""
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in self.content)


class FunctionCallItem(CaptureModel):
    """An earlier call of a function tool (``ResponseFunctionToolCallParam``)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict | None = None


class FunctionCallOutputItem(CaptureModel):
    """A function's result (``FunctionCallOutput``)."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(getattr(p, "text", "") for p in self.output)


class SummaryPart(CaptureModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(CaptureModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(CaptureModel):
    """An earlier response's reasoning (``ResponseReasoningItem``)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


InputItem = tagged({"message": MessageItem, "function_call": FunctionCallItem,
                    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}, default="message")


class FunctionTool(CaptureModel):
    """``FunctionToolParam``."""
    type: Literal["function"]
    name: str
    parameters: dict | None = None
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict | None = None
    async_: bool | None = Field(default=None, alias="async")


Tool = tagged({"function": FunctionTool})


class ToolChoiceFunction(CaptureModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | tagged({"function": ToolChoiceFunction})


class TextFormatText(CaptureModel):
    type: Literal["text"]


class TextFormatJSONSchema(CaptureModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormatJSONObject(CaptureModel):
    type: Literal["json_object"]


class TextConfig(CaptureModel):
    format: tagged({"text": TextFormatText, "json_schema": TextFormatJSONSchema,
                     "json_object": TextFormatJSONObject}) | None = None
    verbosity: str | None = None


class ReasoningConfig(CaptureModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponsesRequest(CaptureModel):
    """``POST /v1/responses`` (``openai.types.responses.ResponseCreateParams``; absent and
    ``null`` mean the default)."""
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # known, not supported (unsupported_fields)
    previous_response_id: str | None = None
    conversation: Any | None = None
    background: bool | None = None
    background_options: Any | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    stream_options: dict | None = None
    top_logprobs: int | None = None
    prompt: Any | None = None
    context_management: Any | None = None
    moderation: Any | None = None
    image: Any | None = None
    access_programs: Any | None = None
    prompt_cache_options: Any | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None
    request_id: str | None = None
    chat_template_kwargs: dict | None = None


# The always-unsupported known fields: a value other than these defaults is refused.
_UNSUPPORTED_UNLESS = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False),
    "background_options": (None,), "max_tool_calls": (None,), "stream_options": (None,),
    "top_logprobs": (None, 0), "prompt": (None,), "context_management": (None,), "moderation": (None,),
    "image": (None,), "access_programs": (None,), "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,), "store": (None, False), "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
}
_WHY = {
    "store": "is not supported: responses are not stored (send store=false or leave it out)",
    "previous_response_id": "is not supported: responses are not stored; send the whole conversation as input",
    "conversation": "is not supported: conversations are not stored; send the whole conversation as input",
    "background": "is not supported: responses are not stored",
    "truncation": "'auto' is not supported: a prompt too long for the context is refused",
    "top_logprobs": "is not supported on /v1/responses (use /v1/chat/completions for logprobs)",
}


def unsupported_fields(req: ResponsesRequest) -> list[tuple[str, str]]:
    """``(path, why)`` for each known field set to something this server cannot honour."""
    out = [(name, _WHY.get(name, "is not supported"))
           for name, allowed in _UNSUPPORTED_UNLESS.items() if getattr(req, name) not in allowed]
    if req.include:
        out.append(("include", f"is not supported (got {req.include!r:.100})"))
    if req.text is not None and req.text.verbosity is not None:
        out.append(("text.verbosity", "is not supported"))
    if req.reasoning is not None:
        for name in ("summary", "generate_summary", "context", "mode"):
            if getattr(req.reasoning, name) is not None:
                out.append((f"reasoning.{name}", "is not supported (no reasoning summaries)"))
    for i, t in enumerate(req.tools or []):
        if isinstance(t, FunctionTool):
            for name in ("defer_loading", "async_"):
                if getattr(t, name):
                    out.append((f"tools[{i}].{name.rstrip('_')}", "is not supported"))
            for name in ("allowed_callers", "output_schema"):
                if getattr(t, name) is not None:
                    out.append((f"tools[{i}].{name}", "is not supported"))
    if isinstance(req.input, list):
        for i, item in enumerate(req.input):
            if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
                out.append((f"input[{i}].encrypted_content", "is not supported"))
            if isinstance(item, (FunctionCallItem, FunctionCallOutputItem)):
                for name in ("namespace", "caller"):
                    if getattr(item, name) is not None:
                        out.append((f"input[{i}].{name}", "is not supported"))
    return out


def check_responses_request(req: ResponsesRequest) -> None:
    """Refuse unknown fields and fields ``unsupported_fields`` lists. Raises
    VLLMValidationError (``parameter``: the first field's path)."""
    check_fields(req, unsupported_fields)


# ---------------------------------------------------------------------------------------
# Response objects (openai.types.responses.*), as dicts


def random_id(prefix: str) -> str:
    """``<prefix>_<32 hex>``: ``resp``, ``msg``, ``rs`` (reasoning), ``fc`` (function call item)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0) -> dict:
    """``ResponseUsage``."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    """``ResponseOutputMessage`` (no content part when ``text`` is None)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text_part(text)]}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    """``ResponseReasoningItem``: the reasoning text as content (no summary)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": None if text is None else [reasoning_text_part(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """``ResponseFunctionToolCall``."""
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _echo_tool_choice(req: ResponsesRequest) -> Any:
    tc = req.tool_choice
    if tc is None:
        return "auto" if req.tools else "none"
    return tc if isinstance(tc, str) else {"type": "function", "name": tc.name}


def _echo_text(req: ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def response_object(req: ResponsesRequest, response_id: str, model: str, created_at: float,
                    output: list[dict], status: str, usage_obj: dict | None = None,
                    incomplete_reason: str | None = None, error: dict | None = None) -> dict:
    """``Response``: the request's settings echoed, ``output`` items, ``status``
    (``in_progress``, ``completed``, ``incomplete`` with ``incomplete_reason``, ``failed``
    with ``error`` = ``{"code", "message"}``, ``cancelled``)."""
    reasoning = req.reasoning.model_dump(include={"effort", "summary"}) if req.reasoning is not None else None
    return {
        "id": response_id, "object": "response", "created_at": created_at, "model": model, "status": status,
        "output": output, "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None, "reasoning": reasoning,
        "temperature": req.temperature, "top_p": req.top_p, "text": _echo_text(req),
        "tool_choice": _echo_tool_choice(req),
        "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []],
        "truncation": "disabled", "usage": usage_obj, "user": req.user,
        "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
    }


def error_event(message: str, code: str | None = None, param: str | None = None) -> dict:
    """The stream's ``error`` event (``ResponseErrorEvent``) without its sequence number."""
    return {"type": "error", "code": code, "message": message, "param": param}

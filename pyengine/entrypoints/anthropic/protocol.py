"""The Anthropic Messages API wire format (mirrors vllm/entrypoints/anthropic/protocol.py):
request models for ``POST /v1/messages`` and ``/v1/messages/count_tokens`` with the field
names the ``anthropic`` SDK sends (``MessageCreateParams``), unknown fields kept in
``model_extra``; ``unsupported_fields`` lists the known fields this server cannot honour
(``check_messages_request`` refuses both kinds); and the response side as plain dicts (the
shapes of ``anthropic.types.Message``, its content blocks, the stream events and the error
body).

Supported: ``system`` (a string or text blocks), ``messages`` (roles user / assistant /
system; text, ``tool_use``, ``tool_result`` with text, ``thinking`` and
``redacted_thinking`` blocks; a last assistant message is a prefill the answer continues),
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, custom ``tools``
with ``input_schema``, ``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``,
``disable_parallel_tool_use``), ``thinking`` (``enabled`` / ``adaptive`` / ``disabled``:
the chat template's ``enable_thinking``; ``enabled``'s ``budget_tokens``, at least 1024 and
below ``max_tokens`` as Anthropic requires, bounds the reasoning: the engine forces the end
of the thinking once it holds that many tokens (chat's ``thinking_token_budget``; needs
``--reasoning-parser``)), ``output_config`` (``format`` json_schema, ``effort``),
``metadata.user_id``, ``stream``, ``cache_control`` (prefix caching is automatic).
Refused: images, documents and other block types, server tools, citations, containers,
MCP servers, ``context_management``, ...
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pyengine.entrypoints.request_fields import CaptureModel, check_fields, tagged
from pyengine.exceptions import VLLMValidationError

# ---------------------------------------------------------------------------------------
# Request


class TextBlock(CaptureModel):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(CaptureModel):
    """An assistant's earlier tool call."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None
    caller: dict | None = None
    toolset_name: str | None = None


class ToolResultBlock(CaptureModel):
    """A tool's result, in a user message."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[tagged({"text": TextBlock})] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(b.text for b in self.content)


class ThinkingBlock(CaptureModel):
    """An assistant's earlier reasoning (sent back by agents)."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(CaptureModel):
    """Reasoning encrypted by Anthropic's API: opaque, left out of the prompt."""
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = tagged({"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                       "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock})


class MessageParam(CaptureModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolParam(CaptureModel):
    """A custom (client) tool."""
    name: str
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None  # how finely input streams: ours streams as it comes
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list | None = None


class ToolChoiceAuto(CaptureModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(CaptureModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(CaptureModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(CaptureModel):
    type: Literal["none"]


ToolChoice = tagged({"auto": ToolChoiceAuto, "any": ToolChoiceAny, "tool": ToolChoiceTool, "none": ToolChoiceNone})


class ThinkingEnabled(CaptureModel):
    type: Literal["enabled"]
    budget_tokens: int
    display: str | None = None


class ThinkingAdaptive(CaptureModel):
    type: Literal["adaptive"]
    display: str | None = None


class ThinkingDisabled(CaptureModel):
    type: Literal["disabled"]


Thinking = tagged({"enabled": ThinkingEnabled, "adaptive": ThinkingAdaptive, "disabled": ThinkingDisabled})


class Metadata(CaptureModel):
    user_id: str | None = None


class JSONOutputFormat(CaptureModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(CaptureModel):
    effort: str | None = None
    format: JSONOutputFormat | None = None


class _Conversation(CaptureModel):
    """What /v1/messages and /v1/messages/count_tokens share."""
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[tagged({"text": TextBlock})] | None = None
    tools: list[tagged({"custom": ToolParam}, default="custom")] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    chat_template_kwargs: dict | None = None  # vLLM's extra field


class MessagesRequest(_Conversation):
    """``POST /v1/messages`` (``anthropic.types.MessageCreateParams``)."""
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: str | None = None
    # known, not supported (unsupported_fields)
    container: Any | None = None
    context_management: Any | None = None
    mcp_servers: Any | None = None
    diagnostics: Any | None = None
    inference_geo: str | None = None
    # vLLM's extra fields
    priority: int | None = None
    request_id: str | None = None
    seed: int | None = None


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens`` (``MessageCountTokensParams``)."""


_UNSUPPORTED_UNLESS = {"container": (None,), "context_management": (None,), "mcp_servers": (None,),
                       "diagnostics": (None,), "inference_geo": (None,), "user_profile_id": (None,),
                       "workspace_id": (None,), "speed": (None, "standard"),
                       "service_tier": (None, "auto", "standard_only")}


def _block_problems(path: str, block: Any) -> list[tuple[str, str]]:
    out = []
    if isinstance(block, TextBlock) and block.citations:
        out.append((f"{path}.citations", "is not supported"))
    if isinstance(block, (ToolUseBlock, ToolResultBlock)):
        for name in ("caller", "toolset_name"):
            if getattr(block, name, None) is not None:
                out.append((f"{path}.{name}", "is not supported"))
    if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
        for j, b in enumerate(block.content):
            out += _block_problems(f"{path}.content[{j}]", b)
    return out


def unsupported_fields(req: _Conversation) -> list[tuple[str, str]]:
    """``(path, why)`` for each known field set to something this server cannot honour."""
    out = [(name, "is not supported") for name, allowed in _UNSUPPORTED_UNLESS.items()
           if getattr(req, name, None) not in allowed]
    forced = isinstance(req.tool_choice, (ToolChoiceAny, ToolChoiceTool))
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, ToolParam):
            continue
        if t.strict and not forced:
            out.append((f"tools[{i}].strict", "is only supported with tool_choice 'any' or 'tool' (which enforce "
                                               "the input schema)"))
        if t.defer_loading:
            out.append((f"tools[{i}].defer_loading", "is not supported"))
        for name in ("allowed_callers", "input_examples"):
            if getattr(t, name) is not None:
                out.append((f"tools[{i}].{name}", "is not supported"))
    if isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)) and req.thinking.display is not None:
        out.append(("thinking.display", "is not supported (thinking is returned as the model wrote it)"))
    if isinstance(req.system, list):
        for i, b in enumerate(req.system):
            out += _block_problems(f"system[{i}]", b)
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, b in enumerate(m.content):
                out += _block_problems(f"messages[{i}].content[{j}]", b)
    return out


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def check_thinking(req: _Conversation) -> None:
    """Anthropic's rules for ``thinking.budget_tokens``, with its messages: at least 1024,
    and below ``max_tokens`` (thinking counts towards it). Raises VLLMValidationError."""
    if not isinstance(req.thinking, ThinkingEnabled):
        return
    budget = req.thinking.budget_tokens
    if budget < MIN_THINKING_BUDGET:
        raise VLLMValidationError(f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
                                  f"{MIN_THINKING_BUDGET}", parameter="thinking.budget_tokens", value=budget)
    if isinstance(req, MessagesRequest) and req.max_tokens <= budget:
        raise VLLMValidationError(
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
            "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size",
            parameter="max_tokens", value=req.max_tokens)


def check_messages_request(req: _Conversation) -> None:
    """Refuse unknown fields and fields ``unsupported_fields`` lists (also for a
    ``CountTokensRequest``), and a thinking budget Anthropic would refuse
    (``check_thinking``). Raises VLLMValidationError (``parameter``: the first field)."""
    check_fields(req, unsupported_fields)
    check_thinking(req)


# ---------------------------------------------------------------------------------------
# Response side (anthropic.types.*), as dicts

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP ``status`` (also the stream's ``error`` event)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def count_tokens_response(input_tokens: int) -> dict:
    """``MessageTokensCount``."""
    return {"input_tokens": input_tokens}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """``Usage``: ``input_tokens`` are the prompt tokens not read from the prefix cache,
    ``cache_read_input_tokens`` those that were (Anthropic counts them apart)."""
    return {"input_tokens": input_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}

"""Structured outputs and tool calling for the HTTP routes: request fields -> the engine's
``StructuredOutputsParams`` and a per-choice ``ToolCallExtractor``. The rules themselves
live in ``pyengine.entrypoints`` (shared with the C ABI's ``vllm_chat``); this module maps
their ``VLLMValidationError``s to HTTP 400s."""
from __future__ import annotations

from typing import Optional

from pyengine.entrypoints.structured_outputs import structured_outputs_from_request
from pyengine.entrypoints.tool_calls import (ToolCallExtractor, ToolCallMode, messages_for_template, normalize_tools,
                                             resolve_tool_choice)
from pyengine.exceptions import VLLMValidationError
from pyengine.tool_parsers import ToolParserManager


class ToolCallingError(ValueError):
    """A request field the server refuses (-> HTTP 400 with ``param``)."""

    def __init__(self, message: str, param: Optional[str]):
        super().__init__(message)
        self.param = param


def _refused(e: VLLMValidationError) -> ToolCallingError:
    return ToolCallingError(str(e), e.parameter)


# Chat-only tool fields: on /v1/completions they could only be ignored, so they are refused.
CHAT_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


def refuse_tool_fields(req) -> None:
    """A completions request carrying tool fields (unknown there: pydantic's model_extra).
    Raises ToolCallingError."""
    extra = req.model_extra or {}
    for name in CHAT_TOOL_FIELDS:
        if extra.get(name) is not None:
            raise ToolCallingError(f"{name} is not supported by /v1/completions; tool calling is served by "
                                   "/v1/chat/completions.", name)


def request_structured_outputs(req, mode: Optional[ToolCallMode] = None):
    """The request's constraint (response_format / structured_outputs / guided_*), or the
    one its ``tool_choice`` imposes. Raises ToolCallingError."""
    try:
        so = structured_outputs_from_request(req.structured_output_fields())
    except VLLMValidationError as e:
        raise _refused(e) from None
    if mode is not None and mode.structured_outputs is not None:
        if so is not None:
            raise ToolCallingError(f"tool_choice {mode.kind!r} cannot be combined with response_format or "
                                   "structured outputs.", "tool_choice")
        so = mode.structured_outputs
    return so


def chat_tool_mode(req, tool_call_parser: Optional[str], enable_auto_tool_choice: bool) -> tuple[list, ToolCallMode]:
    """(normalized tools, ToolCallMode) of a chat request. Raises ToolCallingError."""
    for old in ("functions", "function_call"):
        if getattr(req, old) is not None:
            raise ToolCallingError(f"{old} is not supported; use tools and tool_choice.", old)
    try:
        tools = normalize_tools(req.tools)
        mode = resolve_tool_choice(tools, req.tool_choice, req.parallel_tool_calls,
                                   enable_auto_tool_choice and tool_call_parser is not None)
    except VLLMValidationError as e:
        raise _refused(e) from None
    return tools, mode


def template_messages(req) -> list[dict]:
    """The request's messages as chat templates expect them (tool calls' arguments as
    objects; ``tool_call_id`` and ``name`` kept)."""
    msgs = []
    for m in req.messages:
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        msgs.append(d)
    return messages_for_template(msgs)


def make_extractor(mode: ToolCallMode, tool_call_parser: Optional[str], tokenizer) -> ToolCallExtractor:
    parser = ToolParserManager.get_tool_parser(tool_call_parser)(tokenizer) \
        if mode.kind == "auto" and tool_call_parser else None
    return ToolCallExtractor(mode, parser)

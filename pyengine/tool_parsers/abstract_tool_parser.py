"""The tool-parser interface (mirrors vllm/tool_parsers/abstract_tool_parser.py).

Tool calls and deltas are plain dicts in OpenAI's wire shapes:
``{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}``,
and in streams ``{"index": i, ...}`` pieces of those (see ``ToolParser.stream``)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """A new tool-call id (vLLM's ``chatcmpl-tool-<hex>`` form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_tool_call(name: str, arguments: Any) -> dict:
    """One OpenAI tool call; ``arguments``: JSON text, or a value to serialize."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ExtractedToolCallInformation:
    """What a finished output holds: ``tools_called``, the calls, and the text outside them
    (``content``, None when there is none)."""
    tools_called: bool
    tool_calls: list[dict] = field(default_factory=list)
    content: str | None = None


class ToolParser:
    """Parses one model's tool-call format. One instance per choice: the streaming side
    (``stream``/``finish``) keeps state."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def stream(self, delta_text: str) -> list[dict]:
        """Feed the next piece of output text; returns OpenAI delta dicts
        (``{"content": ...}`` and/or ``{"tool_calls": [...]}``) ready to send."""
        raise NotImplementedError

    def finish(self) -> list[dict]:
        """The output ended: deltas for whatever was held back."""
        raise NotImplementedError

"""Tool-call parsers: model output text -> OpenAI tool calls (mirrors vllm/tool_parsers/).

``ToolParserManager.get_tool_parser(name)`` returns the parser class that
``vengine serve --tool-call-parser NAME`` selects. Parsers: ``hermes`` (the Qwen and
Hermes families' ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format; the
built-in model's chat template renders tools and calls that way)."""
from __future__ import annotations

from pyengine.tool_parsers.abstract_tool_parser import ExtractedToolCallInformation, ToolParser
from pyengine.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


class ToolParserManager:
    """The registry of tool-call parsers by name (vLLM's ``ToolParserManager``)."""

    tool_parsers: dict[str, type[ToolParser]] = {"hermes": Hermes2ProToolParser}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """Raises ValueError naming the known parsers for an unknown name."""
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise ValueError(f"Unknown tool call parser {name!r}; available: {', '.join(sorted(cls.tool_parsers))}.") \
                from None


__all__ = ["ToolParser", "ToolParserManager", "ExtractedToolCallInformation", "Hermes2ProToolParser"]

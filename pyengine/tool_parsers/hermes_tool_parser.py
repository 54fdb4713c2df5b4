"""The ``hermes`` tool-call parser (mirrors vllm/tool_parsers/hermes_tool_parser.py): the
Hermes 2 Pro / Qwen format, one JSON object per call between tags::

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text outside the tags is the message's content (whitespace-only pieces after a call
are dropped). An output whose calls do not all parse is returned as plain content, as vLLM
does. Streaming holds back only what may be the start of a tag, and emits each call whole
(name and arguments in one delta) once its closing tag (or the end of the output) arrives.
"""
from __future__ import annotations

import json
import re

from pyengine.tool_parsers.abstract_tool_parser import ExtractedToolCallInformation, ToolParser, make_tool_call

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)


def parse_call(body: str) -> dict | None:
    """``{"name": ..., "arguments": ...}`` (arguments an object, or its JSON text) ->
    an OpenAI tool call; None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    return make_tool_call(obj["name"], args)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Hermes2ProToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._pending = ""  # text not yet emitted
        self._in_call = False
        self._num_calls = 0

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        if TOOL_CALL_START not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        calls = []
        for m in _CALL_RE.finditer(model_output):
            call = parse_call(m.group(1).strip())
            if call is None:
                return ExtractedToolCallInformation(False, [], model_output)
            calls.append(call)
        outside = _CALL_RE.split(model_output)[::2]  # the text between the calls
        content = outside[0] + "".join(t for t in outside[1:] if t.strip())
        return ExtractedToolCallInformation(True, calls, content if content.strip() else None)

    def _content(self, text: str) -> list[dict]:
        if not text or (self._num_calls and not text.strip()):
            return []
        return [{"content": text}]

    def _call(self, body: str, closed: bool) -> list[dict]:
        call = parse_call(body.strip())
        if call is None:  # not a call after all: its text is content
            return self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
        call["index"] = self._num_calls
        self._num_calls += 1
        return [{"tool_calls": [call]}]

    def stream(self, delta_text: str) -> list[dict]:
        self._pending += delta_text
        out: list[dict] = []
        while True:
            if not self._in_call:
                i = self._pending.find(TOOL_CALL_START)
                if i < 0:
                    keep = _held_back(self._pending, TOOL_CALL_START)
                    text, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                    return out + self._content(text)
                out += self._content(self._pending[:i])
                self._pending = self._pending[i + len(TOOL_CALL_START):]
                self._in_call = True
            i = self._pending.find(TOOL_CALL_END)
            if i < 0:
                return out
            out += self._call(self._pending[:i], True)
            self._pending = self._pending[i + len(TOOL_CALL_END):]
            self._in_call = False

    def finish(self) -> list[dict]:
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return self._call(pending, False)
        return self._content(pending)

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

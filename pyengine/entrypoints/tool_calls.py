"""Tool calling for OpenAI-style chat (mirrors the tool handling of
vllm/entrypoints/openai/serving_chat.py and protocol.py).

- ``normalize_tools`` checks ``tools`` (function tools only).
- ``resolve_tool_choice``: ``none`` / ``auto`` / ``required`` / ``{"type": "function",
  "function": {"name": ...}}`` -> a ``ToolCallMode``; ``required`` and a named function are
  enforced with structured outputs (``mode.structured_outputs``): a JSON array of
  ``{"name", "parameters"}`` objects (``anyOf`` the tools), or the named function's
  parameters schema; ``auto`` leaves the output free and needs a tool-call parser.
- ``messages_for_template``: assistant ``tool_calls`` (arguments as JSON text on the wire)
  and ``tool`` messages in the shape chat templates expect (arguments as objects).
- ``ToolCallExtractor``: one per choice; turns the output text into the message (content
  and ``tool_calls``) and, when streaming, into OpenAI's deltas: a call's ``index``,
  ``id``, ``type`` and ``function.name`` first, then ``function.arguments`` in pieces.
Errors are ``VLLMValidationError`` naming the request field.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import StructuredOutputsParams
from pyengine.tool_parsers import ToolParser
from pyengine.tool_parsers.abstract_tool_parser import make_tool_call, make_tool_call_id

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def normalize_tools(tools: Any) -> list[dict]:
    """``tools`` as a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`` dicts (checked). Raises VLLMValidationError (``tools``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise VLLMValidationError("tools must be a list of function tools.", parameter="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise VLLMValidationError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}} "
                                      "(only function tools are supported).", parameter="tools")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise VLLMValidationError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                      f"got {name!r}.", parameter="tools")
        if name in names:
            raise VLLMValidationError(f"tools[{i}]: the function name {name!r} is used twice.", parameter="tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise VLLMValidationError(f"tools[{i}].function.parameters must be a JSON schema object.",
                                      parameter="tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def _hoist_defs(schemas: list[dict]) -> tuple[list[dict], dict]:
    """Nested tool schemas with their ``$defs`` (and ``definitions``) moved to the root of
    the combined schema, where their ``#/$defs/...`` references point. Raises
    VLLMValidationError if two tools define one name differently."""
    defs: dict[str, dict] = {}
    out = []
    for s in schemas:
        s = copy.deepcopy(s)
        for key in ("$defs", "definitions"):
            for name, d in (s.pop(key, None) or {}).items():
                if defs.get(key, {}).get(name, d) != d:
                    raise VLLMValidationError(f"tools: two functions define {key}/{name} differently.",
                                              parameter="tools")
                defs.setdefault(key, {})[name] = d
        out.append(s)
    return out, defs


def required_tools_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of ``tool_choice="required"``: a non-empty array (one element when
    ``parallel_tool_calls`` is false) of ``{"name": <a tool's name>, "parameters": <its
    parameters>}`` objects."""
    items, defs = _hoist_defs([{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
        "required": ["name", "parameters"]} for t in tools])
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


@dataclass
class ToolCallMode:
    """What a chat request asked of tools: ``kind`` is "none", "auto", "required" or
    "named" (then ``name``); ``structured_outputs`` enforces required / named."""
    kind: str = "none"
    name: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    parallel_tool_calls: bool = True


def resolve_tool_choice(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool | None = None,
                        auto_tool_choice: bool = False) -> ToolCallMode:
    """``tool_choice`` (absent: "auto" with tools, "none" without, as OpenAI) ->
    ``ToolCallMode``. ``auto_tool_choice``: the front end has a tool-call parser
    (``--enable-auto-tool-choice --tool-call-parser NAME``). Raises VLLMValidationError
    (``tool_choice``)."""
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolCallMode("none", parallel_tool_calls=parallel)
    if not tools:
        raise VLLMValidationError(f"tool_choice {tool_choice!r} needs tools.", parameter="tool_choice")
    if tool_choice == "auto":
        if not auto_tool_choice:
            raise VLLMValidationError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      'to be set.', parameter="tool_choice")
        return ToolCallMode("auto", parallel_tool_calls=parallel)
    if tool_choice == "required":
        so = StructuredOutputsParams(json=required_tools_schema(tools, parallel))
        return ToolCallMode("required", structured_outputs=so, parallel_tool_calls=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise VLLMValidationError(f"tool_choice names the function {name!r}, which is not in tools.",
                                      parameter="tool_choice")
        return ToolCallMode("named", name, StructuredOutputsParams(json=_parameters(tool)), parallel)
    raise VLLMValidationError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r:.200}.", parameter="tool_choice")


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Chat messages as templates expect them: an assistant's ``tool_calls`` arguments
    (JSON text on the wire) as objects. Other fields are kept."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                c = copy.deepcopy(c)
                fn = c.get("function") or {}
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # not JSON: the template gets the text
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


class _RequiredCallsStream:
    """Streams the calls of ``tool_choice="required"`` output, a JSON array of
    ``{"name": ..., "parameters": ...}`` (the grammar fixes that key order): a call's
    header once its name is complete, then the raw text of its parameters value as
    argument pieces."""

    _HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:')

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.state = "between"  # "head" (reading name), "args" (reading parameters)
        self.start = self.args_from = self.args_end = 0
        self.index = -1

    def feed(self, delta: str) -> list[dict]:
        out: list[dict] = []
        i0 = len(self.text)
        self.text += delta
        for i in range(i0, len(self.text)):
            c, prev = self.text[i], self.depth
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            if self.state == "between":
                if prev == 1 and self.depth == 2:
                    self.state, self.start = "head", i
            elif self.state == "head":
                m = self._HEAD.match(self.text, self.start, i + 1)
                if m is not None and m.end() == i + 1:
                    self.index += 1
                    self.state, self.args_from = "args", i + 1
                    self.args_end = i + 1
                    out.append({"tool_calls": [{"index": self.index, "id": make_tool_call_id(), "type": "function",
                                                "function": {"name": json.loads(m.group(1)), "arguments": ""}}]})
            elif self.depth <= 1:  # the call's object closed
                out += self._args()
                self.state = "between"
            elif self.in_str or self.depth >= 3 or prev >= 3 or not c.isspace():
                self.args_end = i + 1
        return out + (self._args() if self.state == "args" else [])

    def _args(self) -> list[dict]:
        piece = self.text[self.args_from:self.args_end]
        self.args_from = self.args_end
        return [{"tool_calls": [{"index": self.index, "function": {"arguments": piece}}]}] if piece else []


class ToolCallExtractor:
    """One choice's output -> content and tool calls, for a ``ToolCallMode`` (and, for
    "auto", a tool-call parser instance). Non-streaming: ``message(text)``; streaming:
    ``stream(delta_text)`` for each piece, then ``finish()``; both give OpenAI delta
    dicts. ``finish_reason(engine_reason)`` is OpenAI's: "tool_calls" when calls were
    made under "auto" or "required" (a named function keeps "stop", as OpenAI)."""

    def __init__(self, mode: ToolCallMode, parser: ToolParser | None = None):
        self.mode = mode
        self.parser = parser
        self._required = _RequiredCallsStream() if mode.kind == "required" else None
        self._named_started = False
        self.tools_called = False

    def message(self, text: str) -> dict:
        """``{"role": "assistant", "content": ..., "tool_calls": [...]}`` (no
        ``tool_calls`` key when none were made)."""
        kind = self.mode.kind
        calls: list[dict] = []
        content: str | None = text
        if kind == "named":
            calls, content = [make_tool_call(self.mode.name, text)], None  # type: ignore[arg-type] # "named" has a name
        elif kind == "required":
            try:
                calls = [make_tool_call(c["name"], c.get("parameters", {})) for c in json.loads(text)]
                content = None
            except (ValueError, TypeError, KeyError):
                calls = []  # cut short (finish_reason "length"): the text stays content
        elif kind == "auto" and self.parser is not None:
            info = self.parser.extract_tool_calls(text)
            calls, content = info.tool_calls, info.content
            if calls and not self.mode.parallel_tool_calls:
                calls = calls[:1]
        self.tools_called = bool(calls)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg

    @property
    def plain(self) -> bool:
        """Streamed text is content as it comes (no tool calls to look for): ``stream``
        keeps no state and gives ``[{"content": delta_text}]``."""
        kind = self.mode.kind
        return kind not in ("named", "required") and not (kind == "auto" and self.parser is not None)

    def stream(self, delta_text: str) -> list[dict]:
        kind = self.mode.kind
        if kind == "named":
            out = []
            if not self._named_started:
                self._named_started = self.tools_called = True
                out.append({"tool_calls": [{"index": 0, "id": make_tool_call_id(), "type": "function",
                                            "function": {"name": self.mode.name, "arguments": ""}}]})
            if delta_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            return out
        if kind == "required":
            out = self._required.feed(delta_text)  # type: ignore[union-attr] # set when kind is "required"
        elif kind == "auto" and self.parser is not None:
            out = self._limit(self.parser.stream(delta_text))
        else:
            return [{"content": delta_text}] if delta_text else []
        self.tools_called = self.tools_called or any("tool_calls" in d for d in out)
        return out

    def finish(self) -> list[dict]:
        if self.mode.kind == "auto" and self.parser is not None:
            out = self._limit(self.parser.finish())
            self.tools_called = self.tools_called or any("tool_calls" in d for d in out)
            return out
        return []

    def _limit(self, deltas: list[dict]) -> list[dict]:
        if self.mode.parallel_tool_calls:
            return deltas
        return [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.tools_called and self.mode.kind in ("auto", "required"):
            return "tool_calls"
        return engine_reason

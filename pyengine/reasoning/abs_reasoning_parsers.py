"""The reasoning-parser interface and registry (mirrors vllm/reasoning/abs_reasoning_parsers.py).

A reasoning parser splits a reasoning model's output into the reasoning (the thinking the
model does before it answers, e.g. between ``<think>`` and ``</think>``) and the content
(the answer, where tool calls are parsed and structured outputs apply).

Differences from vLLM, on purpose:

- One parser instance per output stream (per choice), like ``pyengine.tool_parsers``: the
  streaming side keeps state, so ``extract_reasoning_streaming`` takes only the new text and
  token ids (vLLM also passes the previous and current text and ids), and
  ``finish_streaming`` releases text held back at the end.
- The start state is decided once, at construction, from the prompt and the chat-template
  kwargs (vLLM's ``prompt_is_reasoning_end`` check in the serving layer).
- ``extract_reasoning(model_output, token_ids)`` takes the output's token ids (vLLM: the
  request) so the tags are found by id there too.
- ``get_reasoning_parser`` raises ``ValueError`` (vLLM: ``KeyError``), as
  ``ToolParserManager`` does, so ``--reasoning-parser`` errors read like the others.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class DeltaMessage:
    """What one streamed piece of output adds: reasoning text, content text, either, or
    both (the piece that holds the end tag). ``None`` means "nothing of that kind"."""
    reasoning_content: str | None = None
    content: str | None = None

    @property
    def reasoning(self) -> str | None:
        """vLLM's newer name for ``reasoning_content``."""
        return self.reasoning_content


class ReasoningParser:
    """Base class. ``tokenizer``: the engine's transformers tokenizer;
    ``chat_template_kwargs``: the request's (e.g. ``{"enable_thinking": False}``);
    ``prompt_token_ids``: the rendered prompt, whose tail may already open or close the
    reasoning (templates that put ``<think>`` or ``<think>\\n\\n</think>`` there)."""

    def __init__(self, tokenizer, *, chat_template_kwargs: dict[str, Any] | None = None,
                 prompt_token_ids: Sequence[int] | None = None):
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True when ``input_ids`` (output token ids) show the reasoning is over (for
        structured outputs: the grammar applies from the next token)."""
        raise NotImplementedError

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Sequence[int]) -> bool:
        """True when the reasoning ends within ``delta_ids``, the newest tokens of
        ``input_ids`` (one decode step)."""
        return self.is_reasoning_end(input_ids)

    def prompt_is_reasoning_end(self) -> bool:
        """True when the output starts as content (the prompt closed the reasoning, or the
        template kwargs turned thinking off): the grammar applies from the first token."""
        raise NotImplementedError

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The content's token ids among output ids ``input_ids`` (tags excluded)."""
        raise NotImplementedError

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of the output ids ``token_ids`` are reasoning (tags excluded)."""
        return 0

    def extract_reasoning(self, model_output: str, token_ids: Sequence[int] | None = None
                          ) -> tuple[str | None, str | None]:
        """A whole output -> ``(reasoning, content)``, each None when empty."""
        raise NotImplementedError

    def extract_reasoning_streaming(self, delta_text: str, delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        """The next piece of output (its text and token ids) -> what to send, or None."""
        raise NotImplementedError

    def finish_streaming(self) -> DeltaMessage | None:
        """The output ended: what was held back, or None."""
        return None

"""Reasoning in the chat request path (the reasoning half of vllm/entrypoints/openai/serving_chat.py):
``--reasoning-parser NAME`` (``pyengine.reasoning``) applied to one request.

- ``load_reasoning_parser(name, tokenizer)``: the parser class, checked against the
  tokenizer at start-up (its think tokens must be single tokens): ValueError otherwise.
- ``RequestReasoning``: one request's setup (the parser class, the request's
  ``chat_template_kwargs``, its prompt ids, ``include_reasoning``): a parser per choice
  (``choice()``), the structured-output constraint gated to the content
  (``gate(so)``: the grammar starts after the end token, vLLM's reasoner-aware grammar), and
  the thinking budget given the parser's tags (``budget(params)``: the engine forces the end
  token once the reasoning holds ``thinking_token_budget`` tokens).
- ``ChoiceReasoning``: one choice's split, streamed (``stream(text, token_ids)`` then
  ``finish()``) or whole (``whole(text, token_ids)``): ``(reasoning, content)`` text pairs,
  the content being what tool-call parsing and the response's ``content`` get.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pyengine.reasoning import ReasoningParser, ReasoningParserManager
from pyengine.reasoning.basic_parsers import UNDECIDED, BaseThinkingReasoningParser
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams


def load_reasoning_parser(name: str | None, tokenizer) -> type[ReasoningParser] | None:
    """The class ``--reasoning-parser name`` selects (None for None), after building one
    over ``tokenizer`` so a tokenizer without the parser's tokens is refused now, not at
    the first request. Raises ValueError (unknown name, tokens missing)."""
    if name is None:
        return None
    cls = ReasoningParserManager.get_reasoning_parser(name)
    cls(tokenizer)
    return cls


class ChoiceReasoning:
    """One choice's reasoning / content split. ``include``: the request's
    ``include_reasoning`` (False: the reasoning is cut out and not returned)."""

    def __init__(self, parser: ReasoningParser, include: bool = True):
        self.parser = parser
        self.include = include

    def stream(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """The next output delta -> ``(reasoning text, content text)``, each None if empty."""
        return self._pair(self.parser.extract_reasoning_streaming(text, list(token_ids)))

    def finish(self) -> tuple[str | None, str | None]:
        """The output ended: what the parser held back."""
        return self._pair(self.parser.finish_streaming())

    def _pair(self, m) -> tuple[str | None, str | None]:
        if m is None:
            return None, None
        return (m.reasoning_content if self.include else None), m.content

    def whole(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """A whole output -> ``(reasoning, content)`` (a fresh split, by token ids)."""
        r, c = self.parser.extract_reasoning(text, list(token_ids))
        return (r if self.include else None), c

    def reasoning_tokens(self, token_ids: Sequence[int] | None = None) -> int:
        """Reasoning tokens (tags excluded) of ``token_ids``, else of the stream so far."""
        if token_ids is None:
            return self.parser.num_reasoning_tokens  # type: ignore[attr-defined] # the streaming parsers count as they go
        return self.parser.count_reasoning_tokens(list(token_ids))


@dataclasses.dataclass
class RequestReasoning:
    """One chat request's reasoning setup: ``parser_cls`` built per choice with the
    request's ``chat_template_kwargs`` and ``prompt_token_ids`` (which decide where the
    output starts: reasoning, content, or the first token decides)."""
    parser_cls: type
    tokenizer: Any
    chat_template_kwargs: dict | None
    prompt_token_ids: list[int]
    include_reasoning: bool = True

    def parser(self) -> ReasoningParser:
        return self.parser_cls(self.tokenizer, chat_template_kwargs=self.chat_template_kwargs,
                               prompt_token_ids=self.prompt_token_ids)

    def choice(self) -> ChoiceReasoning:
        return ChoiceReasoning(self.parser(), self.include_reasoning)

    def gate(self, so: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """``so`` applied to the content only: the engine leaves the reasoning free and
        starts the grammar after the end token (``StructuredOutputsParams.reasoning_*``);
        unchanged when the output starts as content (the prompt closed the reasoning,
        ``enable_thinking`` false)."""
        if so is None:
            return None
        p = self.parser()
        if p.prompt_is_reasoning_end():
            return so
        if not isinstance(p, BaseThinkingReasoningParser):
            raise ValueError(f"{type(p).__name__} cannot gate structured outputs (no think token ids)")
        undecided = p.initial_phase == UNDECIDED
        return dataclasses.replace(so, reasoning_end_token_id=p.end_token_id,
                                   reasoning_start_token_id=p.start_token_id if undecided else None)

    def budget(self, params: SamplingParams) -> SamplingParams:
        """``params`` whose ``thinking_token_budget`` (if any) the engine can enforce: the
        parser's think tags and where the output starts (the reasoning open, or the first
        token deciding: ``thinking_open``), so the engine counts the reasoning as this
        parser splits it. An output that starts as the answer (the prompt closed the
        reasoning, ``enable_thinking`` false) has no reasoning to bound: the budget is
        dropped. Raises ValueError for a parser without think token ids."""
        if params.thinking_token_budget is None:
            return params
        p = self.parser()
        if p.prompt_is_reasoning_end():
            return params.clone(thinking_token_budget=None)
        if not isinstance(p, BaseThinkingReasoningParser):
            raise ValueError(f"{type(p).__name__} cannot enforce a thinking budget (no think token ids)")
        return params.clone(thinking_start_token_id=p.start_token_id, thinking_end_token_id=p.end_token_id,
                            thinking_open=p.initial_phase != UNDECIDED)

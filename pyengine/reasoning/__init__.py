"""Reasoning parsers: a reasoning model's output -> reasoning and content (mirrors
vllm/reasoning/).

``ReasoningParserManager.get_reasoning_parser(name)`` returns the class that
``--reasoning-parser NAME`` selects: ``qwen3`` (Qwen3: the output may open ``<think>`` or
answer at once) and ``deepseek_r1`` (templates that open ``<think>`` in the prompt). One
instance per output stream: ``cls(tokenizer, chat_template_kwargs=..., prompt_token_ids=...)``;
``extract_reasoning`` for a whole output, ``extract_reasoning_streaming`` then
``finish_streaming`` for a stream, ``prompt_is_reasoning_end`` / ``is_reasoning_end_streaming``
/ ``extract_content_ids`` for structured outputs (the grammar applies to the content)."""
from __future__ import annotations

from pyengine.reasoning.abs_reasoning_parsers import DeltaMessage, ReasoningParser
from pyengine.reasoning.basic_parsers import BaseThinkingReasoningParser
from pyengine.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pyengine.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
from pyengine.reasoning.registry import ReasoningParserManager

__all__ = ["DeltaMessage", "ReasoningParser", "ReasoningParserManager", "BaseThinkingReasoningParser",
           "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser"]

"""The ``qwen3`` reasoning parser (mirrors vllm/reasoning/qwen3_reasoning_parser.py).

Qwen3's chat template lets the model open ``<think>`` itself; with
``chat_template_kwargs={"enable_thinking": False}`` it puts ``<think>\\n\\n</think>\\n\\n``
in the prompt instead and the answer comes at once. Later templates (Qwen3-2507 thinking
models) open ``<think>`` in the prompt. So the output is:

- reasoning until ``</think>`` when the prompt opened ``<think>`` or the output starts with it;
- content from the start when the prompt closed the reasoning, when ``enable_thinking`` is
  false, or when the first output token is not ``<think>`` (a model that does not think);
- reasoning only (no content) when it was cut short before ``</think>`` (vLLM's rule).

Not done (vLLM's Qwen3.5 addition): a ``<tool_call>`` inside unclosed reasoning is not taken
as the end of the reasoning.
"""
from __future__ import annotations

from pyengine.reasoning.basic_parsers import CONTENT, UNDECIDED, BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    def default_phase(self) -> str:
        if self.chat_template_kwargs.get("enable_thinking", True) is False:
            return CONTENT
        return UNDECIDED

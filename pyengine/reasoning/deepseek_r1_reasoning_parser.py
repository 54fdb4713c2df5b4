"""The ``deepseek_r1`` reasoning parser (mirrors vllm/reasoning/deepseek_r1_reasoning_parser.py).

DeepSeek-R1's chat template opens ``<think>`` in the prompt, so the output is reasoning
until ``</think>`` and content after it, whether or not the model repeats ``<think>`` at
the start (a repeated tag is dropped). An output cut short before ``</think>`` is all
reasoning. A prompt that ends with ``</think>`` (a template that turned thinking off) makes
the whole output content.
"""
from __future__ import annotations

from pyengine.reasoning.basic_parsers import REASONING, BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    def default_phase(self) -> str:
        return REASONING

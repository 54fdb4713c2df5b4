"""The registry of reasoning parsers by name (vLLM's ``ReasoningParserManager`` in
``vllm/reasoning/abs_reasoning_parsers.py``), beside the parsers it names, so the base
class does not import its implementations."""
from __future__ import annotations

from pyengine.reasoning.abs_reasoning_parsers import ReasoningParser
from pyengine.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pyengine.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser


class ReasoningParserManager:
    """The registry of reasoning parsers by name (vLLM's ``ReasoningParserManager``): the
    names ``vengine serve --reasoning-parser NAME`` accepts. Fixed at import (no runtime
    registration: no module-global mutable state)."""

    @classmethod
    def _parsers(cls) -> dict[str, type[ReasoningParser]]:
        return {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(cls._parsers())

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """Raises ValueError naming the known parsers for an unknown name."""
        parsers = cls._parsers()
        try:
            return parsers[name]
        except KeyError:
            raise ValueError(f"Unknown reasoning parser {name!r}; available: {', '.join(sorted(parsers))}.") from None

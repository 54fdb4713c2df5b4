"""Exceptions that cross the public API (mirrors vllm/v1/engine/exceptions.py and
vllm/exceptions.py)."""
from __future__ import annotations

from typing import Any, Optional


class EngineDeadError(RuntimeError):
    """The engine core died (its thread raised, or its process exited); every pending and
    future request fails with this."""


class VLLMValidationError(ValueError):
    """A request was refused at the door. ``parameter`` names the request field at fault
    (front ends report it, e.g. as the ``param`` of an OpenAI error body); ``value`` is
    the offending value, when one is."""

    def __init__(self, message: str, *, parameter: Optional[str] = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter
        self.value = value

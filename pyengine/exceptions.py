"""Exceptions that cross the public API (mirrors vllm/v1/engine/exceptions.py and
vllm/exceptions.py)."""
from __future__ import annotations

from typing import Any


class EngineDeadError(RuntimeError):
    """The engine core died (its thread raised, or its process exited); every pending and
    future request fails with this."""


class VLLMValidationError(ValueError):
    """A request was refused at the door. ``parameter`` names the request field at fault
    (front ends report it, e.g. as the ``param`` of an OpenAI error body); ``value`` is
    the offending value, when one is."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter
        self.value = value


# Exception classes that keep their class across the engine-core boundary
# (pyengine.messages.ErrorInfo); any other arrives as a RuntimeError naming its class.
TRANSPORTED: dict[str, type[BaseException]] = {c.__name__: c for c in (
    ValueError, VLLMValidationError, TypeError, KeyError, IndexError, RuntimeError, NotImplementedError,
    TimeoutError, EngineDeadError)}


def exception_from(info) -> BaseException:
    """The exception an ``ErrorInfo`` (``type``, ``message``, ``parameter``) stands for:
    the same class where it is one of ``TRANSPORTED``, else a ``RuntimeError`` whose text
    starts with the class's name."""
    cls = TRANSPORTED.get(info.type)
    if cls is None:
        return RuntimeError(f"{info.type}: {info.message}")
    if cls is VLLMValidationError:
        return VLLMValidationError(info.message, parameter=info.parameter)
    return cls(info.message)

"""Exceptions that cross the public API (mirrors vllm/v1/engine/exceptions.py and
vllm/exceptions.py)."""
from __future__ import annotations

import re
from collections.abc import Mapping
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

    def renamed(self, names: Mapping[str, str]) -> VLLMValidationError:
        """This refusal as a front end whose request calls fields otherwise reports it
        (``names``: field -> the front end's name): ``parameter`` renamed (a dotted path by
        its head), and in the message each of ``names`` that is an identifier (has an
        ``_``, so no word of a sentence) as a whole word, not after a ``.``, and the
        parameter itself where the message opens with it ("stop must ..."). One pass: a
        new name is not renamed again. ``self`` when nothing changes."""
        param = self.parameter
        message = str(self)
        lead = ""
        if param is not None:
            head, dot, rest = param.partition(".")
            param = names.get(head, head) + dot + rest
            if head in names and message.startswith(head + " "):  # the field the message is about
                lead, message = names[head], message[len(head):]
        idents = sorted((k for k, v in names.items() if "_" in k and k != v), key=len, reverse=True)
        if idents:
            pattern = r"(?<![\w.])(" + "|".join(map(re.escape, idents)) + r")(?!\w)"
            message = re.sub(pattern, lambda m: names[m.group(1)], message)
        message = lead + message
        if param == self.parameter and message == str(self):
            return self
        return VLLMValidationError(message, parameter=param, value=self.value)


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

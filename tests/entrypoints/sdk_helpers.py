"""Test helpers for the agent APIs: an SDK client whose HTTP calls a function answers
(the SDK's HTTP library's MockTransport; the SDKs' own request building, SSE parsing and
stream accumulation run unchanged), and a check that an SDK object has no field its type
does not declare (the SDK models accept unknown fields, so a typo would otherwise pass)."""
from __future__ import annotations

import importlib
import json

import openai
from pydantic import BaseModel


def http_module(sdk=openai):
    """The HTTP library ``sdk`` (``openai`` or ``anthropic``) is built on: ``httpx``, or
    ``httpx2`` in newer releases (their public ``DefaultHttpxClient`` subclasses its Client)."""
    client_cls = next(k for k in sdk.DefaultHttpxClient.__mro__[1:] if k.__name__ == "Client")
    return importlib.import_module(client_cls.__module__.split(".")[0])


class Recorder:
    """Answers every request with ``reply(body) -> (content_type, bytes)``; keeps the
    request bodies (parsed JSON) in ``bodies``."""

    def __init__(self, reply):
        self.reply = reply
        self.bodies: list[dict] = []
        self.paths: list[str] = []

    def __call__(self, request):
        body = json.loads(request.content or b"{}")
        self.bodies.append(body)
        self.paths.append(request.url.path)
        ctype, data = self.reply(body)
        return http_module().Response(200, headers={"content-type": ctype}, content=data)

    def http_client(self, sdk=openai):
        """An HTTP client for ``sdk`` whose every request this recorder answers."""
        http = http_module(sdk)
        return http.Client(transport=http.MockTransport(self))


def json_reply(obj) -> tuple[str, bytes]:
    return "application/json", json.dumps(obj).encode()


def sse_reply(frames: list[str]) -> tuple[str, bytes]:
    return "text/event-stream", "".join(frames).encode()


def assert_declared(obj, path: str = "") -> None:
    """Every field of ``obj`` (an SDK pydantic object, recursively) is one its type declares."""
    if isinstance(obj, BaseModel):
        assert not obj.model_extra, f"{path or type(obj).__name__}: undeclared {sorted(obj.model_extra)}"
        for name in type(obj).model_fields:
            assert_declared(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            assert_declared(v, f"{path}[{i}]")

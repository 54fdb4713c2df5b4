"""What every route and the WSGI layer share: OpenAI's error body and responses, the
request's JSON body, and the defaults of the server's limits. Imports nothing of the
server above it (the routes, ``server.app`` and ``server.wsgi`` import it)."""
from __future__ import annotations

import json

from flask import Response, request

from pyengine.entrypoints.openai.errors import APIError, error_body

__all__ = ["APIError", "error_body", "error_response", "json_response", "not_ready_response", "request_body",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_CONCURRENT_STREAMS", "SOCKET_ENVIRON_KEY"]

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_CONCURRENT_STREAMS = 1024  # --max-concurrent-streams (server.wsgi applies it)
SOCKET_ENVIRON_KEY = "vengine.socket"  # the client socket, in the WSGI environ (server.wsgi sets it)


def error_response(status: int, message: str, param: str | None = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status=status,
                    mimetype="application/json")


def not_ready_response(state: str) -> Response:
    """``/health``'s answer while the server is not ready to serve: 503 with
    ``{"status": state}`` (``"loading"``, ``"draining"``)."""
    return Response(json.dumps({"status": state}), status=503, mimetype="application/json")


def json_response(obj) -> Response:
    """``obj`` as a compact JSON response (200)."""
    return Response(json.dumps(obj, separators=(",", ":")), mimetype="application/json")


def request_body() -> bytes:
    """The current request's JSON body, for a serving object to parse. Raises
    ``APIError`` 400 for another content type, and werkzeug's 413 past the body limit."""
    if request.mimetype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.")
    return request.get_data(cache=False)  # get_data raises 413 past MAX_CONTENT_LENGTH

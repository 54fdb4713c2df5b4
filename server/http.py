"""What every route and the WSGI layer share: OpenAI's error body, JSON responses, the
JSON request body, and the names of the server's limits. Imports nothing of the server
above it (the routes, ``server.app`` and ``server.wsgi`` import it)."""
from __future__ import annotations

import json
from typing import Optional

from flask import Response, request

from pyengine.entrypoints.openai.serving_engine import parse_request

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_CONCURRENT_STREAMS = 1024  # --max-concurrent-streams (server.wsgi applies it)
SOCKET_ENVIRON_KEY = "vengine.socket"  # the client socket, in the WSGI environ (server.wsgi sets it)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               409: "ConflictError", 413: "RequestTooLargeError",
               415: "UnsupportedMediaTypeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body: ``status``, ``message`` and the
    request field it is about (``param``, or None)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status=status,
                    mimetype="application/json")


def json_response(obj) -> Response:
    """``obj`` as a compact JSON response (200)."""
    return Response(json.dumps(obj, separators=(",", ":")), mimetype="application/json")


def json_body(schema):
    """The current request's JSON body validated by ``schema`` (a pydantic model, or any
    class with ``model_validate_json``). Raises ``APIError`` 400 for another content
    type, ``VLLMValidationError`` for a body the schema refuses, and werkzeug's 413 past
    the body limit."""
    if request.mimetype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.")
    return parse_request(schema, request.get_data(cache=False))  # get_data raises 413 past MAX_CONTENT_LENGTH

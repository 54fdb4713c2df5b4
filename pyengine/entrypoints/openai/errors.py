"""What a serving object raises besides ``VLLMValidationError`` (a refused field, 400),
and OpenAI's error body every front end answers with."""
from __future__ import annotations

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               409: "ConflictError", 413: "RequestTooLargeError",
               415: "UnsupportedMediaTypeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


class APIError(Exception):
    """An error answered with OpenAI's error body: HTTP ``status``, ``message`` and the
    request field it is about (``param``, or None). A bad field is a
    ``VLLMValidationError`` (400) instead."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RequestFailed(Exception):
    """One engine request ended with finish_reason "error" (it failed inside the engine;
    the others go on): HTTP 500, or an error event then [DONE] once streaming began."""

    def __init__(self, error: str | None):
        super().__init__(f"The request failed inside the engine: {error or 'unknown error'}")


class ClientDisconnected(Exception):
    """The client went away (HTTP: closed its connection); nothing more is sent."""


class RequestCancelled(Exception):
    """The front end cut the request (HTTP: the shutdown drain ran out); the message says
    why (HTTP 503)."""

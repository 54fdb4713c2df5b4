"""HTTP options around the app that vLLM's server takes from its command line: CORS
(``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``, through flask-cors, as vLLM adds Starlette's CORSMiddleware),
``--root-path`` (the path prefix a proxy serves the API under) and
``--max-request-body-bytes`` for a body without ``Content-Length`` (chunked).
"""
from __future__ import annotations

from collections.abc import Sequence

from werkzeug.exceptions import RequestEntityTooLarge

# What "*" in --allowed-methods stands for (Starlette's list, as vLLM answers a preflight).
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
PREFLIGHT_MAX_AGE_S = 600  # Starlette's default, so browsers cache a preflight as with vLLM


def enable_cors(app, origins: Sequence[str] = ("*",), methods: Sequence[str] = ("*",),
                headers: Sequence[str] = ("*",), allow_credentials: bool = False) -> None:
    """Answer CORS preflights and add the CORS headers to every response of ``app`` (a
    Flask app), vLLM's defaults being every origin, method and header. A preflight
    (``OPTIONS``) needs no API key: the app's gate lets it through."""
    from flask_cors import CORS

    methods = ALL_METHODS if "*" in methods else tuple(m.upper() for m in methods)
    # every origin without credentials: "*" (as Starlette); with credentials the caller's
    # origin is echoed, since browsers refuse "*" for a credentialed request
    CORS(app, origins=list(origins), methods=list(methods), allow_headers=list(headers),
         supports_credentials=bool(allow_credentials), max_age=PREFLIGHT_MAX_AGE_S,
         send_wildcard="*" in origins and not allow_credentials)


def mount_at_root_path(app, root_path: str | None) -> None:
    """Serve ``app`` both at ``/`` and under ``root_path`` (e.g. ``/llm``: ``/llm/v1/models``
    is ``/v1/models``, with ``SCRIPT_NAME`` set), so it works behind a proxy that keeps
    the prefix as well as one that strips it. Raises ValueError unless ``root_path``
    starts with "/"."""
    if not root_path or root_path == "/":
        return
    if not root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {root_path!r}.")
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    inner = app.wsgi_app
    app.wsgi_app = DispatcherMiddleware(inner, {root_path.rstrip("/"): inner})


def apply_http_options(app, args) -> None:
    """CORS and the root path from ``args`` (the ``vengine serve`` namespace, or any
    object; missing attributes take vLLM's defaults: CORS for every origin, method and
    header, without credentials; no root path)."""
    enable_cors(app, origins=getattr(args, "allowed_origins", None) or ("*",),
                methods=getattr(args, "allowed_methods", None) or ("*",),
                headers=getattr(args, "allowed_headers", None) or ("*",),
                allow_credentials=bool(getattr(args, "allow_credentials", False)))
    mount_at_root_path(app, getattr(args, "root_path", None))


class _CappedBody:
    """``wsgi.input`` of a request without ``Content-Length`` (``Transfer-Encoding:
    chunked``): reads end at ``max_bytes``, and once they reach it one byte more is
    tried; if the body goes on, werkzeug's ``RequestEntityTooLarge`` (the app's 413).
    werkzeug caps such a stream at the limit itself, but stops there without telling
    whether more followed, so an oversized body was served cut at the limit."""

    __slots__ = ("_input", "_left")

    def __init__(self, inp, max_bytes: int):
        self._input, self._left = inp, max_bytes

    def _capped(self, fn, size):
        if size is None or size < 0 or size > self._left:
            size = self._left
        data = fn(size) if size > 0 else b""
        self._left -= len(data)
        if self._left <= 0 and self._input.read(1):  # a byte past the limit: never kept
            raise RequestEntityTooLarge()
        return data

    def read(self, size=None):
        return self._capped(self._input.read, size)

    def readline(self, size=None):
        return self._capped(self._input.readline, size)

    def readlines(self, hint=None):
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")


def limit_request_body(app, max_bytes: int) -> None:
    """Refuse a request body over ``max_bytes`` with 413 however it is framed: one with
    ``Content-Length`` is refused by Flask (``MAX_CONTENT_LENGTH``, set here too) before
    it is read; one without (chunked) as its reads pass the limit, never buffered past
    it (see ``_CappedBody``). Raises ValueError unless ``max_bytes`` > 0."""
    if max_bytes <= 0:
        raise ValueError(f"--max-request-body-bytes must be > 0, got {max_bytes}.")
    app.config["MAX_CONTENT_LENGTH"] = max_bytes
    inner = app.wsgi_app

    def capped(environ, start_response):
        if not environ.get("CONTENT_LENGTH"):
            environ["wsgi.input"] = _CappedBody(environ["wsgi.input"], max_bytes)
        return inner(environ, start_response)
    app.wsgi_app = capped

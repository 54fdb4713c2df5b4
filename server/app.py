"""The Flask app: OpenAI-compatible routes over ``pyengine.AsyncLLM``.

``create_app(engine, args)`` builds a fresh app (no module-global mutable state). It is
meant to be served by gevent's ``pywsgi.WSGIServer`` (see ``server.wsgi``): handlers wait
for engine output on gevent Events woken through ``server.bridge``.
"""
from __future__ import annotations

import hmac
import logging

from flask import Flask, Response, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from pyengine import VLLMValidationError
from pyengine.entrypoints.openai.errors import ClientDisconnected, RequestCancelled, RequestFailed
from pyengine.entrypoints.openai.serving_engine import validation_error

from .bridge import is_engine_dead
from .http import APIError, error_response, not_ready_response
from .middleware import apply_http_options, limit_request_body
from .page import create_page_blueprint
from .routes import register_routes
from .state import ServerConfig, ServerState

logger = logging.getLogger(__name__)

_COUNTED_ENVIRON_KEY = "vengine.counted"


def _authorized(header: str, keys: list[str]) -> bool:
    """``Authorization: Bearer KEY``; the scheme is case-insensitive (RFC 9110), the key
    compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    given = token.strip().encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given, k.encode())
    return ok and scheme.lower() == "bearer"


# ---------------------------------------------------------------------------------------
# The app factory


def create_app(engine, args=None) -> Flask:
    """Build the Flask app over a started ``AsyncLLM``. ``args``: the CLI namespace (or any
    object with some of ``served_model_name``, ``api_key``, ``chat_template``,
    ``max_request_body_bytes``); ``None`` takes the defaults."""
    cfg = ServerConfig.from_args(engine, args)
    st = ServerState(engine, cfg)
    app = Flask("vengine.server", static_folder=None)  # the page's blueprint serves /static
    limit_request_body(app, cfg.max_request_body_bytes)  # Content-Length and chunked bodies alike
    app.json.sort_keys = False  # type: ignore[attr-defined] # Flask's DefaultJSONProvider
    app.extensions["vengine"] = st
    app.register_blueprint(create_page_blueprint())
    apply_http_options(app, args)  # CORS, --root-path
    _register_error_handlers(app, st)
    _register_gate(app, st)
    register_routes(app, st)  # the health, model, tokenization, completion, chat, responses and messages routes
    return app


def _register_error_handlers(app: Flask, st: ServerState) -> None:
    """Every error as OpenAI's error body: the protocol layer's and the engine's refusals
    (``VLLMValidationError``) as 400 naming the field, with their own message."""

    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.errorhandler(ClientDisconnected)
    def _client_gone(e: ClientDisconnected):  # nobody reads the answer
        return Response(status=499)

    @app.errorhandler(RequestFailed)
    def _failed(e: RequestFailed):
        return error_response(500, str(e))

    @app.errorhandler(RequestCancelled)
    def _cut(e: RequestCancelled):
        return error_response(503, str(e))

    @app.errorhandler(VLLMValidationError)
    def _refused(e: VLLMValidationError):  # the engine's or the protocol layer's one answer
        return error_response(400, str(e), e.parameter)

    @app.errorhandler(ValidationError)
    def _validation_error(e: ValidationError):
        return _refused(validation_error(e))

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        status = e.code or 500
        msg = e.description or e.name
        if status == 413:
            msg = f"Request body too large (limit: {st.cfg.max_request_body_bytes} bytes)."
        return error_response(status, msg)

    @app.errorhandler(Exception)
    def _internal_error(e: Exception):
        if is_engine_dead(e, st.engine):
            return error_response(503, f"The engine is dead: {e}")
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}")


def _register_gate(app: Flask, st: ServerState) -> None:
    """The shutdown drain and the API key, before every request; the drain's count of
    requests being served, until each response is closed."""
    cfg = st.cfg

    @app.before_request
    def _gate():  # shutdown drain, then the API key
        if st.draining and request.path != "/metrics":
            # on a connection opened before the drain (the listening socket is closed):
            # /health says why it is not ready, for a router's pooled connections
            resp = (not_ready_response("draining") if request.path == "/health"
                    else error_response(503, "The server is shutting down."))
            resp.headers["Connection"] = "close"
            return resp
        if cfg.api_keys and request.method != "OPTIONS" and request.path.startswith("/v1") and not (
                _authorized(request.headers.get("Authorization", ""), cfg.api_keys)
                or _authorized("Bearer " + request.headers.get("x-api-key", ""), cfg.api_keys)):  # Anthropic's
            return error_response(401, "Invalid or missing API key.")
        st.active_requests += 1
        request.environ[_COUNTED_ENVIRON_KEY] = True
        return None

    @app.after_request
    def _count_until_closed(resp: Response):
        # A streamed response is still being served after the view returned: the request
        # counts (for the shutdown drain) until the server closes the response.
        if request.environ.pop(_COUNTED_ENVIRON_KEY, False):
            def release() -> None:
                st.active_requests -= 1
            resp.call_on_close(release)
            # werkzeug runs no close hook on a direct-passthrough response (send_file: the
            # page's files); iterated like any other, it runs them.
            resp.direct_passthrough = False
        return resp

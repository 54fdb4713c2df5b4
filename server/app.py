"""The Flask app: OpenAI-compatible routes over ``pyengine.AsyncLLM``.

``create_app(engine, args)`` builds a fresh app (no module-global mutable state). It is
meant to be served by gevent's ``pywsgi.WSGIServer`` (see ``server.wsgi``): handlers wait
for engine output on gevent Events woken through ``server.bridge``.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from flask import Flask, Response, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from pyengine import VLLMValidationError, envs
from pyengine.entrypoints.openai.serving_engine import parse_request, validation_error

from .bridge import GeventBridge, is_engine_dead
from .metrics import ServerMetrics
from .middleware import apply_http_options, limit_request_body
from .page import create_page_blueprint

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_CONCURRENT_STREAMS = 1024  # --max-concurrent-streams (server.wsgi applies it)
SOCKET_ENVIRON_KEY = "vengine.socket"
_COUNTED_ENVIRON_KEY = "vengine.counted"

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                409: "ConflictError", 413: "RequestTooLargeError",
                415: "UnsupportedMediaTypeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RequestFailed(Exception):
    """One engine request ended with finish_reason "error" (it failed inside the engine;
    the others go on): HTTP 500, or an error event then [DONE] once streaming began."""

    def __init__(self, error: Optional[str]):
        super().__init__(f"The request failed inside the engine: {error or 'unknown error'}")


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status=status,
                    mimetype="application/json")


def _json_response(obj) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), mimetype="application/json")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    chat_template: Optional[str] = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_path: str = ""
    max_model_len: int = 0
    dev_mode: bool = False  # VENGINE_SERVER_DEV_MODE (vLLM's VLLM_SERVER_DEV_MODE): development endpoints (/reset_prefix_cache)
    tool_call_parser: Optional[str] = None  # --tool-call-parser (pyengine.tool_parsers)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    # prompts × n in one request: at most the requests the server serves at once
    # (--max-concurrent-streams), so one request cannot queue more work than that many clients
    max_sequences_per_request: int = DEFAULT_MAX_CONCURRENT_STREAMS

    @classmethod
    def from_args(cls, engine, args) -> "ServerConfig":
        ecfg = getattr(engine, "config", None)
        names = getattr(args, "served_model_name", None) if args is not None else None
        if isinstance(names, str):
            names = [names]
        if not names:
            names = [getattr(ecfg, "served_model_name", None) or "vengine"]
        api_key = getattr(args, "api_key", None) if args is not None else None
        keys = [api_key] if isinstance(api_key, str) and api_key else list(api_key or [])
        template = getattr(args, "chat_template", None) if args is not None else None
        if template and "{" not in template:  # a path, as vLLM's --chat-template takes either
            with open(template, encoding="utf-8") as f:
                template = f.read()
        return cls(served_model_names=list(names), api_keys=keys, chat_template=template,
                   max_request_body_bytes=int(getattr(args, "max_request_body_bytes", None)
                                              or DEFAULT_MAX_BODY_BYTES),
                   model_path=str(getattr(ecfg, "model", "")),
                   max_model_len=int(getattr(ecfg, "max_model_len", 0) or 0),
                   tool_call_parser=getattr(args, "tool_call_parser", None) if args is not None else None,
                   enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
                   max_sequences_per_request=int(getattr(args, "max_concurrent_streams", None)
                                                 or DEFAULT_MAX_CONCURRENT_STREAMS),
                   dev_mode=envs.server_dev_mode())


class ServerState:
    """Everything one app instance owns."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.tokenizer = engine.tokenizer
        self.bridge = GeventBridge(engine)
        self.metrics = ServerMetrics(engine, cfg.served_model_names[0])
        self.created = int(time.time())
        # Shutdown drain (hub thread only): HTTP requests being served (admission and
        # tokenization included, until the response is closed), the generations among them
        # (jobs), and whether new requests are refused (draining) or the generations in
        # flight were cut (cut_message).
        self.active_requests = 0
        self.jobs: set = set()
        self.draining = False
        self.cut_message: Optional[str] = None

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); the ones in flight go on."""
        self.draining = True

    def cut_jobs(self, message: str) -> None:
        """End every request still in flight: its engine requests are aborted, a stream
        gets an error event then [DONE], a plain request a 503."""
        self.cut_message = message
        for job in list(self.jobs):
            job.cut(message)

    def close(self) -> None:
        self.bridge.close()
        self.metrics.close()


# ---------------------------------------------------------------------------------------
# Request -> engine inputs


def _parse(schema):
    if request.mimetype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.")
    return parse_request(schema, request.get_data(cache=False))  # get_data raises 413 past MAX_CONTENT_LENGTH


def _check_model(st: ServerState, model: Optional[str]) -> str:
    if model is None:
        return st.cfg.served_model_names[0]
    if model not in st.cfg.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    return model


def _tokenize(st: ServerState, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text (the engine's ``Processor.encode``), computed on a
    threadpool thread: the Rust tokenizer releases the GIL, so a long prompt does not
    stall the hub (other streams)."""
    encode = st.engine.processor.encode
    return st.bridge.run_blocking(lambda: [encode(t, add_special_tokens) for t in texts])


def _authorized(header: str, keys: list[str]) -> bool:
    """``Authorization: Bearer KEY``; the scheme is case-insensitive (RFC 9110), the key
    compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip().encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token, k.encode())
    return ok and scheme.lower() == "bearer"


# ---------------------------------------------------------------------------------------
# The app factory


def create_app(engine, args=None) -> Flask:
    """Build the Flask app over a started ``AsyncLLM``. ``args``: the CLI namespace (or any
    object with some of ``served_model_name``, ``api_key``, ``chat_template``,
    ``max_request_body_bytes``); ``None`` takes the defaults."""
    from .health import register_health_routes
    from .serving_chat import register_chat_routes
    from .serving_completion import register_completion_routes
    from .serving_models import register_model_routes
    from .serving_tokenization import register_tokenization_routes

    cfg = ServerConfig.from_args(engine, args)
    st = ServerState(engine, cfg)
    app = Flask("vengine.server", static_folder=None)  # the page's blueprint serves /static
    limit_request_body(app, cfg.max_request_body_bytes)  # Content-Length and chunked bodies alike
    app.json.sort_keys = False
    app.extensions["vengine"] = st
    app.register_blueprint(create_page_blueprint())
    apply_http_options(app, args)  # CORS, --root-path
    _register_error_handlers(app, st)
    _register_gate(app, st)
    register_health_routes(app, st)  # /health, /version, /metrics, /reset_prefix_cache (dev mode)
    register_model_routes(app, st)  # GET /v1/models, /v1/models/<model>
    register_tokenization_routes(app, st)  # POST /tokenize, /detokenize
    register_completion_routes(app, st)  # POST /v1/completions
    register_chat_routes(app, st)  # POST /v1/chat/completions
    return app


def _register_error_handlers(app: Flask, st: ServerState) -> None:
    """Every error as OpenAI's error body: the protocol layer's and the engine's refusals
    (``VLLMValidationError``) as 400 naming the field, with their own message."""

    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        return error_response(e.status, e.message, e.param)

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
            resp = error_response(503, "The server is shutting down.")
            resp.headers["Connection"] = "close"
            return resp
        if cfg.api_keys and request.method != "OPTIONS" and request.path.startswith("/v1") and not _authorized(
                request.headers.get("Authorization", ""), cfg.api_keys):
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

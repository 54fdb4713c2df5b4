"""The HTTP routes: each parses nothing and decides nothing itself; it hands the body to
its serving object (``pyengine.entrypoints.openai``, one per endpoint, built by
``server.state.ServerState``) with the request's ``Session``, and answers what that
returns: a JSON object, or an SSE stream (mirrors vllm/entrypoints/openai/api_server.py's
routes, e.g. ``handler.create_completion(request)``).

- ``GET /health``, ``/version``, ``/metrics``; ``POST /reset_prefix_cache`` in development
  mode (``VENGINE_SERVER_DEV_MODE``, vLLM's ``VLLM_SERVER_DEV_MODE``);
- ``GET /v1/models``, ``/v1/models/<model>``;
- ``POST /tokenize``, ``/detokenize``;
- ``POST /v1/completions``, ``/v1/chat/completions``;
- ``POST /v1/responses``, ``/v1/messages``, ``/v1/messages/count_tokens`` (built on chat;
  every error on the ``/v1/messages`` paths has Anthropic's error body).
"""
from __future__ import annotations

import asyncio
import json

from flask import Flask, Response, request
from prometheus_client import CONTENT_TYPE_LATEST

from pyengine import VERSION
from pyengine.entrypoints.anthropic.serving_messages import error_body as anthropic_error_body
from pyengine.entrypoints.openai.serving_engine import SSEStream

from .http import SOCKET_ENVIRON_KEY, error_response, json_response, request_body
from .state import ServerState


def respond(result) -> Response:
    """A serving object's answer: an ``SSEStream`` as ``text/event-stream`` (closed, so
    its engine requests end, when the response is), else the JSON object."""
    if isinstance(result, SSEStream):
        return Response(result, mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return json_response(result)


def register_routes(app: Flask, st: ServerState) -> None:
    """Add every route to ``app`` (``st``: its state)."""
    _register_health_routes(app, st)

    @app.get("/v1/models")
    def models():
        return json_response(st.models.show_available_models())

    @app.get("/v1/models/<path:model>")  # path: served names may hold "/" ("org/name")
    def retrieve_model(model: str):
        return json_response(st.models.model_card(model))

    @app.post("/tokenize")
    def tokenize():
        return json_response(st.tokenization.create_tokenize(request_body(), st.bridge.run_blocking))

    @app.post("/detokenize")
    def detokenize():
        return json_response(st.tokenization.create_detokenize(request_body()))

    @app.post("/v1/completions")
    def completions():
        return respond(st.completion.create_completion(request_body(), st.session(
            request.environ.get(SOCKET_ENVIRON_KEY))))

    @app.post("/v1/chat/completions")
    def chat_completions():
        return respond(st.chat.create_chat_completion(request_body(), st.session(
            request.environ.get(SOCKET_ENVIRON_KEY))))

    @app.post("/v1/responses")
    def responses():
        return respond(st.responses.create_response(request_body(), st.session(
            request.environ.get(SOCKET_ENVIRON_KEY))))

    _register_messages_routes(app, st)


def _register_messages_routes(app: Flask, st: ServerState) -> None:
    @app.post("/v1/messages")
    def messages():
        return respond(st.messages.create_message(request_body(), st.session(
            request.environ.get(SOCKET_ENVIRON_KEY))))

    @app.post("/v1/messages/count_tokens")
    def count_tokens():
        return json_response(st.messages.count_tokens(request_body(), run=st.bridge.run_blocking))

    @app.after_request
    def _anthropic_errors(resp: Response):
        # The app answers errors with OpenAI's body; on these paths, Anthropic's.
        if resp.status_code >= 400 and request.path.startswith("/v1/messages") and resp.is_json:
            try:
                message = json.loads(resp.get_data())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return resp
            resp.set_data(json.dumps(anthropic_error_body(resp.status_code, message)))
        return resp


def _register_health_routes(app: Flask, st: ServerState) -> None:
    engine = st.engine

    @app.get("/health")
    def health():
        # 503 once the engine died, or one of its data-parallel engine cores (the others
        # still serve, but a router should know). Before this app serves, while the engine
        # loads, server.loading answers 503 {"status": "loading"}; while draining, the
        # gate (server.app) answers 503 {"status": "draining"}.
        if engine.errored:
            return error_response(503, f"The engine is dead: {engine.dead_error!r}")
        dead = engine.dead_engines()
        if dead:
            return error_response(503, "Engine core(s) dead: " + "; ".join(
                f"engine {i}: {why}" for i, why in sorted(dead.items())))
        return Response(status=200)

    @app.get("/version")
    def version():
        return json_response({"version": VERSION})

    @app.get("/metrics")
    def metrics():
        return Response(st.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    if st.cfg.dev_mode:
        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            # 200 when reset, 409 while requests hold KV blocks
            if st.bridge.run_blocking(asyncio.run, engine.reset_prefix_cache()):
                return json_response({"success": True})
            return error_response(409, "The prefix cache cannot be reset while requests hold KV blocks.")

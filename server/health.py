"""``GET /health``, ``/version``, ``/metrics`` and the development endpoint ``POST
/reset_prefix_cache`` (``VENGINE_SERVER_DEV_MODE``, vLLM's ``VLLM_SERVER_DEV_MODE``)."""
from __future__ import annotations

import asyncio

from flask import Flask, Response

from pyengine import VERSION

from .http import error_response, json_response


def register_health_routes(app: Flask, st) -> None:
    """Add the routes to ``app`` (``st``: its ``server.app.ServerState``)."""
    engine = st.engine

    @app.get("/health")
    def health():
        # 503 once the engine died, or one of its data-parallel engine cores (the others
        # still serve, but a router should know); while draining, the gate answers 503.
        if getattr(engine, "errored", False):
            return error_response(503, f"The engine is dead: {getattr(engine, 'dead_error', None)!r}")
        dead = engine.dead_engines() if hasattr(engine, "dead_engines") else {}
        if dead:
            return error_response(503, "Engine core(s) dead: " + "; ".join(
                f"engine {i}: {why}" for i, why in sorted(dead.items())))
        return Response(status=200)

    @app.get("/version")
    def version():
        return json_response({"version": VERSION})

    @app.get("/metrics")
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(st.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    if st.cfg.dev_mode:
        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            # 200 when reset, 409 while requests hold KV blocks
            if st.bridge.run_blocking(asyncio.run, engine.reset_prefix_cache()):
                return json_response({"success": True})
            return error_response(409, "The prefix cache cannot be reset while requests hold KV blocks.")

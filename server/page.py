"""The browser page at ``/`` and the JSON stats it polls at ``/stats``.

``GET /`` serves a static playground (a completion box and a chat box streaming from the
server's own ``/v1/completions`` and ``/v1/chat/completions`` over SSE) and a live panel
(running/waiting requests, KV cache use, tokens/s). The files are plain HTML/JS/CSS under
``server/static/`` shipped as package data: no build step and nothing fetched from outside.
The page itself is public; with ``--api-key`` the user pastes the key into the page, which
sends it as ``Authorization: Bearer KEY`` on its ``/v1`` requests.

``GET /stats`` is a JSON view of the same figures ``/metrics`` exports (one
``registry.collect()`` of the app's ``ServerMetrics``: the engine's gauges come from
``AsyncLLM.get_stats()``, the token and request counters from the request handlers), so the
two never disagree. Counters are cumulative; a client gets rates (tokens/s) from two
snapshots and their ``timestamp`` as Prometheus' ``rate()`` does. Like ``/metrics`` it needs
no API key. With ``--api-server-count N`` each API server's counters are its own requests;
the engine's gauges are shared.

vLLM has no page of its own; the stats names follow its Prometheus metric names.
"""
from __future__ import annotations

import time
from pathlib import Path

from flask import Blueprint, current_app

# Prometheus sample name -> /stats key. Counters (``_total``) are summed over their labels
# (``vllm:request_success_total`` has one series per finish reason).
STATS_FROM_METRICS = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_gpu_blocks": "num_gpu_blocks",
    "vllm:num_free_blocks": "num_free_blocks",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "num_requests_finished",
}
_FLOAT_KEYS = frozenset({"kv_cache_usage"})
STATIC_DIR = Path(__file__).parent / "static"


def stats_snapshot(registry) -> dict:
    """One JSON-ready snapshot of ``registry`` (a ``prometheus_client.CollectorRegistry``):
    every key of ``STATS_FROM_METRICS`` (0 where the metric is absent, e.g. a dead engine's
    gauges), ints except ``kv_cache_usage`` (a fraction in [0, 1]), plus ``timestamp``
    (server wall clock, seconds since the epoch, taken with the samples)."""
    out: dict[str, float] = dict.fromkeys(STATS_FROM_METRICS.values(), 0)
    for family in registry.collect():
        for sample in family.samples:
            key = STATS_FROM_METRICS.get(sample.name)
            if key is not None:
                out[key] += sample.value
    for k, v in out.items():
        out[k] = float(v) if k in _FLOAT_KEYS else int(v)
    out["timestamp"] = time.time()
    return out


def create_page_blueprint() -> Blueprint:
    """A fresh blueprint (``GET /``, ``GET /stats``, ``GET /static/<file>``) for one app;
    the handlers read the app's ``ServerState`` from ``current_app.extensions["vengine"]``."""
    bp = Blueprint("page", __name__, static_folder=str(STATIC_DIR), static_url_path="/static")

    @bp.get("/")
    def index():
        resp = bp.send_static_file("index.html")
        resp.headers["Cache-Control"] = "no-cache"
        return resp

    @bp.get("/stats")
    def stats():
        st = current_app.extensions["vengine"]
        body = stats_snapshot(st.metrics.registry)
        body = {"model_name": st.metrics.model_name, "engine_alive": not st.engine.errored, **body}
        resp = current_app.json.response(body)
        resp.headers["Cache-Control"] = "no-store"
        return resp

    return bp


__all__ = ["STATS_FROM_METRICS", "create_page_blueprint", "stats_snapshot"]

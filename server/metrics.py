"""Prometheus metrics with vLLM's names, on a per-app ``CollectorRegistry``.

Engine gauges and the prefix-cache / preemption counters are read from
``AsyncLLM.get_stats()`` at scrape time; request histograms and token counters are
recorded by the request handlers from ``RequestOutput.metrics`` timestamps.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineStatsCollector:
    """Custom collector: one ``get_stats()`` call per scrape."""

    def __init__(self, engine, model_name: str):
        self._engine = engine
        self._labels = {"model_name": model_name}

    def collect(self):
        try:
            st = self._engine.get_stats()
        except Exception:  # noqa: BLE001 - a dead engine still lets /metrics answer
            logger.debug("get_stats failed", exc_info=True)
            return
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    getattr(st, "num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    getattr(st, "num_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    getattr(st, "kv_cache_usage", 0.0))
        yield gauge("vllm:num_gpu_blocks", "Number of KV cache blocks.", getattr(st, "num_gpu_blocks", 0))
        yield gauge("vllm:num_free_blocks", "Number of free KV cache blocks.",
                    getattr(st, "num_free_blocks", 0))
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.",
                      getattr(st, "prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.",
                      getattr(st, "prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                      getattr(st, "num_preemptions", 0))


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        lbl = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     lbl, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         lbl, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lbl, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lbl, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                    lbl, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens per request.",
                                 lbl, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        r.register(_EngineStatsCollector(engine, model_name))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Turns the ``RequestOutput.metrics`` of one engine request's outputs into
    TTFT / ITL / e2e observations (one ITL sample per token of each delta)."""

    __slots__ = ("m", "_first_seen", "_last_token_time", "_tokens")

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self._first_seen = False
        self._last_token_time = None
        self._tokens = 0

    def observe(self, out, new_tokens: int) -> None:
        rm = getattr(out, "metrics", None)
        if rm is None or new_tokens <= 0:
            return
        ftt, ltt = rm.first_token_time, rm.last_token_time
        if not self._first_seen and ftt is not None:
            self._first_seen = True
            self.m.ttft.observe(max(0.0, ftt - rm.arrival_time))
            self._last_token_time = ftt
            new_tokens -= 1
        if new_tokens > 0 and ltt is not None and self._last_token_time is not None:
            gap = max(0.0, ltt - self._last_token_time) / new_tokens
            for _ in range(new_tokens):
                self.m.itl.observe(gap)
        if ltt is not None:
            self._last_token_time = ltt

    def finish(self, out) -> None:
        rm = getattr(out, "metrics", None)
        if rm is None:
            return
        end = rm.finished_time or rm.last_token_time
        if end is not None:
            self.m.e2e.observe(max(0.0, end - rm.arrival_time))

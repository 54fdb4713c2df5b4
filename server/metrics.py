"""Prometheus metrics with vLLM's names and buckets (vllm/v1/metrics/loggers.py), on a
per-app ``CollectorRegistry``.

Engine gauges and the prefix-cache / preemption counters are read from
``AsyncLLM.get_stats()`` at scrape time; ``vllm:iteration_tokens_total`` from each engine
step's ``SchedulerStats`` (a stat logger on the engine: the stats arrive as messages from
the engine core); request histograms and token counters are recorded per HTTP request
(``RequestRecorder``, fed by ``server.bridge.RequestGroup``) from ``RequestOutput.metrics``
timestamps. Every admitted
engine request adds its prompt to ``vllm:prompt_tokens`` once, when admitted, and ends
once in ``vllm:request_success`` (its finish reason; "abort" when its client left or the
server cut it, "error" when it failed), whether or not the handler saw its last output.
"""
from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pyengine.metrics import StatLoggerBase

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _IterationTokensLogger(StatLoggerBase):
    """Observes the tokens of every engine step (from the engine's SchedulerStats), under
    the step's engine core (vLLM's ``engine`` label)."""

    def __init__(self, histogram, model_name: str):
        self.histogram = histogram
        self.model_name = model_name

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None and scheduler_stats.num_batched_tokens > 0:
            self.histogram.labels(self.model_name, str(scheduler_stats.engine_index)).observe(
                scheduler_stats.num_batched_tokens)


class _EngineStatsCollector:
    """Custom collector: one stats read per scrape; one sample per engine core, labelled
    ``engine="<index>"`` as vLLM's (data parallelism: one per core)."""

    def __init__(self, engine, model_name: str):
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        try:
            per = self._engine.get_stats_per_engine()
        except Exception:  # noqa: BLE001 - a dead engine still lets /metrics answer
            logger.debug("get_stats failed", exc_info=True)
            return
        names = ["model_name", "engine"]

        def family(kind, name, doc, field_name):
            f = kind(name, doc, labels=names)
            for st in per:
                f.add_metric([self._model_name, str(st.engine_index)],
                             float(getattr(st, field_name, 0)))
            return f

        def gauge(name, doc, field_name):
            return family(GaugeMetricFamily, name, doc, field_name)

        def counter(name, doc, field_name):
            return family(CounterMetricFamily, name, doc, field_name)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running")
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting")
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage")
        yield gauge("vllm:num_gpu_blocks", "Number of KV cache blocks.", "num_gpu_blocks")
        yield gauge("vllm:num_free_blocks", "Number of free KV cache blocks.", "num_free_blocks")
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", "prefix_cache_queries")
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", "prefix_cache_hits")
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions")
        if any(getattr(st, "spec_accepted_per_pos", None) for st in per):  # speculative decoding is on
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts")
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens")
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          "spec_num_accepted_tokens")
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=names + ["position"])
            for st in per:
                for pos, n in enumerate(st.spec_accepted_per_pos):
                    c.add_metric([self._model_name, str(st.engine_index), str(pos)], float(n))
            yield c


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
        labels = {"model_name": model_name}
        self.itl = BatchedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                    labels, _ITL_BUCKETS, r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                    lbl, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens per request.",
                                 lbl, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        # vLLM's name for the per-token gaps (dashboards read it); the same samples as the ITL.
        self.tpot = BatchedHistogram("vllm:time_per_output_token_seconds",
                                     "Histogram of time per output token in seconds.", labels, _ITL_BUCKETS, r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     lbl + ["engine"], buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        self._remove_stat_logger: Callable[[], None] | None = engine.add_stat_logger(
            _IterationTokensLogger(iteration_tokens, model_name))
        r.register(_EngineStatsCollector(engine, model_name))

    def close(self) -> None:
        """Stop observing the engine's steps (the app is going away)."""
        if self._remove_stat_logger is not None:
            self._remove_stat_logger()
            self._remove_stat_logger = None

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BatchedHistogram:
    """A Prometheus histogram (one label set) that takes ``n`` equal observations in one
    update (``observe_many``): a delta of many tokens has one ITL sample per token.
    Registered on ``registry`` as a collector (prometheus_client's public
    ``HistogramMetricFamily``), so it is rendered as a ``Histogram`` of the same name,
    buckets and labels would be. ``buckets``: the finite upper bounds, ascending (+Inf is
    added). Observed from the hub thread, read by scrapes; a lock keeps a scrape's
    buckets and sum consistent."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets, registry):
        self.name, self.documentation = name, documentation
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self.observe_many(amount, 1)

    def observe_many(self, amount: float, n: int) -> None:
        """``n`` observations of ``amount`` (seconds, or the histogram's unit)."""
        i = bisect_left(self._bounds, amount)  # the first bucket whose bound >= amount
        with self._lock:
            self._counts[i] += n
            self._sum += amount * n

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, acc = [], 0
        for bound, c in zip([*self._bounds, float("inf")], counts):
            acc += c
            cumulative.append((floatToGoString(bound), acc))
        family = HistogramMetricFamily(self.name, self.documentation, labels=self._label_names)
        family.add_metric(self._label_values, cumulative, total)
        return [family]


def observe_many(histogram, amount: float, n: int) -> None:
    """``n`` observations of ``amount``: one update on a ``BatchedHistogram``, ``n``
    ``observe`` calls on any other histogram."""
    if isinstance(histogram, BatchedHistogram):
        histogram.observe_many(amount, n)
        return
    for _ in range(n):
        histogram.observe(amount)


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
        rm = out.metrics
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
            self.m.itl.observe_many(gap, new_tokens)
            self.m.tpot.observe_many(gap, new_tokens)
        if ltt is not None:
            self._last_token_time = ltt

    def finish(self, out) -> None:
        """The request's e2e latency and its queue / prefill / decode phases (vLLM's
        definitions: arrival to first scheduled, first scheduled to first token, first to
        last token)."""
        rm = out.metrics
        if rm is None:
            return
        m = self.m
        end = rm.finished_time or rm.last_token_time
        if end is not None:
            m.e2e.observe(max(0.0, end - rm.arrival_time))
        scheduled, first, last = rm.first_scheduled_time, rm.first_token_time, rm.last_token_time
        if scheduled is not None:
            m.queue_time.observe(max(0.0, scheduled - rm.arrival_time))
            if first is not None:
                m.prefill_time.observe(max(0.0, first - scheduled))
        if first is not None and last is not None:
            m.decode_time.observe(max(0.0, last - first))


class RequestRecorder:
    """The metrics of one HTTP request's engine requests (prompt ``i`` each): its prompt
    counted in ``vllm:prompt_tokens`` once admitted (vLLM counts them at prefill, aborted
    requests included: not at the end the handler may never see), the tokens of each
    output, the TTFT / ITL / e2e timings, and each request's end counted once in
    ``vllm:request_success`` with its finish reason ("error" when it failed, "abort" when
    its end was never seen: the client left, the engine died, the server cut it)."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self._prompt_lens: list[int] = []
        self._tokens: list[int] = []
        self._reasons: list[dict[int, str]] = []  # per prompt: choice index -> finish reason
        self._timers: list[RequestTimer] = []
        self._recorded: set[int] = set()

    def admitted(self, prompt_tokens: int) -> None:
        """The next prompt's engine request was queued."""
        self._prompt_lens.append(prompt_tokens)
        self._tokens.append(0)
        self._reasons.append({})
        self._timers.append(RequestTimer(self.m))
        self.m.prompt_tokens.inc(prompt_tokens)

    def output(self, i: int, out) -> None:
        """One ``RequestOutput`` (a delta) of prompt ``i``, as it is taken: a finished
        one ends the request before its chunks go out (a client gone at that moment
        does not make it an abort)."""
        reasons = self._reasons[i]
        newest = total = 0
        for o in out.outputs:
            self._tokens[i] += len(o.token_ids)
            if o.finish_reason == "error":
                self.ended(i, "error")
                return
            if o.finish_reason is not None:
                reasons.setdefault(o.index, o.finish_reason)
            newest, total = max(newest, len(o.token_ids)), total + len(o.token_ids)
        if newest:
            self.m.generation_tokens.inc(total)
            self._timers[i].observe(out, newest)
        if out.finished:
            self.ended(i, reasons[min(reasons)] if reasons else "abort", out)

    def ended(self, i: int, reason: str, out=None) -> None:
        """Prompt ``i``'s request ended (``reason``: its finish reason, "abort" or
        "error"): counted once, whichever way it ended."""
        if i in self._recorded:
            return
        self._recorded.add(i)
        m = self.m
        m.req_prompt.observe(self._prompt_lens[i])
        m.req_gen.observe(self._tokens[i])
        m.finished(reason)
        if out is not None and reason not in ("abort", "error"):
            self._timers[i].finish(out)

    def close(self) -> None:
        """The HTTP request is over: requests whose end was not seen count as aborted."""
        for i in range(len(self._prompt_lens)):
            self.ended(i, "abort")

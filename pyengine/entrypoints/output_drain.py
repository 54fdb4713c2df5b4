"""One subscription to an engine's outputs, shared by the front ends that read them off
the engine's output-handler thread (the HTTP server's ``server.bridge`` and the C ABI's
``capi._impl``): request id -> ``Subscriber``, each engine request queued through it
(``add``), and once per engine step the subscribers whose collectors were just filled
handed to the front end's ``on_ready`` (on the output-handler thread: it must not
block). Each front end is then a thin adapter: the HTTP server wakes the waiting
greenlets (one gevent async watcher), the C ABI drains the collectors there and pushes
the deltas into C."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pyengine.engine.output_processor import RequestOutputCollector
from pyengine.engine.processor import ProcessedRequest
from pyengine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class Subscriber:
    """One engine request read through an ``OutputDrain``: its collector (set once
    queued) and ``target``, the front end's own (a gevent Event; the C request)."""

    __slots__ = ("request_id", "target", "collector")

    def __init__(self, request_id: str, target: Any):
        self.request_id = request_id
        self.target = target
        self.collector: RequestOutputCollector | None = None

    @property
    def finished(self) -> bool:
        """Its final output has been taken."""
        return self.collector is not None and self.collector.finished

    def take(self) -> RequestOutput | None:
        """The pending output (DELTA outputs merged), or None (nothing new, or not queued
        yet). Raises ``EngineDeadError`` once the engine died."""
        collector = self.collector
        return None if collector is None else collector.get_nowait()


class OutputDrain:
    """``engine``: an ``AsyncLLM``; ``on_ready(subscribers)``: called on the engine's
    output-handler thread once per step with the subscribers of the requests whose
    collectors were filled (and with every subscriber once the engine died)."""

    def __init__(self, engine, on_ready: Callable[[list[Subscriber]], None]):
        self.engine = engine
        self._on_ready = on_ready
        self._subscribers: dict[str, Subscriber] = {}
        self._unsubscribe: Callable[[], None] | None = engine.add_output_listener(self._listener)

    def add(self, request: ProcessedRequest, target: Any) -> Subscriber:
        """Queue ``request`` (``AsyncLLM.add_processed_request``) and subscribe to its
        outputs; an output that arrives before this returns reaches ``on_ready`` too.
        Raises what the engine raises (ValueError for a duplicate id,
        ``EngineDeadError``); nothing is queued or subscribed then."""
        sub = Subscriber(request.request_id, target)
        self._subscribers[sub.request_id] = sub  # before queueing: the first output may come at once
        try:
            sub.collector = self.engine.add_processed_request(request)
        except BaseException:
            self._subscribers.pop(sub.request_id, None)
            raise
        return sub

    def remove(self, request_id: str) -> None:
        """Stop routing this request's outputs (idempotent)."""
        self._subscribers.pop(request_id, None)

    def subscribers(self) -> list[Subscriber]:
        return list(self._subscribers.values())

    def abort(self, request_ids: list[str]) -> None:
        """``AsyncLLM.abort`` (may take the engine's lock: not on an event loop)."""
        self.engine.abort(request_ids)

    def dead_error(self) -> BaseException | None:
        """Why the engine died (or was shut down), or None while it serves."""
        return self.engine.dead_error

    def close(self) -> None:
        """Unsubscribe from the engine (idempotent); subscribers stay readable."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            try:
                unsubscribe()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                logger.debug("unsubscribing failed", exc_info=True)

    # -- output-handler thread ------------------------------------------------------
    def _listener(self, request_ids: list[str]) -> None:
        get = self._subscribers.get
        ready = [s for s in map(get, request_ids) if s is not None]
        if ready:
            self._on_ready(ready)

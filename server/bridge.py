"""The bridge from the engine's output-handler thread to gevent greenlets.

The engine calls our listener on its (native) output-handler thread once per step with
the ids of the requests whose collectors were just filled. The listener only appends the
ids to a thread-safe ``deque`` and calls ``send()`` on one ``loop.async_()`` watcher: that
is the only gevent call ever made from a native thread. The watcher's callback runs on
the hub and sets the ``gevent.event.Event`` of each waiting handler; the handler then
drains its collectors with ``get_nowait()``. One engine step for N streams costs one
cross-thread wake-up, not N, and the hub never blocks on a native lock.

A ``RequestGroup`` is the set of engine requests one HTTP request made (a prompt list
makes several); all of them share one Event. It also watches the client socket, so a
client that leaves while its request sits in a long prefill (nothing is written, so a
write error cannot reveal the disconnect) is noticed at once.
"""
from __future__ import annotations

import logging
import queue
import socket as _stdsocket
import threading
from collections import deque
from typing import Iterator, Optional

import gevent
from gevent.event import Event

from pyengine import EngineDeadError

logger = logging.getLogger(__name__)

# How long a waiting handler sleeps before re-checking engine health on its own
# (a dead engine might never call the listener again).
_POLL_S = 1.0


class ClientDisconnected(Exception):
    """The HTTP client closed its connection."""


class ServerShuttingDown(Exception):
    """The server's shutdown drain ran out (``--shutdown-timeout``): this request was cut."""


def is_engine_dead(exc: BaseException, engine=None) -> bool:
    """True for pyengine's ``EngineDeadError``, or any error once the engine died."""
    if isinstance(exc, EngineDeadError):
        return True
    return bool(engine is not None and getattr(engine, "errored", False))


class GeventBridge:
    """One per app (per engine). Bound lazily to the hub of the thread that serves."""

    def __init__(self, engine):
        self._engine = engine
        self._pending: deque = deque()  # filled by the output thread, drained on the hub
        self._waiters: dict[str, Event] = {}  # request id -> Event; hub thread only
        self._watcher = None
        self._health_timer = None
        self._hub = None
        self._unsubscribe = None
        self._abort_q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._aborter: Optional[threading.Thread] = None

    # -- engine calls that take the engine's locks: never on the hub -------------------
    def add_request(self, request_id, prompt, sampling_params, priority):
        """``engine.add_request`` on a gevent threadpool thread: it takes the engine's
        output-processor lock, which the output thread holds while it processes a whole
        step; the calling greenlet waits cooperatively, the hub keeps serving."""
        return self.run_blocking(self._engine.add_request, request_id, prompt, sampling_params, priority=priority)

    @staticmethod
    def run_blocking(fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a gevent threadpool thread (a call that may block on
        a native lock or wait for the engine core); the calling greenlet waits
        cooperatively, the hub keeps serving."""
        return gevent.get_hub().threadpool.apply(fn, args, kwargs)

    def abort(self, request_ids: list) -> None:
        """Fire-and-forget ``engine.abort`` through one native thread (callable from the
        hub, from a hub callback or from any greenlet: ``SimpleQueue.put`` never blocks)."""
        if self._aborter is None:
            t = threading.Thread(target=self._abort_loop, name="vengine-http-abort", daemon=True)
            self._aborter = t
            t.start()
        self._abort_q.put(list(request_ids))

    def _abort_loop(self) -> None:
        while True:
            ids = self._abort_q.get()
            if ids is None:
                return
            try:
                self._engine.abort(ids)
            except Exception:  # noqa: BLE001 - a dead engine has nothing left to abort
                logger.debug("abort failed", exc_info=True)

    # -- hub side -------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Create the async watcher on the current thread's hub (idempotent)."""
        if self._watcher is not None:
            if self._hub is not gevent.get_hub():
                raise RuntimeError("the vengine app is bound to another thread's gevent hub")
            return
        hub = gevent.get_hub()
        watcher = hub.loop.async_()
        watcher.start(self._on_wake)
        # One periodic wake-up of every waiting handler instead of a timeout on each
        # handler's wait (a Timeout object per wait, i.e. per engine step per stream).
        timer = hub.loop.timer(_POLL_S, _POLL_S)
        timer.ref = False  # never keeps the hub's loop alive
        timer.start(self._on_health_poll)
        self._hub, self._watcher, self._health_timer = hub, watcher, timer
        self._unsubscribe = self._engine.add_output_listener(self._listener)

    def close(self) -> None:
        if self._aborter is not None:
            self._abort_q.put(None)
            self._aborter = None
        if self._unsubscribe is not None:
            try:
                self._unsubscribe()
            except Exception:  # noqa: BLE001 - engine may be gone already
                pass
            self._unsubscribe = None
        for w in (self._watcher, self._health_timer):
            if w is not None:
                w.stop()
                w.close()
        self._watcher = self._health_timer = None

    def register(self, request_id: str, event: Event) -> None:
        self._waiters[request_id] = event

    def unregister(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def _on_wake(self) -> None:
        pending, waiters = self._pending, self._waiters
        while pending:
            ids = pending.popleft()
            for rid in ids:
                ev = waiters.get(rid)
                if ev is not None:
                    ev.set()

    def _on_health_poll(self) -> None:
        # Every waiting handler re-checks its collectors and the engine's health once per
        # _POLL_S, as a timeout on its own wait would make it (a dead engine might never
        # call the listener again).
        self.wake_all()

    def wake_all(self) -> None:
        """Wake every waiter (hub thread), e.g. when the engine died."""
        for ev in list(self._waiters.values()):
            ev.set()

    # -- output-handler thread ------------------------------------------------------
    def _listener(self, request_ids) -> None:
        self._pending.append(request_ids)
        w = self._watcher
        if w is not None:
            w.send()


class _SocketWatch:
    """Read-readiness watcher on the client socket of one in-flight request.

    While a response is being produced, a well-behaved HTTP/1.1 client sends nothing, so
    the socket turning readable means EOF (disconnect) or, rarely, a pipelined request.
    The callback peeks without consuming and stops watching either way (level-triggered
    readiness would otherwise spin).
    """

    def __init__(self, sock, on_disconnect):
        self._sock = sock
        self._on_disconnect = on_disconnect
        self._io = None
        try:
            fd = sock.fileno()
            if fd < 0:
                return
            self._io = gevent.get_hub().loop.io(fd, 1)
            self._io.start(self._on_readable)
        except Exception:  # noqa: BLE001 - no watcher is a degraded, not a broken, mode
            logger.debug("cannot watch client socket", exc_info=True)
            self._io = None

    def _on_readable(self) -> None:
        self.stop()
        raw = getattr(self._sock, "_sock", self._sock)
        gone = False
        try:
            data = raw.recv(1, _stdsocket.MSG_PEEK | _stdsocket.MSG_DONTWAIT)
            gone = not data
        except BlockingIOError:
            self._restart()
            return
        except OSError:  # ECONNRESET, EBADF, ...: the connection is unusable either way
            gone = True
        if gone:
            self._on_disconnect()

    def _restart(self) -> None:
        if self._io is not None:
            self._io.start(self._on_readable)

    def stop(self) -> None:
        if self._io is not None:
            self._io.stop()

    def close(self) -> None:
        io, self._io = self._io, None
        if io is not None:
            io.stop()
            io.close()


class RequestGroup:
    """The engine requests of one HTTP request, read on the hub without blocking it."""

    def __init__(self, bridge: GeventBridge, engine, sock=None):
        self.bridge = bridge
        self.engine = engine
        self.event = Event()
        self.request_ids: list[str] = []
        self.collectors: list = []
        self.disconnected = False
        self.cancelled: Optional[str] = None  # why the server cut this request (shutdown)
        self._done: set[int] = set()
        self._aborted: set[str] = set()
        self._watch: Optional[_SocketWatch] = None
        bridge.ensure_started()
        if sock is not None:
            self._watch = _SocketWatch(sock, self._on_disconnect)

    def _on_disconnect(self) -> None:
        self.disconnected = True
        # Abort right away (a queue put, no waiting), then wake the handler.
        self.abort_unfinished()
        self.event.set()

    def cancel(self, message: str) -> None:
        """End this request's generation on the server's behalf (hub thread): its engine
        requests are aborted and its reader raises ``ServerShuttingDown(message)``."""
        self.cancelled = message
        self.abort_unfinished()
        self.event.set()

    def add(self, request_id: str, prompt, sampling_params, priority: int = 0):
        """``engine.add_request``; raises its ValueError / EngineDeadError unchanged."""
        self.bridge.register(request_id, self.event)
        try:
            collector = self.bridge.add_request(request_id, prompt, sampling_params, priority)
        except BaseException:
            self.bridge.unregister(request_id)
            raise
        self.request_ids.append(request_id)
        self.collectors.append(collector)
        if self.disconnected or self.cancelled:  # the client left / shutdown came while admitting
            self.abort_unfinished()
        return collector

    def outputs(self) -> Iterator[tuple[int, object]]:
        """Yield ``(index, RequestOutput)`` as outputs arrive until all requests finished.

        Raises ``ClientDisconnected`` when the client left, ``ServerShuttingDown`` when
        the server cut it (shutdown), and the engine's ``EngineDeadError`` when the engine
        died.
        """
        collectors, done, event = self.collectors, self._done, self.event
        woken = False  # the last pass followed a wake-up
        while len(done) < len(collectors):
            if self.disconnected:
                raise ClientDisconnected()
            if self.cancelled:
                raise ServerShuttingDown(self.cancelled)
            got = False
            for i, col in enumerate(collectors):
                if i in done:
                    continue
                out = col.get_nowait()
                if out is None:
                    continue
                got = True
                if out.finished:
                    done.add(i)
                yield i, out
                if self.disconnected:
                    raise ClientDisconnected()
                if self.cancelled:
                    raise ServerShuttingDown(self.cancelled)
            if not got and len(done) < len(collectors):
                if woken:  # woken with nothing to read: the bridge's periodic poll
                    self._check_engine()
                # No switch happened since the get_nowait calls above, so a fill after
                # them is followed by a listener call that sets the event after clear().
                event.clear()
                event.wait()
                woken = True
            else:
                woken = False

    def _check_engine(self) -> None:
        if getattr(self.engine, "errored", False):
            raise EngineDeadError(f"The engine died: {getattr(self.engine, 'dead_error', None)!r}")

    def abort_unfinished(self) -> None:
        ids = [rid for i, rid in enumerate(self.request_ids) if i not in self._done
               and rid not in self._aborted and not getattr(self.collectors[i], "finished", False)]
        if ids:
            self._aborted.update(ids)
            self.bridge.abort(ids)

    def close(self) -> None:
        """Abort what is still running and drop every hook (idempotent)."""
        self.abort_unfinished()
        for rid in self.request_ids:
            self.bridge.unregister(rid)
        self._done.update(range(len(self.collectors)))
        if self._watch is not None:
            self._watch.close()
            self._watch = None

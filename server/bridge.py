"""The HTTP server's adapter over the engine's output drain
(``pyengine.entrypoints.output_drain``): gevent wake-ups, and one HTTP request's engine
requests read on the hub.

The drain calls our ``on_ready`` on the engine's (native) output-handler thread once per
step with the subscribers whose collectors were just filled. It only appends them to a
thread-safe ``deque`` and calls ``send()`` on one ``loop.async_()`` watcher: that is the
only gevent call ever made from a native thread. The watcher's callback runs on the hub
and sets the ``gevent.event.Event`` of each subscriber's handler; the handler then drains
its collectors with ``Subscriber.take``. One engine step for N streams costs one
cross-thread wake-up, not N, and the hub never blocks on a native lock.

A ``RequestGroup`` is the set of engine requests one HTTP request made (a prompt list
makes several; the serving object's ``Generation``); all of them share one Event. It also
watches the client socket, so a client that leaves while its request sits in a long
prefill (nothing is written, so a write error cannot reveal the disconnect) is noticed at
once. ``HTTPSession`` is the serving object's ``Session`` of one HTTP request.
"""
from __future__ import annotations

import logging
import queue
import socket as _stdsocket
import threading
from collections import deque
from collections.abc import Callable, Iterator

import gevent
from gevent.event import Event

from pyengine import EngineDeadError, RequestOutput
from pyengine.engine.processor import ProcessedRequest
from pyengine.entrypoints.openai.errors import APIError, ClientDisconnected, RequestCancelled
from pyengine.entrypoints.output_drain import OutputDrain, Subscriber

from .metrics import RequestRecorder, ServerMetrics

logger = logging.getLogger(__name__)

# How long a waiting handler sleeps before re-checking engine health on its own
# (a dead engine might never call the listener again).
_POLL_S = 1.0


def _call_catching(fn, args: tuple, kwargs: dict) -> tuple[bool, object]:
    """``(True, fn(*args, **kwargs))``, or ``(False, the Exception it raised)``
    (``GeventBridge.run_blocking``, on a threadpool thread)."""
    try:
        return True, fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - raised again in the calling greenlet
        return False, e


def is_engine_dead(exc: BaseException, engine=None) -> bool:
    """True for pyengine's ``EngineDeadError``, or any error once the engine died."""
    if isinstance(exc, EngineDeadError):
        return True
    return engine is not None and engine.errored


class GeventBridge:
    """One per app (per engine). Bound lazily to the hub of the thread that serves."""

    def __init__(self, engine):
        self._engine = engine
        self._pending: deque = deque()  # lists of subscribers, filled by the output thread, drained on the hub
        self._drain: OutputDrain | None = None
        self._watcher = None
        self._health_timer = None
        self._hub = None
        self._abort_q: queue.SimpleQueue = queue.SimpleQueue()
        self._aborter: threading.Thread | None = None

    # -- engine calls that take the engine's locks: never on the hub -------------------
    def add_request(self, request: ProcessedRequest, event: Event) -> Subscriber:
        """Queue ``request`` through the drain on a gevent threadpool thread: it takes the
        engine's output-processor lock, which the output thread holds while it processes
        a whole step; the calling greenlet waits cooperatively, the hub keeps serving."""
        self.ensure_started()
        assert self._drain is not None
        return self.run_blocking(self._drain.add, request, event)

    def remove(self, request_id: str) -> None:
        if self._drain is not None:
            self._drain.remove(request_id)

    @staticmethod
    def run_blocking(fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a gevent threadpool thread (a call that may block on
        a native lock or wait for the engine core); the calling greenlet waits
        cooperatively, the hub keeps serving.

        An ``Exception`` that ``fn`` raises is raised here, in the calling greenlet, with
        its traceback, and nothing is logged: most are a client's error (a request the
        validation refused, answered 400), and the caller decides what to log. Raised on
        the pool's thread, gevent's hub would print each one with its traceback.
        Other ``BaseException`` kinds (``SystemExit``, ``KeyboardInterrupt``) are left to
        gevent, which hands them to the hub as ever."""
        ok, value = gevent.get_hub().threadpool.apply(_call_catching, (fn, args, kwargs))
        if ok:
            return value
        try:
            raise value
        finally:
            del value  # no frame keeps the exception (and its traceback's frames) alive

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
        timer.start(self.wake_all)
        self._hub, self._watcher, self._health_timer = hub, watcher, timer
        self._drain = OutputDrain(self._engine, self._on_ready)

    def close(self) -> None:
        if self._aborter is not None:
            self._abort_q.put(None)
            self._aborter = None
        if self._drain is not None:
            self._drain.close()
        for w in (self._watcher, self._health_timer):
            if w is not None:
                w.stop()
                w.close()
        self._watcher = self._health_timer = None

    def _on_wake(self) -> None:
        pending = self._pending
        while pending:
            for sub in pending.popleft():
                sub.target.set()

    def wake_all(self) -> None:
        """Wake every waiter (hub thread): each re-checks its collectors and the engine's
        health once per _POLL_S, as a timeout on its own wait would make it (a dead
        engine might never call the listener again)."""
        if self._drain is not None:
            for sub in self._drain.subscribers():
                sub.target.set()

    # -- output-handler thread ------------------------------------------------------
    def _on_ready(self, subscribers: list[Subscriber]) -> None:
        self._pending.append(subscribers)
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
        gone = False
        try:
            # a plain socket over the same descriptor (gevent's recv would wait, on the hub)
            raw = _stdsocket.socket(fileno=self._sock.fileno())
            try:
                data = raw.recv(1, _stdsocket.MSG_PEEK | _stdsocket.MSG_DONTWAIT)
            finally:
                raw.detach()  # the descriptor stays the connection's
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
    """The engine requests of one HTTP request, read on the hub without blocking it (the
    serving object's ``Generation``); ``recorder``: their metrics; ``on_close``: called
    once when it is closed."""

    def __init__(self, bridge: GeventBridge, engine, recorder: RequestRecorder, sock=None,
                 on_close: Callable[[RequestGroup], None] | None = None):
        self.bridge = bridge
        self.engine = engine
        self.recorder = recorder
        self.event = Event()
        self.subscribers: list[Subscriber] = []
        self.disconnected = False
        self.cancelled: str | None = None  # why the server cut this request (shutdown)
        self._done: set[int] = set()
        self._aborted: set[str] = set()
        self._on_close = on_close
        self._watch: _SocketWatch | None = None
        bridge.ensure_started()
        if sock is not None:
            self._watch = _SocketWatch(sock, self._on_disconnect)

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.subscribers]

    def _on_disconnect(self) -> None:
        self.disconnected = True
        # Abort right away (a queue put, no waiting), then wake the handler.
        self.abort_unfinished()
        self.event.set()

    def cancel(self, message: str) -> None:
        """End this request's generation on the server's behalf (hub thread): its engine
        requests are aborted and its reader raises ``RequestCancelled(message)``."""
        self.cancelled = message
        self.abort_unfinished()
        self.event.set()

    def add(self, request: ProcessedRequest) -> Subscriber:
        """Queue one engine request; raises the engine's ValueError / EngineDeadError unchanged."""
        sub = self.bridge.add_request(request, self.event)
        self.subscribers.append(sub)
        self.recorder.admitted(len(request.prompt_token_ids))
        if self.disconnected or self.cancelled:  # the client left / shutdown came while admitting
            self.abort_unfinished()
        return sub

    def _check(self) -> None:
        if self.disconnected:
            raise ClientDisconnected()
        if self.cancelled:
            raise RequestCancelled(self.cancelled)

    def outputs(self) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(index, RequestOutput)`` as outputs arrive until all requests finished;
        each is recorded (metrics) when taken, before it is yielded.

        Raises ``ClientDisconnected`` when the client left, ``RequestCancelled`` when the
        server cut it (shutdown), and the engine's ``EngineDeadError`` when the engine
        died.
        """
        subs, done, event = self.subscribers, self._done, self.event
        woken = False  # the last pass followed a wake-up
        while len(done) < len(subs):
            self._check()
            got = False
            for i, sub in enumerate(subs):
                if i in done:
                    continue
                out = sub.take()
                if out is None:
                    continue
                got = True
                if out.finished:
                    done.add(i)
                self.recorder.output(i, out)
                yield i, out
                self._check()
            if not got and len(done) < len(subs):
                if woken:  # woken with nothing to read: the bridge's periodic poll
                    self._check_engine()
                # No switch happened since the take calls above, so a fill after them is
                # followed by an on_ready call that sets the event after clear().
                event.clear()
                event.wait()
                woken = True
            else:
                woken = False

    def _check_engine(self) -> None:
        if self.engine.errored:
            raise EngineDeadError(f"The engine died: {self.engine.dead_error!r}")

    def abort_unfinished(self) -> None:
        ids = [s.request_id for i, s in enumerate(self.subscribers) if i not in self._done
               and s.request_id not in self._aborted and not s.finished]
        if ids:
            self._aborted.update(ids)
            self.bridge.abort(ids)

    def close(self) -> None:
        """Abort what is still running and drop every hook (idempotent); the requests
        whose end was not seen are recorded as aborted."""
        self.abort_unfinished()
        for s in self.subscribers:
            self.bridge.remove(s.request_id)
        self._done.update(range(len(self.subscribers)))
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self.recorder.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)


class HTTPSession:
    """The serving object's ``Session`` of one HTTP request: blocking work on the gevent
    threadpool, and its engine requests as a ``RequestGroup`` (watching ``sock``, the
    client's socket, and counted in ``jobs`` for the shutdown drain). ``cut_message()``:
    why new generations are refused (the drain cut those in flight), or None."""

    def __init__(self, bridge: GeventBridge, engine, metrics: ServerMetrics, jobs: set,
                 cut_message: Callable[[], str | None], sock=None):
        self.bridge, self.engine, self.metrics = bridge, engine, metrics
        self.jobs, self.sock, self.cut_message = jobs, sock, cut_message

    def run_blocking(self, fn):
        return self.bridge.run_blocking(fn)

    def start(self, requests: list[ProcessedRequest]) -> RequestGroup:
        """Raises ``APIError`` (400: the engine refused a request; 503: the server is
        cutting its requests, or the engine is dead); nothing stays queued then."""
        cut = self.cut_message()
        if cut is not None:
            raise APIError(503, cut)
        group = RequestGroup(self.bridge, self.engine, RequestRecorder(self.metrics), self.sock,
                             on_close=self.jobs.discard)
        self.jobs.add(group)
        try:
            for r in requests:
                group.add(r)
        except ValueError as e:  # the engine refused it (a duplicate id)
            group.close()
            raise APIError(400, str(e), getattr(e, "parameter", None)) from None
        except Exception as e:
            group.close()
            if is_engine_dead(e, self.engine):
                raise APIError(503, f"The engine is dead: {e}") from None
            raise
        return group

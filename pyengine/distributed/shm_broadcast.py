"""One writer, N readers on one host: a ring of message slots in shared memory (the role
of vllm/distributed/device_communicators/shm_broadcast.py's ``MessageQueue``).

Rank 0 hands each step to the other ranks of its host through it instead of two gloo
broadcasts over TCP: a write is a memcpy and flag stores, a read a few flag loads, where
each gloo message costs a socket round through the kernel and a wake-up of the
receiver's thread.

Layout: ``num_slots`` slots of ``slot_bytes`` data each, then per slot one flag byte for
"written" and one per reader for "read". A slot's message: an int64 length, then the
bytes. Protocol (one writer): to write slot i, wait until it was never written or every
reader has read it; clear "written", copy the message, clear every "read" flag, set
"written". A reader of slot i waits for "written" set and its "read" flag clear, copies
the message out, sets its "read" flag. Stores are ordered by a lock round trip (a full
barrier), as vLLM does, for hosts whose memory model reorders stores.

Waiting (``SpinWaiter``) spins (yielding the core) for ``spin_s``, then sleeps with a growing interval up
to ``_MAX_SLEEP_S``: steady decode keeps the readers in the spin, while an idle engine
costs its worker ranks no core.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np

_LEN_BYTES = 8
_MAX_SLEEP_S = 1e-3


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with the resource tracker: the
    writer owns it (a reader's registration would have the tracker unlink it, or warn of a
    leak, when the reader exits; Python 3.13 has ``track=False`` for this)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class SpinWaiter:
    """One wait: call ``wait()`` between looks at a condition. Spins (``sched_yield``, which
    lets other threads and processes run) for ``spin_s``, then sleeps with a growing
    interval up to ``max_sleep_s``; ``check`` is called every ~10 ms of waiting (it raises
    to give up)."""

    def __init__(self, spin_s: float, check: Callable[[], None] | None, max_sleep_s: float = _MAX_SLEEP_S):
        self.spin_s, self.check, self.max_sleep_s = spin_s, check, max_sleep_s
        self.t0 = time.perf_counter()
        self.sleep = 0.0
        self.next_check = self.t0 + 0.01

    def wait(self) -> None:
        now = time.perf_counter()
        if self.check is not None and now >= self.next_check:
            self.next_check = now + 0.01
            self.check()
        if now - self.t0 < self.spin_s:
            os.sched_yield()
            return
        self.sleep = min(self.max_sleep_s, max(2 * self.sleep, 20e-6))
        time.sleep(self.sleep)


class ShmMessageQueue:
    """``ShmMessageQueue(num_readers, num_slots, slot_bytes)`` creates the ring (the
    writer's side); ``ShmMessageQueue.attach(handle, reader_index)`` opens it on a reader
    (``handle``: the writer's ``handle()``, a str). ``enqueue(*parts)`` writes one message
    (the parts' bytes concatenated; raises ValueError past ``max_message_bytes``);
    ``dequeue()`` returns the next message as a uint8 numpy array (a copy). ``close()``
    releases it (the writer also removes the segment). ``check``: called while waiting
    (e.g. to raise when a peer died)."""

    def __init__(self, num_readers: int, num_slots: int = 4, slot_bytes: int = 1 << 20, *,
                 _attach: tuple[str, int] | None = None):
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        meta = num_slots * (1 + num_readers)
        if _attach is None:
            self.shm = shared_memory.SharedMemory(create=True, size=num_slots * slot_bytes + meta)
            self.reader_index = None
            self.shm.buf[num_slots * slot_bytes:] = bytes(meta)
        else:
            name, self.reader_index = _attach
            self.shm = _attach_untracked(name)
        buf = np.frombuffer(self.shm.buf, dtype=np.uint8)
        self._data = buf[:num_slots * slot_bytes].reshape(num_slots, slot_bytes)
        self._flags = buf[num_slots * slot_bytes:].reshape(num_slots, 1 + num_readers)
        self._idx = 0
        self.spin_s = 0.005
        self.check: Callable[[], None] | None = None
        self._lock = threading.Lock()  # only for _fence

    def _fence(self) -> None:
        """A full memory barrier (a lock's atomic acquire and release), so the flag stores
        below are seen after the data stores they publish."""
        self._lock.acquire()
        self._lock.release()

    @property
    def max_message_bytes(self) -> int:
        return self.slot_bytes - _LEN_BYTES

    def handle(self) -> str:
        return f"{self.shm.name}:{self.num_readers}:{self.num_slots}:{self.slot_bytes}"

    @classmethod
    def attach(cls, handle: str, reader_index: int) -> ShmMessageQueue:
        name, n, slots, size = handle.rsplit(":", 3)
        return cls(int(n), int(slots), int(size), _attach=(name, reader_index))

    def enqueue(self, *parts) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        if n > self.max_message_bytes:
            raise ValueError(f"message of {n} bytes exceeds the slot's {self.max_message_bytes}")
        i = self._idx
        flags = self._flags[i]
        w = SpinWaiter(self.spin_s, self.check)
        while flags[0] and not flags[1:].all():  # written and not yet read by every reader
            w.wait()
        flags[0] = 0
        self._fence()
        slot = self._data[i]
        slot[:_LEN_BYTES] = np.frombuffer(np.int64(n).tobytes(), dtype=np.uint8)
        o = _LEN_BYTES
        for v in views:
            slot[o:o + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            o += v.nbytes
        flags[1:] = 0
        self._fence()
        flags[0] = 1
        self._idx = (i + 1) % self.num_slots

    def dequeue(self) -> np.ndarray:
        i, r = self._idx, 1 + self.reader_index
        flags = self._flags[i]
        w = SpinWaiter(self.spin_s, self.check)
        while not flags[0] or flags[r]:
            w.wait()
        self._fence()
        slot = self._data[i]
        n = int(slot[:_LEN_BYTES].view(np.int64)[0])
        out = slot[_LEN_BYTES:_LEN_BYTES + n].copy()
        self._fence()
        flags[r] = 1
        self._idx = (i + 1) % self.num_slots
        return out

    def close(self) -> None:
        """Release the mapping; the writer also removes the segment. Idempotent."""
        if self.shm is None:
            return
        self._data = self._flags = None
        try:
            self.shm.close()
        except BufferError:  # an array still views the buffer; the mapping goes with the process
            pass
        if self.reader_index is None:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        self.shm = None

"""The shared-memory step queue (pyengine/distributed/shm_broadcast.py): one writer, N
readers, messages in order through a ring smaller than the stream, the writer waiting
(and giving up through ``check``) when a reader falls a ring behind."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from pyengine.distributed.shm_broadcast import ShmMessageQueue


def _read(handle, index, n, out):
    q = ShmMessageQueue.attach(handle, index)
    try:
        out.extend(q.dequeue().tobytes() for _ in range(n))
    finally:
        q.close()


@pytest.mark.timeout(60)
def test_messages_reach_every_reader_in_order():
    w = ShmMessageQueue(num_readers=2, num_slots=3, slot_bytes=256)
    msgs = [np.arange(i % 7, dtype=np.int64).tobytes() + bytes([i % 256]) * (i % 50) for i in range(40)]
    outs = [[], []]
    readers = [threading.Thread(target=_read, args=(w.handle(), r, len(msgs), outs[r])) for r in (0, 1)]
    for t in readers:
        t.start()
    for m in msgs:  # 40 messages through 3 slots: the writer waits for both readers
        head, tail = m[:len(m) // 2], m[len(m) // 2:]
        w.enqueue(np.frombuffer(head, dtype=np.uint8), np.frombuffer(tail, dtype=np.uint8))
    for t in readers:
        t.join(30)
    w.close()
    assert outs == [msgs, msgs]


@pytest.mark.timeout(60)
def test_full_ring_calls_check_and_large_messages_are_refused():
    w = ShmMessageQueue(num_readers=1, num_slots=2, slot_bytes=64)
    with pytest.raises(ValueError, match="exceeds"):
        w.enqueue(np.zeros(w.max_message_bytes + 1, dtype=np.uint8))
    w.enqueue(np.zeros(w.max_message_bytes, dtype=np.uint8))
    w.enqueue(np.ones(3, dtype=np.uint8))
    calls = []

    def dead():
        calls.append(1)
        raise RuntimeError("reader died")
    w.check = dead
    with pytest.raises(RuntimeError, match="reader died"):  # nobody reads: the ring stays full
        w.enqueue(np.ones(1, dtype=np.uint8))
    assert calls
    r = ShmMessageQueue.attach(w.handle(), 0)
    assert r.dequeue().nbytes == w.max_message_bytes and r.dequeue().tolist() == [1, 1, 1]
    w.enqueue(np.full(2, 9, dtype=np.uint8))  # a slot is free again
    assert r.dequeue().tolist() == [9, 9]
    r.close()
    w.close()

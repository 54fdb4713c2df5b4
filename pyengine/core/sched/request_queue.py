"""Waiting queues for the two scheduling policies (mirrors vllm/v1/core/sched/request_queue.py)."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pyengine.config import SchedulingPolicy
from pyengine.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self):
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """Ordered by (priority, arrival_time): lower value first, ties by arrival."""

    def __init__(self):
        self._heap: list[Request] = []

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, r)

    prepend = add  # a preempted request keeps its original (priority, arrival) place

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, r: Request) -> None:
        self._heap.remove(r)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy | str):
    """Raises ValueError for an unknown policy."""
    if SchedulingPolicy.parse(policy) is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()

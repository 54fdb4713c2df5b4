"""Waiting queues: FCFS (arrival order, prepend to the front) and priority
((priority, arrival) order, ties by arrival), remove, unknown policy."""
import pytest

from pyengine.config import SchedulingPolicy
from pyengine.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from pyengine.request import Request
from pyengine.sampling_params import SamplingParams


def R(rid, priority=0, arrival=0.0):
    return Request(rid, [1, 2, 3], SamplingParams(), 16, arrival_time=arrival, priority=priority)


def drain(q):
    out = []
    while len(q):
        out.append(q.pop().request_id)
    return out


def test_fcfs_order_and_prepend():
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue)
    # arrival times deliberately out of order: FCFS is insertion order
    a, b, c = R("a", arrival=3.0), R("b", arrival=1.0), R("c", arrival=2.0, priority=-5)
    for r in (a, b, c):
        q.add(r)
    assert len(q) == 3
    assert q.peek() is a
    assert [r.request_id for r in q] == ["a", "b", "c"]
    p = R("p", arrival=9.0)
    q.prepend(p)
    assert q.peek() is p
    assert drain(q) == ["p", "a", "b", "c"]


def test_fcfs_remove():
    q = FCFSRequestQueue()
    rs = [R(x) for x in "abcd"]
    for r in rs:
        q.add(r)
    q.remove(rs[2])
    assert [r.request_id for r in q] == ["a", "b", "d"]
    q.remove(rs[0])
    assert q.peek() is rs[1]
    assert drain(q) == ["b", "d"]
    with pytest.raises(ValueError):
        q.remove(rs[0])


def test_priority_order_ties_by_arrival():
    q = create_request_queue("priority")
    assert isinstance(q, PriorityRequestQueue)
    specs = [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", 2, 0.5), ("e", -1, 5.0), ("f", 1, 0.1)]
    for rid, prio, arr in specs:
        q.add(R(rid, prio, arr))
    assert q.peek().request_id == "e"
    assert [r.request_id for r in q] == ["e", "c", "b", "a", "f", "d"]
    assert len(q) == 6
    assert drain(q) == ["e", "c", "b", "a", "f", "d"]


def test_priority_ties_by_arrival_not_insertion():
    q = PriorityRequestQueue()
    late, early = R("late", 3, 10.0), R("early", 3, 1.0)
    q.add(late)
    q.add(early)
    assert q.pop() is early
    assert q.pop() is late


def test_priority_prepend_keeps_place():
    q = PriorityRequestQueue()
    a, b, c = R("a", 0, 1.0), R("b", 1, 0.0), R("c", 0, 2.0)
    q.add(a)
    q.add(c)
    q.prepend(b)  # preempted low-priority request does not jump the queue
    assert drain(q) == ["a", "c", "b"]
    q.add(c)
    q.prepend(a)  # an earlier arrival of the same priority goes first
    assert drain(q) == ["a", "c"]


def test_priority_remove_keeps_heap_order():
    q = PriorityRequestQueue()
    rs = [R(f"r{i}", prio, arr) for i, (prio, arr) in
          enumerate([(3, 0.0), (1, 1.0), (2, 2.0), (0, 3.0), (1, 0.5), (2, 0.1)])]
    for r in rs:
        q.add(r)
    q.remove(rs[3])  # the head
    q.remove(rs[2])
    assert drain(q) == ["r4", "r1", "r5", "r0"]


def test_unknown_policy():
    with pytest.raises(ValueError) as ei:
        create_request_queue("lifo")
    msg = str(ei.value)
    assert "fcfs" in msg and "priority" in msg and "lifo" in msg


def test_scheduling_policy_enum_takes_the_user_strings():
    assert SchedulingPolicy.parse("priority") is SchedulingPolicy.PRIORITY
    assert SchedulingPolicy.parse(SchedulingPolicy.FCFS) is SchedulingPolicy.FCFS
    assert SchedulingPolicy.PRIORITY == "priority"
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError, match="valid policies: fcfs, priority"):
        SchedulingPolicy.parse("lifo")

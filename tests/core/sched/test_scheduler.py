"""Scheduler and AsyncScheduler with a fake model runner: token budget, chunked prefill,
decode-before-prefill, max_num_seqs, preemption (fcfs / priority), stop conditions,
aborts, async placeholders and stale outputs, and no KV block leak."""
import random
from collections import defaultdict, deque
from types import SimpleNamespace

import pytest
import torch

from pyengine.config import EngineConfig
from pyengine.core.sched.async_scheduler import AsyncScheduler
from pyengine.core.sched.scheduler import Scheduler
from pyengine.request import Request, RequestStatus
from pyengine.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_config(**kw) -> EngineConfig:
    base = dict(model="tiny", tokenizer="tiny", served_model_name="tiny", hf_config=None,
                dtype=torch.float32, device=torch.device("cpu"), max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=64, block_size=BS, num_gpu_blocks_override=None,
                kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, enable_prefix_caching=True,
                enable_chunked_prefill=True, scheduling_policy="fcfs", seed=0, async_scheduling=False,
                enforce_eager=True, attention_backend="torch")
    base.update(kw)
    return EngineConfig(**base)


def make_sched(num_blocks=64, cls=Scheduler, **kw):
    return cls(make_config(**kw), num_blocks)


_prompt_base = [0]


def make_req(rid, prompt_len=None, prompt=None, max_tokens=8, priority=0, arrival=None, **sp):
    if prompt is None:
        # distinct tokens per request so that prefix caching does not interfere
        _prompt_base[0] += 1
        prompt = [10_000 * _prompt_base[0] + i for i in range(prompt_len)]
    sp.setdefault("max_tokens", max_tokens)
    sp.setdefault("all_stop_token_ids", {EOS})
    params = SamplingParams(**sp)
    return Request(rid, prompt, params, max_tokens,
                   arrival_time=float(len(rid)) if arrival is None else arrival, priority=priority)


def tok_for(s):
    """Deterministic fake 'greedy' token: a function of the position sampled."""
    return 1000 + s.num_computed_tokens + s.num_new_tokens


def runner_output(so, token_fn=tok_for):
    return SimpleNamespace(sampled_token_ids=[token_fn(s) for s in so.scheduled if s.sample], logprobs=None)


def step(sched, token_fn=tok_for):
    so = sched.schedule()
    check_output(sched, so)
    out = sched.update_from_output(so, runner_output(so, token_fn))
    return so, out


def check_output(sched, so):
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert so.total_num_scheduled_tokens == sum(s.num_new_tokens for s in so.scheduled)
    assert len(so.scheduled) <= sched.max_num_seqs
    assert len({id(s.request) for s in so.scheduled}) == len(so.scheduled)
    for s in so.scheduled:
        assert s.num_new_tokens > 0
        assert s.request.status == RequestStatus.RUNNING
        assert len(s.block_ids) * BS >= s.num_computed_tokens + s.num_new_tokens
        assert 0 not in s.block_ids


def sched_of(so):
    return [(s.request.request_id, s.num_new_tokens) for s in so.scheduled]


def assert_no_leak(sched):
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert not sched.running and not len(sched.waiting) and not sched.requests
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not any(kv.req_to_blocks.values())
    assert pool.get_usage() == 0.0


def check_ref_counts(sched):
    kv = sched.kv_cache_manager
    holders = defaultdict(int)
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] += 1
    for b in kv.block_pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id]
        assert (b.block_id in kv.block_pool.free_queue) == (b.ref_cnt == 0)
    # only running requests hold blocks
    for rid, blocks in kv.req_to_blocks.items():
        if blocks:
            assert sched.requests[rid].status == RequestStatus.RUNNING


class Driver:
    """Runs a scheduler like EngineCore does (batch queue depth 1 = sync, 2 = async),
    collecting each request's streamed tokens and finish state."""

    def __init__(self, sched, depth=1, token_fn=tok_for):
        self.sched, self.depth, self.token_fn = sched, depth, token_fn
        self.q = deque()
        self.tokens = defaultdict(list)
        self.finish = {}
        self.outputs_per_req = defaultdict(int)

    def collect(self, outs):
        if outs is None:
            return
        for o in outs.outputs:
            assert o.request_id not in self.finish, f"output after finish for {o.request_id}"
            self.tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                self.finish[o.request_id] = (o.finish_reason, o.stop_reason)

    def step(self):
        sched = self.sched
        if len(self.q) < self.depth and sched.has_unfinished_requests():
            so = sched.schedule()
            check_output(sched, so)
            check_ref_counts(sched)
            if not so.is_empty:
                self.q.append((so, runner_output(so, self.token_fn)))
                if len(self.q) < self.depth:
                    self.collect(sched.take_pending_outputs())
                    return True
        if not self.q:
            self.collect(sched.take_pending_outputs())
            assert not sched.has_unfinished_requests(), "nothing scheduled, nothing in flight: stuck"
            return False
        so, ro = self.q.popleft()
        self.collect(sched.update_from_output(so, ro))
        check_ref_counts(sched)
        return True

    def run(self, max_steps=2000, on_step=None):
        for i in range(max_steps):
            if on_step is not None:
                on_step(i)
            if not self.step() and not self.sched.has_requests() and not self.q:
                return
        raise AssertionError("did not finish")


def expected_tokens(prompt_len, n):
    return [1000 + prompt_len + k for k in range(n)]


# ---- budget, chunked prefill, ordering ----------------------------------------------

def test_token_budget_respected_and_prefills_chunked():
    sched = make_sched(max_num_batched_tokens=16)
    for rid in ("a", "b", "c"):
        sched.add_request(make_req(rid, 10, max_tokens=3))
    so, _ = step(sched)
    assert sched_of(so) == [("a", 10), ("b", 6)]
    assert [s.sample for s in so.scheduled] == [True, False]
    assert so.total_num_scheduled_tokens == 16
    so, _ = step(sched)
    # decode of a, rest of b's prefill, c's prompt chunk
    assert sched_of(so) == [("a", 1), ("b", 4), ("c", 10)]
    assert so.total_num_scheduled_tokens == 15
    d = Driver(sched)
    d.run()
    assert_no_leak(sched)


def test_chunked_prefill_samples_only_on_last_chunk():
    sched = make_sched(max_num_batched_tokens=16)
    r = make_req("a", 40, max_tokens=2)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        so, out = step(sched)
        (s,) = so.scheduled
        chunks.append((s.num_computed_tokens, s.num_new_tokens, s.sample))
        if not s.sample:
            assert out.outputs == []
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert r.output_token_ids == [1040]
    so, out = step(sched)
    assert sched_of(so) == [("a", 1)] and so.scheduled[0].sample
    assert out.outputs[0].finish_reason == "length"
    assert r.output_token_ids == [1040, 1041]
    assert_no_leak(sched)


@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_long_prefill_token_threshold_shares_the_budget(cls, depth):
    # vLLM's long_prefill_token_threshold: a prefill advances by at most that many tokens
    # a step, so concurrent long prompts move together and a short one is not starved
    sched = make_sched(cls=cls, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    for rid, plen in (("a", 40), ("b", 40), ("c", 5)):
        sched.add_request(make_req(rid, plen, max_tokens=3))
    so = sched.schedule()
    assert sched_of(so) == [("a", 8), ("b", 8), ("c", 5)]
    sched.update_from_output(so, runner_output(so))
    so = sched.schedule()
    assert [(rid, n) for rid, n in sched_of(so) if rid != "c"] == [("a", 8), ("b", 8)]
    sched.update_from_output(so, runner_output(so))
    d = Driver(sched, depth=depth)
    d.run()
    assert_no_leak(sched)
    assert d.tokens["a"][-2:] == expected_tokens(40, 3)[-2:]  # decodes unaffected (1 token < threshold)


def test_no_chunked_prefill_waits_for_budget():
    sched = make_sched(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_req("a", 10, max_tokens=2))
    sched.add_request(make_req("b", 10, max_tokens=2))
    so, _ = step(sched)
    assert sched_of(so) == [("a", 10)]  # b would need a chunk: waits
    so, _ = step(sched)
    assert sched_of(so) == [("a", 1), ("b", 10)]
    Driver(sched).run()
    assert_no_leak(sched)


def test_decodes_before_waiting_prefills_mixed_in_one_step():
    sched = make_sched(max_num_batched_tokens=32)
    sched.add_request(make_req("a", 8, max_tokens=5))
    so, _ = step(sched)
    assert so.num_prefill_reqs == 1
    sched.add_request(make_req("b", 8, max_tokens=5))
    sched.add_request(make_req("c", 30, max_tokens=5))
    so, _ = step(sched)
    assert sched_of(so)[0] == ("a", 1)
    assert sched_of(so) == [("a", 1), ("b", 8), ("c", 23)]
    assert so.num_prefill_reqs == 2
    so, _ = step(sched)
    # running first: a and b decode, c's rest of the prompt
    assert sched_of(so) == [("a", 1), ("b", 1), ("c", 7)]
    Driver(sched).run()
    assert_no_leak(sched)


def test_budget_shared_when_decodes_exhaust_it():
    sched = make_sched(max_num_batched_tokens=3)
    for rid in ("a", "b", "c", "d"):
        sched.add_request(make_req(rid, 1, max_tokens=4))
    so, _ = step(sched)
    assert sched_of(so) == [("a", 1), ("b", 1), ("c", 1)]
    so, _ = step(sched)
    assert sched_of(so) == [("a", 1), ("b", 1), ("c", 1)]  # d waits: running first
    d = Driver(sched)
    d.run()
    assert {r: len(t) for r, t in d.tokens.items()} == {"a": 2, "b": 2, "c": 2, "d": 4}
    assert_no_leak(sched)


def test_max_num_seqs_respected():
    sched = make_sched(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_req(rid, 4, max_tokens=2))
    so, _ = step(sched)
    assert sched_of(so) == [("a", 4), ("b", 4)]
    assert len(sched.waiting) == 1
    so, _ = step(sched)  # a and b finish (max_tokens=2)
    assert sched_of(so) == [("a", 1), ("b", 1)]
    assert not sched.running
    so, _ = step(sched)
    assert sched_of(so) == [("c", 4)]
    d = Driver(sched)
    d.run()
    assert_no_leak(sched)


# ---- preemption -------------------------------------------------------------------

def test_fcfs_preempts_most_recently_admitted_and_resumes():
    # 6 usable blocks of 4: three 7-token prompts fill them (2 blocks each)
    sched = make_sched(num_blocks=7, enable_prefix_caching=False)
    reqs = [make_req(r, 7, max_tokens=4) for r in ("a", "b", "c")]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    d.step()  # prefill all: 6 blocks
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    d.step()  # decode to 9 tokens each, still 2 blocks each
    so = sched.schedule()  # a needs a 3rd block: c (last admitted) is the victim; b too
    check_output(sched, so)
    assert so.preempted_req_ids == ["c"]
    assert sched_of(so) == [("a", 1), ("b", 1)]
    c = reqs[2]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == expected_tokens(7, 2)  # tokens kept
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.waiting.peek() is c
    assert not sched.kv_cache_manager.req_to_blocks.get("c")
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    for r in reqs:
        assert d.tokens[r.request_id] == expected_tokens(7, 4)
        assert d.finish[r.request_id] == ("length", None)
    assert_no_leak(sched)


def test_fcfs_victim_is_the_request_itself_when_last():
    sched = make_sched(num_blocks=5, enable_prefix_caching=False)  # 4 usable
    a, b = make_req("a", 6, max_tokens=3), make_req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.step()  # 4 blocks used; a has 7 tokens (fits in 2 blocks), b has 9
    so = sched.schedule()
    check_output(sched, so)
    assert so.preempted_req_ids == ["b"]  # b needs a block and is the last admitted: itself
    assert sched_of(so) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and sched.running == [a]
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert d.tokens["a"] == expected_tokens(6, 3)
    assert d.tokens["b"] == expected_tokens(8, 3)
    assert_no_leak(sched)


def test_fcfs_no_admission_in_a_step_with_preemption():
    sched = make_sched(num_blocks=5, enable_prefix_caching=False)  # 4 usable
    a, b = make_req("a", 8, max_tokens=3), make_req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.step()  # 4 blocks used; both have 9 tokens
    sched.add_request(make_req("w", 1, max_tokens=1))
    so = sched.schedule()
    # a needs a 3rd block: victim b; a scheduled; b's freed block is left, but nobody is admitted
    assert so.preempted_req_ids == ["b"]
    assert sched_of(so) == [("a", 1)]
    assert so.num_prefill_reqs == 0
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert d.tokens["a"] == expected_tokens(8, 3)
    assert d.tokens["b"] == expected_tokens(8, 3)
    assert_no_leak(sched)


def test_priority_victim_is_largest_priority_then_arrival():
    sched = make_sched(num_blocks=7, scheduling_policy="priority", enable_prefix_caching=False)
    b = make_req("b", 7, max_tokens=4, priority=5, arrival=0.0)  # worst priority, admitted first
    sched.add_request(b)
    d = Driver(sched)
    d.step()
    a = make_req("a", 7, max_tokens=4, priority=0, arrival=1.0)
    c = make_req("c", 7, max_tokens=4, priority=1, arrival=2.0)  # most recently admitted
    sched.add_request(c)
    sched.add_request(a)
    d.step()
    assert [r.request_id for r in sched.running] == ["b", "a", "c"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    so = sched.schedule()  # b needs a 3rd block; fcfs would take c, priority takes b
    check_output(sched, so)
    assert so.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert sched_of(so) == [("a", 1), ("c", 1)]
    assert b.output_token_ids == expected_tokens(7, 2)
    assert sched.waiting.peek() is b
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    for r in (a, b, c):
        assert d.tokens[r.request_id] == expected_tokens(7, 4)
    assert_no_leak(sched)


def test_priority_victim_not_the_last_admitted():
    sched = make_sched(num_blocks=7, scheduling_policy="priority", enable_prefix_caching=False)
    a = make_req("a", 7, max_tokens=4, priority=0, arrival=0.0)
    b = make_req("b", 7, max_tokens=4, priority=5, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.step()
    c = make_req("c", 7, max_tokens=4, priority=1, arrival=2.0)
    sched.add_request(c)
    d.step()  # a, b decode; c prefills
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    d.step()  # a, b need a 3rd block, c does not yet: a's victim is b (not c, the latest)
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert c.num_preemptions == 0
    d.run()
    for r in (a, b, c):
        assert d.tokens[r.request_id] == expected_tokens(7, 4)
    assert_no_leak(sched)


def test_priority_victim_with_equal_priority_is_latest_arrival():
    sched = make_sched(num_blocks=7, scheduling_policy="priority", enable_prefix_caching=False)
    # admitted in (priority, arrival) order: x(0,0) y(1,1) z(1,3); victim among equals: latest arrival
    x = make_req("x", 7, max_tokens=3, priority=0, arrival=0.0)
    y = make_req("y", 7, max_tokens=3, priority=1, arrival=1.0)
    z = make_req("z", 7, max_tokens=3, priority=1, arrival=3.0)
    for r in (z, y, x):
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    assert [r.request_id for r in sched.running] == ["x", "y", "z"]
    d.step()
    so = sched.schedule()
    assert so.preempted_req_ids[0] == "z"
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert_no_leak(sched)


@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_priority_ties_do_not_preempt_each_other_forever(cls, depth):
    # The n > 1 children of one request share priority and arrival time. The victim must be
    # the one the waiting queue would admit last (ties by request id); picking the other
    # made two such siblings preempt each other forever.
    sched = make_sched(cls=cls, num_blocks=12, scheduling_policy="priority", enable_prefix_caching=False,
                       max_num_batched_tokens=8, max_model_len=48)
    prompt = list(range(100, 136))  # 9 of the 11 usable blocks each
    kids = [make_req(f"r-{i}", prompt=prompt, max_tokens=4, arrival=5.0) for i in range(2)]
    for r in kids:
        sched.add_request(r)
    d = Driver(sched, depth=depth)
    d.run(max_steps=200)
    assert all(d.tokens[r.request_id] == expected_tokens(36, 4) for r in kids)
    assert sched.num_preemptions <= 4
    assert_no_leak(sched)


def test_priority_victim_already_scheduled_this_step_is_taken_back():
    sched = make_sched(num_blocks=5, scheduling_policy="priority", enable_prefix_caching=False)
    v = make_req("v", 6, max_tokens=4, priority=5, arrival=0.0)
    sched.add_request(v)
    d = Driver(sched)
    d.step()  # v: 6 prompt tokens in 2 blocks, 7 tokens now
    r = make_req("r", 8, max_tokens=4, priority=0, arrival=1.0)
    sched.add_request(r)
    d.step()  # v decodes (fits in 2 blocks), r prefills 8 tokens (2 blocks): pool full
    assert [x.request_id for x in sched.running] == ["v", "r"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    so = sched.schedule()
    check_output(sched, so)
    # v's decode (8th token) fit and was scheduled first; r needs a 3rd block: the victim is v,
    # which must leave this step's output and give its budget back.
    assert so.preempted_req_ids == ["v"]
    assert sched_of(so) == [("r", 1)]
    assert so.total_num_scheduled_tokens == 1
    assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0
    assert v.output_token_ids == expected_tokens(6, 2)
    assert r.num_computed_tokens == 9
    assert sched.running == [r]
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert d.tokens["v"] == expected_tokens(6, 4)
    assert d.tokens["r"] == expected_tokens(8, 4)
    assert_no_leak(sched)


# ---- priority preemption of a waiting request (seat cap, KV) ----------------------------

def first_token_step(d, rid, max_steps=50):
    """Drive ``d`` until ``rid`` has a token; returns how many driver steps that took."""
    for k in range(1, max_steps + 1):
        d.step()
        if d.tokens[rid]:
            return k
    raise AssertionError(f"{rid} got no token in {max_steps} steps")


@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_priority_waiting_request_preempts_at_the_seat_cap(cls, depth):
    # Issue 17: --max-num-seqs 2, two long priority-10 requests running, a priority-0 one
    # arrives. It must not wait for a low one to finish (was: 0 preemptions, TTFT = the rest
    # of a 1000-token request).
    sched = make_sched(cls=cls, max_num_seqs=2, scheduling_policy="priority")
    lows = [make_req(f"low{i}", 6, max_tokens=40, priority=10, arrival=float(i)) for i in range(2)]
    for r in lows:
        sched.add_request(r)
    d = Driver(sched, depth=depth)
    for _ in range(4):
        d.step()
    urgent = make_req("urgent", 5, max_tokens=4, priority=0, arrival=9.0)
    sched.add_request(urgent)
    assert first_token_step(d, "urgent") <= depth
    # the victim: the lowest priority, latest arrival; the other low one kept running
    assert lows[1].num_preemptions == 1 and lows[0].num_preemptions == 0
    assert urgent.num_preemptions == 0
    d.run()
    assert d.tokens["urgent"] == expected_tokens(5, 4)
    for r in lows:  # the preempted stream is unchanged (tokens kept, recomputed)
        assert d.tokens[r.request_id] == expected_tokens(6, 40)
    assert sched.num_preemptions == 1
    assert_no_leak(sched)


@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_priority_waiting_request_preempts_when_kv_is_full(cls, depth):
    # Free seats, but every KV block is held by less urgent requests.
    sched = make_sched(cls=cls, num_blocks=9, scheduling_policy="priority", enable_prefix_caching=False)
    lows = [make_req(f"low{i}", 12, max_tokens=12, priority=5, arrival=float(i)) for i in range(2)]
    for r in lows:
        sched.add_request(r)
    d = Driver(sched, depth=depth)
    while sched.kv_cache_manager.block_pool.get_num_free_blocks():
        d.step()
    assert not any(r.num_preemptions for r in lows)
    urgent = make_req("urgent", 7, max_tokens=3, priority=1, arrival=5.0)
    sched.add_request(urgent)
    assert first_token_step(d, "urgent") <= depth
    assert lows[1].num_preemptions >= 1 and urgent.num_preemptions == 0
    d.run()
    assert d.tokens["urgent"] == expected_tokens(7, 3)
    for r in lows:
        assert d.tokens[r.request_id] == expected_tokens(12, 12)
    assert_no_leak(sched)


def test_async_priority_preemption_drops_the_victims_in_flight_token():
    # The victim's token of the batch in flight when it was preempted is dropped, as for a
    # KV preemption, and its stream is the one it would have had without the preemption.
    sched = make_sched(cls=AsyncScheduler, max_num_seqs=1, scheduling_policy="priority")
    low = make_req("low", 4, max_tokens=10, priority=3, arrival=0.0)
    sched.add_request(low)
    so1 = sched.schedule()
    sched.add_request(make_req("urgent", 4, max_tokens=2, priority=0, arrival=1.0))
    so2 = sched.schedule()  # so1 (which samples for low) is still in flight
    assert so2.preempted_req_ids == ["low"] and sched_of(so2) == [("urgent", 4)]
    out1 = sched.update_from_output(so1, runner_output(so1))
    assert out1.outputs == [] and low.output_token_ids == []
    d = Driver(sched, depth=2)
    d.q.append((so2, runner_output(so2)))
    d.run()
    assert low.output_token_ids == expected_tokens(4, 10)
    assert_no_leak(sched)


def test_equal_priority_waiting_request_does_not_preempt():
    sched = make_sched(max_num_seqs=1, scheduling_policy="priority")
    a = make_req("a", 4, max_tokens=5, priority=2, arrival=0.0)
    sched.add_request(a)
    step(sched)
    sched.add_request(make_req("b", 4, max_tokens=2, priority=2, arrival=1.0))
    sched.add_request(make_req("c", 4, max_tokens=2, priority=7, arrival=2.0))
    d = Driver(sched)
    d.run()
    assert sched.num_preemptions == 0
    assert d.tokens["a"][-1:] == expected_tokens(4, 5)[-1:]
    assert_no_leak(sched)


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = make_sched(max_num_seqs=1)
    sched.add_request(make_req("a", 4, max_tokens=5, priority=9, arrival=0.0))
    step(sched)
    sched.add_request(make_req("b", 4, max_tokens=2, priority=0, arrival=1.0))
    Driver(sched).run()
    assert sched.num_preemptions == 0
    assert_no_leak(sched)


def test_priority_preemption_skipped_when_it_cannot_make_room():
    # 6 usable blocks: a more urgent request (priority 0) holds 4, a less urgent one 2. A
    # priority-1 request needing 4 blocks could not fit even if the priority-5 one left,
    # so nobody is preempted for it.
    sched = make_sched(num_blocks=7, scheduling_policy="priority", enable_prefix_caching=False)
    top = make_req("top", 15, max_tokens=2, priority=0, arrival=0.0)
    low = make_req("low", 7, max_tokens=2, priority=5, arrival=1.0)
    sched.add_request(top)
    sched.add_request(low)
    step(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    sched.add_request(make_req("mid", 16, max_tokens=2, priority=1, arrival=2.0))
    so = sched.schedule()
    assert so.preempted_req_ids == [] and low.num_preemptions == 0
    d = Driver(sched)
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert sched.num_preemptions == 0
    assert_no_leak(sched)


# ---- no recompute thrash under KV pressure ------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_kv_pressure_preempts_each_request_at_most_once(policy, cls, depth):
    # Issue 17's workload scaled to blocks of 4: 6 long requests need 84 of the 47 usable
    # blocks, and short ones arrive every 3 steps. Short requests were preempted and
    # recomputed 4-7 times each; a preempted request now comes back only when it can finish.
    sched = make_sched(cls=cls, num_blocks=48, scheduling_policy=policy, max_num_batched_tokens=64,
                       max_model_len=128)
    longs = [make_req(f"long{i}", 4, max_tokens=50, arrival=float(i)) for i in range(6)]
    shorts = [make_req(f"short{i}", 4, max_tokens=8, arrival=10.0 + i) for i in range(20)]
    for r in longs:
        sched.add_request(r)
    pending = list(shorts)
    d = Driver(sched, depth=depth)

    def on_step(i):
        if pending and i % 3 == 0:
            sched.add_request(pending.pop(0))

    d.run(on_step=on_step)
    assert not pending
    assert sched.num_preemptions > 0  # the workload does press on the KV cache
    assert max(r.num_preemptions for r in longs + shorts) <= 1
    for r in longs + shorts:
        assert d.tokens[r.request_id] == expected_tokens(4, r.max_tokens)
    assert_no_leak(sched)


def test_preempted_request_waits_for_room_to_finish():
    # 5 usable blocks of 4. Right after b's preemption 3 blocks are free, enough for its 5
    # tokens (2 blocks); but a, running, will need 2 more blocks within the 4 steps b still
    # needs, so taking them back at once would only make b the next victim again.
    sched = make_sched(num_blocks=6, enable_prefix_caching=False)
    a, b = make_req("a", 8, max_tokens=10), make_req("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.step()
    sched._preempt(b)  # as a KV preemption would
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 3
    so = sched.schedule()
    assert sched_of(so) == [("a", 1)]  # b stays out
    d.collect(sched.update_from_output(so, runner_output(so)))
    d.run()
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert d.tokens["a"] == expected_tokens(8, 10) and d.tokens["b"] == expected_tokens(4, 4)
    assert_no_leak(sched)


def test_readmission_reserve_looks_a_bounded_number_of_steps_ahead():
    # The reserve covers the steps the preempted request still needs, at most
    # READMISSION_HORIZON_STEPS (256): a huge max_tokens must not make it wait for the whole
    # running set to reach its final length.
    from pyengine.core.sched.scheduler import READMISSION_HORIZON_STEPS

    assert READMISSION_HORIZON_STEPS == 256
    sched = make_sched(num_blocks=1000, max_model_len=2000)
    sched.add_request(make_req("a", 4, max_tokens=1500))
    step(sched)  # a: 5 tokens, 4 of them computed in 1 block
    long_q = make_req("q", 8, max_tokens=1500)
    # own: 8 + 256 tokens -> 66 blocks, 2 held after admission; a: 5 + 256 -> 66 blocks, 1 held
    assert sched._readmission_reserve(long_q, 8) == (66 - 2) + (66 - 1)
    short_q = make_req("s", 8, max_tokens=10)
    # 10 tokens + 1 prefill step: own 8 + 11 capped at its final 18 -> 5 blocks; a 5 + 11 -> 4
    assert sched._readmission_reserve(short_q, 8) == (5 - 2) + (4 - 1)


def test_unknown_policy_rejected():
    with pytest.raises(ValueError) as ei:
        make_sched(scheduling_policy="lifo")
    assert "fcfs" in str(ei.value) and "priority" in str(ei.value)


# ---- stop conditions ----------------------------------------------------------------

def run_one(req, tokens, **cfg):
    sched = make_sched(**cfg)
    sched.add_request(req)
    it = iter(tokens)
    outs = []
    while sched.has_unfinished_requests():
        so, out = step(sched, token_fn=lambda s: next(it))
        outs += out.outputs
    assert_no_leak(sched)
    return outs


def test_stop_on_eos():
    r = make_req("a", 4, max_tokens=10)
    outs = run_one(r, [5, 6, EOS, 7])
    assert [o.new_token_ids for o in outs] == [[5], [6], [EOS]]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert all(o.finish_reason is None for o in outs[:-1])
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_id_sets_stop_reason():
    r = make_req("a", 4, max_tokens=10, stop_token_ids=[9])
    outs = run_one(r, [5, 9, 7])
    assert outs[-1].new_token_ids == [9]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 9


def test_eos_ignored_when_not_in_all_stop_token_ids():
    r = make_req("a", 4, max_tokens=3, all_stop_token_ids=set())  # ignore_eos
    outs = run_one(r, [EOS, EOS, EOS])
    assert [o.new_token_ids for o in outs] == [[EOS]] * 3
    assert outs[-1].finish_reason == "length"


def test_min_tokens_delays_stop():
    r = make_req("a", 4, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    outs = run_one(r, [EOS, 9, EOS, 5])
    assert [o.new_token_ids[0] for o in outs] == [EOS, 9, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None


def test_max_tokens_length():
    r = make_req("a", 4, max_tokens=3)
    outs = run_one(r, [5, 6, 7, 8])
    assert len(outs) == 3
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_length():
    r = make_req("a", 8, max_tokens=100)
    outs = run_one(r, [5, 6, 7, 8], max_model_len=10)
    assert len(outs) == 2
    assert outs[-1].finish_reason == "length"
    assert r.num_tokens == 10


def test_num_cached_tokens_reported_on_first_output():
    sched = make_sched()
    prompt = list(range(100, 110))
    sched.add_request(make_req("a", prompt=prompt, max_tokens=2))
    d = Driver(sched)
    d.run()
    sched.add_request(make_req("b", prompt=prompt, max_tokens=2))
    so, out = step(sched)
    assert sched_of(so) == [("b", 2)]  # 8 cached tokens, 2 recomputed
    assert out.outputs[0].num_cached_tokens == 8
    stats = out.scheduler_stats
    assert stats.prefix_cache_hits == 8
    assert stats.prefix_cache_queries == 20
    so, out = step(sched)
    assert out.outputs[0].num_cached_tokens == 0
    assert_no_leak(sched)


# ---- aborts ------------------------------------------------------------------------

def test_abort_waiting_and_running():
    sched = make_sched(max_num_seqs=1)
    a, b = make_req("a", 9, max_tokens=10), make_req("b", 9, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < 63
    sched.finish_requests(["b", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.running and not len(sched.waiting)
    outs = sched.take_pending_outputs()
    assert outs is not None
    got = {o.request_id: o for o in outs.outputs}
    assert set(got) == {"a", "b"}
    for o in got.values():
        assert o.finish_reason == "abort" and o.new_token_ids == [] and o.finished
    assert sched.take_pending_outputs() is None
    assert_no_leak(sched)
    assert not sched.has_requests()
    # aborting again is a no-op
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.take_pending_outputs() is None


def test_abort_preempted_request():
    sched = make_sched(num_blocks=5, enable_prefix_caching=False)
    a, b = make_req("a", 8, max_tokens=3), make_req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    so, _ = step(sched)
    assert so.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    d = Driver(sched)
    d.collect(sched.take_pending_outputs())
    assert d.finish["b"] == ("abort", None)
    d.run()
    assert_no_leak(sched)


def test_abort_output_delivered_with_next_step_outputs():
    sched = make_sched()
    sched.add_request(make_req("a", 4, max_tokens=5))
    sched.add_request(make_req("b", 4, max_tokens=5))
    step(sched)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    so, out = step(sched)
    assert sched_of(so) == [("a", 1)]
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("b", "abort"), ("a", None)]
    assert "b" in so.finished_req_ids


# ---- async scheduling --------------------------------------------------------------

def test_async_placeholder_feeds_one_token():
    sched = make_sched(cls=AsyncScheduler)
    r = make_req("a", 5, max_tokens=4)
    sched.add_request(r)
    so1 = sched.schedule()
    (s1,) = so1.scheduled
    assert (s1.num_new_tokens, s1.sample, s1.placeholder_input) == (5, True, False)
    assert r.num_output_placeholders == 1
    so2 = sched.schedule()  # before so1's token is known
    (s2,) = so2.scheduled
    assert s2.num_new_tokens == 1 and s2.sample and s2.placeholder_input
    assert s2.num_computed_tokens == 5
    assert r.num_output_placeholders == 2
    out1 = sched.update_from_output(so1, runner_output(so1))
    assert [o.new_token_ids for o in out1.outputs] == [[1005]]
    assert r.num_output_placeholders == 1
    so3 = sched.schedule()
    (s3,) = so3.scheduled
    assert s3.placeholder_input and s3.num_computed_tokens == 6
    out2 = sched.update_from_output(so2, runner_output(so2))
    assert out2.outputs[0].new_token_ids == [1006]
    out3 = sched.update_from_output(so3, runner_output(so3))
    assert out3.outputs[0].new_token_ids == [1007]
    assert r.num_output_placeholders == 0
    d = Driver(sched, depth=2)
    d.run()
    assert r.output_token_ids == expected_tokens(5, 4)
    assert_no_leak(sched)


def test_async_placeholders_count_against_max_tokens():
    sched = make_sched(cls=AsyncScheduler)
    r = make_req("a", 5, max_tokens=1)
    sched.add_request(r)
    so1 = sched.schedule()
    assert sched_of(so1) == [("a", 5)]
    so2 = sched.schedule()
    assert so2.is_empty and so2.scheduled == []
    out = sched.update_from_output(so1, runner_output(so1))
    assert out.outputs[0].finish_reason == "length"
    assert_no_leak(sched)


def test_async_placeholders_count_against_max_tokens_2():
    sched = make_sched(cls=AsyncScheduler)
    r = make_req("a", 5, max_tokens=2)
    sched.add_request(r)
    so1 = sched.schedule()
    so2 = sched.schedule()
    assert sched_of(so2) == [("a", 1)]
    so3 = sched.schedule()
    assert so3.is_empty
    sched.update_from_output(so1, runner_output(so1))
    assert sched.schedule().is_empty  # the second token is still in flight
    out = sched.update_from_output(so2, runner_output(so2))
    assert out.outputs[0].finish_reason == "length"
    assert r.output_token_ids == [1005, 1006]
    assert_no_leak(sched)


def test_async_placeholders_count_against_max_model_len():
    sched = make_sched(cls=AsyncScheduler, max_model_len=7)
    r = make_req("a", 5, max_tokens=100)
    sched.add_request(r)
    so1 = sched.schedule()
    so2 = sched.schedule()
    assert sched_of(so2) == [("a", 1)]
    assert sched.schedule().is_empty  # 5 + 2 placeholders = max_model_len
    sched.update_from_output(so1, runner_output(so1))
    out = sched.update_from_output(so2, runner_output(so2))
    assert out.outputs[0].finish_reason == "length"
    assert r.num_tokens == 7
    assert_no_leak(sched)


def test_async_output_of_preempted_request_dropped():
    sched = make_sched(cls=AsyncScheduler, num_blocks=5, enable_prefix_caching=False)
    a, b = make_req("a", 8, max_tokens=3), make_req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()
    assert sched_of(so1) == [("a", 8), ("b", 8)]
    so2 = sched.schedule()  # a's placeholder token needs a 3rd block: b is preempted
    assert so2.preempted_req_ids == ["b"]
    assert sched_of(so2) == [("a", 1)]
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    out1 = sched.update_from_output(so1, runner_output(so1))
    assert [o.request_id for o in out1.outputs] == ["a"]  # b's token is stale
    assert b.output_token_ids == []
    assert a.output_token_ids == [1008]
    d = Driver(sched, depth=2)
    d.q.append((so2, runner_output(so2)))
    d.run()
    assert a.output_token_ids == expected_tokens(8, 3)
    assert b.output_token_ids == expected_tokens(8, 3)
    assert_no_leak(sched)


def test_async_kv_preemption_drops_the_in_flight_token():
    sched = make_sched(cls=AsyncScheduler, num_blocks=5, enable_prefix_caching=False)
    a, b = make_req("a", 8, max_tokens=3), make_req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()
    so2 = sched.schedule()  # b preempted while so1 (which samples for b) is in flight
    assert so2.preempted_req_ids == ["b"]
    sched.update_from_output(so1, runner_output(so1))
    assert b.output_token_ids == []  # its token of so1 dropped
    d = Driver(sched, depth=2)
    d.q.append((so2, runner_output(so2)))
    d.run()
    assert b.output_token_ids == expected_tokens(8, 3)
    assert_no_leak(sched)


def test_async_output_of_aborted_request_dropped():
    sched = make_sched(cls=AsyncScheduler)
    a, b = make_req("a", 4, max_tokens=5), make_req("b", 4, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()
    so2 = sched.schedule()
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    out1 = sched.update_from_output(so1, runner_output(so1))
    assert [(o.request_id, o.finish_reason) for o in out1.outputs] == [("b", "abort"), ("a", None)]
    out2 = sched.update_from_output(so2, runner_output(so2))
    assert [o.request_id for o in out2.outputs] == ["a"]
    assert b.output_token_ids == []
    d = Driver(sched, depth=2)
    d.run()
    assert_no_leak(sched)


def test_async_output_of_finished_request_dropped():
    sched = make_sched(cls=AsyncScheduler)
    r = make_req("a", 4, max_tokens=10)
    sched.add_request(r)
    so1 = sched.schedule()
    so2 = sched.schedule()
    out1 = sched.update_from_output(so1, runner_output(so1, lambda s: EOS))
    assert out1.outputs[0].finish_reason == "stop"
    out2 = sched.update_from_output(so2, runner_output(so2))
    assert out2.outputs == []
    assert r.output_token_ids == [EOS]
    assert_no_leak(sched)


# ---- everything at once: no leak, streams unchanged ---------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_random_mix_no_leak_and_streams_unchanged(policy, cls, depth, seed):
    rng = random.Random(seed)
    sched = make_sched(cls=cls, num_blocks=14, max_num_batched_tokens=rng.choice([8, 16, 32]),
                       max_num_seqs=rng.choice([3, 8]), scheduling_policy=policy)
    shared = [[7000 + i for i in range(rng.randint(4, 12))] for _ in range(2)]
    pending = []
    for i in range(14):
        plen = rng.randint(1, 20)
        prompt = (rng.choice(shared) + [rng.randrange(3, 900) for _ in range(plen)])[:24] \
            if rng.random() < 0.6 else [rng.randrange(3, 900) for _ in range(plen)]
        r = make_req(f"r{i}", prompt=prompt, max_tokens=rng.randint(1, 12),
                     priority=rng.randint(0, 3), arrival=float(i))
        pending.append(r)
    reqs = list(pending)
    aborted = set()
    d = Driver(sched, depth=depth)

    def on_step(i):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.08 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            aborted.add(rid)
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if not sched.requests and pending:
            sched.add_request(pending.pop(0))

    d.run(on_step=on_step)
    assert not pending
    assert_no_leak(sched)
    for r in reqs:
        rid = r.request_id
        assert rid in d.finish
        if d.finish[rid][0] == "abort":
            assert rid in aborted
            assert d.tokens[rid] == expected_tokens(len(r.prompt_token_ids), len(d.tokens[rid]))
        else:
            assert d.finish[rid] == ("length", None)
            assert d.tokens[rid] == expected_tokens(len(r.prompt_token_ids), r.max_tokens)
    stats = sched.make_stats()
    assert stats.num_free_blocks == stats.num_gpu_blocks == 13
    assert stats.kv_cache_usage == 0.0


# ---- per-request error path: one request's failure ends only that request ------------

def _fail_for(rid, fn, when=lambda req: True):
    """Wrap ``fn(req, ...)`` so that it raises for request ``rid`` once ``when(req)`` holds."""
    def wrapped(req, *a, **k):
        if req.request_id == rid and when(req):
            raise RuntimeError(f"injected failure for {rid}")
        return fn(req, *a, **k)
    return wrapped


@pytest.mark.parametrize("where", ["admission", "running", "update"])
@pytest.mark.parametrize("cls,depth", [(Scheduler, 1), (AsyncScheduler, 2)])
def test_one_request_failing_ends_only_that_request(where, cls, depth):
    sched = make_sched(cls=cls, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4)
    kv = sched.kv_cache_manager
    reqs = [make_req(f"r{i}", 10 + i, max_tokens=6) for i in range(4)]
    if where == "admission":  # while the waiting request is admitted (prefix-cache lookup)
        kv.get_computed_blocks = _fail_for("r1", kv.get_computed_blocks)
    elif where == "running":  # while a running request gets its next slots (after 2 tokens)
        kv.allocate_slots = _fail_for("r2", kv.allocate_slots, lambda r: r.num_output_tokens >= 2)
    else:  # while its sampled token is checked against the stop conditions
        sched._check_stop = _fail_for("r3", sched._check_stop, lambda r: r.num_output_tokens == 3)
    failed = {"admission": "r1", "running": "r2", "update": "r3"}[where]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched, depth=depth)
    d.run()
    assert_no_leak(sched)
    for r in reqs:
        if r.request_id == failed:
            assert d.finish[failed] == ("error", None) and r.status == RequestStatus.FINISHED_ERROR
            assert len(d.tokens[failed]) < 6
        else:
            assert d.finish[r.request_id] == ("length", None)
            assert d.tokens[r.request_id] == expected_tokens(len(r.prompt_token_ids), 6)


def test_failed_request_output_carries_the_error():
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    sched.fail_request("a", ValueError("bad state"))
    sched.fail_request("never-added", KeyError("k"))
    outs = {o.request_id: o for o in sched.take_pending_outputs().outputs}
    assert outs["a"].finish_reason == "error" and outs["a"].error == "ValueError: bad state"
    assert outs["never-added"].finish_reason == "error" and "KeyError" in outs["never-added"].error
    assert_no_leak(sched)


def test_duplicate_request_id_refused():
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    with pytest.raises(ValueError, match="already in the engine core"):
        sched.add_request(make_req("a", 5))
    assert len(sched.waiting) == 1


def test_first_output_carries_first_scheduled_time_and_steps_their_tokens():
    """The engine core's side of the queue / prefill metrics and of iteration_tokens_total:
    the first admission time goes out once, with the first token (a chunked prefill's
    earlier steps give no output); every step's stats say how many tokens it ran."""
    import time

    sched = make_sched(max_num_batched_tokens=32)
    r = make_req("r", prompt_len=40, max_tokens=3)
    sched.add_request(r)
    t0 = time.monotonic()
    so, out = step(sched)  # 32 of 40 prompt tokens: no sample
    assert r.first_scheduled_time is not None and r.first_scheduled_time >= t0
    admitted = r.first_scheduled_time
    assert out.outputs == [] and out.scheduler_stats.num_batched_tokens == 32
    so, out = step(sched)  # the rest of the prompt and the first token
    (o,) = out.outputs
    assert o.first_scheduled_time == admitted and out.scheduler_stats.num_batched_tokens == 8
    so, out = step(sched)
    (o,) = out.outputs
    assert o.first_scheduled_time is None and out.scheduler_stats.num_batched_tokens == 1
    assert sched.make_stats().num_batched_tokens == 0  # not a step's report

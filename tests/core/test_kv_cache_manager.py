"""KVCacheManager: prefix hits in whole blocks (never the whole prompt), stats in tokens,
shared blocks and ref counts, all-or-nothing allocate_slots, free back to baseline."""
import random

import pytest

from pyengine.core.kv_cache_manager import KVCacheManager
from pyengine.request import Request
from pyengine.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens, arrival_time=0.0)


def admit(kv, r):
    """Admit as the scheduler does: prefix hit, allocate the rest, mark computed."""
    hits, n_hit = kv.get_computed_blocks(r)
    n = r.num_tokens - n_hit
    ok = kv.allocate_slots(r, n, hits)
    if ok:
        r.num_computed_tokens = n_hit + n
    return ok, hits, n_hit


def test_no_hit_on_empty_cache_and_stats_in_tokens():
    kv = KVCacheManager(16, BS, enable_caching=True)
    r = req("a", range(10))
    blocks, n = kv.get_computed_blocks(r)
    assert blocks == [] and n == 0
    assert kv.prefix_cache_stats.queries == 10
    assert kv.prefix_cache_stats.hits == 0


@pytest.mark.parametrize("prompt_b,expected_hit_blocks", [
    (list(range(10)), 2),             # same 10-token prompt: 2 full blocks (8 tokens)
    (list(range(9)) + [99], 2),        # shares 9 tokens -> 2 whole blocks
    (list(range(7)) + [99, 98], 1),    # shares 7 tokens -> 1 whole block
    (list(range(8)), 1),               # exactly 2 blocks: the last one is recomputed
    (list(range(4)), 0),               # one block exactly: never the whole prompt
    (list(range(5)), 1),
    ([99] + list(range(1, 10)), 0),    # differs in the first block: chained hashes miss
])
def test_prefix_hit_whole_blocks_never_full_prompt(prompt_b, expected_hit_blocks):
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = req("a", range(10))
    ok, _, _ = admit(kv, a)
    assert ok
    q0 = kv.prefix_cache_stats.queries
    h0 = kv.prefix_cache_stats.hits
    b = req("b", prompt_b)
    blocks, n = kv.get_computed_blocks(b)
    assert len(blocks) == expected_hit_blocks
    assert n == expected_hit_blocks * BS
    assert n < len(prompt_b)
    assert [x.block_id for x in blocks] == kv.get_block_ids("a")[:expected_hit_blocks]
    assert kv.prefix_cache_stats.queries - q0 == len(prompt_b)
    assert kv.prefix_cache_stats.hits - h0 == expected_hit_blocks * BS


def test_partial_block_not_cached():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = req("a", range(6))
    admit(kv, a)
    # only one full block of a is cached; b shares all 6 tokens of a plus more
    b = req("b", list(range(6)) + [50, 51, 52])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and len(blocks) == 1


def test_shared_prefix_shares_blocks_and_ref_counts():
    kv = KVCacheManager(16, BS, enable_caching=True)
    base = kv.block_pool.get_num_free_blocks()
    a = req("a", range(10))
    admit(kv, a)
    assert len(kv.get_block_ids("a")) == 3
    b = req("b", list(range(9)) + [77, 78, 79])
    ok, hits, n_hit = admit(kv, b)
    assert ok and n_hit == 8
    ida, idb = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert idb[:2] == ida[:2]
    assert idb[2] != ida[2]
    assert len(idb) == 3
    for bid in ida[:2]:
        assert kv.block_pool.blocks[bid].ref_cnt == 2
    assert kv.block_pool.blocks[ida[2]].ref_cnt == 1
    assert kv.block_pool.get_num_free_blocks() == base - 4
    kv.free(a)
    for bid in ida[:2]:
        assert kv.block_pool.blocks[bid].ref_cnt == 1
    assert kv.block_pool.get_num_free_blocks() == base - 3
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == base


def test_hit_on_freed_cached_blocks_revives_them():
    kv = KVCacheManager(16, BS, enable_caching=True)
    base = kv.block_pool.get_num_free_blocks()
    a = req("a", range(12))
    admit(kv, a)
    ida = list(kv.get_block_ids("a"))
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == base
    b = req("b", range(12))
    ok, hits, n_hit = admit(kv, b)
    assert ok and n_hit == 8
    assert kv.get_block_ids("b")[:2] == ida[:2]
    # 2 revived hit blocks + 1 new
    assert kv.block_pool.get_num_free_blocks() == base - 3
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == base


def test_allocate_slots_grows_by_blocks():
    kv = KVCacheManager(16, BS, enable_caching=False)
    base = kv.block_pool.get_num_free_blocks()
    r = req("r", range(3))
    assert kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    assert len(kv.get_block_ids("r")) == 1
    for step in range(6):
        r.all_token_ids.append(100 + step)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert len(kv.get_block_ids("r")) == -(-r.num_computed_tokens // BS)
    assert kv.block_pool.get_num_free_blocks() == base - 3
    kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == base


def _snapshot(kv):
    pool = kv.block_pool
    return (pool.get_num_free_blocks(), pool.free_block_ids(), [b.ref_cnt for b in pool.blocks],
            dict(pool.cached), {k: list(v) for k, v in kv.req_to_blocks.items() if v},
            kv.prefix_cache_stats.hits)


def test_allocate_slots_short_returns_false_and_changes_nothing():
    kv = KVCacheManager(5, BS, enable_caching=True)  # 4 usable blocks
    a = req("a", range(9))
    admit(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == 4
    b = req("b", list(range(8)) + list(range(100, 112)))  # 20 tokens: 5 blocks
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8
    before = _snapshot(kv)
    # 2 hit blocks (free, evictable) + 3 new ones needed, only 2 other free blocks
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hits) is False
    assert _snapshot(kv) == before
    assert kv.block_pool.get_num_free_blocks() == 4
    assert all(x.ref_cnt == 0 for x in hits)
    # a smaller request with the same hits fits exactly
    c = req("c", list(range(8)) + list(range(200, 208)))  # 16 tokens: 4 blocks
    hits, n_hit = kv.get_computed_blocks(c)
    assert n_hit == 8
    assert kv.allocate_slots(c, c.num_tokens - n_hit, hits) is True
    assert kv.block_pool.get_num_free_blocks() == 0
    kv.free(c)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 4


def test_allocate_slots_short_without_hits():
    kv = KVCacheManager(4, BS, enable_caching=True)  # 3 usable
    a = req("a", range(8))
    assert kv.allocate_slots(a, 8)
    before = _snapshot(kv)
    b = req("b", range(100, 108))
    assert kv.allocate_slots(b, 8) is False
    assert _snapshot(kv) == before
    # growth of a running request that does not fit also changes nothing
    a.num_computed_tokens = 8
    a.all_token_ids += [1, 2, 3, 4, 5]
    before = _snapshot(kv)
    assert kv.allocate_slots(a, 5) is False
    assert _snapshot(kv) == before
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 3


def test_free_releases_tail_first():
    kv = KVCacheManager(8, BS, enable_caching=False)
    r = req("r", range(12))
    kv.allocate_slots(r, 12)
    bids = list(kv.get_block_ids("r"))
    kv.free(r)
    assert kv.block_pool.free_block_ids()[-3:] == bids[::-1]


def test_caching_disabled_never_hits():
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = req("a", range(10))
    admit(kv, a)
    b = req("b", range(10))
    blocks, n = kv.get_computed_blocks(b)
    assert blocks == [] and n == 0
    assert kv.prefix_cache_stats.queries == 0 and kv.prefix_cache_stats.hits == 0


@pytest.mark.parametrize("seed", range(5))
def test_free_returns_everything_whatever_the_mix(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(40, BS, enable_caching=True)
    base = kv.block_pool.get_num_free_blocks()
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    live = []
    for i in range(40):
        if live and (rng.random() < 0.4 or kv.block_pool.get_num_free_blocks() < 8):
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 10))]
        r = req(f"r{i}", prompt)
        ok, hits, n_hit = admit(kv, r)
        if not ok:
            continue
        live.append(r)
        # a few decode steps
        for _ in range(rng.randint(0, 5)):
            r.all_token_ids.append(rng.randrange(1000))
            if not kv.allocate_slots(r, 1):
                break
            r.num_computed_tokens += 1
        # invariant: ref counts equal the number of live requests holding each block
        holders = {}
        for x in live:
            for bid in kv.get_block_ids(x.request_id):
                holders[bid] = holders.get(bid, 0) + 1
        for b in kv.block_pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0)
            assert (b.block_id in kv.block_pool.free_queue) == (b.ref_cnt == 0)
    for r in live:
        kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == base
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])
    assert kv.block_pool.get_usage() == 0.0
    assert kv.prefix_cache_stats.hits > 0



def test_cache_salt_is_in_the_first_block_hash():
    """vLLM's cache_salt: the same tokens under another salt (or none) share no block."""
    def salted(rid, salt):
        return Request(rid, list(range(10)), SamplingParams(max_tokens=8), 8, arrival_time=0.0, cache_salt=salt)

    kv = KVCacheManager(32, BS, enable_caching=True)
    first = salted("a", "tenant-1")
    assert admit(kv, first)[0]
    kv.free(first)
    assert kv.get_computed_blocks(salted("b", "tenant-2"))[1] == 0
    assert kv.get_computed_blocks(salted("c", None))[1] == 0
    assert kv.get_computed_blocks(salted("d", "tenant-1"))[1] == 8  # two whole blocks of 4

"""BlockPool: null block, LRU free queue, lazy eviction of cached blocks, touch, ref counts, usage."""
import pytest

from pyengine.core.block_pool import BlockPool, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool):
    return pool.free_block_ids()


def test_too_few_blocks_rejected():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_null_block_reserved():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert 0 not in ids(got)
    assert sorted(ids(got)) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 4
    assert 0 not in free_ids(pool)


def test_get_new_blocks_too_many_changes_nothing():
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_initial_order_and_lru_in_freed_order():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3]  # initial order: by id
    assert all(b.ref_cnt == 1 for b in a)
    b2, b3, b1 = a[1], a[2], a[0]
    pool.free_blocks([b2])
    pool.free_blocks([b3])
    pool.free_blocks([b1])
    # never-used blocks 4, 5 were freed "earliest": they go first, then the freed order
    assert free_ids(pool) == [4, 5, 2, 3, 1]
    assert ids(pool.get_new_blocks(5)) == [4, 5, 2, 3, 1]


def test_free_blocks_keeps_given_order():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))  # a request's tail first
    assert ids(pool.get_new_blocks(4)) == [4, 3, 2, 1]


def test_lazy_eviction_of_cached_block():
    pool = BlockPool(4, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(b1, h)
    assert b1.block_hash == h and pool.get_cached_block(h) is b1
    pool.free_blocks([b1])
    # still cached while free
    assert pool.get_cached_block(h) is b1
    assert b1.block_hash == h
    assert pool.get_num_free_blocks() == 1
    # reused for new data: only now the hash goes
    (nb,) = pool.get_new_blocks(1)
    assert nb is b1
    assert pool.get_cached_block(h) is None
    assert b1.block_hash is None
    assert b1.ref_cnt == 1


def test_eviction_only_touches_the_reused_block():
    pool = BlockPool(4, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    h1, h2 = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(b1, h1)
    pool.cache_block(b2, h2)
    pool.free_blocks([b2, b1])
    (nb,) = pool.get_new_blocks(1)
    assert nb is b2
    assert pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is b1


def test_touch_cached_free_block_removes_it_from_free_queue():
    pool = BlockPool(4, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_block(b2, h)
    pool.free_blocks([b1, b2, b3])
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(h)
    assert hit is b2
    pool.touch([hit])
    assert b2.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    assert 2 not in free_ids(pool)
    got = pool.get_new_blocks(2)
    assert b2 not in got
    assert pool.get_cached_block(h) is b2  # touched block is not evicted
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_ref_counts_with_shared_prefix():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(b, h)
    pool.touch([b])  # a second request shares it
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert 1 not in free_ids(pool)
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert free_ids(pool)[-1] == 1
    # touching a free cached block again revives it
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 2 and 1 not in free_ids(pool)


def test_get_usage():
    pool = BlockPool(5, enable_caching=False)
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    got += pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(got[:2])
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(got[2:])
    assert pool.get_usage() == 0.0


def test_no_caching_ignores_cache_block():
    pool = BlockPool(4, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(b, h)
    assert b.block_hash is None
    assert pool.get_cached_block(h) is None


def test_reset_prefix_cache():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(b, h)
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.get_cached_block(h) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and b.block_hash is None


def test_hash_chain_depends_on_parent_and_tokens():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, (1, 2))
    assert h1 != hash_block_tokens(None, [1, 3])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(h1, [5, 6], ("lora",))


def test_huge_pool_materialises_blocks_only_when_handed_out():
    # A tiny model under gpu_memory_utilization gets millions of blocks; the pool must not
    # build a Python object per block up front.
    pool = BlockPool(50_000_000, enable_caching=True)
    assert pool.get_num_free_blocks() == 49_999_999
    assert len(pool.blocks) == 1
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and len(pool.blocks) == 4
    pool.free_blocks([a[1]])
    # never-used blocks still go before the freed one
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_num_free_blocks() == 49_999_999 - 5 + 1
    assert pool.get_usage() == pytest.approx(4 / 49_999_999)

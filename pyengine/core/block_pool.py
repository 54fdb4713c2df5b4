"""KV block pool with prefix-cache bookkeeping (mirrors vllm/v1/core/block_pool.py).

Blocks with ref_cnt 0 sit in a free queue in eviction order (least recently freed
first). A free block may still hold a cached prefix (``block_hash`` set): it is evicted
lazily, only when it is taken for new data.

Never-used blocks come first in that order (vLLM's queue starts with every block, by
id). They are not materialised up front: a tiny model under ``gpu_memory_utilization``
gets millions of blocks, and building one Python object each would cost seconds and GBs of
host memory. A counter hands them out by id instead, before any freed block.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pyengine.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_block_hash

logger = logging.getLogger(__name__)

NONE_HASH = 0x5EED_5EED


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block_tokens(parent_hash: int | None, token_ids: Iterable[int], extra_keys: tuple = ()) -> int:
    """Chained block hash over (parent hash, token ids, extra keys); ints hash deterministically."""
    return hash((NONE_HASH if parent_hash is None else parent_hash, tuple(token_ids), extra_keys))


class BlockPool:
    """Owns ``num_blocks`` KV blocks. Block 0 is reserved as the null block (padding
    rows of block tables point at it), so ``num_blocks - 1`` are usable.

    With ``enable_kv_cache_events`` it records what enters and leaves the prefix cache
    (vLLM's KV events, pyengine/distributed/kv_events.py) until ``take_events``."""

    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False):
        if num_blocks < 2:
            raise ValueError(f"KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = KVCacheBlock(0, ref_cnt=1)
        self.blocks = [self.null_block]  # blocks handed out so far, indexed by id
        # Freed blocks only; ids len(self.blocks) .. num_blocks-1 are free and never used.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.enable_kv_cache_events = enable_kv_cache_events and enable_caching
        self.kv_events: list = []  # since the last take_events

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - len(self.blocks)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order (never-used first). O(num free): for tests."""
        return list(range(len(self.blocks), self.num_blocks)) + list(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Raises ValueError if fewer than n blocks are free (callers check first)."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"Cannot allocate {n} KV blocks; {self.get_num_free_blocks()} free.")
        first = len(self.blocks)
        fresh = min(n, self.num_blocks - first)
        out = [KVCacheBlock(i, ref_cnt=1) for i in range(first, first + fresh)]
        self.blocks.extend(out)
        for _ in range(n - fresh):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:  # lazy eviction of a cached prefix
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    if self.enable_kv_cache_events:
                        self.kv_events.append(BlockRemoved([external_block_hash(b.block_hash)]))
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def record_stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
                      block_size: int) -> None:
        """Record a ``BlockStored`` event (with events on): consecutive full blocks of one
        request, their chained hashes, the hash before the first (None: none) and their
        tokens (``block_size`` each)."""
        if self.enable_kv_cache_events and block_hashes:
            self.kv_events.append(BlockStored([external_block_hash(h) for h in block_hashes],
                                              None if parent_hash is None else external_block_hash(parent_hash),
                                              list(token_ids), block_size))

    def take_events(self) -> list:
        """The KV events recorded since the last call, oldest first."""
        events, self.kv_events = self.kv_events, []
        return events

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue's tail in the given order."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights are loaded, or to benchmark
        without cache hits). Only when no block is in use: returns False and changes
        nothing while a request holds blocks."""
        in_use = self.num_blocks - 1 - self.get_num_free_blocks()
        if in_use:
            logger.warning("Failed to reset the prefix cache: %d KV blocks are still in use.", in_use)
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.enable_kv_cache_events:
            self.kv_events.append(AllBlocksCleared())
        logger.info("Prefix cache reset.")
        return True

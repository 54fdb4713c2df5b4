"""Per-request KV block allocation with automatic prefix caching
(mirrors vllm/v1/core/kv_cache_manager.py, single KV-cache group)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyengine.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pyengine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Cumulative counts, in tokens."""
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, enable_kv_cache_events: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of known tokens. A
        request's ``cache_salt`` is an extra key of its first block (vLLM's), so the chain
        of every block differs from that of other salts and of no salt."""
        bs, hashes, toks = self.block_size, request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(toks):
            i = len(hashes)
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, toks[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks; never the whole prompt
        (the last token is recomputed to get logits). Returns (blocks, num_tokens)."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in request.block_hashes[:max_hit_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds now."""
        return len(self.req_to_block_ids.get(request_id, ()))

    def num_blocks_to_take(self, request: Request, num_new_tokens: int,
                           new_computed_blocks: Sequence[KVCacheBlock] = (), num_lookahead_tokens: int = 0) -> int:
        """How many blocks ``allocate_slots`` with these arguments would take out of the
        free pool: new blocks, plus prefix-hit blocks that sit in the free queue (they
        stop being free once touched)."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = (cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
                - self.num_blocks(request.request_id) - len(new_computed_blocks))
        if not new_computed_blocks:  # (every decode step: no generator per request)
            return max(need, 0)
        return max(need, 0) + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (), num_lookahead_tokens: int = 0) -> bool:
        """Reserve blocks so that num_computed + len(new_computed)*bs + num_new_tokens
        (+ ``num_lookahead_tokens``: slots a speculative proposer writes its own KV into
        past the step's tokens, vLLM's lookahead) tokens fit. Only full blocks of known
        tokens (``request.all_token_ids``, never draft tokens) that this step computes are
        cached. Returns False (and changes nothing) if not enough blocks are free."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
        block_ids = self.req_to_block_ids[rid]
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total + num_lookahead_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        if need <= 0 and not new_computed_blocks:  # fast path: most decode steps
            if self.enable_caching:
                num_full = min(total, len(request.all_token_ids)) // self.block_size
                if num_full > self.num_cached_blocks.get(rid, 0):  # (no call while no block filled up)
                    self._cache_full_blocks(request, num_full)
            return True
        if (self.num_blocks_to_take(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
                > self.block_pool.get_num_free_blocks()):
            return False
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.num_cached_blocks[rid] = len(blocks)
        if need > 0:
            new = self.block_pool.get_new_blocks(need)
            blocks.extend(new)
            block_ids.extend(b.block_id for b in new)
        if self.enable_caching:
            # Full blocks whose tokens are all known and computed by the end of this step.
            self._cache_full_blocks(request, min(total, request.num_tokens) // self.block_size)
        return True

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks, hashes, pool = self.req_to_blocks[rid], request.block_hashes, self.block_pool
        for i in range(start, num_full):
            pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full
        if pool.enable_kv_cache_events:
            bs = self.block_size
            pool.record_stored(hashes[start:num_full], hashes[start - 1] if start else None,
                               request.all_token_ids[start * bs:num_full * bs], bs)

    def free(self, request: Request) -> None:
        """Release all blocks of the request, tail first so that the tail is evicted first."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """See ``BlockPool.reset_prefix_cache``: False while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list:
        """The KV events (pyengine/distributed/kv_events.py) since the last call."""
        return self.block_pool.take_events()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids[request_id]

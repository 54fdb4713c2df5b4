"""KV cache events as vLLM publishes them (pyengine/distributed/kv_events.py, issue 29):
the block pool records BlockStored / BlockRemoved / AllBlocksCleared; the engine core
publishes one KVEventBatch per step on a ZMQ PUB socket; a subscriber decoding them with
vLLM's own struct layout (msgspec, array-like, tagged) rebuilds exactly the prefix cache's
content."""
from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from pyengine import LLM, SamplingParams
from pyengine.config import KVEventsConfig
from pyengine.core.block_pool import BlockPool
from pyengine.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    offset_endpoint_port,
)


# vLLM's wire types, declared as a consumer of vLLM's events does (vllm/distributed/kv_events.py's
# field order; the batch array_like, the events tagged maps, omit_defaults).
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class _BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


class _KVEventBatch(_EventBatch):
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(type=_KVEventBatch)


def test_wire_format_decodes_as_vllms_structs():
    batch = KVEventBatch(12.5, [BlockStored([1, 2**64 - 1], None, list(range(32)), 16),
                                BlockRemoved([7]), AllBlocksCleared()], 3)
    got = _DECODER.decode(encode_batch(batch))
    assert got.ts == 12.5 and got.data_parallel_rank == 3
    stored, removed, cleared = got.events
    assert isinstance(stored, _BlockStored) and stored.block_hashes == [1, 2**64 - 1]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.lora_id is None and stored.medium == "GPU"
    assert isinstance(removed, _BlockRemoved) and removed.block_hashes == [7] and removed.medium == "GPU"
    assert isinstance(cleared, _AllBlocksCleared)
    assert decode_batch(encode_batch(batch)) == batch
    import msgpack
    raw = msgpack.unpackb(encode_batch(batch))  # the layout vllm-router's kv_aware subscriber requires
    assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored" and raw[1][2] == {"type": "AllBlocksCleared"}
    # a batch without a rank leaves it out (omit_defaults)
    assert _DECODER.decode(encode_batch(KVEventBatch(1.0, []))).data_parallel_rank is None


def test_block_pool_records_evictions_and_resets():
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, -5)  # a negative engine hash goes out as its unsigned 64-bit value
    pool.free_blocks([a, b, c])
    assert pool.take_events() == []  # caching itself is recorded by the manager (record_stored)
    pool.get_new_blocks(3)  # takes the freed blocks: a's cached prefix is evicted
    assert pool.take_events() == [BlockRemoved([external_block_hash(-5)])]
    assert external_block_hash(-5) == 2**64 - 5
    pool2 = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    pool2.reset_prefix_cache()
    assert pool2.take_events() == [AllBlocksCleared()]
    off = BlockPool(4, enable_caching=True)  # events off: nothing recorded
    off.reset_prefix_cache()
    assert off.take_events() == []


def test_endpoint_offsets_and_config_validation():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert KVEventsConfig.from_value(None) is None
    assert KVEventsConfig.from_value({"enable_kv_cache_events": False, "publisher": "zmq"}) is None
    cfg = KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"})
    assert cfg.endpoint == "tcp://*:5557" and cfg.topic == "kv"
    with pytest.raises(ValueError, match="Unknown kv_events_config field"):
        KVEventsConfig.from_value({"enable_kv_cache_events": True, "bogus": 1})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "kafka"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A ZMQ SUB socket that folds the events into the set of cached block hashes (and
    keeps each stored block's tokens), as a KV-aware router does."""

    def __init__(self, port: int, topic: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.cached: dict[int, list[int]] = {}
        self.seqs: list[int] = []
        self.ranks: set = set()
        self.removed = 0

    def drain(self, quiet_s: float = 0.5) -> None:
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = _DECODER.decode(payload)
            self.ranks.add(batch.data_parallel_rank)
            for e in batch.events:
                if isinstance(e, _BlockStored):
                    bs = e.block_size
                    for k, h in enumerate(e.block_hashes):
                        self.cached[h] = e.token_ids[k * bs:(k + 1) * bs]
                elif isinstance(e, _BlockRemoved):
                    for h in e.block_hashes:
                        self.removed += 1
                        self.cached.pop(h, None)
                else:
                    self.cached.clear()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_engine_publishes_the_prefix_cache_content(llama_dir, tokenizer):
    port = _free_port()
    llm = LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=12, max_model_len=96, block_size=16,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv@test"})
    sub = Subscriber(port, "kv@test")
    try:
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription must reach the publisher first
        pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool

        def engine_content() -> dict[int, int]:
            return {external_block_hash(h): b.block_id for h, b in pool.cached.items()}
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        shared = list(range(100, 140))  # 2.5 blocks of a shared prefix
        prompts = [shared + [7, 8, 9], shared + [10, 11], list(range(200, 250))]
        llm.generate(prompts, sp, use_tqdm=False)
        sub.drain()
        assert set(sub.cached) == set(engine_content()) and sub.cached
        # the published tokens are the blocks' own tokens: the shared prefix's two full blocks are there
        assert shared[:16] in sub.cached.values() and shared[16:32] in sub.cached.values()
        # more prompts than the 11 blocks hold: blocks are evicted and reported as removed
        llm.generate([list(range(250 + 50 * i, 290 + 50 * i)) for i in range(5)], sp, use_tqdm=False)
        sub.drain()
        assert sub.removed > 0 and set(sub.cached) == set(engine_content())
        assert llm.reset_prefix_cache()
        sub.drain()
        assert sub.cached == {} and engine_content() == {}
        assert sub.seqs == list(range(len(sub.seqs)))  # sequence numbers 0, 1, ... without a gap
        assert sub.ranks == {0}
    finally:
        sub.close()
        llm.shutdown()


def test_kv_events_port_in_use_is_a_clear_error(llama_dir):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match="Cannot open the KV events endpoint"):
            LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=12, max_model_len=96,
                kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})

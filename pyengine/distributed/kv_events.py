"""KV cache events, as vLLM publishes them (mirrors vllm/distributed/kv_events.py).

The block pool records what enters and leaves the prefix cache; after each engine step
the engine core hands the step's events to a publisher, one ``KVEventBatch`` per step.
Routers that follow prefix-cache content (vllm-router's ``kv_aware`` policy, llm-d, the
production-stack router, Dynamo) read them.

Wire format (vLLM's msgspec structs, written here with plain msgpack: the batch an
``array_like`` struct, each event a ``tag=True`` struct, i.e. a map whose ``"type"`` is
the class name; what vllm-router's ``kv_aware`` subscriber decodes, and refuses otherwise:
"KV event batch must be an array", "KV event must be a tagged map"):

- a ZMQ multipart message ``[topic, seq, payload]``: ``topic`` the configured bytes,
  ``seq`` the batch's sequence number as 8 bytes big-endian (0, 1, ...), ``payload`` the
  msgpack batch;
- the batch: an array ``[ts, events, data_parallel_rank]``: ``ts`` float seconds since
  the epoch (``time.time()``), ``data_parallel_rank`` an int (left out when None);
- each event: a map of ``"type"`` (the tag) then its fields by name, in vLLM's order:
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved",
  "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}`` (vLLM's optional later
  fields, ``extra_keys``, ``group_idx``..., are left out: msgspec's ``omit_defaults``).

Block hashes go out as unsigned 64-bit ints (the engine's chained ``hash()`` of
(parent hash, token ids, extra keys), taken modulo 2**64): ``BlockStored`` lists the
hashes of consecutive full blocks of one request whose ``token_ids`` (``block_size``
each, concatenated) were just cached, ``parent_block_hash`` the hash of the block
before the first of them (None at the start of a prompt); ``BlockRemoved`` the hashes
that left the prefix cache (evicted for new data); ``AllBlocksCleared`` a prefix-cache
reset. ``medium`` is "GPU" on every device (vLLM's name for the engine's own cache).

The optional replay socket (``replay_endpoint``, a ZMQ ROUTER) answers a request frame
``[identity, b"", start_seq (8 bytes big-endian)]`` with every buffered batch from that
sequence number on, each as ``[identity, b"", seq, payload]``, then
``[identity, b"", (-1 as 8 signed bytes), b""]``, as vLLM's publisher does.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_block_hash(block_hash: int) -> int:
    """The engine's block hash (a Python ``hash()``, signed 64-bit) as published: an
    unsigned 64-bit int (routers refuse negative hashes)."""
    return block_hash & _U64


@dataclass
class BlockStored:
    """Consecutive full blocks of one request entered the prefix cache. ``block_hashes``:
    published hashes (``external_block_hash``), in order; ``token_ids``: their tokens,
    ``block_size`` per block; ``parent_block_hash``: the block before the first one."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> dict:
        return {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": self.lora_id,
                "medium": self.medium, "lora_name": self.lora_name}


@dataclass
class BlockRemoved:
    """These hashes left the prefix cache (their blocks were taken for new data)."""
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass
class AllBlocksCleared:
    """The prefix cache was reset: every block hash published so far is gone."""

    def to_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """One engine step's events. ``ts``: seconds since the epoch."""
    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: int | None = None

    def to_wire(self) -> list:
        wire = [self.ts, [e.to_wire() for e in self.events]]
        if self.data_parallel_rank is not None:
            wire.append(self.data_parallel_rank)
        return wire


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch`` (see the module docstring)."""
    import msgpack

    return msgpack.packb(batch.to_wire(), use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of ``encode_batch`` (for tests and subscribers). Raises ValueError on an
    unknown event tag."""
    import msgpack

    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    out = []
    for e in events:
        fields = dict(e)
        tag = fields.pop("type", None)
        cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}.get(tag)
        if cls is None:
            raise ValueError(f"unknown KV event tag {tag!r}")
        out.append(cls(**fields))
    return KVEventBatch(ts, out, rest[0] if rest else None)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``data_parallel_rank``: a tcp port plus the
    rank, an inproc/ipc name with ``_dp<rank>`` appended (vLLM's rule). Raises ValueError
    for a tcp endpoint without a port."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"KV events endpoint {endpoint!r} has no port")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


class EventPublisher:
    """Where the engine core sends each step's events (vLLM's ``EventPublisher``)."""

    def publish(self, batch: KVEventBatch) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Send what is queued (briefly), then close."""


class ZmqEventPublisher(EventPublisher):
    """A ZMQ PUB socket (and optionally a ROUTER for replays) served by one thread, so
    ``publish`` (on the engine loop) only enqueues. The socket binds when the endpoint
    has a wildcard or is ipc/inproc, else connects (vLLM's rule). Batches that do not
    fit the queue (``max_queue_size``) are dropped with a warning: a stalled subscriber
    never stalls the engine."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, data_parallel_rank: int, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = ""):
        import zmq

        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        ep = self.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="KVEventPublisher", daemon=True)
        self._thread.start()
        logger.info("Publishing KV cache events on %s%s.", ep,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped so far.", self._dropped)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encode_batch(batch)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
            except Exception:  # noqa: BLE001 - keep publishing the next batches
                logger.exception("Publishing KV events failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("Invalid KV event replay request (%d frames).", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self) -> None:
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()


def make_publisher(kv_events_config, data_parallel_rank: int) -> EventPublisher | None:
    """The publisher of a ``pyengine.config.KVEventsConfig`` (None: no events). Raises
    ValueError when the endpoint cannot be bound or connected (port in use), or when
    pyzmq / msgpack are missing."""
    if kv_events_config is None:
        return None
    try:
        import msgpack  # noqa: F401
        import zmq
    except ImportError as e:
        raise ValueError(f"KV events need pyzmq and msgpack (pip install pyzmq msgpack): {e}") from None
    c = kv_events_config
    try:
        return ZmqEventPublisher(data_parallel_rank, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm,
                                 c.max_queue_size, c.topic)
    except zmq.ZMQError as e:
        raise ValueError(f"Cannot open the KV events endpoint {c.endpoint!r} "
                         f"(data-parallel rank {data_parallel_rank}): {e}") from None

"""Tensor-parallel process group (mirrors vllm/distributed/parallel_state.py, without its
module-global groups: a ``GroupCoordinator`` is passed to whatever needs it).

Two torch.distributed groups over the same ranks:

* ``device_group``: NCCL on CUDA, gloo on CPU. Carries the model's collectives (the
  all-reduce after each row-parallel linear and the vocab-parallel embedding, the logits
  gather, the sampled-token broadcast); on CUDA these may be captured in CUDA graphs.
* ``cpu_group``: gloo. Carries start-up agreements (KV cache size), and the step inputs
  rank 0 sends each step when the shared-memory queue is off or a step is too large for
  its slot, so no host data goes through a GPU. Its operations never time out: the other
  ranks wait in it for rank 0's next step however long the engine idles (a dead peer
  still fails them at once: its sockets close).

Rank 0's step messages (``send_step`` / ``recv_step``) go through a ``ShmMessageQueue``
(pyengine/distributed/shm_broadcast.py) when every rank is on rank 0's host, as the
executor's ranks are (``VENGINE_TP_SHM_BROADCAST=0``: gloo only).
"""
from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from pyengine import envs
from pyengine.distributed.all_reduce_norm import AllReduceRMSNorm, symm_mem_buffer
from pyengine.distributed.shm_broadcast import ShmMessageQueue
from pyengine.ops import fused_add_rms_norm

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Largest all-reduce (bytes) sent through symmetric memory; larger ones go through NCCL.
# A one-shot all-reduce reads every peer's whole buffer, so it wins on latency-bound sizes
# (decode: batch x hidden x 2 bytes, 8 KB at batch 1 for an 8B model) and loses on
# bandwidth-bound ones (prefill chunks), where NCCL's ring/tree is the better algorithm.
SYMM_MEM_MAX_BYTES = 1 << 20

# The other ranks' wait for rank 0's next step (an engine may idle for days).
_IDLE_TIMEOUT = datetime.timedelta(days=365)


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_distributed_init_method(host: str, port: int) -> str:
    """``tcp://host:port``; torch.distributed's TCP rendezvous (rank 0 hosts the store)."""
    return f"tcp://{host}:{port}"


class GroupCoordinator:
    """One tensor-parallel group as seen by one rank.

    ``rank`` / ``world_size``: this process's rank and the group size. The collectives
    below run on every rank of the group in the same order (as all torch.distributed
    collectives must). ``device``: where this rank's model lives.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 device_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.is_first_rank = rank == 0
        self.symm_mem: SymmMemAllReduce | None = None
        self.fused_norm: AllReduceRMSNorm | None = None  # enable_symm_mem sets it up
        self.mq: ShmMessageQueue | None = None  # rank 0's step messages (init_message_queue)

    # ---- model collectives (device group) -------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group; returns the sum: a new tensor when the symmetric-memory
        path takes it (small tensors of the model's dtype on CUDA, see ``enable_symm_mem``),
        else ``x`` itself, reduced in place by NCCL / gloo. CUDA-graph capturable."""
        sm = self.symm_mem
        if sm is not None and sm.accepts(x):
            return sm(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = sum over the group of x``; returns ``(rms_norm(s + residual), s + residual)``.
        x: this rank's partial sum [T, hidden]; residual: [T, hidden], the same on every
        rank; weight: [hidden]. One kernel (``AllReduceRMSNorm``) when ``enable_symm_mem``
        set it up and the shapes fit, else ``all_reduce`` then ``fused_add_rms_norm``.
        Collective, CUDA-graph capturable."""
        fused = self.fused_norm
        if fused is not None and fused.accepts(x, residual):
            return fused(x, residual, weight, eps)
        return fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def enable_symm_mem(self, dtype: torch.dtype, max_bytes: int = SYMM_MEM_MAX_BYTES) -> bool:
        """Route small all-reduces of ``dtype`` through torch's symmetric memory (a one-shot
        all-reduce over NVLink peer-to-peer reads: a few microseconds where NCCL takes
        ~15-20 at decode sizes; the role of vllm/distributed/device_communicators/
        symm_mem.py). Collective: every rank calls it, in the same order as the other
        collectives. On when ``VENGINE_SYMM_MEM_ALLREDUCE=1``, which the engine-core
        process sets by default (one engine per process there): a second tensor-parallel
        engine created in one process (after ``LLM.shutdown``) hangs in torch's
        symmetric-memory rendezvous, so an engine core in the front end's process keeps
        NCCL unless asked. Off on CPU and where torch lacks the op; if any rank
        fails to set it up, no rank uses it. Returns whether it is on.

        With it, unless ``VENGINE_FUSED_ALLREDUCE_RMSNORM=0``, the all-reduces that a residual
        add and RMSNorm follow become one kernel with them (``all_reduce_add_rms_norm``,
        pyengine/distributed/all_reduce_norm.py), under the same every-rank-or-none rule."""
        if self.device.type != "cuda" or self.world_size == 1 or not envs.symm_mem_allreduce():
            return False
        sm = self._on_every_rank(lambda: SymmMemAllReduce(self.device_group, self.device, dtype, max_bytes),
                                 "Symmetric-memory all-reduce off (%s); NCCL carries every all-reduce.")
        if sm is None:
            return False
        self.symm_mem = sm
        if envs.fused_allreduce_rmsnorm():  # the check also orders every rank's zeroing before any use
            self.fused_norm = self._on_every_rank(
                lambda: AllReduceRMSNorm(self.device_group, self.device, dtype, max_bytes, self.rank,
                                         self.world_size),
                "Fused all-reduce + RMSNorm off (%s).")
        return True

    def _on_every_rank(self, create: Callable[[], T], off_message: str) -> T | None:
        """``create()`` on every rank; its result where it worked on every rank, else None on
        all of them (logged with ``off_message`` % the reason). Collective."""
        obj, err = None, None
        try:
            obj = create()
        except Exception as e:  # an old torch, no peer access: the slower path everywhere
            err = e
        if self.all_reduce_min(int(obj is not None)) == 0:
            logger.info(off_message, err or "another rank could not set it up")
            return None
        return obj

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim`` on rank
        ``dst``, rank order; returns the result on ``dst`` and None elsewhere."""
        x = x.contiguous()
        if self.rank != dst:
            dist.gather(x, None, dst=dst, group=self.device_group)
            return None
        # The parts land in one buffer [world, *x.shape]; moving the rank axis next to
        # ``dim`` and merging them is a view when every dimension before ``dim`` has size
        # 1 (one logits row at batch 1): no concatenation kernel on the decode path.
        buf = x.new_empty((self.world_size, *x.shape))
        dist.gather(x, list(buf.unbind(0)), dst=dst, group=self.device_group)
        d = dim % x.dim()
        out = buf.movedim(0, d)
        return out.reshape(*x.shape[:d], self.world_size * x.shape[d], *x.shape[d + 1:])

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape and dtype on all ranks) on every rank, stacked in
        rank order: [world_size, *x.shape]. Collective."""
        x = x.contiguous()
        out = x.new_empty((self.world_size, *x.shape))
        if x.is_cuda:
            dist.all_gather_into_tensor(out, x, group=self.device_group)
        else:  # (gloo has no all_gather_into_tensor)
            dist.all_gather(list(out.unbind(0)), x, group=self.device_group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` into every rank's ``x`` (in place); returns ``x``."""
        dist.broadcast(x, src=src, group=self.device_group)
        return x

    # ---- host data (cpu group) ------------------------------------------------------
    def broadcast_cpu(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``broadcast`` of a CPU tensor over the gloo group."""
        dist.broadcast(x, src=src, group=self.cpu_group)
        return x

    def init_message_queue(self, check: Callable[[], None] | None = None, slot_bytes: int = 1 << 20) -> bool:
        """Collective (cpu group): rank 0 creates a shared-memory queue for its step
        messages and the other ranks attach to it; every rank must be on rank 0's host.
        ``check`` (rank 0): called while rank 0 waits for a slot, to raise when a peer
        died. ``slot_bytes``: the largest message (bytes, with its 8-byte length) the
        queue carries; a larger step's payload goes over gloo. If any rank fails to set
        it up, none uses it. Returns whether it is on."""
        if self.world_size == 1 or not envs.tp_shm_broadcast():
            return False
        mq, err = None, None
        handle = torch.zeros(256, dtype=torch.uint8)
        if self.is_first_rank:
            try:
                mq = ShmMessageQueue(self.world_size - 1, slot_bytes=slot_bytes)
                name = mq.handle().encode()
                handle[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
            except Exception as e:  # no /dev/shm: gloo carries the steps
                err = e
        self.broadcast_cpu(handle)
        if not self.is_first_rank and handle[0]:
            try:
                mq = ShmMessageQueue.attach(bytes(handle.numpy()).rstrip(b"\0").decode(), self.rank - 1)
            except Exception as e:
                err = e
        if self.all_reduce_min(int(mq is not None)) == 0:
            logger.info("Shared-memory step queue off (%s); gloo carries the steps.",
                        err or "another rank could not set it up")
            if mq is not None:
                mq.close()
            return False
        mq.check = check
        self.mq = mq
        return True

    def send_step(self, header: np.ndarray, *payload: np.ndarray) -> None:
        """Rank 0: one step message to every other rank: an int64 ``header`` whose
        content tells the receivers the payload's size, then the ``payload`` arrays'
        bytes. One shared-memory message when it fits a slot; else (or without the
        queue) the header and then the payload as two gloo broadcasts."""
        mq = self.mq
        size = sum(p.nbytes for p in payload)
        if mq is not None:
            if header.nbytes + size <= mq.max_message_bytes:
                mq.enqueue(header, *payload)
                return
            mq.enqueue(header)  # too large for a slot: the payload follows over gloo
        else:
            self.broadcast_cpu(torch.from_numpy(header))
        if size:
            data = payload[0].view(np.uint8) if len(payload) == 1 else \
                np.concatenate([p.reshape(-1).view(np.uint8) for p in payload])
            self.broadcast_cpu(torch.from_numpy(data))

    def recv_step(self, header_len: int, payload_bytes: Callable[[list[int]], int]) -> tuple[list[int], np.ndarray]:
        """Ranks > 0: the next ``send_step`` message: (header as ints, payload as uint8
        array); ``payload_bytes(header)`` gives the payload's size."""
        mq = self.mq
        if mq is not None:
            msg = mq.dequeue()
            head = msg[:8 * header_len].view(np.int64).tolist()
            n = payload_bytes(head)
            if n == 0 or msg.nbytes > 8 * header_len:
                return head, msg[8 * header_len:]
        else:
            head = self.broadcast_cpu(torch.empty(header_len, dtype=torch.int64)).tolist()
            n = payload_bytes(head)
        if n == 0:
            return head, np.empty(0, dtype=np.uint8)
        return head, self.broadcast_cpu(torch.empty(n, dtype=torch.uint8)).numpy()

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the group (a host int)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Tear down the process groups (also after a peer died: then it only frees them)
        and the step queue."""
        if self.mq is not None:
            self.mq.close()
            self.mq = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a broken group may refuse a clean teardown
                logger.debug("destroy_process_group: %s", e)

    def abort(self) -> None:
        """Abort the groups' communicators so a collective blocked on a dead peer returns
        (NCCL kernels otherwise wait forever; gloo raises on its own)."""
        try:
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
        except Exception as e:
            logger.debug("abort process group: %s", e)


class SymmMemAllReduce:
    """A symmetric-memory buffer of ``max_bytes`` on every rank and torch's
    ``symm_mem.one_shot_all_reduce_copy_out``: each rank copies its input into its buffer,
    the ranks meet at a barrier on the buffers' signal pads, and each sums every peer's
    buffer into a fresh output. One kernel, capturable in CUDA graphs.

    Raises RuntimeError/AttributeError where torch or the machine cannot do it."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int):
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out  # AttributeError on an old torch
        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer, _ = symm_mem_buffer(self.max_numel, dtype, device, self.group_name)

    def accepts(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous() and x.is_cuda

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.op(self.buffer[:x.numel()].view(x.shape), x, "sum", self.group_name, out)
        return out


def init_distributed_environment(rank: int, world_size: int, init_method: str, device: torch.device,
                                 timeout_s: float = 600.0,
                                 peer_failure: Callable[[], str | None] | None = None) -> GroupCoordinator:
    """Join the group (blocks until all ``world_size`` ranks have joined) and return this
    rank's ``GroupCoordinator``. NCCL when ``device`` is CUDA (one GPU per rank, set as
    this thread's current device), gloo otherwise.

    ``peer_failure``: polled while waiting for the other ranks; when it returns a message
    (a rank's process died before joining) this raises RuntimeError with it instead of
    waiting out ``timeout_s``. Raises RuntimeError if a process group already exists in
    this process (one tensor-parallel engine per process)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "only one tensor-parallel engine can run per process")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    _rendezvous(lambda: dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                                world_size=world_size, timeout=timeout), peer_failure)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    tp = GroupCoordinator(rank, world_size, device, device_group, cpu_group)
    # First collective outside any CUDA-graph capture, on the thread that will run the
    # model: NCCL creates its communicator here.
    tp.all_reduce(torch.zeros(1, device=device))
    if cuda:
        torch.cuda.synchronize(device)
    return tp


def _rendezvous(init: Callable[[], None], peer_failure: Callable[[], str | None] | None) -> None:
    """Run ``init`` (which blocks until every rank joined); with ``peer_failure``, on a
    helper thread, polling ``peer_failure`` meanwhile. A rank that died before joining
    would otherwise keep ``init`` waiting until its timeout; then the helper thread is
    left to time out on its own."""
    if peer_failure is None:
        init()
        return
    err: list[BaseException] = []

    def run():
        try:
            init()
        except BaseException as e:  # re-raised on the calling thread
            err.append(e)

    t = threading.Thread(target=run, name="tp-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        msg = peer_failure()
        if msg is not None and t.is_alive():
            raise RuntimeError(msg)
    if err:
        raise err[0]

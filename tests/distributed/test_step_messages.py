"""Rank 0's step messages (GroupCoordinator.send_step / recv_step), two processes over
gloo: through the shared-memory queue, with a payload too large for a slot going over
gloo, and with the queue off."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

HEADER_LEN = 3  # [size of the payload in bytes, a tag, 0]
SIZES = [0, 5, 100, 200, 3, 1000, 0, 64]  # > 100 bytes do not fit a 128-byte slot with the header


def _payload(i: int, n: int) -> np.ndarray:
    return ((np.arange(n) + 7 * i) % 251).astype(np.uint8)


def _rank(rank: int, init: str, shm: bool, conn) -> None:
    import os

    import torch
    import torch.distributed as dist

    from pyengine.distributed import GroupCoordinator

    os.environ["VENGINE_TP_SHM_BROADCAST"] = "1" if shm else "0"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    tp = GroupCoordinator(rank, 2, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    on = tp.init_message_queue(slot_bytes=128)
    got = []
    for i, n in enumerate(SIZES):
        if rank == 0:
            p = _payload(i, n)
            # the payload in two parts, as the runner sends its two buffers
            tp.send_step(np.array([n, i, 0], dtype=np.int64), p[:n // 2], p[n // 2:])
        else:
            head, payload = tp.recv_step(HEADER_LEN, lambda h: h[0])
            got.append(head[1] == i and head[0] == n and payload.tobytes() == _payload(i, n).tobytes())
    tp.destroy()
    conn.send((on, got))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_step_messages_arrive_whole_and_in_order(shm):
    from pyengine.distributed import get_distributed_init_method, get_open_port

    ctx = mp.get_context("spawn")
    init = get_distributed_init_method("127.0.0.1", get_open_port())
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, init, shm, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    results = [pipes[r][0].recv() for r in range(2)]
    for p in procs:
        p.join(30)
    assert [on for on, _ in results] == [shm, shm]
    assert results[1][1] == [True] * len(SIZES)

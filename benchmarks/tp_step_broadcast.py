"""How rank 0 should hand each step to the other tensor-parallel ranks: the cost, per step,
of getting one step's inputs from rank 0 to rank 1 over the gloo group (two processes).

Three ways, for a decode step of batch 1 and of batch 256 (600-token contexts) and an
8192-token prefill step (8 x 1024):

* ``packed``: rank 0 already packs every integer input of the step into two buffers for
  its own forward (``step_codec.pack_step``); it broadcasts a fixed header and those
  bytes over gloo (``GroupCoordinator.send_step`` without the shared-memory queue), which
  the other ranks copy to their device as they are.
* ``shm``: the same header and bytes as one message through the shared-memory queue
  (``ShmMessageQueue``; what vengine does when every rank is on rank 0's host).
* ``cbor2``: the step's SchedulerOutput as the model needs it (per request: id, computed
  and new token counts, block ids, sample / placeholder flags, the token ids fed) encoded
  with cbor2, broadcast as a length then the bytes, decoded; the receiving rank must then
  pack the inputs itself (the ``pack`` column, measured on rank 0, is added).
* ``object_list``: the same per-request data through ``torch.distributed.broadcast_object_list``
  (pickle), plus ``pack``.

Each figure is the median over ``--iters`` of (send, receive and decode, then a barrier)
minus the median of a barrier alone, in microseconds; the methods take turns within
each iteration.

    python benchmarks/tp_step_broadcast.py --json tp_step_broadcast.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks.common import finish, hardware_info, header_md, md_table  # noqa: E402

SCENARIOS = {"decode b=1": (1, 1, 600), "decode b=256": (256, 1, 600), "prefill 8192": (8, 1024, 0)}
METHODS = ("packed", "shm", "cbor2", "object_list")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    return p


def make_step(num_reqs: int, new_tokens: int, context: int, block_size: int = 16):
    """A SchedulerOutput of ``num_reqs`` requests each feeding ``new_tokens`` after
    ``context`` cached tokens, and the runner-side state ``pack_step`` reads."""
    from pyengine.core.sched.output import ScheduledRequest, SchedulerOutput
    from pyengine.request import Request
    from pyengine.sampling_params import SamplingParams

    sched = []
    for i in range(num_reqs):
        n = context + new_tokens
        req = Request(f"r{i}", [(7 * i + j) % 30000 for j in range(n)], SamplingParams(), 4096)
        blocks = list(range(1 + i * (n // block_size + 1), 1 + i * (n // block_size + 1) + -(-n // block_size)))
        sched.append(ScheduledRequest(req, new_tokens, context, blocks, True, False, 0))
    so = SchedulerOutput(sched, num_reqs * new_tokens)
    runner = SimpleNamespace(block_size=block_size, _prev_rows={})
    return so, runner


def scheduler_view(so) -> list:
    """The per-request data a rank needs to build the step's inputs, as plain lists."""
    return [[s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.block_ids, s.sample,
             s.placeholder_input, s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]]
            for s in so.scheduled]


def _send(method: str, group, so, step, tp, mq) -> None:
    import cbor2
    import numpy as np
    import torch
    import torch.distributed as dist

    if method in ("packed", "shm"):  # rank 0 packs ``step`` for its own forward anyway: not counted
        tp.mq = mq if method == "shm" else None
        tp.send_step(np.array(step.shape.header(), dtype=np.int64), step.buf64, step.buf32)
    elif method == "cbor2":
        data = cbor2.dumps(scheduler_view(so))
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group)
    else:
        dist.broadcast_object_list([scheduler_view(so)], 0, group=group)


def _recv(method: str, group, tp, mq) -> None:
    import cbor2
    import torch
    import torch.distributed as dist

    from pyengine.worker.step_codec import HEADER_LEN, payload_bytes

    if method in ("packed", "shm"):
        tp.mq = mq if method == "shm" else None
        tp.recv_step(HEADER_LEN, payload_bytes)
    elif method == "cbor2":
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=group)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=group)
        cbor2.loads(payload.numpy().tobytes())
    else:
        obj = [None]
        dist.broadcast_object_list(obj, 0, group=group)


def _rank_main(rank: int, init_method: str, iters: int, conn) -> None:
    import torch
    import torch.distributed as dist

    from pyengine.distributed import GroupCoordinator

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    group = dist.group.WORLD
    tp = GroupCoordinator(rank, 2, torch.device("cpu"), group, group)
    if not tp.init_message_queue():
        raise SystemExit("the shared-memory queue could not be set up (VENGINE_TP_SHM_BROADCAST=0?)")
    mq = tp.mq
    from pyengine.worker.step_codec import pack_step
    results: dict = {}
    for name, (reqs, new, ctx) in SCENARIOS.items():
        so, runner = make_step(reqs, new, ctx)
        step = pack_step(so, runner.block_size, runner._prev_rows)
        row = {}
        if rank == 0:
            t = []
            for _ in range(iters):
                t0 = time.perf_counter()
                pack_step(so, runner.block_size, runner._prev_rows)
                t.append(time.perf_counter() - t0)
            row["pack_us"] = 1e6 * statistics.median(t)
        # Methods interleaved within each iteration, so load from other processes on the
        # host falls on all of them alike; a few rounds first as warm-up.
        times: dict = {m: [] for m in ("barrier",) + METHODS}
        for it in range(iters + 5):
            for method in times:
                t0 = time.perf_counter()
                if method != "barrier":
                    if rank == 0:
                        _send(method, group, so, step, tp, mq)
                    else:
                        _recv(method, group, tp, mq)
                dist.barrier(group=group)
                if it >= 5:
                    times[method].append(time.perf_counter() - t0)
        base = statistics.median(times.pop("barrier"))
        row["barrier_us"] = 1e6 * base
        for method, t in times.items():
            row[f"{method}_us"] = 1e6 * (statistics.median(t) - base)
        results[name] = row
    tp.mq = mq
    tp.destroy()
    if rank == 0:
        conn.send(results)


def main(argv: list[str] | None = None) -> dict:
    import multiprocessing as mp

    from pyengine.distributed import get_distributed_init_method, get_open_port

    args = build_parser().parse_args(argv)
    hw = hardware_info("cpu")
    cmd = "benchmarks/tp_step_broadcast.py " + " ".join(argv or sys.argv[1:])
    init = get_distributed_init_method("127.0.0.1", get_open_port())
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, args=(rank, init, args.iters, w)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = r.recv()
    for p in procs:
        p.join()
    rows = []
    for name, row in results.items():
        row["cbor2_total_us"] = row["cbor2_us"] + row["pack_us"]
        row["object_list_total_us"] = row["object_list_us"] + row["pack_us"]
        rows.append([name, row["shm_us"], row["packed_us"], row["cbor2_us"], row["object_list_us"], row["pack_us"],
                     row["cbor2_total_us"], row["object_list_total_us"]])
    print(header_md("Step inputs rank 0 -> rank 1 (us per step, median)", hw, cmd))
    print(md_table(["step", "packed, shared memory", "packed, gloo", "cbor2", "object_list", "pack (rank 1 must add)",
                    "cbor2 + pack", "object_list + pack"], rows))
    return finish("tp_step_broadcast", args, hw, cmd, results=results)


if __name__ == "__main__":
    main()

"""What one decoder-layer all-reduce + residual add + RMSNorm costs on two GPUs, three ways,
in microseconds per call (hidden 4096, bf16; rows = tokens in the step):

* ``nccl``: NCCL all-reduce, then the triton ``fused_add_rms_norm`` (vengine's default);
* ``symm_mem``: torch's symmetric-memory one-shot all-reduce, then the same norm
  (``VENGINE_SYMM_MEM_ALLREDUCE=1, VENGINE_FUSED_ALLREDUCE_RMSNORM=0``);
* ``fused``: pyengine/distributed/all_reduce_norm.py, one kernel
  (``VENGINE_SYMM_MEM_ALLREDUCE=1``).

Each is a chain of ``--calls`` calls (every call's residual output feeding the next, as
in a decoder) captured in one CUDA graph, replayed ``--iters`` times; the figure is the
replay time over the number of calls (median of ``--repeats``). Needs two CUDA GPUs.

    python benchmarks/all_reduce_norm.py --json all_reduce_norm.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks.common import cuda_graph_replay_us, finish, hardware_info, header_md, md_table  # noqa: E402

HIDDEN = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128", help="comma-separated token counts")
    p.add_argument("--calls", type=int, default=64, help="calls per graph (even)")
    p.add_argument("--iters", type=int, default=50, help="graph replays per timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", dest="json_out", default=None)
    return p


def _rank_main(rank: int, init: str, args, conn) -> None:
    import torch

    from pyengine.distributed import init_distributed_environment
    from pyengine.ops.native import fused_add_rms_norm

    device = torch.device("cuda", rank)
    tp = init_distributed_environment(rank, 2, init, device)
    os.environ["VENGINE_SYMM_MEM_ALLREDUCE"] = "1"
    assert tp.enable_symm_mem(torch.bfloat16), "symmetric memory unavailable"
    assert tp.fused_norm is not None, "fused all-reduce + RMSNorm unavailable"
    fused, sm = tp.fused_norm, tp.symm_mem
    weight = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    barrier = torch.distributed.barrier  # both ranks start each timing together
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = torch.randn(args.calls, rows, HIDDEN, device=device, dtype=torch.bfloat16)
        r0 = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)

        def chain(mode):
            def run():
                r = r0
                for k in range(args.calls):
                    x = xs[k].clone() if mode == "nccl" else xs[k]  # NCCL reduces in place
                    if mode == "fused":
                        _, r = fused(x, r, weight, 1e-5)
                    else:
                        if mode == "nccl":
                            torch.distributed.all_reduce(x, group=tp.device_group)
                        else:
                            x = sm(x)
                        _, r = fused_add_rms_norm(x, r, weight, 1e-5)
            return run

        row = {}
        for mode in ("nccl", "symm_mem", "fused"):
            if mode != "nccl" and not fused.accepts(xs[0], r0):
                continue
            row[mode] = cuda_graph_replay_us(chain(mode), args.iters, args.repeats, barrier) / args.calls
        # a bare clone per call is in the nccl chain only; time it to subtract
        row["clone"] = cuda_graph_replay_us(lambda: [xs[k].clone() for k in range(args.calls)], args.iters,
                                            args.repeats, barrier) / args.calls
        results[rows] = row
    if rank == 0:
        conn.send(results)
    tp.destroy()


def main(argv: list[str] | None = None) -> dict:
    import multiprocessing as mp

    from pyengine.distributed import get_distributed_init_method, get_open_port

    args = build_parser().parse_args(argv)
    hw = hardware_info("cuda")
    cmd = "benchmarks/all_reduce_norm.py " + " ".join(argv or sys.argv[1:])
    init = get_distributed_init_method("127.0.0.1", get_open_port())
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, args=(rank, init, args, w)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = r.recv()
    for p in procs:
        p.join()
    rows = [[n, v["nccl"] - v["clone"], v.get("symm_mem"), v.get("fused"),
             (v.get("fused") / v.get("symm_mem")) if v.get("fused") and v.get("symm_mem") else None]
            for n, v in results.items()]
    print(header_md("All-reduce + residual add + RMSNorm, hidden 4096 bf16, two GPUs (us per call)", hw, cmd))
    print(md_table(["rows", "NCCL + norm", "symm-mem one-shot + norm", "fused kernel", "fused / symm-mem"], rows))
    return finish("all_reduce_norm", args, hw, cmd, results=results)


if __name__ == "__main__":
    main()

"""Batch-1 linear layers: cuBLAS (``F.linear``) against pyengine/ops/gemv.py's Triton GEMV
on the Llama-3.1-8B shapes at TP=1 and TP=2 (bf16, one GPU), microseconds per call and
the weight bytes read per second.

Each timing is a CUDA graph of calls that rotate over copies of the weight totalling more
than 8x the L2 cache (so every call reads its weight from HBM, as in a forward), replayed
``--iters`` times; the median of ``--repeats``. ``--sweep`` times every (BLOCK_N, BLOCK_K,
warps) of the grid below and reports the best per shape.

    python benchmarks/gemv.py --sweep --json gemv.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks.common import cuda_graph_replay_us, finish, hardware_info, header_md, md_table  # noqa: E402

# (name, N, K): q/k/v, o_proj, gate/up, down_proj of Llama-3.1-8B, whole and halved
SHAPES = [("qkv tp1", 6144, 4096), ("o tp1", 4096, 4096), ("gate_up tp1", 28672, 4096), ("down tp1", 4096, 14336),
          ("qkv tp2", 3072, 4096), ("o tp2", 4096, 2048), ("gate_up tp2", 14336, 4096), ("down tp2", 4096, 7168)]
GRID = {"block_n": (4, 8, 16), "block_k": (512, 1024, 2048), "num_warps": (4, 8)}
DEFAULT = {}  # gemv()'s own choice


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time every config of the grid")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", dest="json_out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    from pyengine.ops.gemv import gemv

    args = build_parser().parse_args(argv)
    hw = hardware_info("cuda")
    cmd = "benchmarks/gemv.py " + " ".join(argv if argv is not None else sys.argv[1:])
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results, rows = {}, []
    configs = ([dict(zip(GRID, c)) for c in itertools.product(*GRID.values())] if args.sweep else [DEFAULT])
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-8 * l2 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])
        cublas = cuda_graph_replay_us(lambda: [F.linear(x, w) for w in ws], args.iters, args.repeats) / len(ws)
        best, timed = None, []
        for cfg in configs:
            err = (gemv(x, ws[0], **cfg).float() - ref.float()).abs().max().item()
            t = cuda_graph_replay_us(lambda: [gemv(x, w, **cfg) for w in ws], args.iters, args.repeats) / len(ws)
            timed.append({**cfg, "us": t})
            if best is None or t < best[0]:
                best = (t, cfg, err)
        t, cfg, err = best
        default = t if not args.sweep else cuda_graph_replay_us(lambda: [gemv(x, w) for w in ws], args.iters,
                                                                args.repeats) / len(ws)
        results[name] = {"n": n, "k": k, "bytes": nbytes, "cublas_us": cublas, "gemv_us": t, "config": cfg,
                         "gemv_default_us": default, "max_abs_err_vs_cublas": err, "cublas_tb_s": nbytes / cublas / 1e6,
                         "gemv_tb_s": nbytes / t / 1e6, "sweep": timed}
        label = "/".join(str(cfg[key]) for key in GRID) if cfg else "default"
        rows.append([name, f"{n}x{k}", cublas, default, t, default / cublas, nbytes / cublas / 1e6,
                     nbytes / t / 1e6, label, err])
        ws.clear()
        torch.cuda.empty_cache()
    print(header_md("Batch-1 linear, bf16: cuBLAS vs Triton GEMV (us per call)", hw, cmd))
    print(md_table(["layer", "N x K", "cuBLAS", "GEMV (default tile)", "GEMV (best tile)", "default / cuBLAS",
                    "cuBLAS TB/s", "best TB/s", "best BLOCK_N/BLOCK_K/warps", "max |diff|"], rows))
    return finish("gemv", args, hw, cmd, results=results)


if __name__ == "__main__":
    main()

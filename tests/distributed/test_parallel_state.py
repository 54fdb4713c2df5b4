"""pyengine/distributed/parallel_state.py: the symmetric-memory all-reduce gives NCCL's
sums (eagerly and replayed from a CUDA graph), takes only what it should, and stays off
when VENGINE_SYMM_MEM_ALLREDUCE=0. Two GPUs (the `nvidia-h200-x2` machine)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import run_two_ranks

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA GPUs")


def _rank(rank: int, init_method: str, env_off: bool, q) -> None:
    os.environ["VENGINE_SYMM_MEM_ALLREDUCE"] = "0" if env_off else "1"
    from pyengine.distributed import init_distributed_environment

    device = torch.device("cuda", rank)
    tp = init_distributed_environment(rank, 2, init_method, device)
    try:
        on = tp.enable_symm_mem(torch.bfloat16, max_bytes=1 << 16)
        report = {"on": on, "cases": []}
        gen = torch.Generator(device=device).manual_seed(rank)
        for rows in (1, 3, 8, 64):  # 8 KB ... 512 KB of bf16: the last one past max_bytes -> NCCL
            x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16, generator=gen)
            ref = x.float().clone()
            torch.distributed.all_reduce(ref, group=tp.device_group)
            taken = tp.symm_mem is not None and tp.symm_mem.accepts(x)
            y = tp.all_reduce(x.clone())
            report["cases"].append((rows, taken, (y.float() - ref).abs().max().item()))
        # captured in a CUDA graph and replayed with new inputs
        static = torch.zeros(2, 4096, device=device, dtype=torch.bfloat16)
        tp.all_reduce(static.clone())  # warm-up outside capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tp.all_reduce(static.clone())
        errs = []
        for k in range(3):
            static.copy_(torch.full_like(static, float(rank + 1 + k)))
            graph.replay()
            torch.cuda.synchronize(device)
            errs.append((out.float() - float(2 * k + 3)).abs().max().item())  # (1+k) + (2+k)
        report["graph_errors"] = errs
        q.put((rank, report))
        del graph, out  # a captured NCCL call left alive kept destroy_process_group from returning
        torch.cuda.synchronize(device)
    finally:
        tp.destroy()


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(300)
def test_symm_mem_all_reduce_matches_nccl_eager_and_in_cuda_graphs():
    reports = run_two_ranks(_rank, False)
    for rank, rep in reports.items():
        assert rep["on"], "symmetric memory should be available on two NVLink-connected H200s"
        taken = {rows: t for rows, t, _ in rep["cases"]}
        assert taken == {1: True, 3: True, 8: True, 64: False}  # limit 64 KB: 8 rows of 4096 bf16 are 64 KB
        for rows, _, err in rep["cases"]:
            assert err <= 0.0625, (rank, rows, err)  # the bf16 rounding of a sum of two N(0, 1) draws
        assert max(rep["graph_errors"]) == 0.0


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(300)
def test_symm_mem_all_reduce_off_by_env():
    reports = run_two_ranks(_rank, True)
    for rep in reports.values():
        assert rep["on"] is False
        assert all(not t for _, t, _ in rep["cases"])
        assert max(rep["graph_errors"]) == 0.0

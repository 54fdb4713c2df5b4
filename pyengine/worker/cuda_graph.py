"""CUDA graphs for decode-only steps (role of vllm/v1/worker/gpu_model_runner.py's
capture_model and nano-vllm's capture_cudagraph).

One graph per padded batch size, all sharing one memory pool and one set of persistent
input buffers (input ids, positions, slot mapping, sequence lengths, block table). A step
copies its inputs into the first rows of the buffers, pads the rest (slot -1, sequence
length 0: the decode kernel writes and reads nothing for them) and replays the smallest
graph that fits. Nothing per step is baked into a graph: every value it reads lives in
those buffers.
"""
from __future__ import annotations

import logging
import time

import torch

from pyengine.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, then steps of 16, capped at max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 16, 16))
    out = sorted({min(s, max_num_seqs) for s in sizes})
    return out


class CUDAGraphRunner:
    def __init__(self, model, attn_backend, max_num_seqs: int, max_blocks_per_req: int,
                 max_model_len: int, device: torch.device, capture_error_mode: str = "global"):
        self.model = model
        self.capture_error_mode = capture_error_mode  # torch.cuda.graph's
        self.attn_backend = attn_backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        B = self.sizes[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(B, dtype=i64, device=device)
        self.positions = torch.zeros(B, dtype=i64, device=device)
        self.slot_mapping = torch.full((B,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(B, dtype=i32, device=device)
        self.block_table = torch.zeros(B, max_blocks_per_req, dtype=i32, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=i32, device=device)
        self._qsl_cpu = torch.arange(B + 1, dtype=i32)
        self._seq_cpu = torch.zeros(B, dtype=i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=bs, num_reqs=bs, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs],
            query_start_loc_cpu=self._qsl_cpu[:bs + 1], seq_lens_cpu=self._seq_cpu[:bs])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (so smaller ones reuse its pool). Returns seconds."""
        t0 = time.perf_counter()
        if hasattr(self.attn_backend, "reserve"):
            self.attn_backend.reserve(self.max_batch_size)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            self.model(self.input_ids[:bs], self.positions[:bs], meta)  # warm-up (triton autotune/compile)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode=self.capture_error_mode):
                self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("Captured %d CUDA graphs (batch sizes %s..%s) in %.2f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], dt)
        return dt

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode-only step with meta.num_reqs <= max_batch_size; returns hidden [num_reqs, H]."""
        n = meta.num_reqs
        bs = next(s for s in self.sizes if s >= n)
        w = meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n], non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:n, :w].copy_(meta.block_table, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

"""CUDA graphs for decode-only steps (role of vllm/v1/worker/gpu_model_runner.py's
capture_model and nano-vllm's capture_cudagraph).

One graph per padded batch size, all sharing one memory pool and one set of persistent
input buffers (input ids, positions, slot mapping, sequence lengths, block table). A step
copies its inputs into the first rows of the buffers, pads the rest (slot -1, sequence
length 0: the decode kernel writes and reads nothing for them) and replays the smallest
graph that fits. Nothing per step is baked into a graph: every value it reads lives in
those buffers.

``query_len`` > 1: graphs of speculative-decoding verification steps where every request
feeds the same ``query_len`` tokens (its newest token and ``query_len - 1`` drafts; the
triton extend kernel, whose grid depends only on the host ints ``query_len`` and the
padded batch size). Padding requests then get sequence length ``query_len`` (they read
whatever their block-table row names, and write nothing).
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
                 max_model_len: int, device: torch.device, capture_error_mode: str = "global",
                 query_len: int = 1):
        self.model = model
        self.capture_error_mode = capture_error_mode  # torch.cuda.graph's
        self.attn_backend = attn_backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.query_len = q = query_len
        B = self.sizes[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(B * q, dtype=i64, device=device)
        self.positions = torch.zeros(B * q, dtype=i64, device=device)
        self.slot_mapping = torch.full((B * q,), -1, dtype=i64, device=device)
        self.seq_lens = torch.full((B,), 0 if q == 1 else q, dtype=i32, device=device)
        self.block_table = torch.zeros(B, max_blocks_per_req, dtype=i32, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=i32, device=device) * q
        self._qsl_cpu = torch.arange(B + 1, dtype=i32) * q
        self._seq_cpu = torch.full((B,), q, dtype=i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        q = self.query_len
        return AttentionMetadata(
            num_actual_tokens=bs * q, num_reqs=bs, max_query_len=q, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs * q],
            query_start_loc_cpu=self._qsl_cpu[:bs + 1], seq_lens_cpu=self._seq_cpu[:bs])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (so smaller ones reuse its pool). Returns seconds."""
        t0 = time.perf_counter()
        if hasattr(self.attn_backend, "reserve"):
            self.attn_backend.reserve(self.max_batch_size)
        pool = torch.cuda.graph_pool_handle()
        q = self.query_len
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            self.model(self.input_ids[:bs * q], self.positions[:bs * q], meta)  # warm-up (triton autotune/compile)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode=self.capture_error_mode):
                self.outputs[bs] = self.model(self.input_ids[:bs * q], self.positions[:bs * q], meta)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("Captured %d CUDA graphs (batch sizes %s..%s) in %.2f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], dt)
        return dt

    def covers(self, meta: AttentionMetadata) -> bool:
        """Whether ``run`` can take this step: every request feeds ``query_len`` tokens, at
        most ``max_batch_size`` requests, a block table that fits the buffers."""
        q = self.query_len
        return (meta.max_query_len == q and meta.num_actual_tokens == meta.num_reqs * q
                and meta.num_reqs <= self.max_batch_size and meta.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step that ``covers`` accepts (decode-only for query_len 1); returns hidden
        [num_reqs * query_len, H]."""
        n, q = meta.num_reqs, self.query_len
        t = n * q
        bs = next(s for s in self.sizes if s >= n)
        w = meta.block_table.shape[1]
        self.input_ids[:t].copy_(input_ids[:t], non_blocking=True)
        self.positions[:t].copy_(positions[:t], non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping[:t], non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:n, :w].copy_(meta.block_table, non_blocking=True)
        if bs > n:
            self.slot_mapping[t:bs * q].fill_(-1)
            self.seq_lens[n:bs].fill_(0 if q == 1 else q)
        self.graphs[bs].replay()
        return self.outputs[bs][:t]

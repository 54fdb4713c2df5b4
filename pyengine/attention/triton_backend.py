"""Triton paged-attention backend (role of vllm/v1/attention/backends/triton_attn.py).

Per step: ``reshape_and_cache`` writes the step's K/V rows into the paged cache by slot
mapping (padding rows, slot -1, skipped); then

* decode-only batches (``meta.max_query_len == 1``): the split-KV decode kernel, grid
  ``(num_reqs, num_kv_heads, num_splits)`` where ``num_splits`` depends only on
  ``num_reqs`` and the device, plus a reduction kernel. No host syncs, no allocations
  except the output tensor, scratch owned by the backend: capturable in a CUDA graph.
* uniform short queries (every request ``Q = meta.max_query_len`` <= 16 rows, at most
  64 rows: speculative verification, a draft chain's first forward): the same decode
  kernel, each row a causal decode query of its own (``paged_decode(query_len=Q)``) with
  the split count of ``num_reqs`` requests, so a verification row attends as the plain
  decode step would; the extend kernel costs several times more at these sizes.
* anything else (prefill, chunked prefill, mixed decode + prefill): the varlen extend
  kernel over each request's whole context read through the block table.

CUDA graphs (decode): capture with ``meta.num_reqs`` equal to the padded batch size and
``seq_lens`` of padding requests set to 0 (their output rows are zeros). Call
``reserve(max_num_seqs)`` once before capture so the split scratch is allocated outside
the graph; otherwise it is allocated on first use and grown if a larger batch arrives.
Rows past ``num_reqs`` in a decode step (padding of ``T`` beyond the padded batch) are
left unwritten.

Host ints used: ``meta.num_reqs``, ``meta.max_query_len`` (never ``.item()``).
"""
from __future__ import annotations

import torch

from pyengine.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from pyengine.ops.fused import rope_and_cache
from pyengine.ops.paged_attention import default_num_splits, paged_decode, paged_extend, reshape_and_cache, varlen_attention

# the uniform short-query path's limits (query rows per request, rows in all)
SHORT_QUERY_LEN, SHORT_QUERY_ROWS = 16, 64


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` (the current device) and ``cuda:0`` name one device here; ``==`` says no."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Triton backend. Extra knobs (attributes, set before first use / capture):
    ``max_splits`` (decode split cap, default 16), ``waves`` (target decode programs per
    SM, default 2), ``num_splits_override`` (force a split count; None = heuristic)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
        dev = torch.device(device)
        if dev.type == "cuda":
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            self.num_sms = torch.cuda.get_device_properties(idx).multi_processor_count
        else:
            self.num_sms = 8
        self.max_splits = 16
        self.waves = 2.0
        self.num_splits_override: int | None = None
        self._part_out: torch.Tensor | None = None
        self._part_lse: torch.Tensor | None = None
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown scratch (see _ensure_scratch)

    # -- split-KV scratch --------------------------------------------------------------
    def num_splits(self, batch: int) -> int:
        if self.num_splits_override is not None:
            return self.num_splits_override
        return default_num_splits(batch, self.num_kv_heads, self.num_sms, self.max_splits, self.waves)

    def _scratch_units(self, max_batch: int) -> int:
        # max over b <= max_batch of b * num_splits(b): (request, split) pairs
        return max(b * self.num_splits(b) for b in range(1, max_batch + 1))

    def _short_query_units(self, max_batch: int) -> int:
        # the uniform short-query path: b requests of q rows, b * q <= SHORT_QUERY_ROWS
        return max((b * q * self.num_splits(b) for b in range(1, max_batch + 1)
                    for q in range(2, SHORT_QUERY_LEN + 1) if b * q <= SHORT_QUERY_ROWS), default=0)

    def reserve(self, max_num_seqs: int, device: torch.device | None = None) -> None:
        """Allocate the decode scratch for batches up to ``max_num_seqs`` (call before CUDA
        graph capture), the uniform short-query path's included."""
        units = max(self._scratch_units(max_num_seqs), self._short_query_units(max_num_seqs))
        self._ensure_scratch(units, device or torch.device(self.device))

    def _ensure_scratch(self, units: int, device: torch.device) -> None:
        if (self._part_lse is not None and self._part_lse.numel() >= units * self.num_heads
                and _same_device(self._part_lse.device, device)):
            return
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonAttentionBackend: decode scratch too small during CUDA graph "
                               "capture; call backend.reserve(max_num_seqs) before capturing")
        if self._part_lse is not None and self._part_out is not None:
            # graphs captured earlier write into the old buffers: they stay allocated (freed,
            # the allocator would hand them to other tensors that those replays overwrite)
            self._retired.append((self._part_lse, self._part_out))
        self._part_lse = torch.empty(units * self.num_heads, dtype=torch.float32, device=device)
        self._part_out = torch.empty(units * self.num_heads * self.head_dim, dtype=torch.float32,
                                     device=device)

    # -- forward -----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (or None/empty before
        caches are bound: then each request attends over its own rows of this step).
        Returns [T, num_heads, head_dim] in q.dtype (rows past num_actual_tokens
        unspecified)."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_reqs = meta.num_reqs
        if kv_cache is None or kv_cache.numel() == 0:
            # Profiling run (no cache bound yet): k and v may be differently strided views.
            k, v = k.contiguous(), v.contiguous()
            return varlen_attention(q, k, v, meta.query_start_loc, out, self.scale,
                                    meta.max_query_len, num_reqs)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, key_cache, value_cache, meta, out, k_scale, v_scale)

    def forward_with_rope(self, q, k, v, positions, cos_sin_cache, kv_cache, meta,
                          q_norm_weight=None, k_norm_weight=None, eps=1e-6, k_scale=1.0, v_scale=1.0):
        """RoPE (and Qwen3's q/k RMSNorm) fused with the KV-cache write in one kernel;
        the rotated k exists only in the cache. Falls back to the unfused path before the
        caches are bound (profiling) or for a head_dim/2 that is not a power of two."""
        half = q.shape[-1] // 2
        # An FP8 cache takes the unfused path: RoPE, then reshape_and_cache's quantizing write.
        if kv_cache is None or kv_cache.numel() == 0 or half & (half - 1) or kv_cache.dtype == torch.float8_e4m3fn:
            return super().forward_with_rope(q, k, v, positions, cos_sin_cache, kv_cache, meta,
                                             q_norm_weight, k_norm_weight, eps, k_scale, v_scale)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        q = rope_and_cache(q, k, v, positions, cos_sin_cache, key_cache, value_cache, meta.slot_mapping,
                           q_norm_weight, k_norm_weight, eps)
        return self._attend(q, key_cache, value_cache, meta, torch.empty_like(q))

    def _attend(self, q, key_cache, value_cache, meta, out, k_scale=1.0, v_scale=1.0):
        num_reqs, Q = meta.num_reqs, meta.max_query_len
        # decode (Q = 1), or uniform short queries (T == R * max Q: every request has Q rows)
        if Q == 1 or (Q <= SHORT_QUERY_LEN and num_reqs * Q <= SHORT_QUERY_ROWS
                      and meta.num_actual_tokens == num_reqs * Q):
            rows = num_reqs * Q
            splits = self.num_splits(num_reqs)
            if splits > 1:
                if self._part_lse is None:  # first use: size for a typical max batch
                    b = max(num_reqs, 256)
                    self._ensure_scratch(max(self._scratch_units(b), self._short_query_units(b)), q.device)
                self._ensure_scratch(rows * splits, q.device)
            paged_decode(q[:rows], key_cache, value_cache, meta.block_table, meta.seq_lens,
                         out[:rows], self.scale, splits, self._part_out, self._part_lse,
                         k_scale=k_scale, v_scale=v_scale, query_len=Q)
            return out
        return paged_extend(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                            meta.block_table, out, self.scale, meta.max_query_len, num_reqs,
                            k_scale=k_scale, v_scale=v_scale)

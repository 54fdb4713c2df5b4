"""Reference attention backend in plain torch (role of vllm/v1/attention/backends/
cpu_attn.py / the torch SDPA backend): correctness first, runs anywhere.

Per step: write the step's K/V rows into the paged cache at ``slot_mapping`` (rows with
slot -1 are skipped), then, request by request, gather the request's context
(``seq_len`` tokens) through its block table and run causal attention with grouped-query
heads. Query j of a request with query length q and context length s sits at position
s - q + j and sees keys 0 .. s - q + j. Scores and softmax run in float32.
"""
from __future__ import annotations

import torch

from pyengine.attention.backend import AttentionBackend, AttentionMetadata, register_backend


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, Hkv, D];
    slot_mapping: int64 [T] (block_id * block_size + offset, -1 = skip). In place."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    flat = kv_cache.view(2, num_slots, kv_cache.shape[3], kv_cache.shape[4])
    slots = slot_mapping[: k.shape[0]]
    valid = slots >= 0
    idx = slots[valid]  # boolean indexing syncs on CUDA; acceptable for the reference path
    flat[0].index_copy_(0, idx, k[valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, idx, v[valid].to(kv_cache.dtype))


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention for one request whose queries are the *last* q rows of its
    context.

    q: [q_len, H, D]; k, v: [s, Hkv, D] with s >= q_len and H % Hkv == 0 (query head h uses
    kv head h // (H // Hkv), as HF's repeat_kv). Returns [q_len, H, D] in q.dtype; the
    math runs in float32.
    """
    q_len, num_heads, _ = q.shape
    s, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, q, D]
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, s, D]
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, q, s]
    q_pos = torch.arange(s - q_len, s, device=q.device).unsqueeze(1)
    k_pos = torch.arange(s, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Reference backend. Uses ``meta.query_start_loc_cpu`` / ``meta.seq_lens_cpu`` for its
    per-request loop (host-side control flow, so not CUDA-graph capturable).

    ``kv_cache`` may be None or empty (profiling/dummy runs before caches are bound): then
    nothing is written and each request attends over its own rows of this step only (valid
    when the whole context is in the step).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.zeros_like(q)
        has_cache = kv_cache is not None and kv_cache.numel() > 0
        if has_cache:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        bs = kv_cache.shape[2] if has_cache else self.block_size
        for i in range(meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            if end <= start:
                continue
            if has_cache:
                s = seq_lens[i]
                nblocks = (s + bs - 1) // bs
                blocks = meta.block_table[i, :nblocks].long()
                ctx_k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:s]
                ctx_v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:s]
            else:
                ctx_k, ctx_v = k[start:end], v[start:end]
            out[start:end] = causal_gqa_attention(q[start:end], ctx_k, ctx_v, self.scale)
        return out

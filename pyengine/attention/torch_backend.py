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

FP8 = torch.float8_e4m3fn


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, Hkv, D];
    slot_mapping: int64 [T] (block_id * block_size + offset, -1 = skip). In place. An FP8
    cache gets ``clamp(k / k_scale)`` (and v) rounded to e4m3."""
    if kv_cache.dtype == FP8:
        k = (k / k_scale).clamp(-448.0, 448.0)
        v = (v / v_scale).clamp(-448.0, 448.0)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    flat = kv_cache.view(2, num_slots, kv_cache.shape[3], kv_cache.shape[4])
    slots = slot_mapping[: k.shape[0]]
    valid = slots >= 0
    idx = slots[valid]  # boolean indexing syncs on CUDA; acceptable for the reference path
    kk, vv = k[valid].to(kv_cache.dtype), v[valid].to(kv_cache.dtype)
    if kv_cache.dtype == FP8:  # torch's CPU index_copy_ has no FP8 kernel: move the bytes
        flat, kk, vv = flat.view(torch.uint8), kk.view(torch.uint8), vv.view(torch.uint8)
    flat[0].index_copy_(0, idx, kk)
    flat[1].index_copy_(0, idx, vv)


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
                kv_cache: torch.Tensor | None, meta: AttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        out = torch.zeros_like(q)
        has_cache = kv_cache is not None and kv_cache.numel() > 0
        fp8 = has_cache and kv_cache.dtype == FP8
        if has_cache:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
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
                cache = kv_cache.view(torch.uint8) if fp8 else kv_cache  # (no FP8 index_select on CPU)
                ctx_k = cache[0].index_select(0, blocks).flatten(0, 1)[:s]
                ctx_v = cache[1].index_select(0, blocks).flatten(0, 1)[:s]
                if fp8:  # back to the model dtype: e4m3 values times the layer's scale
                    ctx_k = ctx_k.view(FP8).to(q.dtype) * k_scale
                    ctx_v = ctx_v.view(FP8).to(q.dtype) * v_scale
            else:
                ctx_k, ctx_v = k[start:end], v[start:end]
            out[start:end] = causal_gqa_attention(q[start:end], ctx_k, ctx_v, self.scale)
        return out

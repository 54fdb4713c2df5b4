"""Attention backend interface and registry (role of vllm/v1/attention/backends/*).

A backend writes the step's new K/V into the paged cache by slot mapping and computes
attention of the step's queries over each request's cached context, read through its
block table. The model runner builds one ``AttentionMetadata`` per step and passes it to
every layer.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values), dtype = model dtype, or float8_e4m3fn with
``kv_cache_dtype="fp8"``: then each layer passes its per-tensor ``k_scale`` / ``v_scale``
(floats; the cache holds ``k / k_scale`` in e4m3) and the backends read it back scaled.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout. Token rows are grouped by request, requests in batch order.

    num_actual_tokens: rows that are real; rows past it (CUDA-graph padding) have slot -1.
    query_start_loc: int32 [num_reqs + 1], device; request i owns rows [qsl[i], qsl[i+1]).
    seq_lens: int32 [num_reqs], device; context length after this step (cached + new), tokens.
    block_table: int32 [num_reqs, max_blocks_per_req], device; physical block ids.
    slot_mapping: int64 [num_tokens], device; block_id * block_size + offset, -1 = skip.
    query_start_loc_cpu / seq_lens_cpu: the same on the host (torch reference backend).
    """
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


class AttentionBackend(ABC):
    """One instance per model (shared by all layers); stateless across layers except for
    buffers it owns (e.g. split-KV scratch, CUDA-graph persistent buffers)."""

    name: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (RoPE applied);
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; k_scale, v_scale: an
        FP8 cache's scales (ignored for a cache in the model dtype).
        Writes k/v rows into kv_cache at meta.slot_mapping (skipping -1), then returns
        causal attention output [T, num_heads, head_dim] (rows past num_actual_tokens are
        unspecified)."""


    def forward_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-6, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Like ``forward`` but q and k come before RoPE (and before Qwen3's per-head
        RMSNorm when the norm weights are given), so a backend can fuse them with the KV
        write. positions: int64 [T]; cos_sin_cache: [max_positions, head_dim]. This default
        applies them with ``pyengine.ops.apply_rotary`` and calls ``forward``."""
        from pyengine import ops
        q, k = ops.apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
        return self.forward(q, k, v, kv_cache, meta, k_scale, v_scale)


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls
    return deco


def get_backend_cls(name: str) -> type[AttentionBackend]:
    """Raises ValueError for an unknown backend name."""
    # Import for registration side effects; the triton module needs triton installed.
    from pyengine.attention import torch_backend  # noqa: F401
    if name == "triton":
        from pyengine.attention import triton_backend  # noqa: F401
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; valid: {', '.join(sorted(_BACKENDS))}.")
    return _BACKENDS[name]

"""Rotary position embedding with a precomputed cos/sin cache (mirrors
vllm/model_executor/layers/rotary_embedding.py, neox style = HF Llama/Qwen ``rotate_half``).

Supported ``rope_type``: ``default``, ``linear``, ``llama3``. The RoPE parameters are read
from ``hf_config.rope_parameters`` (transformers >= 5) or ``rope_theta`` +
``rope_scaling`` (older configs).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pyengine import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], as transformers' ROPE_INIT_FUNCTIONS.

    Raises ValueError for an unsupported rope_type or partial rotary factor.
    """
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported.")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low_ff = float(params["low_freq_factor"])
        high_ff = float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings") or max_position_embeddings)
        low_wl, high_wl = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache`` [max_position_embeddings, head_dim] (non-persistent buffer).

    cos/sin are computed in float32 then cast to ``dtype`` (HF casts them to the activation
    dtype the same way). ``forward(positions [T], q [T,H,D], k [T,Hkv,D]) -> (q, k)``.
    Positions past the cache are out of range (index error on CPU): the loader extends it
    to ``max_model_len`` (``extend_to``).
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, rope_params: dict,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.head_dim = head_dim
        with torch.device("cpu"):  # kept on the host: a model built on the meta device recomputes its cache
            self._inv_freq = compute_inv_freq(head_dim, rope_params, max_position_embeddings)
        # the current default device (the loader builds models under one)
        self.register_buffer("cos_sin_cache", self._cache(max_position_embeddings, torch.get_default_device(),
                                                          dtype or torch.get_default_dtype()),
                             persistent=False)

    def _cache(self, num_positions: int, device, dtype) -> torch.Tensor:
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=device),
                            self._inv_freq.to(device))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)

    def init_buffers(self, device) -> None:
        """Compute ``cos_sin_cache`` (same length and dtype) on ``device``: the loader's step
        after building the model on the meta device (``loader.materialize``)."""
        cache = self.cos_sin_cache
        self.cos_sin_cache = self._cache(cache.shape[0], device, cache.dtype)

    def extend_to(self, num_positions: int) -> None:
        """Grow the cache to cover positions ``< num_positions`` (the engine's
        ``max_model_len``, which may exceed ``max_position_embeddings`` under linear RoPE
        scaling or ``VENGINE_ALLOW_LONG_MAX_MODEL_LEN``); the same values as computed on
        the fly by transformers."""
        cache = self.cos_sin_cache
        if num_positions > cache.shape[0]:
            self.cos_sin_cache = self._cache(num_positions, cache.device, cache.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.apply_rotary(q, k, positions, self.cos_sin_cache)

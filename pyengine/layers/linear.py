"""Linear layers that hold fused weights (mirrors vllm/model_executor/layers/linear.py,
single-rank for now).

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` used by
``pyengine.models.loader``; fused layers copy each checkpoint shard (q/k/v, gate/up) into
its slice of the output dim. Weights are created uninitialized (``torch.empty``) on the
current default device/dtype: the loader fills them.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (dtype/device converted).
    Raises ValueError on a shape mismatch."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


class Linear(nn.Module):
    """y = x @ W^T (+ b). weight: [out_features, in_features]; bias: [out_features] or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim.

    ``output_sizes`` lists each part's width; ``shard_ids`` names them (e.g. ``("q", "k",
    "v")`` or ``(0, 1)``). ``weight_loader(param, loaded, shard_id)`` writes the checkpoint
    tensor of that part into its row slice; ``param.loaded_shards`` (a set) records which
    parts arrived, so the loader can name missing ones.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_ids: Sequence,
                 bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids = list(shard_ids)
        offsets, off = {}, 0
        for sid, size in zip(self.shard_ids, self.output_sizes):
            offsets[sid] = (off, size)
            off += size
        self._offsets = offsets
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._shard_loader
                p.shard_ids = tuple(self.shard_ids)

    def _shard_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            default_weight_loader(param, loaded)
            return
        if shard_id not in self._offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {self.shard_ids}")
        off, size = self._offsets[shard_id]
        dst = param.data.narrow(0, off, size)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: expected {tuple(dst.shape)}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        dst.copy_(loaded)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection: output = cat(q [H*D], k [Hkv*D], v [Hkv*D]).
    Shard ids ``"q"``, ``"k"``, ``"v"``."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], ("q", "k", "v"), bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q+2kv] -> (q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]) views."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)



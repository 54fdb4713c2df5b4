"""Gated activations (mirrors vllm/model_executor/layers/activation.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops as _ops  # triton kernels on CUDA


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = cat(gate, up) (the fused gate_up projection output).
    Returns silu(gate) * up, [..., d], dtype of x."""
    if _ops.use_triton(x):
        return _ops.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

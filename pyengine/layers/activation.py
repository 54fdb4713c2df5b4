"""Gated activations (mirrors vllm/model_executor/layers/activation.py); the op itself is
``pyengine.ops.silu_and_mul`` (Triton on CUDA, torch elsewhere)."""
from __future__ import annotations

import torch
from torch import nn

from pyengine import ops

__all__ = ["SiluAndMul"]


# config.json hidden_act values that are SiLU (transformers' ACT2FN maps "swish" to SiLU too)
SILU_NAMES = ("silu", "swish")


class SiluAndMul(nn.Module):
    """x: [..., 2*d] = cat(gate, up) -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)

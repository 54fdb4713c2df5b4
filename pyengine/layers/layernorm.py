"""RMSNorm (mirrors vllm/model_executor/layers/layernorm.py); the ops themselves are
``pyengine.ops.rms_norm`` / ``fused_add_rms_norm`` (Triton on CUDA, torch elsewhere)."""
from __future__ import annotations

import torch
from torch import nn

from pyengine import ops

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``forward(x)`` -> normed x; ``forward(x, residual)`` ->
    (normed(x + residual), x + residual) (the fused residual-add variant used between
    decoder layers, as in vLLM).

    ``forward(x, residual, all_reduce_x=True)``: ``x`` is this rank's partial sum of a
    ``RowParallelLinear(reduce_results=False)``; it is summed over ``tp_group`` first, in
    one kernel with the add and the norm where the group has one
    (``GroupCoordinator.all_reduce_add_rms_norm``). Without a group (one rank) the flag
    changes nothing."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, tp_group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.tp_group = tp_group if tp_group is not None and tp_group.world_size > 1 else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, all_reduce_x: bool = False):
        if residual is None:
            if all_reduce_x and self.tp_group is not None:
                x = self.tp_group.all_reduce(x)
            return ops.rms_norm(x, self.weight, self.eps)
        if all_reduce_x and self.tp_group is not None:
            return self.tp_group.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

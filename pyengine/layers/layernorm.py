"""RMSNorm (mirrors vllm/model_executor/layers/layernorm.py).

The ops are plain module-level functions so a kernels module can swap in fused CUDA/triton
versions without touching the models.
"""
from __future__ import annotations

import torch
from torch import nn

from pyengine import ops as _ops  # triton kernels on CUDA


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2) + eps)).

    x: [..., hidden] any float dtype; weight: [hidden]. Statistics are computed in float32
    and the normalized value is cast back to x.dtype *before* the weight multiply, exactly as
    HF's LlamaRMSNorm does, so low-precision results match transformers bit for bit.
    Returns a tensor shaped and typed like x.
    """
    if _ops.use_triton(x):
        return _ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual').

    x, residual: [..., hidden], same dtype; weight: [hidden]. The sum is kept in x.dtype
    (HF adds the residual in model dtype too). Pure function: inputs are not modified; a
    kernel version may update in place, so callers must not reuse x/residual afterwards.
    """
    if _ops.use_triton(x):
        return _ops.fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


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
            return rms_norm(x, self.weight, self.eps)
        if all_reduce_x and self.tp_group is not None:
            return self.tp_group.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

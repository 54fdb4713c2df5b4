"""The torch reference of every fused op (vLLM's ``forward_native``): what ``pyengine.ops``
runs where Triton does not (CPU, ``VENGINE_DISABLE_TRITON_OPS=1``), and what the kernels
are tested against. Shapes and dtypes as in ``pyengine.ops``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2) + eps)).

    x: [..., hidden] any float dtype; weight: [hidden]. Statistics are computed in float32
    and the normalized value is cast back to x.dtype *before* the weight multiply, exactly as
    HF's LlamaRMSNorm does, so low-precision results match transformers bit for bit.
    Returns a tensor shaped and typed like x.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual').

    x, residual: [..., hidden], same dtype; weight: [hidden]. The sum is kept in x.dtype
    (HF adds the residual in model dtype too). Pure function: inputs are not modified (a
    kernel version may update in place, so callers must not reuse x/residual afterwards).
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = cat(gate, up) (the fused gate_up projection output).
    Returns silu(gate) * up, [..., d], dtype of x."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE on q and k.

    q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]; positions: int64 [T];
    cos_sin_cache: [max_positions, head_dim] = cat(cos, sin) over the head_dim/2
    frequencies, in the model dtype. Returns new (q, k), same shapes/dtypes.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rotated * sin

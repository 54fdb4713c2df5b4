"""The torch reference of every fused op (vLLM's ``forward_native``): what ``pyengine.ops``
runs where Triton does not (CPU, ``VENGINE_DISABLE_TRITON_OPS=1``), and what the kernels
are tested against. Shapes and dtypes as in ``pyengine.ops``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "seeded_exponentials"]


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


# ---- counter-based random draws of seeded rows (see pyengine/ops/__init__.py) -----------
_M32 = 0xFFFFFFFF
# the 32-bit "lowbias32" mixer's multipliers (Wellons' hash prospector); salts keep a
# position, a token id and a seed half from ever entering a mix as the same word
MIX_MUL = (0x7FEB352D, 0x846CA68B)
POS_SALT, TOKEN_SALT = 0x9E3779B9, 0x6A09E667


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow: c in two 16-bit halves
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit words (int64 tensors holding values in [0, 2**32)) with full
    avalanche: xorshift-multiply rounds."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL[1])
    return x ^ (x >> 16)


def seeded_bits(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                vocab_size: int) -> torch.Tensor:
    """int64 [R, vocab_size], 32-bit words: a hash of (seed, position, token id). For one
    row (seed, position) it is a bijection of the token id, so no two tokens share a word."""
    key = mix32(mix32(mix32((positions.to(torch.int64) & _M32) ^ POS_SALT) ^ seed_hi) ^ seed_lo)
    tok = mix32(torch.arange(vocab_size, dtype=torch.int64, device=positions.device) + TOKEN_SALT)
    return mix32(key.unsqueeze(1) ^ tok.unsqueeze(0))


def seeded_exponentials(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """float32 [R, vocab_size] of Exp(1) draws, a function of (seed, position, token id)
    only: ``-log(u)``, ``u`` the top 23 bits of ``seeded_bits`` as a float in (0, 1): with 24
    bits, (2**24 - 1) + 0.5 rounds to 2**24 in float32, u = 1 and the draw -0.0, which makes a
    zero-probability token's 0 / -0 a NaN that wins the argmax."""
    u = ((seeded_bits(seed_lo, seed_hi, positions, vocab_size) >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    return u.log_().neg_()

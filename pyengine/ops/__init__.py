"""Device kernels with torch fallbacks (role of vllm/_custom_ops.py).

Each op runs the triton kernel (``pyengine/ops/fused.py``) when the input is on a CUDA
device, else its torch reference (``pyengine/ops/native.py``). The layers
(``pyengine/layers``) call these and nothing below them. Triton is imported only on first
CUDA use, so CPU-only hosts never need it.

* ``rms_norm(x, weight, eps) -> y``
* ``fused_add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)``
* ``silu_and_mul(x [..., 2d]) -> [..., d]``
* ``linear(x [T, K], weight [N, K], bias) -> [T, N]``: ``F.linear``, but one bf16/fp16
  row (batch-1 decode) goes through the Triton GEMV (ops/gemv.py), faster than cuBLAS
  on every 8B-model layer shape on the H200.
* ``apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight=None, k_norm_weight=None,
  eps=1e-6) -> (q, k)``: neox RoPE, optionally fused with Qwen3's per-head q/k RMSNorm
  (applied before the rotation).
* ``seeded_exponentials(seeds, positions, vocab_size) -> [R, V]``: seeded rows' draws.

Set ``VENGINE_DISABLE_TRITON_OPS=1`` to force the torch versions on CUDA too. With
``TRITON_INTERPRET=1``, ``VENGINE_TRITON_OPS_ON_CPU=1`` runs the triton kernels on CPU
tensors through triton's interpreter (tests of the GPU compute path on a CPU machine).
"""
from __future__ import annotations

import torch

from pyengine import envs
from pyengine.ops import native

_DISABLED = envs.disable_triton_ops()
_ON_CPU = envs.triton_ops_on_cpu()


def use_triton(x: torch.Tensor) -> bool:
    return (x.is_cuda or _ON_CPU) and not _DISABLED


def _fused():
    from pyengine.ops import fused
    return fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _fused().rms_norm(x, weight, eps)
    return native.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _fused().fused_add_rms_norm(x, residual, weight, eps)
    return native.fused_add_rms_norm(x, residual, weight, eps)


_GEMV_DTYPES = (torch.bfloat16, torch.float16)  # float32 keeps cuBLAS: the exactness tests' dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and not _DISABLED and x.dtype in _GEMV_DTYPES
            and weight.dtype == x.dtype and x.is_contiguous() and weight.stride(-1) == 1):
        from pyengine.ops.gemv import gemv
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return _fused().silu_and_mul(x)
    return native.silu_and_mul(x)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    if use_triton(q) and half & (half - 1) == 0:  # kernel needs head_dim/2 a power of two
        return _fused().apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight,
                                     k_norm_weight, eps)
    if q_norm_weight is not None:
        q = native.rms_norm(q, q_norm_weight, eps)
        k = native.rms_norm(k, k_norm_weight, eps)
    return native.apply_rotary(q, k, positions, cos_sin_cache)


def seeded_exponentials(seeds, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [R, vocab_size] of i.i.d. Exp(1) draws, each a function of its row's seed,
    its row's position and its token id only (a counter-based generator, as SGLang's and
    LMDeploy's seeded sampling; vLLM keeps a ``torch.Generator`` per request). ``seeds``:
    R ints in [-2**63, 2**64) (the low 64 bits count); ``positions``: int64 [R] on the
    device, each row's input position. So a seeded row's token at a position does not
    depend on how many draws came before it (the batch, sync or async scheduling, the rows
    a speculative step verified, a preemption). Raises ValueError unless there is one seed
    per position."""
    if len(seeds) != positions.shape[0]:
        raise ValueError(f"{len(seeds)} seeds for {positions.shape[0]} positions")
    halves = torch.tensor([[s & 0xFFFFFFFF for s in seeds], [(s >> 32) & 0xFFFFFFFF for s in seeds]],
                          dtype=torch.int64, pin_memory=positions.is_cuda).to(positions.device, non_blocking=True)
    if use_triton(positions):
        return _fused().seeded_exponentials(halves[0], halves[1], positions, vocab_size)
    return native.seeded_exponentials(halves[0], halves[1], positions, vocab_size)


__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "linear", "use_triton",
           "seeded_exponentials"]

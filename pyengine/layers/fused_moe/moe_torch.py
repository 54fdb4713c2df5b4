"""The experts' computation in plain torch, one expert at a time (the CPU path, and the
reference the Triton kernels are tested against). The same operations, in the same dtypes,
as transformers' MoE experts (``Qwen3MoeExperts``, ``MixtralExperts``, ``Qwen2MoeExperts``
under their default ``grouped_mm`` implementation, ``transformers/integrations/moe.py``):
for each (token, slot) pair, gate/up projection (rounded to the activation dtype), SiLU of
the gate (rounded), times up (rounded), down projection (rounded), times the routing
weight; then the k products of a token summed (``sum`` over the slots, float32
accumulation, one rounding).

The routing weight's dtype decides the product's: Qwen-MoE's routers cast the top-k weights
to the activation dtype (a bf16 product, rounded), Mixtral's keep them float32 (a float32
product, rounded only after the sum) -- ``cast_weights``. In float32 both are the float32
computation, and the result is transformers' bit for bit from the same inputs.

It syncs with the host (which experts were hit), so it is not for CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                        cast_weights: bool = True) -> torch.Tensor:
    """hidden: [T, H]; w13: [E_local, 2 * I, H] (gate rows then up rows); w2: [E_local, H, I];
    topk_weights: float [T, k]; topk_ids: int [T, k], global expert ids; expert_map: int32
    [E] (global id -> local id, -1 for an expert this rank does not hold; expert
    parallelism) or None (every expert local); ``cast_weights``: the routing weights are
    cast to hidden's dtype before they scale the experts' outputs (Qwen-MoE), else they
    stay float32 and so does the product (Mixtral). Returns [T, H] in hidden's dtype: the
    sum over the chosen (local) experts of weight * down(silu(gate(x)) * up(x))."""
    t, k = topk_ids.shape
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    weights = topk_weights.to(hidden.dtype) if cast_weights else topk_weights
    pair_out = torch.zeros(t, k, hidden.shape[1], dtype=torch.promote_types(hidden.dtype, weights.dtype),
                           device=hidden.device)
    inter = w2.shape[-1]
    for e in torch.unique(ids).tolist():  # ascending
        if e < 0:
            continue
        slot, tok = torch.where(ids.t() == e)  # slot-major rows, as transformers' eager loop (a GEMM's bits follow row order)
        gate_up = F.linear(hidden[tok], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        pair_out[tok, slot] = F.linear(h, w2[e]) * weights[tok, slot, None]
    return pair_out.sum(dim=1).to(hidden.dtype)

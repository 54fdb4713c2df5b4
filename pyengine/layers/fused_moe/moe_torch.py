"""The experts' computation in plain torch, one expert at a time (the CPU path, and the
reference the Triton kernels are tested against). The same operations in the same order
as transformers' ``Qwen3MoeExperts.forward`` (and Mixtral's, Qwen2-MoE's): for each
expert that some token chose, in ascending expert order, gate/up projection, SiLU(gate)
* up, down projection, times the routing weight, added into the output rows. In float32
it gives transformers' result bit for bit from the same inputs.

It syncs with the host (which experts were hit), so it is not for CUDA graphs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def fused_experts_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden: [T, H]; w13: [E_local, 2 * I, H] (gate rows then up rows); w2: [E_local, H, I];
    topk_weights: float [T, k]; topk_ids: int [T, k], global expert ids; expert_map: int32
    [E] (global id -> local id, -1 for an expert this rank does not hold; expert
    parallelism) or None (every expert local). Returns [T, H] in hidden's dtype: the sum
    over the chosen (local) experts of weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros_like(hidden)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    inter = w2.shape[-1]
    for e in torch.unique(ids).tolist():  # ascending, as transformers' expert loop
        if e < 0:
            continue
        slot, tok = torch.where(ids.t() == e)  # slot-major rows, as transformers (a GEMM's bits follow row order)
        x = hidden[tok]
        gate_up = F.linear(x, w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * topk_weights[tok, slot, None].to(hidden.dtype)
        out.index_add_(0, tok, y)
    return out

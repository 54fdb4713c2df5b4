"""Top-k expert selection (the role of ``fused_topk`` in
vllm/model_executor/layers/fused_moe/fused_moe.py), the math of transformers' MoE
routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``):
softmax over every expert in float32, the ``top_k`` largest probabilities, and, with
``renormalize``, those divided by their sum.
"""
from __future__ import annotations

import torch


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] (any float dtype; the router's output). Returns
    ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``, each row in
    descending probability (``torch.topk``'s order, as transformers). No host sync.

    Raises ValueError when ``top_k`` is not in [1, E]."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)

"""Mixture-of-experts layers (vLLM's vllm/model_executor/layers/fused_moe/):

* ``router.fused_topk``: softmax top-k routing, as transformers' MoE routers;
* ``layer.FusedMoE``: one layer's experts, stacked [E, ...], tensor- or expert-parallel;
* ``moe_torch.fused_experts_torch``: the per-expert torch loop (CPU path, reference);
* ``fused_moe.fused_experts``: the Triton kernels (CUDA path; imports triton), with
  per-shape tile configs in ``configs/*.json``.
"""
from pyengine.layers.fused_moe.layer import FusedMoE, expert_checkpoint_target
from pyengine.layers.fused_moe.moe_torch import fused_experts_torch
from pyengine.layers.fused_moe.router import fused_topk

__all__ = ["FusedMoE", "expert_checkpoint_target", "fused_experts_torch", "fused_topk"]

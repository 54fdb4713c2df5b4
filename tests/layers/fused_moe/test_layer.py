"""pyengine/layers/fused_moe: the router and the per-expert torch path against
transformers' own modules (bit for bit in float32), and FusedMoE's loading and
partial sums under tensor and expert parallelism (ranks simulated in one process)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pyengine.layers.fused_moe import FusedMoE, expert_checkpoint_target, fused_experts_torch, fused_topk

E, K, H, INTER = 8, 2, 32, 24


def _hf_config(cls_name, **kw):
    import transformers

    base = dict(hidden_size=H, num_experts_per_tok=K, experts_implementation="eager", hidden_act="silu")
    if cls_name == "MixtralConfig":
        base.update(num_local_experts=E, intermediate_size=INTER)
    else:
        base.update(num_experts=E, moe_intermediate_size=INTER)
    base.update(kw)
    return getattr(transformers, cls_name)(**base)


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True),
                                       ("qwen2_moe", False)])
def test_router_matches_transformers(arch, norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls, cfg_name = {"qwen3_moe": (Qwen3MoeTopKRouter, "Qwen3MoeConfig"), "mixtral": (MixtralTopKRouter, "MixtralConfig"),
                     "qwen2_moe": (Qwen2MoeTopKRouter, "Qwen2MoeConfig")}[arch]
    kw = {} if arch == "mixtral" else {"norm_topk_prob": norm}
    router = cls(_hf_config(cfg_name, **kw))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g))
        x = torch.randn(13, H, generator=g)
        logits, ref_w, ref_ids = router(x)
    w, ids = fused_topk(logits, K, renormalize=norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids) and torch.equal(w, ref_w.float())


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        fused_topk(torch.zeros(2, 4), 5, True)


def _weights(seed=1, e=E, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = 0.3 * torch.randn(e, 2 * INTER, H, generator=g)
    w2 = 0.3 * torch.randn(e, H, INTER, generator=g)
    return w13.to(dtype), w2.to(dtype)


def _routing(t, seed=2):
    g = torch.Generator().manual_seed(seed)
    return fused_topk(torch.randn(t, E, generator=g), K, True)


def test_torch_experts_match_transformers_bitwise():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf = Qwen3MoeExperts(_hf_config("Qwen3MoeConfig"))
    w13, w2 = _weights()
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        x = torch.randn(17, H, generator=torch.Generator().manual_seed(3))
        w, ids = _routing(17)
        ref = hf(x, ids.long(), w)
    assert torch.equal(fused_experts_torch(x, w13, w2, w, ids), ref)


_EXPERTS = {"qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeExperts", True),
            "mixtral": ("MixtralConfig", "mixtral", "MixtralExperts", False),
            "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeExperts", True)}


@pytest.mark.parametrize("arch", list(_EXPERTS))
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_torch_experts_match_transformers_bf16(arch, impl):
    """bf16, transformers' default experts implementation (``grouped_mm``): each GEMM output,
    the SiLU and gate*up rounded to bf16, the routing weight in the router's dtype (bf16 for
    Qwen-MoE, float32 for Mixtral) times the down output, then the slots summed in float32
    and rounded once. Bit for bit. transformers' eager loop instead adds each product into a
    bf16 output (a rounding per expert): the same for Qwen-MoE here, not for Mixtral, whose
    float32 products it rounds before adding."""
    import importlib

    cfg_name, mod, cls, cast = _EXPERTS[arch]
    experts_cls = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), cls)
    hf = experts_cls(_hf_config(cfg_name, experts_implementation=impl)).to(torch.bfloat16)
    w13, w2 = _weights(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        for t in (1, 5, 17):
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            w, ids = fused_topk(torch.randn(t, E, generator=g), K, True)
            ref = hf(x, ids.long(), w.to(torch.bfloat16) if cast else w)
            got = fused_experts_torch(x, w13, w2, w, ids, cast_weights=cast)
            assert got.dtype == torch.bfloat16
            if impl == "grouped_mm" or cast:
                assert torch.equal(got, ref), (arch, impl, t)
            else:  # Mixtral under the eager loop: its per-expert bf16 rounding, within an ulp or two
                torch.testing.assert_close(got.float(), ref.float(), atol=0.13, rtol=2 ** -6)


class _Rank(SimpleNamespace):
    """What FusedMoE reads of a GroupCoordinator."""


def _layer(rank, ep, tp=2):
    return FusedMoE(E, K, H, INTER, renormalize=True, tp_group=_Rank(rank=rank, world_size=tp), enable_expert_parallel=ep)


def _load(layer, w13, w2):
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], ("w1", e))
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], ("w3", e))
        layer.weight_loader(layer.w2_weight, w2[e], ("w2", e))


@pytest.mark.parametrize("ep", [False, True])
def test_ranks_partial_sums_add_up_to_the_whole(ep):
    w13, w2 = _weights()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(5))
    whole = FusedMoE(E, K, H, INTER, renormalize=True)
    _load(whole, w13, w2)
    ranks = [_layer(r, ep) for r in range(2)]
    for r in ranks:
        _load(r, w13, w2)
    if ep:  # whole experts: rank 1 holds experts 4..7
        assert ranks[1].w13_weight.shape == (4, 2 * INTER, H) and torch.equal(ranks[1].w13_weight, w13[4:])
        assert ranks[1].expert_map.tolist() == [-1] * 4 + [0, 1, 2, 3]
    else:  # every expert, half the intermediate dim: gate rows then up rows of rank 1's half
        half = INTER // 2
        assert ranks[1].w13_weight.shape == (E, INTER, H)
        assert torch.equal(ranks[1].w13_weight[:, :half], w13[:, half:INTER])
        assert torch.equal(ranks[1].w13_weight[:, half:], w13[:, INTER + half:])
        assert torch.equal(ranks[1].w2_weight, w2[:, :, half:])
    with torch.no_grad():
        total = ranks[0](x, logits) + ranks[1](x, logits)
        torch.testing.assert_close(total, whole(x, logits), atol=1e-5, rtol=1e-5)


def test_layer_refusals():
    with pytest.raises(ValueError, match="MoE intermediate size"):
        _layer(0, ep=False, tp=5)
    with pytest.raises(ValueError, match="number of experts"):
        _layer(0, ep=True, tp=3)
    with pytest.raises(ValueError, match="hidden_act"):
        FusedMoE(E, K, H, INTER, True, hidden_act="gelu")
    layer = FusedMoE(E, K, H, INTER, True)
    with pytest.raises(ValueError, match="stacked"):
        layer.weight_loader(layer.w13_weight, torch.zeros(E, 2 * INTER, H), None)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER + 1, H), ("w1", 0))
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H, INTER), ("w2", E))


def test_expert_checkpoint_names():
    qwen = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    assert expert_checkpoint_target("model.layers.3.mlp.experts.17.gate_proj.weight", qwen) == \
        ("model.layers.3.mlp.experts.w13_weight", ("w1", 17))
    assert expert_checkpoint_target("model.layers.0.mlp.experts.2.down_proj.weight", qwen) == \
        ("model.layers.0.mlp.experts.w2_weight", ("w2", 2))
    # the shared expert, a stacked tensor and an unknown projection are not per-expert tensors
    for name in ("model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.experts.1.w1.weight"):
        assert expert_checkpoint_target(name, qwen) is None

"""Layer ops against transformers' own implementations (the reference any kernel swapped
into pyengine.layers must also meet)."""
from __future__ import annotations

import pytest
import torch

from pyengine.layers.activation import silu_and_mul
from pyengine.layers.layernorm import RMSNorm, fused_add_rms_norm, rms_norm
from pyengine.layers.linear import MergedColumnParallelLinear
from pyengine.layers.rotary import RotaryEmbedding, apply_rotary, get_rope_params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64, generator=g))
    ours = RMSNorm(64, eps=1e-5).to(dtype)
    ours.weight.data.copy_(ref.weight.data)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        res = torch.randn(7, 64, generator=g).to(dtype)
        out, new_res = ours(x, res)
        assert torch.equal(new_res, x + res)
        assert torch.equal(out, ref(x + res))
        assert torch.equal(fused_add_rms_norm(x, res, ours.weight, 1e-5)[0], rms_norm(x + res, ours.weight, 1e-5))


def test_silu_and_mul():
    x = torch.randn(5, 2 * 12)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(x[:, :12]) * x[:, 12:])


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rotary_matches_hf(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, rope_parameters=dict(rope))
    hf_rope = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 5, 130, 511, 77])
    q = torch.randn(6, 4, 32, generator=g)
    k = torch.randn(6, 2, 32, generator=g)
    cos, sin = hf_rope(q, positions[None])
    # HF layout: [B, heads, T, D]
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(32, 512, get_rope_params(cfg), dtype=torch.float32)
    oq, ok = ours(positions, q, k)
    torch.testing.assert_close(oq, rq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    oq2, _ = apply_rotary(q, k, positions, ours.cos_sin_cache)
    assert torch.equal(oq, oq2)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope_type"):
        RotaryEmbedding(16, 32, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})


def test_merged_linear_shards():
    lin = MergedColumnParallelLinear(3, [2, 4], bias=True)
    lin.weight.weight_loader(lin.weight, torch.ones(4, 3), 1)
    lin.weight.weight_loader(lin.weight, torch.zeros(2, 3), 0)
    assert torch.equal(lin.weight[:2], torch.zeros(2, 3)) and torch.equal(lin.weight[2:], torch.ones(4, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        lin.weight.weight_loader(lin.weight, torch.zeros(3, 3), 0)

"""Layer ops against transformers' own implementations (the reference any kernel swapped
into pyengine.layers must also meet)."""
from __future__ import annotations

import pytest
import torch

from pyengine.config import get_rope_params
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import MergedColumnParallelLinear
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.ops.native import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul


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


# ---- tensor-parallel layers: each rank's shard, loaded from a safetensors slice ---------
def _ranks(tp):
    from pyengine.distributed import GroupCoordinator
    # Loading reads only rank and world size; no process group is needed to check shards.
    return [GroupCoordinator(r, tp, torch.device("cpu"), None, None) for r in range(tp)]


def _slices(tmp_path, tensors: dict):
    """safetensors slices of ``tensors`` (what the model loader hands the weight loaders)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    f = tmp_path / "w.safetensors"
    save_file(tensors, str(f))
    fh = safe_open(str(f), framework="pt")
    return {k: fh.get_slice(k) for k in tensors}


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (2, 1), (4, 2)])
def test_qkv_parallel_shards_heads(tmp_path, tp, kv_heads):
    """Each rank holds its query heads and the KV heads they use (replicated when there are
    fewer KV heads than ranks); the ranks' outputs are the full projection's head slices."""
    from pyengine.layers.linear import QKVParallelLinear
    H, D, hidden = 4, 3, 5
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(rows, hidden, generator=g) for n, rows in (("q", H * D), ("k", kv_heads * D),
                                                                       ("v", kv_heads * D))}
    bias = {f"{n}b": torch.randn(w.shape[0], generator=g) for n, w in full.items()}
    src = _slices(tmp_path, {**full, **bias})
    x = torch.randn(2, hidden, generator=g)
    ref = {n: x @ w.T + bias[f"{n}b"] for n, w in full.items()}
    for group in _ranks(tp):
        lin = QKVParallelLinear(hidden, D, H, kv_heads, bias=True, tp_group=group)
        for n in "qkv":
            lin.weight.weight_loader(lin.weight, src[n], n)
            lin.bias.weight_loader(lin.bias, src[f"{n}b"], n)
        q, k, v = lin.split(lin(x))
        heads_q = H // tp
        kv_head = group.rank * kv_heads // tp  # the KV head of this rank's first query head
        assert lin.num_heads == heads_q and lin.num_kv_heads == max(1, kv_heads // tp)
        torch.testing.assert_close(q, ref["q"][:, group.rank * heads_q * D:(group.rank + 1) * heads_q * D])
        kv = slice(kv_head * D, (kv_head + lin.num_kv_heads) * D)
        torch.testing.assert_close(k, ref["k"][:, kv])
        torch.testing.assert_close(v, ref["v"][:, kv])


def test_mlp_and_embedding_shards_sum_to_the_full_layer(tmp_path):
    """gate_up column slices, down partial sums and vocab ranges (with padding) over 2 ranks
    reassemble the single-rank results."""
    from pyengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from pyengine.layers.linear import RowParallelLinear
    hidden, inter, vocab, tp = 6, 8, 11, 2
    g = torch.Generator().manual_seed(1)
    w = {"gate": torch.randn(inter, hidden, generator=g), "up": torch.randn(inter, hidden, generator=g),
         "down": torch.randn(hidden, inter, generator=g), "emb": torch.randn(vocab, hidden, generator=g)}
    src = _slices(tmp_path, w)
    x = torch.randn(3, hidden, generator=g)
    ids = torch.tensor([0, 5, 6, 10])
    act = torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)
    down_sum, emb_sum, logits = 0, 0, []
    for group in _ranks(tp):
        gu = MergedColumnParallelLinear(hidden, [inter, inter], tp_group=group)
        gu.weight.weight_loader(gu.weight, src["gate"], 0)
        gu.weight.weight_loader(gu.weight, src["up"], 1)
        part = silu_and_mul(gu(x))
        torch.testing.assert_close(part, act[:, group.rank * inter // tp:(group.rank + 1) * inter // tp])
        down = RowParallelLinear(inter, hidden, tp_group=group)
        down.weight.weight_loader(down.weight, src["down"])
        down_sum = down_sum + torch.nn.functional.linear(part, down.weight)  # before the all-reduce
        emb = VocabParallelEmbedding(vocab, hidden, tp_group=group)
        emb.weight.weight_loader(emb.weight, src["emb"])
        assert emb.weight.shape == (6, hidden)  # ceil(11 / 2) rows, the last rank's one padded
        inside = (ids >= emb.vocab_start_index) & (ids < emb.vocab_end_index)
        local = torch.nn.functional.embedding((ids - emb.vocab_start_index).clamp(0, 5), emb.weight)
        emb_sum = emb_sum + local * inside.unsqueeze(-1)
        head = ParallelLMHead(vocab, hidden, tie_to=emb, tp_group=group)
        assert head.weight is emb.weight
        logits.append(x @ head.weight.T)
    torch.testing.assert_close(down_sum, act @ w["down"].T)
    torch.testing.assert_close(emb_sum, w["emb"][ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], x @ w["emb"].T)
    assert torch.equal(torch.cat(logits, -1)[:, vocab:], torch.zeros(3, 1))  # padding row is zero


def test_row_parallel_partial_sums_carry_the_bias_once(tmp_path):
    """reduce_results=False: no all-reduce (the group has no process group here, so one
    would fail); the ranks' outputs, rank 0's with the bias, sum to the full layer."""
    from pyengine.layers.linear import RowParallelLinear
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    src = _slices(tmp_path, {"w": w, "b": b})
    x = torch.randn(3, 8, generator=g)
    total = 0
    for group in _ranks(2):
        layer = RowParallelLinear(8, 5, bias=True, tp_group=group, reduce_results=False)
        layer.weight.weight_loader(layer.weight, src["w"])
        layer.bias.weight_loader(layer.bias, src["b"])
        total = total + layer(x[:, group.rank * 4:(group.rank + 1) * 4])
    torch.testing.assert_close(total, x @ w.T + b)


def test_parallel_loader_rejects_wrong_checkpoint_shape():
    from pyengine.layers.linear import RowParallelLinear
    group = _ranks(2)[1]
    with pytest.raises(ValueError, match="shape mismatch"):
        RowParallelLinear(8, 4, tp_group=group).weight.weight_loader(
            RowParallelLinear(8, 4, tp_group=group).weight, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 2"):
        RowParallelLinear(7, 4, tp_group=group)


def test_same_for_parts_compared_on_the_parameters_device(monkeypatch):
    """A ``same_for_parts`` tensor (GPTQ's ``g_idx``) of a fused layer is loaded from each
    part's checkpoint; the later parts are compared with the parameter where it lives (a
    CUDA parameter against a host checkpoint tensor failed on the H200). The parameter sits
    on the meta device here; the comparison must see both tensors there."""
    import pyengine.layers.linear as linear

    seen = []

    def equal(a, b):
        seen.append((a.device.type, b.device.type))
        return True
    monkeypatch.setattr(linear.torch, "equal", equal)
    param = torch.nn.Parameter(torch.empty(8, dtype=torch.int32, device="meta"), requires_grad=False)
    param.same_for_parts = True
    loaded = torch.arange(8, dtype=torch.int64)
    for load in (linear.default_weight_loader, lambda p, t, s: linear._load_whole(p, t, [0, 1], s)):
        param.__dict__.pop("loaded_parts", None)
        for shard in (0, 1):
            load(param, loaded, shard)
    assert seen == [("meta", "meta")] * 2  # the second part of each, against the first
    param.__dict__.pop("loaded_parts")
    monkeypatch.setattr(linear.torch, "equal", lambda a, b: False)
    linear.default_weight_loader(param, loaded, 0)
    with pytest.raises(ValueError, match="shard 1 differs"):
        linear.default_weight_loader(param, loaded, 1)

"""The EAGLE-3 proposer against a dense reference written from the checkpoint format: every
draft the engine proposed (incremental, through its paged KV cache, its rows fed from this
step's target states only; also sharded over two tensor-parallel ranks) equals the draft
of a from-scratch computation over the whole context: transformers' hidden states of the
target at the auxiliary layers, then the head (fc, one midlayer over [norm(embedding),
norm(hidden)], RoPE, GQA, d2t) in plain torch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pyengine import LLM, SamplingParams
from tests.helpers import build_tiny_eagle3, prompt_token_ids

K = 3


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, h, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DenseEagle3:
    def __init__(self, head_dir, target):
        self.cfg = json.loads((Path(head_dir) / "config.json").read_text())
        self.w = load_file(str(Path(head_dir) / "model.safetensors"))
        self.target = target
        self.embed = target.get_input_embeddings().weight

    def drafts(self, context: list[int], k: int) -> list[int]:
        c, w = self.cfg, self.w
        with torch.no_grad():
            hs = self.target(torch.tensor([context]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in c["eagle_aux_hidden_state_layer_ids"]], -1)
        hidden = aux[:-1] @ w["fc.weight"].T  # rows 0 .. L-2: token p + 1 with the state at p
        toks = list(context[1:])
        out = []
        for _ in range(k):
            normed, pre = self._layer(toks, hidden)
            d = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            d += int(w["d2t"][d])
            out.append(d)
            toks.append(d)
            hidden = torch.cat([hidden, pre[-1:]])
        return out

    def _layer(self, toks, hidden):
        c, w = self.cfg, self.w
        m = "midlayer."
        T, nh, nkv, hd = len(toks), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = torch.cat([_rms(self.embed[toks], w[m + "input_layernorm.weight"]),
                       _rms(hidden, w[m + "hidden_norm.weight"])], -1)
        pos = torch.arange(T)
        q = _rope((x @ w[m + "self_attn.q_proj.weight"].T).view(T, nh, hd), pos, c["rope_theta"])
        kk = _rope((x @ w[m + "self_attn.k_proj.weight"].T).view(T, nkv, hd), pos, c["rope_theta"])
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        rep = nh // nkv
        kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / hd ** 0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nh * hd) @ w[m + "self_attn.o_proj.weight"].T
        r = a + hidden
        y = _rms(r, w[m + "post_attention_layernorm.weight"])
        y = (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) \
            @ w[m + "mlp.down_proj.weight"].T
        pre = y + r
        return _rms(pre, w["norm.weight"]), pre


MODES = {"default": {}, "chunked_prefill": {"max_num_batched_tokens": 8},
         "preemption": {"num_gpu_blocks_override": 3, "max_model_len": 48},
         # the head sharded over two ranks (gloo), fed the target's summed residual stream
         "tp2_chunked_prefill": {"tensor_parallel_size": 2, "max_num_batched_tokens": 8}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_eagle3_drafts_equal_a_dense_reference(llama_dir, tokenizer, tmp_path_factory, mode):
    from transformers import AutoModelForCausalLM

    head = build_tiny_eagle3(tmp_path_factory.mktemp("eagle3_ref"), llama_dir, seed=4, draft_vocab_size=300,
                             aux_layer_ids=[0, 1, 1])
    llm = LLM(str(llama_dir), device="cpu", speculative_config={"method": "eagle3", "model": str(head),
                                                                "num_speculative_tokens": K}, **MODES[mode])
    runner = llm.llm_engine.engine_core.model_runner
    seen = []
    propose = runner.drafter.propose

    def recording(so, sampled, generated, hidden):
        drafts = propose(so, sampled, generated, hidden)
        for s, g, d in zip(sampled, generated, drafts):
            if d:
                seen.append((s.request.all_token_ids + list(g), d))
        return drafts

    runner.drafter.propose = recording
    prompts = prompt_token_ids(tokenizer, 3, min_len=5, max_len=20, seed=3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    if mode == "preemption":
        assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.shutdown()
    target = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    ref = DenseEagle3(head, target)
    assert len(seen) >= 10
    for context, drafts in seen:
        assert drafts == ref.drafts(context, len(drafts)), context

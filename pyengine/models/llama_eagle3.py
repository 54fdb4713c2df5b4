"""EAGLE-3 draft head for Llama-family targets (mirrors vllm/model_executor/models/llama_eagle3.py).

Checkpoint format (the HF ``eagle3`` checkpoints vLLM loads, e.g. ``LlamaForCausalLMEagle3``):
``fc.weight`` [H, 3 * H_target] (the three auxiliary hidden states of the target, fused),
``midlayer.*`` (one decoder layer whose q/k/v projections read ``2 * H``: the normed token
embedding next to the normed hidden state; plus ``midlayer.hidden_norm``), ``norm.weight``,
``lm_head.weight`` [draft_vocab, H], ``d2t`` int64 [draft_vocab] (target id = draft id +
d2t[draft id]; absent: the same vocabulary), ``t2d`` (ignored) and, optionally,
``embed_tokens.weight`` (absent: the target's embedding is shared). Config keys besides
Llama's: ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``,
``eagle_aux_hidden_state_layer_ids`` (default (2, L // 2, L - 3) of the target's L layers,
as vLLM's Llama).

``forward(input_ids [T], positions [T], hidden [T, H], meta) -> (normed [T, H], prenorm
[T, H])``: ``hidden`` is ``combine_hidden_states(aux)`` for rows fed with the target's
states, or the previous draft step's ``prenorm`` for the rows after it."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.config import get_head_dim, get_rope_params
from pyengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import QKVParallelLinear, ReplicatedLinear
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.llama import DecoderAttention, GatedMLP

__all__ = ["Eagle3LlamaForCausalLM", "default_aux_layers"]


def default_aux_layers(hf_config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream the head reads (``len(layers)``: the
    last layer's output): the config's ``eagle_aux_hidden_state_layer_ids``, else vLLM's
    (2, L // 2, L - 3), clamped to [0, L]. Raises ValueError unless there are three."""
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(min(max(int(i), 0), num_target_layers) for i in ids)
    if len(ids) != 3:
        raise ValueError(f"an EAGLE-3 head reads 3 auxiliary hidden states, the config names {len(ids)}")
    return ids


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg, attn_backend, rotary, tp_group=None):
        super().__init__()
        H = cfg.hidden_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = DecoderAttention(cfg, attn_backend, rotary, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                          tp_group=tp_group)
        heads = cfg.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * H, get_head_dim(cfg), heads,
                                                    getattr(cfg, "num_key_value_heads", None) or heads,
                                                    bias=bias, tp_group=tp_group)
        self.mlp = GatedMLP(H, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)),
                            hidden_act=getattr(cfg, "hidden_act", "silu"), tp_group=tp_group)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, tp_group)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, meta):
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = self.self_attn(positions, torch.cat([embeds, hidden], dim=-1), meta)
        x, residual = self.post_attention_layernorm(x, residual, all_reduce_x=True)  # o_proj's partial sum
        return self.mlp(x), residual  # (down_proj's partial sum: the final norm sums it)


class _Eagle3Model(nn.Module):
    def __init__(self, cfg, attn_backend, has_embed: bool, tp_group=None):
        super().__init__()
        H = cfg.hidden_size
        self.rotary_emb = RotaryEmbedding(get_head_dim(cfg), cfg.max_position_embeddings, get_rope_params(cfg))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, tp_group) if has_embed else None
        self.layers = nn.ModuleList([_Eagle3Layer(cfg, attn_backend, self.rotary_emb, tp_group)])
        target_h = getattr(cfg, "target_hidden_size", None) or H
        self.fc = ReplicatedLinear(3 * target_h, H, bias=False)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, tp_group)


class Eagle3LlamaForCausalLM(nn.Module):
    """``Eagle3LlamaForCausalLM(hf_config, attn_backend, has_embed=True, tp_group=None)``;
    load with ``load_eagle3_weights``. Without its own embedding, ``share_embedding(target)``
    must be called (the checkpoint relies on the target's). ``tp_group``: sharded as the
    target is (heads, MLP, the draft vocabulary of the embedding and LM head; ``fc`` and
    the norms replicated), on the target's group; every rank runs every forward."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config, attn_backend, has_embed: bool = True, tp_group=None):
        super().__init__()
        self.config = hf_config
        self.draft_vocab_size = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        self.model = _Eagle3Model(hf_config, attn_backend, has_embed, tp_group)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hf_config.hidden_size, tp_group=tp_group)
        self.draft_id_to_target_id = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                                                  requires_grad=False)
        self._shared_embed: nn.Module | None = None

    def share_embedding(self, embed: nn.Module) -> None:
        """Use the target's token embedding (checkpoints without ``embed_tokens``)."""
        self.__dict__["_shared_embed"] = embed

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] -> [T, H]."""
        return self.model.fc(aux)

    def forward(self, input_ids, positions, hidden, meta) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.model.embed_tokens if self.model.embed_tokens is not None else self._shared_embed
        x, residual = self.model.layers[0](positions, embed(input_ids), hidden, meta)
        return self.model.norm(x, residual, all_reduce_x=True)

    def compute_draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target vocabulary ids) int64 [N] of ``normed`` [N, H], on
        every tensor-parallel rank (collective: ``ParallelLMHead.greedy``)."""
        d = self.lm_head.greedy(normed)
        return d + self.draft_id_to_target_id[d]

    def bind_kv_caches(self, kv_caches: list) -> None:
        if len(kv_caches) != 1:
            raise ValueError(f"expected 1 KV cache, got {len(kv_caches)}")
        self.model.layers[0].self_attn.kv_cache = kv_caches[0]

    @staticmethod
    def checkpoint_names(weights):
        """(vengine parameter name, tensor) of the checkpoint's tensors (``t2d`` dropped)."""
        for name, t in weights:
            if name.endswith("t2d"):
                continue
            if name.endswith("d2t"):
                yield "draft_id_to_target_id", t
                continue
            if name.startswith("model."):
                name = name[len("model."):]
            if not name.startswith("lm_head."):
                name = "model." + name.replace("midlayer.", "layers.0.")
            yield name, t

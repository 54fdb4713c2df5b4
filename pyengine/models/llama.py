"""Llama-family decoder (mirrors vllm/model_executor/models/llama.py): Llama 2/3,
Mistral-style checkpoints, and the base that Qwen2 (qkv bias) and Qwen3 (per-head q/k
RMSNorm) specialise.

Checkpoint names follow HF (``model.layers.N.self_attn.q_proj.weight`` ...); q/k/v load
into ``qkv_proj`` and gate/up into ``gate_up_proj`` via ``packed_modules_mapping``.
The forward has no host syncs and no data-dependent Python branches of its own; every
per-step input is in ``attn_metadata`` (whether the *attention backend* syncs is the
backend's business).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pyengine.attention.backend import AttentionBackend, AttentionMetadata
from pyengine.config import get_head_dim, get_rope_params
from pyengine.layers.activation import SILU_NAMES, SiluAndMul
from pyengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pyengine.layers.rotary import RotaryEmbedding


def config_sliding_window(hf_config, reads_layer_types: bool = True) -> int | None:
    """The attention window transformers applies for this config, or None (full
    attention): ``sliding_window`` when set and not switched off by
    ``use_sliding_window: false``, and, for a family whose transformers class reads
    ``layer_types`` (``reads_layer_types``; Qwen2/Qwen3 derive it from ``max_window_layers``),
    when that list (if present) has a ``sliding_attention`` layer. Raises ValueError for a
    window that is not a positive integer."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window (config.json) must be a positive integer or null, got {window!r}")
    layer_types = getattr(hf_config, "layer_types", None)
    if reads_layer_types and layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


class DecoderAttention(nn.Module):
    """qkv_proj -> (optional per-head q/k RMSNorm) -> RoPE -> backend attention -> o_proj.

    With tensor parallelism a rank holds ``num_heads`` query heads and ``num_kv_heads``
    KV heads (see QKVParallelLinear) and returns its partial sum of o_proj's output
    (the caller all-reduces it).
    ``kv_cache`` ([2, num_blocks, block_size, num_kv_heads, D]) is a plain attribute set
    by ``bind_kv_caches``; None until then.
    """

    def __init__(self, hf_config, attn_backend: AttentionBackend, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, tp_group=None):
        super().__init__()
        total_heads = hf_config.num_attention_heads
        self.head_dim = get_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, total_heads,
                                          getattr(hf_config, "num_key_value_heads", None) or total_heads,
                                          bias=qkv_bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # Not reduced here: the layer's post-attention norm sums it (fused with the norm).
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hf_config.hidden_size, bias=o_bias,
                                        tp_group=tp_group, reduce_results=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Shared objects, kept out of the module tree so they are not (re)registered per layer.
        self.__dict__["rotary"] = rotary
        self.__dict__["attn"] = attn_backend
        self.kv_cache: torch.Tensor | None = None
        # An FP8 KV cache's per-tensor scales (the checkpoint's k_scale / v_scale; see
        # pyengine.models.loader.load_kv_cache_scales): floats, 1.0 when it has none.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # The backend applies (Qwen3's per-head q/k RMSNorm and) RoPE, fused with the KV
        # write where it can.
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
        o = self.attn.forward_with_rope(q, k, v, positions, self.rotary.cos_sin_cache, self.kv_cache, meta,
                                        *qk_norm, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused into ``gate_up_proj`` (shards 0, 1).
    With tensor parallelism it returns this rank's partial sum of down_proj's output (the
    caller all-reduces it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu", tp_group=None):
        super().__init__()
        if hidden_act not in SILU_NAMES:
            raise ValueError(f"Unsupported hidden_act {hidden_act!r}; only 'silu' (or 'swish') is supported.")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_group=tp_group,
                                           reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention then MLP, each after an RMSNorm with the residual add. ``mlp``: the
    layer's feed-forward module (``forward(x [T, H]) -> [T, H]``, this rank's partial sum),
    e.g. an MoE block; None: the dense GatedMLP of ``intermediate_size``."""

    def __init__(self, hf_config, attn_backend, rotary, qkv_bias, o_bias, qk_norm, tp_group=None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(hf_config, attn_backend, rotary, qkv_bias, o_bias, qk_norm, tp_group)
        self.mlp = mlp if mlp is not None else GatedMLP(
            hf_config.hidden_size, hf_config.intermediate_size, bias=bool(getattr(hf_config, "mlp_bias", False)),
            hidden_act=getattr(hf_config, "hidden_act", "silu"), tp_group=tp_group)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, tp_group)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, tp_group)

    def forward(self, positions, hidden, residual, meta, keep: list | None = None):
        # residual carries the pre-norm stream; the fused add+norm saves one pass per layer.
        # With tensor parallelism the attention and MLP outputs arrive as this rank's
        # partial sums, and each norm after them all-reduces first (one kernel with the
        # add and norm where the group has it).
        if residual is None:  # first layer: hidden is the (already reduced) embedding
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, all_reduce_x=True)
        if keep is not None:  # the input residual stream, summed over the ranks (EAGLE-3)
            keep.append(residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, all_reduce_x=True)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """``make_mlp(layer_idx) -> nn.Module | None``: each layer's MLP (None: the dense one)."""

    def __init__(self, hf_config, attn_backend, qkv_bias, o_bias, qk_norm, tp_group=None,
                 make_mlp: Callable[[int], nn.Module | None] | None = None):
        super().__init__()
        head_dim = get_head_dim(hf_config)
        self.rotary_emb = RotaryEmbedding(head_dim, hf_config.max_position_embeddings,
                                          get_rope_params(hf_config))
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp_group)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, attn_backend, self.rotary_emb, qkv_bias, o_bias, qk_norm, tp_group,
                         mlp=make_mlp(i) if make_mlp is not None else None)
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, tp_group)

    # EAGLE-3 (pyengine/spec_decode/eagle.py): the layers whose input residual stream
    # (hidden + residual; len(layers): the last layer's output) forward() keeps, concatenated
    # in this order, in ``aux_hidden_states`` [T, len * hidden_size]. Empty: none kept. It
    # is the residual each layer's input norm (the final norm for len(layers)) returns:
    # with tensor parallelism the sum over the ranks, the same on every rank, at no extra
    # all-reduce.
    aux_hidden_state_layers: tuple = ()
    aux_hidden_states: torch.Tensor | None = None

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        residual = None
        aux_ids = self.aux_hidden_state_layers
        aux = {} if aux_ids else None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in aux_ids:
                kept: list = []
                hidden, residual = layer(positions, hidden, residual, meta, keep=kept)
                aux[i] = kept[0]
            else:
                hidden, residual = layer(positions, hidden, residual, meta)
        hidden, residual = self.norm(hidden, residual, all_reduce_x=True)  # the last MLP's partial sum
        if aux is not None:
            aux[len(self.layers)] = residual
            self.aux_hidden_states = torch.cat([aux[i] for i in aux_ids], dim=-1)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral causal LM.

    ``Model(hf_config, attn_backend, tp_group=None)``; ``forward(input_ids int64 [T],
    positions int64 [T], attn_metadata) -> hidden [T, hidden_size]`` (model dtype);
    ``compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size]`` (on tensor-parallel
    rank 0; None on the other ranks, which must call it too);
    ``bind_kv_caches(list of [2, num_blocks, block_size, Hkv, D], one per layer)``, Hkv this
    rank's KV heads. ``tp_group``: a ``pyengine.distributed.GroupCoordinator`` (tensor
    parallelism) or None. Parameters are created uninitialized: use
    ``pyengine.models.loader.load_model``.
    """

    # checkpoint module name -> (fused module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Subclass knobs.
    qk_norm: bool = False
    # How the family's transformers class treats config.json's sliding_window: Llama's
    # ignores it; Mistral/Qwen2/Qwen3 apply it per layer_types; Mixtral/Qwen3-MoE to every layer.
    applies_sliding_window: bool = False
    window_reads_layer_types: bool = True

    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))

    def o_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))

    def make_mlp(self, hf_config, layer_idx: int, tp_group) -> nn.Module | None:
        """Layer ``layer_idx``'s MLP; None: the dense GatedMLP (MoE models override it)."""
        return None

    @classmethod
    def verify_engine_config(cls, config) -> None:
        """Raises ValueError when the config's sliding window (``config_sliding_window``)
        is shorter than ``max_model_len``: attention here is full-context, which equals
        sliding-window attention only for sequences up to the window (vLLM applies the
        window; this engine refuses rather than run a longer sequence wrong)."""
        if not cls.applies_sliding_window:
            return
        window = config_sliding_window(config.hf_config, cls.window_reads_layer_types)
        if window is not None and config.max_model_len > window:
            raise ValueError(
                f"{cls.__name__}: sliding_window={window} (config.json) is not implemented: attention is "
                f"full-context, which equals sliding-window attention only for sequences of at most {window} "
                f"tokens, and max_model_len is {config.max_model_len}. Set max_model_len <= {window}.")

    def __init__(self, hf_config, attn_backend: AttentionBackend, tp_group=None):
        super().__init__()
        self.config = hf_config
        self.model = DecoderModel(hf_config, attn_backend, self.qkv_bias(hf_config),
                                  self.o_bias(hf_config), self.qk_norm, tp_group,
                                  make_mlp=lambda i: self.make_mlp(hf_config, i, tp_group))
        tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      tie_to=self.model.embed_tokens if tie else None, tp_group=tp_group)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row of ``hidden`` [N, hidden_size]: int64 [N] on every
        tensor-parallel rank (``ParallelLMHead.greedy``; all ranks must call it)."""
        return self.lm_head.greedy(hidden)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Raises ValueError unless there is exactly one cache per layer."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches (one per layer), got {len(kv_caches)}")
        for layer, cache in zip(self.model.layers, kv_caches):
            layer.self_attn.kv_cache = cache


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints in HF format share Llama's layout (a sliding window shorter than
    ``max_model_len`` is refused: ``verify_engine_config``)."""

    applies_sliding_window = True

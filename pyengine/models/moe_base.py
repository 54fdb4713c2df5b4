"""What the MoE model families share (Qwen3-MoE, Mixtral, Qwen2-MoE): the checks that
refuse a config this implementation cannot run exactly, the rule for which layers are
sparse, and the checkpoint-name mapping of per-expert tensors into ``FusedMoE``'s
stacked parameters. Each family's file (``qwen3_moe.py``, ``mixtral.py``,
``qwen2_moe.py``) mixes ``MoECausalLMMixin`` into its dense base class.
"""
from __future__ import annotations

from pyengine.layers.activation import SILU_NAMES
from pyengine.layers.fused_moe.layer import FusedMoE, expert_checkpoint_target

# Router / MoE config fields of other MoE families (DeepSeek, GLM, ...). transformers'
# classes for these three families ignore them, so a config that sets one to anything
# but the value these families compute with asks for a routing this code does not do:
# refused, never approximated. field -> accepted values
UNSUPPORTED_MOE_FIELDS: dict[str, tuple] = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
}


def check_moe_config(hf_config) -> None:
    """Raises ValueError naming the config field of a variant that cannot be honoured: a
    router field of ``UNSUPPORTED_MOE_FIELDS`` set, an activation other than SiLU,
    ``num_experts_per_tok`` outside [1, num_experts], ``decoder_sparse_step`` < 1."""
    arch = type(hf_config).__name__
    for name, accepted in UNSUPPORTED_MOE_FIELDS.items():
        value = getattr(hf_config, name, None)
        if value not in accepted:
            raise ValueError(f"{arch}: {name}={value!r} is not supported (this implementation routes with a "
                             f"softmax over all experts and top-k; supported: {[a for a in accepted if a is not None]}"
                             f" or unset).")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported; only 'silu' (or 'swish') is.")
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if num_experts > 0:
        k = getattr(hf_config, "num_experts_per_tok", None)
        if not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"{arch}: num_experts_per_tok={k!r} must be an integer in [1, num_experts={num_experts}].")
    step = getattr(hf_config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{arch}: decoder_sparse_step={step!r} must be a positive integer.")


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    """Qwen-MoE's rule (transformers' ``Qwen3MoeDecoderLayer``): layer ``layer_idx`` is an
    MoE layer unless it is in ``mlp_only_layers``, when there are experts and
    ``(layer_idx + 1) % decoder_sparse_step == 0``."""
    mlp_only = getattr(hf_config, "mlp_only_layers", None) or []
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and num_experts > 0 and (layer_idx + 1) % step == 0


class MoECausalLMMixin:
    """Mixed in before a dense causal-LM class (``class X(MoECausalLMMixin, LlamaForCausalLM)``).

    * ``verify_engine_config(config)`` (called by the loader before building): the config
      checks above, and a sliding window is refused unless ``max_model_len`` fits in it
      (attention here is full-context; it equals the window's for sequences up to the
      window, and only those).
    * ``map_checkpoint_name``: per-expert tensors -> ``FusedMoE``'s ``w13_weight`` /
      ``w2_weight`` with shard ``(kind, expert)`` (or, for experts a quantization method
      loads into modules of their own, ``FusedMoE.expert_modules``, the same name);
      ``checkpoint_renames`` (pairs of substrings) first, e.g. Mixtral's
      ``.block_sparse_moe.`` -> ``.mlp.``.
    * ``refuse_unknown_weights``: a checkpoint tensor that fills no parameter (a router
      bias, a correction bias, a stacked expert tensor ...) is refused at load.
    """

    supports_expert_parallel = True
    refuse_unknown_weights = True
    expert_proj_names: dict[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def verify_engine_config(cls, config) -> None:
        """Raises ValueError for a config this model cannot run exactly (see the class doc)."""
        check_moe_config(config.hf_config)
        super().verify_engine_config(config)  # the dense base's sliding-window check

    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile the fused-MoE kernel variants of steps up to ``max_num_tokens`` tokens
        (every MoE layer of a model has one shape, so one layer's warm-up serves all);
        the model runner calls it before capturing CUDA graphs."""
        moe = next((m for m in self.modules() if isinstance(m, FusedMoE)), None)
        if moe is not None:
            moe.warm_up(max_num_tokens)

    def expert_checkpoint_names(self, prefix: str, moe: FusedMoE) -> list[str]:
        """The checkpoint module names of every expert projection the ``FusedMoE`` at module
        path ``prefix`` stacks (``model.layers.0.block_sparse_moe.experts.3.w1`` ...): what a
        quantization config's targets and ignore lists name."""
        ck = prefix
        for old, new in self.checkpoint_renames:
            ck = ck.replace(new, old)
        return [f"{ck}.{e}.{proj}" for e in range(moe.global_num_experts) for proj in self.expert_proj_names]

    def map_checkpoint_name(self, name: str):
        """``(parameter, shard)`` for an expert's tensor or a renamed one (taken whole);
        None: the loader's default mapping (packed q/k/v, gate/up)."""
        renamed = name
        for old, new in self.checkpoint_renames:
            renamed = renamed.replace(old, new)
        target = expert_checkpoint_target(renamed, self.expert_proj_names)
        # experts loaded into modules of their own (moe_wna16) take their tensors by name
        if target is not None and not self.get_submodule(target[0].rpartition(".")[0]).expert_modules:
            return target
        return (renamed, None) if renamed != name else None

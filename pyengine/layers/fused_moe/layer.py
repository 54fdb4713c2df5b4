"""The experts of one MoE layer, stacked (mirrors vllm/model_executor/layers/fused_moe/layer.py's
``FusedMoE``).

Weights: ``w13_weight`` [E_local, 2 * I_local, H] (each expert's gate rows, then its up
rows) and ``w2_weight`` [E_local, H, I_local] (down). Checkpoints hold one tensor per
expert and projection (``experts.<e>.gate_proj.weight`` ...); each reaches
``weight_loader`` with the shard id ``(kind, e)``, kind ``"w1"`` (gate), ``"w3"`` (up)
or ``"w2"`` (down), vLLM's names, and is copied into its expert's slice: the loader never
builds a stacked copy on the host, one expert's tensor at a time is all it holds.

Parallelism over the ``tp_group`` ranks (a ``pyengine.distributed.GroupCoordinator``):

* default (vLLM's): every rank holds every expert, split over the intermediate dim
  (I_local = I / tp: gate/up rows and down columns, as the dense MLP's column / row
  parallel layers);
* ``enable_expert_parallel``: rank r holds whole experts [r * E / tp, (r + 1) * E / tp)
  (vLLM's linear placement); tokens routed elsewhere contribute nothing on this rank.

Either way ``forward`` returns this rank's partial sum; the caller sums the ranks (the
decoder layer's all-reduce + residual add + RMSNorm), as for ``RowParallelLinear(reduce_results=False)``.

Compute: the Triton fused kernels (``fused_moe.fused_experts``) where ``pyengine.ops``
runs Triton (CUDA tensors, or ``VENGINE_TRITON_OPS_ON_CPU=1`` under ``TRITON_INTERPRET=1``),
else the per-expert torch loop (``moe_torch.fused_experts_torch``).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pyengine import ops as _ops
from pyengine.layers.activation import SILU_NAMES
from pyengine.layers.fused_moe.moe_torch import fused_experts_torch
from pyengine.layers.fused_moe.router import fused_topk
from pyengine.layers.linear import _check_shape, divide, full_weight, narrow_weight, weight_shape

SHARD_KINDS = ("w1", "w2", "w3")  # gate, down, up (vLLM's / Mixtral's names)
_NOT_LOADED = object()

# One expert's projection in a checkpoint: "<prefix>.experts.<e>.<proj>.<tensor>", the tensor
# its weight or, quantized (FP8), the weight's scales.
EXPERT_TENSORS = ("weight", "weight_scale", "weight_scale_inv")
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\."
                            r"(?P<tensor>weight|weight_scale|weight_scale_inv)$")


def expert_checkpoint_target(name: str, proj_names: dict[str, str]) -> tuple[str, tuple[str, int]] | None:
    """``(parameter name, (kind, expert id))`` for a checkpoint tensor of one expert, e.g.
    ``model.layers.3.mlp.experts.17.gate_proj.weight`` ->
    ``("model.layers.3.mlp.experts.w13_weight", ("w1", 17))`` (``...down_proj.weight_scale``
    -> ``...experts.w2_weight_scale``; see ``EXPERT_TENSORS``); None for any other name.
    ``proj_names``: checkpoint projection name -> kind (Qwen: ``gate_proj``/``up_proj``/
    ``down_proj``; Mixtral: ``w1``/``w3``/``w2``). A projection name not in it is None too
    (the caller decides whether an unknown tensor is an error)."""
    m = _EXPERT_TENSOR.match(name)
    if m is None or m["proj"] not in proj_names:
        return None
    kind = proj_names[m["proj"]]
    param = ("w2_" if kind == "w2" else "w13_") + m["tensor"]
    return f"{m['prefix']}.{param}", (kind, int(m["expert"]))


class FusedMoE(nn.Module):
    """``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
    tp_group=None, enable_expert_parallel=False, hidden_act="silu", cast_routing_weights=True)``.

    ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]`` (hidden's dtype; this rank's
    partial sum): top-k over softmax(router_logits) (``fused_topk``), renormalised when
    ``renormalize`` (``norm_topk_prob``), then the weighted sum of the chosen experts'
    SiLU-gated MLPs. ``cast_routing_weights``: the top-k weights are cast to the model's
    dtype before they scale the experts' outputs, as transformers' Qwen-MoE routers do
    (``router_top_value.to(router_logits.dtype)``); Mixtral's router keeps them float32
    (False). It changes nothing in float32. Raises ValueError (at construction) for an activation other than
    SiLU, ``top_k`` outside [1, E], or sizes that do not split over the ranks.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp_group=None, enable_expert_parallel: bool = False, hidden_act: str = "silu",
                 cast_routing_weights: bool = True):
        super().__init__()
        if hidden_act not in SILU_NAMES:
            raise ValueError(f"Unsupported hidden_act {hidden_act!r} for the experts; only 'silu' is supported.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}] (the number of experts).")
        tp_size = tp_group.world_size if tp_group is not None else 1
        tp_rank = tp_group.rank if tp_group is not None else 0
        # Kept out of the module tree (as LinearBase's): quantized experts' projections split by it.
        self.__dict__["tp_group"] = tp_group
        self.global_num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.cast_routing_weights = bool(cast_routing_weights)
        self.hidden_size = hidden_size
        self.use_ep = bool(enable_expert_parallel) and tp_size > 1
        if self.use_ep:
            if num_experts % tp_size:
                raise ValueError(f"The model's number of experts ({num_experts}) must be divisible by "
                                 f"tensor_parallel_size ({tp_size}) with enable_expert_parallel.")
            self.local_num_experts = num_experts // tp_size
            self.expert_start = tp_rank * self.local_num_experts
            self.intermediate_size_per_partition = intermediate_size
            self.intermediate_start = 0
            self.register_buffer("expert_map", self._expert_map(torch.get_default_device()), persistent=False)
        else:
            self.local_num_experts = num_experts
            self.expert_start = 0
            self.intermediate_size_per_partition = divide(intermediate_size, tp_size, "MoE intermediate size")
            self.intermediate_start = tp_rank * self.intermediate_size_per_partition
            self.expert_map = None
        self.intermediate_size = intermediate_size
        self.params_dtype = torch.get_default_dtype()  # the activations' (weights may be quantized)
        self.quant_method = None  # a quantization FusedMoEMethodBase, set by set_quant_method
        self.scale_block: tuple[int, int] | None = None  # scale blocks (bn, bk) once loaded (FP8 blocks; (1, group) for int)
        self.weight_bits: int | None = None  # packed-integer experts' bits once loaded (moe_wna16)
        self.expert_modules = False  # the experts' tensors load into child modules (drop_expert_weights)
        # checkpoint projection name -> kind (the model's ``expert_proj_names``; set by the loader)
        self.expert_proj_names: dict[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        self.replace_expert_weights(self.params_dtype)
        self._tile_configs = _NOT_LOADED  # fused_moe's table for this shape and GPU, read on first use

    def _shard_ids(self, which: str) -> tuple:
        local = self.local_expert_ids()
        if which == "w2":
            return tuple(("w2", g) for g in local)
        return tuple((k, g) for g in local for k in ("w1", "w3"))

    def _register(self, name: str, t: torch.Tensor, which: str, **attrs) -> nn.Parameter:
        p = nn.Parameter(t, requires_grad=False)
        p.weight_loader = self.weight_loader
        p.shard_ids = self._shard_ids(which)
        for k, v in attrs.items():
            setattr(p, k, v)
        if hasattr(self, name):
            delattr(self, name)
        self.register_parameter(name, p)
        return p

    def local_expert_ids(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.expert_start, self.expert_start + self.local_num_experts)

    def holds_expert(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_num_experts

    def _expert_map(self, device) -> torch.Tensor:
        """int32 [E_global]: a global expert id's index among this rank's experts, -1 for
        other ranks' (expert parallelism)."""
        emap = torch.full((self.global_num_experts,), -1, dtype=torch.int32, device=device)
        emap[self.expert_start:self.expert_start + self.local_num_experts] = torch.arange(
            self.local_num_experts, dtype=torch.int32, device=device)
        return emap

    def init_buffers(self, device) -> None:
        """Compute ``expert_map`` on ``device`` (``loader.materialize``, after a build on the
        meta device)."""
        if self.expert_map is not None:
            self.expert_map = self._expert_map(device)

    def drop_expert_weights(self) -> None:
        """Remove the stacked float weights: a quantization method (``moe_wna16``) loads the
        experts' tensors into modules of its own, children ``<expert id>.<projection>``
        (``expert_modules`` then True until ``set_expert_weights``)."""
        for name in ("w13_weight", "w2_weight"):
            if hasattr(self, name):
                delattr(self, name)
        self.expert_modules = True

    def replace_expert_weights(self, dtype: torch.dtype) -> None:
        """(Re)create the empty stacked weights in ``dtype`` (a quantization method's
        ``create_weights``: FP8)."""
        e, ip, h = self.local_num_experts, self.intermediate_size_per_partition, self.hidden_size
        self._register("w13_weight", torch.empty(e, 2 * ip, h, dtype=dtype), "w13")
        self._register("w2_weight", torch.empty(e, h, ip, dtype=dtype), "w2")

    def add_expert_scale(self, name: str, shape: tuple[int, ...], form: str,
                         block: tuple[int, int] | None = None) -> None:
        """Register an empty float32 scale parameter ``name`` (``w13_...`` / ``w2_...``) that
        every expert's checkpoint scale loads into: ``form`` "tensor" (one value a
        projection, spread over its rows), "channel" (one a row) or "block" (``block`` tiles)."""
        self._register(name, torch.empty(shape, dtype=torch.float32), "w2" if name.startswith("w2_") else "w13",
                       moe_scale=form, moe_block=block)

    def set_expert_weights(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                           w2_scale: torch.Tensor | None, block: tuple[int, int] | None,
                           w13_zp: torch.Tensor | None = None, w2_zp: torch.Tensor | None = None,
                           weight_bits: int | None = None) -> None:
        """The experts' final form (a quantization method's ``process_weights_after_loading``):
        float weights; FP8 weights with float32 scales ``w13_weight_scale`` /
        ``w2_weight_scale`` (per row, or ``block`` tiles); or packed-integer weights
        (``weight_bits``) with group scales (``block`` (1, group size)) and zero points
        ``w13_weight_zp`` / ``w2_weight_zp`` (None: symmetric); see ``fused_moe.fused_experts``.
        Every other parameter and child module dropped."""
        for name, _ in list(self.named_parameters(recurse=False)):
            delattr(self, name)
        for name, _ in list(self.named_children()):
            delattr(self, name)
        tensors = {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale": w13_scale, "w2_weight_scale": w2_scale,
                   "w13_weight_zp": w13_zp, "w2_weight_zp": w2_zp}
        for name, t in tensors.items():
            if t is not None:
                self.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))
        self.scale_block = block if w13_scale is not None else None
        self.weight_bits = weight_bits
        self.expert_modules = False

    def set_quant_method(self, method) -> None:
        """Quantized experts: ``method`` (a ``FusedMoEMethodBase``) replaces the float weights
        by its checkpoint tensors now and gives them their final form after loading. Raises
        ValueError for a shape it cannot split."""
        method.create_weights(self)
        self.quant_method = method

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        """Copy one expert's checkpoint tensor (torch tensor or safetensors slice; only this
        rank's part is read) into its slice of ``param``. ``shard_id``: ``(kind, global
        expert id)``. An expert another rank holds (expert parallelism) is skipped.
        Raises ValueError on a shape mismatch or a bad shard id."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in SHARD_KINDS):
            raise ValueError(f"expected a shard id (kind in {SHARD_KINDS}, expert id), got {shard_id!r}: "
                             f"stacked expert tensors are not supported, one tensor per expert is")
        kind, expert = shard_id
        if not 0 <= expert < self.global_num_experts:
            raise ValueError(f"expert id {expert} out of range: the model has {self.global_num_experts} experts")
        local = expert - self.expert_start
        if not 0 <= local < self.local_num_experts:
            return  # another rank's expert
        ip, i0 = self.intermediate_size_per_partition, self.intermediate_start
        form = getattr(param, "moe_scale", None)
        if form is not None:
            self._load_scale(param, loaded, kind, expert, local, form)
            return
        if kind == "w2":
            _check_shape(loaded, (self.hidden_size, self.intermediate_size), f" for expert {expert} {kind}")
            param.data[local].copy_(narrow_weight(loaded, 1, i0, ip))
        else:
            _check_shape(loaded, (self.intermediate_size, self.hidden_size), f" for expert {expert} {kind}")
            rows = 0 if kind == "w1" else ip
            param.data[local, rows:rows + ip].copy_(narrow_weight(loaded, 0, i0, ip))

    def _load_scale(self, param: torch.Tensor, loaded, kind: str, expert: int, local: int, form: str) -> None:
        # One expert projection's FP8 scale into its rows (w1 / w3: this rank's gate / up rows
        # of w13; w2: all of down's rows, this rank's columns for blocks).
        ip, i0, h, inter = self.intermediate_size_per_partition, self.intermediate_start, self.hidden_size, \
            self.intermediate_size
        what = f" for expert {expert} {kind} weight scale"
        rows = 0 if kind == "w1" else ip
        dst = param.data[local]
        if form == "tensor":
            t = full_weight(loaded)
            if t.numel() != 1:
                raise ValueError(f"expected one per-tensor value{what}, got shape {tuple(t.shape)}")
            (dst if kind == "w2" else dst[rows:rows + ip]).fill_(float(t.reshape(())))
        elif form == "channel":
            n = h if kind == "w2" else inter
            if weight_shape(loaded) not in ((n, 1), (n,)):
                raise ValueError(f"shape mismatch{what}: expected ({n}, 1) per-channel scales in the checkpoint, "
                                 f"got {weight_shape(loaded)}")
            if kind == "w2":
                dst.copy_(full_weight(loaded).reshape(-1))
            else:
                dst[rows:rows + ip].copy_(narrow_weight(loaded, 0, i0, ip).reshape(-1))
        else:
            bn, bk = param.moe_block
            if kind == "w2":
                _check_shape(loaded, (-(-h // bn), -(-inter // bk)), what)
                dst.copy_(narrow_weight(loaded, 1, i0 // bk, dst.shape[1]))
            else:
                _check_shape(loaded, (-(-inter // bn), -(-h // bk)), what)
                dst[rows // bn:(rows + ip) // bn].copy_(narrow_weight(loaded, 0, i0 // bn, ip // bn))

    def _scales(self) -> dict:
        if self.w13_weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            out = {"w13_scale": self.w13_weight_scale, "w2_scale": self.w2_weight_scale, "block_shape": self.scale_block}
            if self.weight_bits is not None:
                out.update(w13_zp=getattr(self, "w13_weight_zp", None), w2_zp=getattr(self, "w2_weight_zp", None),
                           weight_bits=self.weight_bits)
            return out
        return {}

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if _ops.use_triton(hidden):
            from pyengine.layers.fused_moe import fused_moe  # imports triton
            topk_weights, topk_ids = fused_moe.topk_softmax(router_logits, self.top_k, self.renormalize)
            if self._tile_configs is _NOT_LOADED:
                self._tile_configs = self._load_tile_configs(fused_moe) if hidden.is_cuda else None
            return fused_moe.fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                           expert_map=self.expert_map, tile_configs=self._tile_configs,
                                           cast_weights=self.cast_routing_weights, **self._scales())
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        return fused_experts_torch(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                   expert_map=self.expert_map, cast_weights=self.cast_routing_weights)

    def _load_tile_configs(self, fused_moe) -> dict[int, dict] | None:
        # packed integer experts: their own table's entries (swept on their weights) over the
        # unkeyed table's grouped-GEMM ones, which serve the Ms it does not hold; never the
        # unkeyed GEMV-path entries (swept on float weights for the general kernels: the word
        # kernels' defaults, get_default_config's weight_bits, serve those Ms)
        shape = (self.local_num_experts, self.intermediate_size_per_partition)
        table = fused_moe.load_tile_configs(*shape)
        key = fused_moe.weight_dtype_key(self.weight_bits)
        if not key:
            return table
        own = fused_moe.load_tile_configs(*shape, dtype=key) or {}
        merged = {**{m: c for m, c in (table or {}).items() if not c.get("small_batch")}, **own}
        return merged or None

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int) -> int:
        """Compile, before serving, each Triton kernel variant a forward of up to
        ``max_num_tokens`` tokens can pick (one per distinct tile config: the config
        follows the number of tokens). No-op on the torch path. Returns the forwards run."""
        if not _ops.use_triton(self.w13_weight):
            return 0
        from pyengine.layers.fused_moe import fused_moe

        x = torch.zeros(1, self.hidden_size, dtype=self.params_dtype, device=self.w13_weight.device)
        self.forward(x, torch.zeros(1, self.global_num_experts, device=x.device))  # loads the table
        sizes = {1 << i for i in range(max(1, max_num_tokens).bit_length())} | set(self._tile_configs or ())
        seen, runs = set(), 1
        for m in sorted(s for s in sizes if 1 < s <= max_num_tokens):
            cfg = fused_moe.pick_config(self._tile_configs, m, self.local_num_experts,
                                        self.intermediate_size_per_partition, self.hidden_size, self.top_k,
                                        self.weight_bits)
            key = repr(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                self.forward(x.expand(m, -1).contiguous(), torch.zeros(m, self.global_num_experts, device=x.device))
                runs += 1
        return runs

    def extra_repr(self) -> str:
        return (f"experts={self.global_num_experts} (local {self.local_num_experts} from {self.expert_start}), "
                f"top_k={self.top_k}, hidden={self.hidden_size}, intermediate={self.intermediate_size} "
                f"(local {self.intermediate_size_per_partition}), renormalize={self.renormalize}, ep={self.use_ep}, "
                f"cast_routing_weights={self.cast_routing_weights}, "
                f"weights={f'int{self.weight_bits}' if self.weight_bits else str(self.w13_weight.dtype).replace('torch.', '')}"
                f"{f' blocks {list(self.scale_block)}' if self.scale_block else ''}")

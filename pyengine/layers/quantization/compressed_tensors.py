"""compressed-tensors checkpoints, as llm-compressor writes them (mirrors
vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py and its
``schemes/compressed_tensors_w8a8_fp8.py``, ``compressed_tensors_wNa16.py``).

``quantization_config``: ``config_groups`` (each: ``targets`` — ``"Linear"`` or module names,
``re:`` for a regex —, ``weights`` and ``input_activations`` quantization args, a ``format``),
an ``ignore`` list (names or ``re:`` regexes; e.g. ``lm_head``), the global ``format``.
Supported schemes:

* ``float-quantized`` FP8 (e4m3) weights, per tensor, per output channel or in blocks
  (``block_structure``), with activations dynamic per token, dynamic per group (block
  weights), static per tensor (``input_scale``), or none (weight-only). Tensors:
  ``weight`` (F8_E4M3), ``weight_scale``, ``input_scale``.
* ``pack-quantized`` INT4 / INT8 weight-only, per group (``group_size``) or per channel,
  symmetric or asymmetric, activation order (``actorder``) included. Tensors:
  ``weight_packed`` (int32, values offset by 2**(bits-1), packed along K),
  ``weight_scale`` [N, groups], ``weight_zero_point`` (asymmetric: int32 packed along N),
  ``weight_shape``, ``weight_g_idx`` (group actorder).

MoE experts (``get_moe_method``): FP8 schemes run weight-only by the fused MoE
(``fp8.Fp8MoEMethod``; static activation scales refused), INT4/INT8 ones per expert in the
dense layers' tensors (``moe_wna16.MoeWNA16Method``).

Anything else (INT8 activations, NVFP4/MXFP formats, sparsity, transforms, output
activations) is refused with a ValueError naming it. On CPU the W8A8 activation
quantization is reproduced as compressed-tensors runs it, so outputs are token-exact
against transformers loading the same checkpoint.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from pyengine.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param
from pyengine.layers.quantization.utils import (
    FP8_DTYPE,
    apply_fp8,
    apply_int,
    check_g_idx,
    finalize_fp8,
    finalize_int,
    fused_input_scale,
    unpack_int32,
)

_SUPPORTED = ("float-quantized FP8 weights (tensor/channel/block) with dynamic per-token, dynamic per-group, "
              "static per-tensor or no activation quantization; pack-quantized INT4/INT8 weight-only")


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:<pattern>`` matches from the start of the name, any other
    target is the whole name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


@dataclass(frozen=True)
class Scheme:
    """One config group, validated: ``kind`` "fp8" or "int"."""
    targets: tuple[str, ...]
    kind: str
    bits: int
    strategy: str  # weights: tensor | channel | group | block
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    actorder: str | None = None
    act: str | None = None  # fp8 activations: token | group | tensor | None


def _is_class_target(target: str) -> bool:
    """A module-class target: every layer a model quantizes is a ``Linear``, so "Linear"
    matches them all."""
    return target == "Linear" or target.endswith(".Linear")


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not supported (supported: {_SUPPORTED})")


def _parse_activations(args: dict | None, weights: Scheme) -> str | None:
    if not args:
        return None
    if weights.kind != "fp8":
        raise _refuse(f"activation quantization ({args.get('type')} {args.get('num_bits')}-bit) with integer weights")
    if args.get("type") != "float" or args.get("num_bits") != 8 or not args.get("symmetric", True):
        raise _refuse(f"input activations {args.get('type')} {args.get('num_bits')}-bit "
                      f"{'symmetric' if args.get('symmetric', True) else 'asymmetric'}")
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if strategy == "token" and dynamic is True:
        return "token"
    if strategy == "tensor" and dynamic is False:
        return "tensor"
    if strategy == "group" and dynamic is True and weights.block is not None and args.get("group_size") == weights.block[1]:
        return "group"
    raise _refuse(f"input activations with strategy {strategy!r}, dynamic={dynamic!r}, group_size="
                  f"{args.get('group_size')!r}")


def _parse_scheme(name: str, group: dict, default_format: str | None) -> Scheme:
    fmt = group.get("format") or default_format
    w = group.get("weights")
    if not w:
        raise _refuse(f"config group {name!r} without weight quantization")
    if group.get("output_activations"):
        raise _refuse(f"config group {name!r}: output activation quantization")
    if w.get("dynamic"):
        raise _refuse(f"config group {name!r}: dynamic weight quantization")
    targets = tuple(group.get("targets") or ())
    wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if wtype == "float" and bits == 8:
        # naive-quantized: what compressed-tensors writes for FP8 weight-only; its float-quantized
        # compressor is an alias of the naive one (the same tensors)
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise _refuse(f"config group {name!r}: FP8 weights in format {fmt!r}")
        if not w.get("symmetric", True):
            raise _refuse(f"config group {name!r}: asymmetric FP8 weights")
        block = None
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                raise _refuse(f"config group {name!r}: block strategy with block_structure {bs!r}")
            block = (int(bs[0]), int(bs[1]))
        elif strategy not in ("tensor", "channel"):
            raise _refuse(f"config group {name!r}: FP8 weight strategy {strategy!r}")
        s = Scheme(targets, "fp8", 8, strategy, block=block)
        return Scheme(targets, "fp8", 8, strategy, block=block,
                      act=_parse_activations(group.get("input_activations"), s))
    if wtype == "int" and bits in (4, 8):
        if fmt != "pack-quantized":
            raise _refuse(f"config group {name!r}: INT{bits} weights in format {fmt!r}")
        if strategy not in ("group", "channel"):
            raise _refuse(f"config group {name!r}: INT{bits} weight strategy {strategy!r}")
        gs = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(gs, int) or gs <= 0):
            raise _refuse(f"config group {name!r}: group strategy with group_size {gs!r}")
        actorder = w.get("actorder")
        if actorder not in (None, "weight", "group", "static", "dynamic"):
            raise _refuse(f"config group {name!r}: actorder {actorder!r}")
        s = Scheme(targets, "int", bits, strategy, group_size=gs, symmetric=bool(w.get("symmetric", True)),
                   actorder=actorder)
        _parse_activations(group.get("input_activations"), s)
        return s
    raise _refuse(f"config group {name!r}: {wtype} {bits}-bit weights")


class CompressedTensorsConfig(QuantizationConfig):
    """``schemes``: the config groups; ``ignore``: names/regexes left unquantized;
    ``kv_cache_scheme``: the checkpoint's FP8 KV cache scheme (dict) or None."""

    def __init__(self, schemes: list[Scheme], ignore: list[str], kv_cache_scheme: dict | None = None):
        self.schemes, self.ignore, self.kv_cache_scheme = schemes, ignore, kv_cache_scheme
        # compressed-tensors' precedence when several groups target a layer (``match_targets``,
        # ``apply_quantization_config``): a target string names the last group listing it;
        # exact names, then ``re:`` patterns (each in sorted order), then class names decide
        target_scheme = {t: sc for sc in schemes for t in sc.targets}
        ordered = sorted(target_scheme, key=lambda t: ("re:" in t, t))
        self._by_name = [(t, target_scheme[t]) for t in ordered if not _is_class_target(t)]
        self._by_class = next((target_scheme[t] for t in ordered if _is_class_target(t)), None)

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsConfig:
        for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
            value = config.get(key)
            if value and not (isinstance(value, dict) and value.get("format") == "dense"):  # dense: no sparsity
                raise _refuse(f"{key}")
        groups = config.get("config_groups") or {}
        if not groups and not config.get("kv_cache_scheme"):
            raise _refuse("a quantization_config without config_groups")
        schemes = [_parse_scheme(n, g, config.get("format")) for n, g in groups.items()]
        kv = config.get("kv_cache_scheme")
        if kv and not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy") == "tensor"
                       and not kv.get("dynamic")):
            raise _refuse(f"kv_cache_scheme {kv!r} (only static per-tensor FP8)")
        return cls(schemes, list(config.get("ignore") or []), kv or None)

    def kv_cache_scales(self) -> bool:
        return self.kv_cache_scheme is not None

    def _scheme_for(self, name: str) -> Scheme | None:
        if any(match_name(name, t) for t in self.ignore):
            return None
        return next((sc for t, sc in self._by_name if match_name(name, t)), self._by_class)

    def get_quant_method(self, layer: nn.Module, prefix: str, checkpoint_names: list[str]):
        names = checkpoint_names or [prefix]
        if is_layer_skipped(prefix, names, lambda n: self._scheme_for(n) is None):
            return None
        # by content: two groups with the same scheme (different targets) quantize alike
        found = {dataclasses.replace(sc, targets=()) for n in names for sc in [self._scheme_for(n)]}
        if len(found) != 1:
            raise ValueError(f"the parts fused at {prefix!r} ({', '.join(names)}) have different quantization schemes")
        scheme = found.pop()
        return CompressedTensorsW8A8Fp8(scheme) if scheme.kind == "fp8" else CompressedTensorsWNA16(scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: list[str]):
        """FP8 experts (any weight strategy; dynamic or no activation quantization: they run
        weight-only, see ``Fp8MoEMethod``), INT4/INT8 ``pack-quantized`` ones
        (``MoeWNA16Method``), or None when every expert projection is ignored. Raises
        ValueError for static activation scales or experts quantized unalike."""
        from pyengine.layers.quantization.fp8 import Fp8MoEMethod
        from pyengine.layers.quantization.moe_wna16 import MoeWNA16Method

        if is_layer_skipped(prefix, checkpoint_names, lambda n: self._scheme_for(n) is None):
            return None
        found = {dataclasses.replace(sc, targets=()) for n in checkpoint_names for sc in [self._scheme_for(n)]}
        if len(found) != 1:
            raise ValueError(f"the experts of {prefix!r} are quantized with different schemes; a fused MoE layer "
                             f"takes one")
        scheme = found.pop()
        if scheme.kind != "fp8":
            return MoeWNA16Method(lambda: CompressedTensorsWNA16(scheme), scheme.bits, "compressed-tensors",
                                  act_order=scheme.actorder in ("group", "dynamic"))
        if scheme.act == "tensor":
            raise ValueError("FP8 MoE experts with static per-tensor input_scale are not supported: the experts "
                             "run weight-only and the scales would go unused")
        return Fp8MoEMethod(scheme.strategy, scheme.block)


class CompressedTensorsW8A8Fp8(LinearMethodBase):
    """FP8 weights (``float-quantized``), FP8 or unquantized activations."""

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        s, n, k = self.scheme, sum(output_partition_sizes), input_size_per_partition
        self.dtype, self.parts = params_dtype, len(output_partition_sizes)
        layer.register_parameter("weight", new_param(n, k, dtype=FP8_DTYPE, output_dim=0, input_dim=1))
        if s.strategy == "tensor":
            scale = new_param(self.parts, dtype=torch.float32, per_shard=True)
        elif s.strategy == "channel":
            scale = new_param(n, 1, dtype=torch.float32, output_dim=0)
        else:
            bn, bk = s.block
            if k % bk or any(p % bn for p in output_partition_sizes):
                raise ValueError(f"block size {s.block} does not divide this rank's parts {output_partition_sizes} x {k}")
            scale = new_param(n // bn, k // bk, dtype=torch.float32, output_dim=0, input_dim=1,
                              row_factors={0: bn, 1: bk})
        layer.register_parameter("weight_scale", scale)
        if s.act == "tensor":
            layer.register_parameter("input_scale", new_param(self.parts, dtype=torch.float32, per_shard=True))

    def process_weights_after_loading(self, layer):
        s, scale = self.scheme, layer.weight_scale.data
        if s.strategy == "tensor":  # one scale per fused part: per output row
            sizes = list(layer.output_partition_sizes)
            scale = torch.cat([scale[i].expand(sz) for i, sz in enumerate(sizes)])
        elif s.strategy == "channel":
            scale = scale.reshape(-1)
        input_scale = fused_input_scale(layer) if s.act == "tensor" else None
        finalize_fp8(layer, layer.weight.data, scale, self.dtype, block=s.block, act=s.act,
                     input_scale=input_scale, emulate_act=True)

    def apply(self, layer, x, bias=None):
        return apply_fp8(layer, x, bias)

    def dummy_weights(self, layer, gen):
        w = torch.empty(layer.weight.shape, device=layer.weight.device).uniform_(-448, 448, generator=gen)
        layer.weight.data.copy_(w.to(FP8_DTYPE))
        layer.weight_scale.data.fill_(0.02 / 448)
        if hasattr(layer, "input_scale"):
            layer.input_scale.data.fill_(0.05)


def _ignore_loaded(param, loaded, shard_id=None) -> None:
    """weight_shape: redundant with the layer's own shape (the packed tensors are checked)."""


class CompressedTensorsWNA16(LinearMethodBase):
    """INT4/INT8 weight-only (``pack-quantized``)."""

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        s, n, k = self.scheme, sum(output_partition_sizes), input_size_per_partition
        self.dtype, per = params_dtype, 32 // s.bits
        gs = s.group_size or input_size
        self.group_size = gs if s.group_size else k
        if k % per or (s.group_size and k % gs):
            raise ValueError(f"input size {k} is not a multiple of " + (f"{per} packed values" if k % per else
                                                                           f"the group size {gs}"))
        row_parallel = input_size != input_size_per_partition
        layer.register_parameter("weight_packed", new_param(n, k // per, dtype=torch.int32, output_dim=0, input_dim=1,
                                                            row_factors={1: per}))
        act_group = s.actorder in ("group", "dynamic")
        if s.group_size:
            scale_groups = input_size // gs if (row_parallel and act_group) else k // gs
            grouped = {"input_dim": 1, "row_factors": {1: gs}} if not (row_parallel and act_group) else {}
        else:
            scale_groups, grouped = 1, {}
        layer.register_parameter("weight_scale", new_param(n, scale_groups, dtype=torch.float32, output_dim=0,
                                                           **grouped))
        if not s.symmetric:
            if any(p % per for p in output_partition_sizes):
                raise ValueError(f"output parts {output_partition_sizes} are not multiples of {per} packed zero points")
            zattrs = {"output_dim": 0, "row_factors": {0: per, **grouped.get("row_factors", {})}}
            if "input_dim" in grouped:
                zattrs["input_dim"] = 1
            layer.register_parameter("weight_zero_point", new_param(n // per, scale_groups, dtype=torch.int32, **zattrs))
        shape = new_param(2, dtype=torch.int64)
        shape.weight_loader = _ignore_loaded
        layer.register_parameter("weight_shape", shape)
        if act_group:
            layer.register_parameter("weight_g_idx", new_param(k, dtype=torch.int32, input_dim=0, same_for_parts=True))

    def process_weights_after_loading(self, layer):
        s = self.scheme
        q = unpack_int32(layer.weight_packed.data, s.bits, 1).t()  # [K, N], values offset by 2**(bits-1)
        scales = layer.weight_scale.data.t()
        if s.symmetric:
            zeros = torch.full_like(scales, float(1 << (s.bits - 1)))
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, s.bits, 0).t().to(scales.dtype)
        g_idx = layer.weight_g_idx.data if hasattr(layer, "weight_g_idx") else None
        if g_idx is not None:
            check_g_idx(g_idx, scales.shape[0])
        finalize_int(layer, q, scales, zeros, s.bits, self.group_size, self.dtype, g_idx)

    def apply(self, layer, x, bias=None):
        return apply_int(layer, x, bias)

    def dummy_weights(self, layer, gen):
        layer.weight_packed.data.random_(generator=gen)
        layer.weight_scale.data.fill_(0.02 / (1 << (self.scheme.bits - 1)))
        if hasattr(layer, "weight_zero_point"):
            layer.weight_zero_point.data.random_(generator=gen)
        if hasattr(layer, "weight_g_idx"):
            k = layer.weight_g_idx.shape[0]
            layer.weight_g_idx.data.copy_(torch.arange(k) // self.group_size)

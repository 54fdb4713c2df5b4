"""Quantization method interface (mirrors vllm/model_executor/layers/quantization/base_config.py).

A ``QuantizationConfig`` is parsed from a checkpoint's ``quantization_config`` (or made for
on-the-fly quantization) and hands each linear layer a ``LinearMethodBase`` — or None for a
layer that stays unquantized (an ``ignore`` entry). The method owns the layer's weights:

1. ``create_weights(layer, ...)`` registers the checkpoint's tensors as parameters of the
   layer, each with a ``weight_loader`` and the attributes that tell the layer's loader how
   to take this rank's part (``set_weight_attrs``: ``output_dim``, ``input_dim``,
   ``row_factors``, ``per_shard``);
2. ``process_weights_after_loading(layer)`` turns them into what ``apply`` runs (on CPU:
   one dense weight in the compute dtype; on CUDA: the kernels' layout);
3. ``apply(layer, x [T, K], bias) -> [T, N]``.

The linear layers never know which method they run. An MoE layer's experts
(``pyengine.layers.fused_moe.FusedMoE``) get a ``FusedMoEMethodBase`` instead
(``QuantizationConfig.get_moe_method``): it owns their stacked weights the same way, and
the fused-MoE kernels run whatever form it leaves.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


def set_weight_attrs(param: torch.Tensor, attrs: dict) -> None:
    """Set loader attributes on a parameter (vLLM's ``set_weight_attrs``):

    * ``output_dim``: the dim split over the ranks of a column-parallel layer and along which
      fused parts (q/k/v, gate/up) sit;
    * ``input_dim``: the dim split over the ranks of a row-parallel layer;
    * ``row_factors``: ``{dim: rows}``, a dim whose every entry stands for that many logical
      rows (an int32 word of eight 4-bit values, a scale per group or block of rows): the
      loader divides the offsets along it;
    * ``per_shard``: a [num_parts] tensor with one value per fused part (per-tensor scales of
      q/k/v), loaded by shard id;
    * ``same_for_parts``: a tensor each fused part's checkpoint holds too, which must agree
      (GPTQ's ``g_idx`` of q/k/v: one input, one activation order);
    * ``weight_loader``: the layer's loader (set by the layer, not by the method).

    Raises ValueError when an attribute is already set to another value."""
    for k, v in attrs.items():
        if hasattr(param, k) and getattr(param, k) != v:
            raise ValueError(f"parameter attribute {k!r} is already {getattr(param, k)!r}")
        setattr(param, k, v)


def new_param(*shape: int, dtype: torch.dtype, **attrs) -> nn.Parameter:
    """An uninitialized frozen parameter on the current default device with ``attrs``
    (see ``set_weight_attrs``)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(p, attrs)
    return p


class LinearMethodBase(ABC):
    """The weights and the math of one quantized linear layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        """Register this layer's checkpoint tensors as parameters of ``layer``.
        ``output_partition_sizes``: this rank's rows of each fused part (one entry when
        unfused); ``input_size`` / ``output_size``: the whole layer's; ``params_dtype``: the
        compute dtype. Raises ValueError for a shape the format cannot split."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into the form ``apply`` uses (called once, after loading)."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, input_size_per_partition]`` -> ``[T, output_size_per_partition]`` in x.dtype."""

    def dummy_weights(self, layer: nn.Module, gen: torch.Generator) -> None:
        """Fill the parameters with random values of a valid quantized weight
        (``load_format="dummy"``). Default: every float parameter uniform in [-0.02, 0.02]."""
        for p in layer.parameters(recurse=False):
            p.data.uniform_(-0.02, 0.02, generator=gen)


class FusedMoEMethodBase(ABC):
    """The weights of one MoE layer's stacked experts in a quantized form (the role of
    vllm/model_executor/layers/fused_moe/layer.py's ``FusedMoEMethodBase``). ``layer`` is a
    ``FusedMoE``: ``local_num_experts``, ``intermediate_size_per_partition``,
    ``hidden_size``, ``params_dtype`` and its ``weight_loader``."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace ``layer``'s float ``w13_weight`` / ``w2_weight`` by the checkpoint's
        quantized tensors (and their scales). Raises ValueError for a shape the format cannot
        split over the ranks."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into what ``FusedMoE.forward`` runs (called once)."""
        return None

    def dummy_weights(self, layer: nn.Module, gen: torch.Generator) -> None:
        """Random values of a valid quantized weight (``load_format="dummy"``). Default:
        every float parameter uniform in [-0.02, 0.02]."""
        for p in layer.parameters(recurse=False):
            p.data.uniform_(-0.02, 0.02, generator=gen)


class QuantizationConfig(ABC):
    """A quantization method's settings, parsed from ``quantization_config``."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's name (``quant_method`` / ``--quantization``), e.g. ``"gptq"``."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        """Parse a checkpoint's ``quantization_config``. Raises ValueError naming what it
        cannot honour."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str,
                         checkpoint_names: list[str]) -> LinearMethodBase | None:
        """The method for the linear layer ``layer`` at module path ``prefix``;
        ``checkpoint_names`` are the checkpoint modules fused into it (q/k/v_proj of a
        qkv_proj). None: the layer is not quantized. Raises ValueError when the fused parts
        disagree (some quantized, some not)."""

    def get_moe_method(self, layer: nn.Module, prefix: str,
                       checkpoint_names: list[str]) -> FusedMoEMethodBase | None:
        """The method for the experts of the MoE layer at ``prefix``; ``checkpoint_names``:
        the checkpoint module names of every expert projection it stacks
        (``...experts.<e>.gate_proj`` ...). None (the default): the experts stay in the
        model's float dtype, and the loader refuses a checkpoint that stores them quantized.
        Raises ValueError for experts quantized in a way the fused MoE cannot run."""
        return None

    def kv_cache_scales(self) -> bool:
        """Whether the checkpoint holds per-layer ``k_scale`` / ``v_scale`` tensors (an FP8
        KV cache scheme)."""
        return False


def is_layer_skipped(prefix: str, checkpoint_names: list[str], ignored) -> bool:
    """Whether every checkpoint module fused at ``prefix`` is matched by ``ignored`` (a
    predicate on a module name). Raises ValueError when only some of them are: a fused
    layer is one method (vLLM's rule)."""
    names = checkpoint_names or [prefix]
    skipped = [bool(ignored(n)) for n in names]
    if any(skipped) and not all(skipped):
        quantized = [n for n, s in zip(names, skipped) if not s]  # an MoE layer's can be hundreds: a few shown
        shown = ", ".join(quantized[:4]) + (f" and {len(quantized) - 4} more" if len(quantized) > 4 else "")
        raise ValueError(f"the checkpoint quantizes only some of the parts fused at {prefix!r} "
                         f"({shown} but not the others); "
                         f"a fused layer must be quantized all alike")
    return all(skipped)

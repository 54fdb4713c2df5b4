"""Quantization methods, one per file, by vLLM's names (mirrors
vllm/model_executor/layers/quantization/__init__.py):

| name | file | what it reads |
| --- | --- | --- |
| ``compressed-tensors`` | compressed_tensors.py | llm-compressor's: FP8 ``float-quantized``, INT4/INT8 ``pack-quantized`` |
| ``fp8`` | fp8.py | HF-native FP8 (``weight_block_size`` block scales), or a bf16 checkpoint quantized at load |
| ``gptq`` | gptq.py | AutoGPTQ / GPTQModel: ``qweight``, ``qzeros``, ``scales``, ``g_idx`` |
| ``awq`` | awq.py | AutoAWQ GEMM: ``qweight``, ``qzeros``, ``scales`` in AWQ's nibble order |

``get_quantization_config(hf_config, quantization)`` is the one entry point: a checkpoint
whose ``quantization_config`` the engine cannot honour (another method, or settings a
method does not support) is refused with a ValueError naming it, never loaded as if it
were unquantized.
"""
from __future__ import annotations

import importlib

from pyengine.layers.quantization.base_config import LinearMethodBase, QuantizationConfig

# name -> (module under pyengine.layers.quantization, class)
_METHODS: dict[str, tuple[str, str]] = {
    "compressed-tensors": ("compressed_tensors", "CompressedTensorsConfig"),
    "fp8": ("fp8", "Fp8Config"),
    "gptq": ("gptq", "GPTQConfig"),
    "awq": ("awq", "AWQConfig"),
}
QUANTIZATION_METHODS = tuple(_METHODS)
# Methods a bf16/fp16/fp32 checkpoint can be quantized with at load (``quantization=``).
ONLINE_METHODS = ("fp8",)


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    """Raises ValueError naming the supported methods for an unknown ``name``."""
    if name not in _METHODS:
        raise ValueError(f"Unsupported quantization method {name!r}; supported: {', '.join(QUANTIZATION_METHODS)}.")
    module, cls = _METHODS[name]
    return getattr(importlib.import_module(f"pyengine.layers.quantization.{module}"), cls)


def checkpoint_quantization_config(hf_config) -> dict | None:
    """The checkpoint's ``quantization_config`` (config.json) as a dict, or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return dict(qc)


def get_quantization_config(hf_config, quantization: str | None = None) -> QuantizationConfig | None:
    """The quantization config a model loads with: the checkpoint's (``quantization_config``
    in config.json, its ``quant_method``), or, for an unquantized checkpoint,
    ``quantization`` applied at load (one of ``ONLINE_METHODS``). None: not quantized.

    Raises ValueError: an unsupported ``quant_method`` or setting (named), a
    ``quantization`` that disagrees with the checkpoint's, or one that cannot be applied at
    load."""
    ckpt = checkpoint_quantization_config(hf_config)
    if ckpt is not None:
        method = str(ckpt.get("quant_method", "")).lower().replace("_", "-")
        if method not in _METHODS:
            raise ValueError(f"The checkpoint's quantization_config has quant_method {ckpt.get('quant_method')!r}, "
                             f"which vengine does not support (supported: {', '.join(QUANTIZATION_METHODS)}); "
                             f"it is refused rather than run as an unquantized model.")
        if quantization is not None and quantization != method:
            raise ValueError(f"quantization={quantization!r} was asked for, but the checkpoint is quantized with "
                             f"{method!r} (its config.json quantization_config); leave quantization unset.")
        try:
            return get_quantization_config_cls(method).from_config(ckpt)
        except ValueError as e:
            raise ValueError(f"Cannot load the checkpoint's {method!r} quantization_config: {e}") from None
    if quantization is None:
        return None
    if quantization not in ONLINE_METHODS:
        if quantization in _METHODS:
            raise ValueError(f"quantization={quantization!r} needs a checkpoint quantized with it (config.json has no "
                             f"quantization_config); at load a model can be quantized with: "
                             f"{', '.join(ONLINE_METHODS)}.")
        get_quantization_config_cls(quantization)  # raises, naming the supported methods
    return get_quantization_config_cls(quantization).for_online()


__all__ = ["QuantizationConfig", "LinearMethodBase", "QUANTIZATION_METHODS", "ONLINE_METHODS",
           "get_quantization_config", "get_quantization_config_cls", "checkpoint_quantization_config"]

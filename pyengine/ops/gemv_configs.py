"""Launch configs of the batch-1 quantized GEMVs (``fp8_gemv`` and ``int_gemv`` in
pyengine/ops/quant.py), per weight shape and GPU, as the fused-MoE tile configs are.

A file ``configs/gemv,device_name=<GPU>.json`` (spaces in the name as ``_``), written by
``benchmarks/quant.py OUT --parts kernels --sweep``, maps a kernel kind to its shapes:

    {"fp8": {"6144x4096": {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3}, ...},
     "int4": {"6144x4096": {"block_n": 8, "num_warps": 2}, ...}}

``"<N>x<K>"`` is the weight's output x input size. ``lookup`` returns the entry of the
exact shape, else None (the kernel's own default then applies: ``quant.fp8_gemv_default``,
``quant.int_gemv_default``). Kinds: ``fp8`` (FP8 weights, any activation scheme), ``int4``
and ``int8`` (packed integers; any group size).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FIELDS = {"fp8": ("block_n", "block_k", "num_warps", "num_stages"), "int4": ("block_n", "num_warps"),
          "int8": ("block_n", "num_warps")}


def config_file_name(device_name: str) -> str:
    """``gemv,device_name=<name>.json``, spaces as ``_`` (the MoE files' convention)."""
    return f"gemv,device_name={device_name.replace(' ', '_')}.json"


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def parse_table(raw: object, where: str) -> dict[str, dict[str, dict[str, int]]]:
    """Validate a config table (see the module docstring); ValueError naming ``where`` and
    the bad entry otherwise."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a GEMV config table (a JSON object of kinds)")
    table: dict[str, dict[str, dict[str, int]]] = {}
    for kind, shapes in raw.items():
        if kind not in FIELDS:
            raise ValueError(f"{where}: unknown kernel kind {kind!r} (known: {', '.join(FIELDS)})")
        if not isinstance(shapes, dict):
            raise ValueError(f"{where}: {kind} must map 'NxK' shapes to configs")
        table[kind] = {}
        for key, cfg in shapes.items():
            parts = key.split("x")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise ValueError(f"{where}: {kind} shape {key!r} is not 'NxK'")
            if not isinstance(cfg, dict) or set(cfg) != set(FIELDS[kind]) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in cfg.values()):
                raise ValueError(f"{where}: {kind} {key}: expected positive integers {', '.join(FIELDS[kind])}, "
                                 f"got {cfg!r}")
            table[kind][key] = dict(cfg)
    return table


@functools.cache
def load_table(device_name: str, config_dir: str = str(CONFIG_DIR)) -> dict[str, dict[str, dict[str, int]]]:
    """The config table of ``device_name`` ({} without a file). Raises ValueError for a file
    that is not such a table (read once per process)."""
    path = Path(config_dir) / config_file_name(device_name)
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return parse_table(raw, str(path))


@functools.cache
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def lookup(kind: str, n: int, k: int, device) -> dict[str, int] | None:
    """The swept config of this kernel kind and weight shape on ``device`` (a CUDA device;
    None elsewhere, or without an entry)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    entry = load_table(_device_name(index)).get(kind, {}).get(shape_key(n, k))
    return dict(entry) if entry is not None else None

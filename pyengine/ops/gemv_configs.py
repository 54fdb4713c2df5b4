"""Launch configs of the batch-1 quantized GEMVs (``fp8_gemv`` and ``int_gemv`` in
pyengine/ops/quant.py), per weight shape and GPU, as the fused-MoE tile configs are.

A file ``configs/gemv,device_name=<GPU>.json`` (spaces in the name as ``_``), written by
``benchmarks/quant.py OUT --parts kernels --sweep``, maps a kernel kind to its shapes:

    {"fp8": {"6144x4096": {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3}, ...,
             "4096x14336": {"block_n": 32, "block_k": 512, "num_warps": 4, "num_stages": 1, "fma": true}},
     "int4": {"6144x4096": {"block_n": 8, "num_warps": 2}, ...}}

``"<N>x<K>"`` is the weight's output x input size. ``lookup`` returns the entry of the
exact shape, else None (the kernel's own default then applies: ``quant.fp8_gemv_default``,
``quant.int_gemv_default``). Kinds: ``fp8`` (FP8 weights, any activation scheme), ``int4``
and ``int8`` (packed integers; any group size).

Fields (``REQUIRED`` every entry has, ``OPTIONAL`` with the value an entry without them
means; what the kernels do with them: pyengine/ops/quant.py):

* ``block_n``: output rows a program, a power of two (1-64);
* ``num_warps``: a power of two (1-16);
* ``block_k`` (fp8): columns a chunk, a power of two >= 256;
* ``num_stages`` (fp8): software-pipeline stages, 1-8;
* ``split_k`` (optional, 1): programs along K, 1-64 (> 1: float32 partials and a sum pass);
* ``prefetch`` (optional, int kinds, false): the next chunk's words loaded before this
  one's products (JSON true/false);
* ``half2`` (optional, int4, false): bf16/fp16 activations are multiplied in f16x2
  arithmetic (``quant._half2_dot``: ~3 SASS instructions a value against ~4.6; products
  rounded to f16) instead of exact float32 FMAs;
* ``persistent`` (optional, 0): > 0, that many programs an SM, each walking blocks of rows
  with the coming ones' weights in flight during the current products (int kinds: split_k
  1 and no prefetch then; fp8: per-row weight scales, split_k 1, not fma, ``num_stages``
  the pipeline's buffers);
* ``stages`` (optional, int kinds, 1; with ``persistent``): 1, the next chunk's words
  loaded into registers; >= 2, a software pipeline of that many shared-memory buffers;
* ``vec`` (optional, int kinds, 0): the words a thread loads a chunk (1, 2, 4, 8; 0: 4
  where the group size allows, else 2 or 1); more words a thread, fewer cross-thread sums;
* ``fma`` (optional, fp8, false): per-row weight scales run the CUDA-core kernel (float32
  FMAs of the upcast weight, the bf16 GEMV's shape; ``num_stages`` unused) instead of the
  tensor-core one; block scales keep the tensor-core kernel.

Whether a split_k fits a shape (every split gets a chunk) depends on the chunk size and K,
so the kernels check it at launch (ValueError); a sweep writes only configs that ran.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
REQUIRED = {"fp8": ("block_n", "block_k", "num_warps", "num_stages"), "int4": ("block_n", "num_warps"),
            "int8": ("block_n", "num_warps")}
OPTIONAL: dict[str, dict[str, int | bool]] = {
    "fp8": {"split_k": 1, "fma": False, "persistent": 0},
    "int4": {"split_k": 1, "prefetch": False, "half2": False, "persistent": 0, "vec": 0, "stages": 1},
    "int8": {"split_k": 1, "prefetch": False, "persistent": 0, "vec": 0, "stages": 1}}
FIELDS = {kind: REQUIRED[kind] + tuple(OPTIONAL[kind]) for kind in REQUIRED}


def _pow2(lo: int, hi: int) -> tuple[Callable[[object], bool], str]:
    def ok(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi and not v & (v - 1)
    return ok, f"a power of two in [{lo}, {hi}]"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (check, what it must be)
_CHECKS = {"block_n": _pow2(1, 64), "num_warps": _pow2(1, 16), "block_k": _pow2(256, 1 << 16),
           "num_stages": (lambda v: _is_int(v) and 1 <= v <= 8, "an integer in [1, 8]"),
           "split_k": (lambda v: _is_int(v) and 1 <= v <= 64, "an integer in [1, 64]"),
           "prefetch": (lambda v: isinstance(v, bool), "true or false"),
           "fma": (lambda v: isinstance(v, bool), "true or false"),
           "half2": (lambda v: isinstance(v, bool), "true or false"),
           "persistent": (lambda v: _is_int(v) and 0 <= v <= 32, "an integer in [0, 32]"),
           "vec": (lambda v: v in (0, 1, 2, 4, 8), "0 (by the group size), 1, 2, 4 or 8"),
           "stages": (lambda v: _is_int(v) and 1 <= v <= 8, "an integer in [1, 8]")}


def check_config(kind: str, cfg: object, where: str) -> dict[str, int | bool]:
    """One entry of ``kind``, validated: a JSON object with every ``REQUIRED`` field and
    only known ones, each value as ``_CHECKS`` says (the module docstring). Returns a copy;
    ValueError naming ``where``, the field and the allowed values otherwise."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object of {', '.join(FIELDS[kind])}, got {cfg!r}")
    missing = [f for f in REQUIRED[kind] if f not in cfg]
    unknown = sorted(set(cfg) - set(FIELDS[kind]))
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) +
            ([f"unknown field(s) {', '.join(unknown)} (known: {', '.join(FIELDS[kind])})"] if unknown else [])))
    for field, value in cfg.items():
        ok, what = _CHECKS[field]
        if not ok(value):
            raise ValueError(f"{where}: {field} must be {what}, got {value!r}")
    return dict(cfg)


def config_file_name(device_name: str) -> str:
    """``gemv,device_name=<name>.json``, spaces as ``_`` (the MoE files' convention)."""
    return f"gemv,device_name={device_name.replace(' ', '_')}.json"


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def parse_table(raw: object, where: str) -> dict[str, dict[str, dict[str, int | bool]]]:
    """Validate a config table (see the module docstring); ValueError naming ``where`` and
    the bad entry otherwise."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a GEMV config table (a JSON object of kinds)")
    table: dict[str, dict[str, dict[str, int | bool]]] = {}
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
            table[kind][key] = check_config(kind, cfg, f"{where}: {kind} {key}")
    return table


@functools.cache
def load_table(device_name: str, config_dir: str = str(CONFIG_DIR)) -> dict[str, dict[str, dict[str, int | bool]]]:
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


def lookup(kind: str, n: int, k: int, device) -> dict[str, int | bool] | None:
    """The swept config of this kernel kind and weight shape on ``device`` (a CUDA device;
    None elsewhere, or without an entry)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    entry = load_table(_device_name(index)).get(kind, {}).get(shape_key(n, k))
    return dict(entry) if entry is not None else None

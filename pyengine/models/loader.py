"""Build a model and fill it from HF safetensors (mirrors
vllm/model_executor/model_loader/default_loader.py + weight_utils.py).

Checkpoint tensors are mapped onto the model's parameters: names of packed modules
(q/k/v, gate/up; see ``Model.packed_modules_mapping``) load into their fused parameter's
slice; ``lm_head.weight`` is skipped when embeddings are tied; names the model has no
parameter for (e.g. ``rotary_emb.inv_freq``) are ignored. Any parameter (or fused shard)
left unfilled is an error naming it.

Checkpoint tensors reach the parameters' ``weight_loader`` as safetensors slices, so a
tensor-parallel rank reads only its own part of each tensor from the file.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from pyengine.layers.linear import default_weight_loader
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.registry import get_model_cls

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of ``model_dir``: those named by ``model.safetensors.index.json``
    when present, else every ``*.safetensors`` (``consolidated*`` files, Mistral's
    non-HF duplicate, are dropped when other files exist).

    Raises FileNotFoundError when there is none.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint shards listed in {index} are missing: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    files = hf_files or files
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d}")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Yield (name, safetensors slice) for every tensor of every checkpoint file. A slice
    reads from the file only what is indexed (``s[:]`` = the whole tensor; see
    ``pyengine.layers.linear.narrow_weight``); it is valid until the next item."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_slice(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_weights(model: nn.Module, weights, tie_word_embeddings: bool = False) -> None:
    """Copy checkpoint ``weights`` (iterable of (name, tensor or safetensors slice)) into
    ``model``; each parameter's ``weight_loader`` takes its tensor-parallel part.

    A model may map names itself: ``model.map_checkpoint_name(name)`` returning
    ``(parameter name, shard id)`` (e.g. one MoE expert's tensor into the stacked experts'
    parameter) or None (the default mapping). With ``model.refuse_unknown_weights`` a
    checkpoint tensor that fills no parameter is an error instead of being ignored.

    Raises ValueError naming any parameter or fused shard the checkpoint did not provide,
    or on a shape mismatch.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "map_checkpoint_name", None)
    strict = bool(getattr(model, "refuse_unknown_weights", False))
    loaded: dict[str, set] = {}
    for name, tensor in weights:
        if tie_word_embeddings and name.startswith("lm_head."):
            continue  # lm_head shares the embedding parameter
        mapped = remap(name) if remap is not None else None
        if mapped is not None:
            target, shard = mapped
        else:
            target, shard = name, None
            parts = name.split(".")
            for i, p in enumerate(parts):
                if p in packed:
                    fused, shard = packed[p]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                    break
        param = params.get(target)
        if param is None:
            if strict and not name.endswith("rotary_emb.inv_freq"):
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in {type(model).__name__}: "
                                 f"a weight this implementation does not use cannot be ignored safely")
            logger.debug("ignoring checkpoint tensor %s", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from None
        loaded.setdefault(target, set()).add(shard)
    if tie_word_embeddings:
        loaded.setdefault("lm_head.weight", set()).add(None)
    missing = []
    for pname, param in params.items():
        got = loaded.get(pname)
        if pname == "lm_head.weight" and tie_word_embeddings:
            got = loaded.get("model.embed_tokens.weight")
        if not got:
            missing.append(pname)
            continue
        shard_ids = getattr(param, "shard_ids", None)
        if shard_ids and None not in got:
            missing += [f"{pname}[{s}]" for s in shard_ids if s not in got]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}")


def load_model(config, attn_backend, tp_group=None) -> nn.Module:
    """Build ``get_model_cls(config.hf_config)(config.hf_config, attn_backend, tp_group)``
    on ``config.device`` in ``config.dtype`` and load every safetensors file of
    ``config.model`` into it (this rank's shard of each tensor when ``tp_group``, a
    ``pyengine.distributed.GroupCoordinator``, is given). Returns the model in eval mode.

    ``config.enable_expert_parallel`` reaches models that have experts
    (``supports_expert_parallel``); ``model_cls.verify_engine_config(config)``, where a
    model has it, refuses settings it cannot honour.

    Raises ValueError (unsupported architecture or variant, missing weights, shape
    mismatch), FileNotFoundError (no weights).
    """
    hf_config = config.hf_config
    model_cls = get_model_cls(hf_config)
    verify = getattr(model_cls, "verify_engine_config", None)  # settings a model cannot honour
    if verify is not None:
        verify(config)
    kwargs = {}
    if getattr(config, "enable_expert_parallel", False):
        if not getattr(model_cls, "supports_expert_parallel", False):
            raise ValueError(f"enable_expert_parallel: {model_cls.__name__} has no experts to shard.")
        kwargs["enable_expert_parallel"] = True
    with _default_dtype(config.dtype), torch.device(config.device):
        model = model_cls(hf_config, attn_backend, tp_group=tp_group, **kwargs)
    for m in model.modules():  # positions up to max_model_len (see EngineConfig.max_model_len)
        if isinstance(m, RotaryEmbedding):
            m.extend_to(config.max_model_len)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    with torch.no_grad():
        if getattr(config, "load_format", "auto") == "dummy":
            init_dummy_weights(model, config.seed)
        else:
            load_weights(model, iterate_weights(config.model), tie_word_embeddings=tie)
    return model.eval()


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights on the model's device (vLLM's load_format="dummy"), for benchmarks
    of a model shape without a checkpoint: uniform in [-0.02, 0.02], norm weights 1."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.02, 0.02, generator=gen)

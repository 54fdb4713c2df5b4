"""Build a model and fill it from HF safetensors (mirrors
vllm/model_executor/model_loader/default_loader.py + weight_utils.py).

Checkpoint tensors are mapped onto the model's parameters: names of packed modules
(q/k/v, gate/up; see ``Model.packed_modules_mapping``) load into their fused parameter's
slice; ``lm_head.weight`` is skipped when embeddings are tied; names the model has no
parameter for (e.g. ``rotary_emb.inv_freq``) are ignored. Any parameter (or fused shard)
left unfilled is an error naming it.

Checkpoint tensors reach the parameters' ``weight_loader`` as safetensors slices, so a
tensor-parallel rank reads only its own part of each tensor from the file.

Quantized checkpoints (``pyengine.layers.quantization``): the config's method replaces each
linear layer's weight by its own parameters before loading and processes them after. A
quantized tensor that would reach a float parameter (an FP8 weight without its scale, an
int32 packed weight) or that no parameter takes (a ``weight_scale`` of an unquantized
layer) is refused with a ValueError naming it: never converted and run as if it were the
weight.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pyengine.layers.fused_moe.layer import FusedMoE
from pyengine.layers.linear import LinearBase, ReplicatedLinear, default_weight_loader, full_weight
from pyengine.layers.quantization import get_quantization_config
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


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int64, torch.int32, torch.int16)  # indices (g_idx, weight_shape): any width holds them
# Names of quantization tensors (compressed-tensors, HF fp8, GPTQ, AWQ): a checkpoint tensor of
# this name that no parameter takes means a quantized layer would run without it.
_QUANT_TENSOR_NAMES = ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_packed", "weight_shape",
                       "weight_global_scale", "input_scale", "input_zero_point", "qweight", "qzeros", "scales",
                       "g_idx")


# One MoE expert's tensor (``...experts.17.gate_proj.weight_scale``): FusedMoE holds its experts in
# the model's float dtype or in the form its quantization method gives them (FP8, packed INT);
# a quantized tensor with nowhere to go (experts the config leaves float) is refused with that reason.
# The same pattern names the FusedMoE and the expert of a parameter path under one expert (an
# expert projection's, ``moe_wna16``).
_EXPERT_OF = re.compile(r"^(?P<moe>.*\.experts)\.(?P<id>\d+)\.")


def _is_quantized(name: str, tensor) -> bool:
    return name.rsplit(".", 1)[-1] in _QUANT_TENSOR_NAMES or _dtype_of(tensor) not in _FLOATS


def _is_kv_cache_scale(name: str) -> bool:
    """A per-layer KV cache scale (``_KV_SCALE_NAMES``): read by ``load_kv_cache_scales`` with
    ``kv_cache_dtype="fp8"``, unused otherwise (as vLLM)."""
    return any(name.endswith(f".{k}") for k in _KV_SCALE_NAMES)


def _dtype_of(tensor) -> torch.dtype | None:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    return _SAFETENSORS_DTYPES.get(tensor.get_dtype())


def _check_dtype(name: str, tensor, param: torch.Tensor) -> None:
    """Raises ValueError when a checkpoint tensor cannot be converted to its parameter's
    dtype as a value (quantized data into a float parameter, or float into an int/FP8 one)."""
    src = _dtype_of(tensor)
    if src == param.dtype or (src in _FLOATS and param.dtype in _FLOATS) or (src in _INTS and param.dtype in _INTS):
        return
    raise ValueError(f"checkpoint tensor {name!r} is {str(src).replace('torch.', '')} but the model's parameter is "
                     f"{str(param.dtype).replace('torch.', '')}: a quantized checkpoint needs a quantization_config in "
                     f"config.json that vengine supports, with this tensor's layer in its scope")


class LayerwiseFinish:
    """The quantized layers of a model that ``materialize`` left on the meta device: each is
    allocated when the checkpoint's first tensor for it arrives and finished (its method's
    ``process_weights_after_loading``) as soon as every one of its parameters is loaded, so
    a load holds one layer at a time in its checkpoint form (an on-the-fly FP8 layer's float
    weight) besides the finished ones. ``finished``: the prefixes of the finished layers."""

    def __init__(self, model: nn.Module, device):
        self.device = device
        self._layer_of: dict[str, tuple[str, nn.Module]] = {}
        self._left: dict[str, int] = {}
        self._complete: set[str] = set()
        self._names: dict[str, list[str]] = {}
        self.finished: set[str] = set()
        for prefix, m in quantized_layers(model):
            names = [f"{prefix}.{n}" for n, _ in m.named_parameters()]
            self._names[prefix] = names
            self._left[prefix] = len(names)
            for n in names:
                self._layer_of[n] = (prefix, m)

    def param(self, name: str, params: dict):
        """``params[name]``, its whole layer allocated first if it is still on the meta
        device (``params`` updated). Raises ValueError for a tensor of a finished layer (a
        checkpoint that holds a tensor twice)."""
        entry = self._layer_of.get(name)
        if entry is not None and entry[0] in self.finished:
            raise ValueError(f"the layer {entry[0]!r} is already complete: the checkpoint holds {name!r} twice")
        p = params.get(name)
        if p is not None and p.is_meta and entry is not None:
            prefix, m = entry
            materialize(m, self.device)
            params.update((f"{prefix}.{n}", q) for n, q in m.named_parameters())
            p = params[name]
        return p

    def loaded(self, name: str, got: set, params: dict) -> None:
        """Note that ``params[name]`` now holds the shards ``got``; finish its layer when that
        was the layer's last missing part (its parameters leave ``params``, so the checkpoint
        form is freed). Raises ValueError when the method cannot process the layer."""
        entry = self._layer_of.get(name)
        if entry is None or name in self._complete or not _complete(params[name], got):
            return
        prefix, m = entry
        self._complete.add(name)
        self._left[prefix] -= 1
        if self._left[prefix]:
            return
        _process(prefix, m)
        self.finished.add(prefix)
        for n in self._names[prefix]:
            params.pop(n, None)


def _complete(param: torch.Tensor, got: set) -> bool:
    """Whether the shards ``got`` fill ``param`` (a whole tensor, or each of its ``shard_ids``)."""
    ids = getattr(param, "shard_ids", None)
    return None in got or bool(ids) and all(s in got for s in ids)


def _process(prefix: str, layer: nn.Module) -> None:
    try:
        layer.quant_method.process_weights_after_loading(layer)
    except ValueError as e:
        raise ValueError(f"cannot load the quantized layer {prefix!r}: {e}") from None


def load_weights(model: nn.Module, weights, tie_word_embeddings: bool = False,
                 finish: LayerwiseFinish | None = None) -> None:
    """Copy checkpoint ``weights`` (iterable of (name, tensor or safetensors slice)) into
    ``model``; each parameter's ``weight_loader`` takes its tensor-parallel part. With
    ``finish``, quantized layers left on the meta device are allocated and processed layer
    by layer (see ``LayerwiseFinish``).

    A model may map names itself: ``model.map_checkpoint_name(name)`` returning
    ``(parameter name, shard id)`` (e.g. one MoE expert's tensor into the stacked experts'
    parameter) or None (the default mapping). With ``model.refuse_unknown_weights`` a
    checkpoint tensor that fills no parameter is an error instead of being ignored.

    Raises ValueError naming any parameter or fused shard the checkpoint did not provide,
    on a shape mismatch, or for quantized tensors the model cannot use (see the module
    docstring).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "map_checkpoint_name", None)
    strict = bool(getattr(model, "refuse_unknown_weights", False))
    loaded: dict[str, set] = {}
    unused_quantized: list[str] = []
    # quantized tensors of layers that run in float only: MoE experts, routers and gates
    experts: list[str] = []
    float_only: list[str] = []
    modules = dict(model.named_modules())
    for name, tensor in weights:
        if tie_word_embeddings and name.startswith("lm_head."):
            if _is_quantized(name, tensor):  # a quantized head would run as the float embedding
                unused_quantized.append(name)
            continue  # lm_head shares the embedding parameter
        mapped = remap(name) if remap is not None else None
        if mapped is not None:
            target, shard = mapped
        else:
            target, shard = name, None
            # (a parameter of that very name is not a fused one: an MoE expert's projection, moe_wna16)
            parts = name.split(".") if name not in params else []
            for i, p in enumerate(parts):
                if p in packed:
                    fused, shard = packed[p]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                    break
        # One expert's tensor, its id in the (renamed) path (experts in modules of their own,
        # moe_wna16) or in the shard id (the stacked experts): another rank's is skipped.
        expert = _EXPERT_OF.match(target)
        moe_name = expert["moe"] if expert else target.rpartition(".")[0]
        moe = modules.get(moe_name)
        eid = int(expert["id"]) if expert else shard[1] if isinstance(shard, tuple) else None
        if isinstance(moe, FusedMoE) and eid is not None:
            if eid >= moe.global_num_experts:
                raise ValueError(f"checkpoint tensor {name!r}: expert id {eid} out of range: the model "
                                 f"has {moe.global_num_experts} experts")
            if not moe.holds_expert(eid):
                continue  # another rank's expert (expert parallelism)
        param = finish.param(target, params) if finish is not None else params.get(target)
        # an MoE layer's tensor it has no parameter for?
        if param is None and isinstance(moe, FusedMoE) and moe.quant_method is not None \
                and not _is_quantized(name, tensor):
            raise ValueError(f"checkpoint tensor {name!r} is an unquantized expert tensor, but the "
                             f"quantization_config quantizes the experts of {moe_name!r}: "
                             f"the checkpoint and its config disagree")
        if _is_quantized(name, tensor):
            # an expert's quantized tensor needs a quantized form of the experts (FP8) to load into
            if _EXPERT_OF.match(name) and (param is None or (param.dtype in _FLOATS
                                                                and _dtype_of(tensor) not in _FLOATS)):
                experts.append(name)
                continue
            if isinstance(modules.get(target.rpartition(".")[0]), ReplicatedLinear):
                float_only.append(name)
                continue
        if param is None:
            if _is_kv_cache_scale(name):
                pass  # load_kv_cache_scales' (fp8 KV cache), ignored otherwise
            elif _is_quantized(name, tensor):
                unused_quantized.append(name)
            elif strict and not name.endswith("rotary_emb.inv_freq"):
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in {type(model).__name__}: "
                                 f"a weight this implementation does not use cannot be ignored safely")
            logger.debug("ignoring checkpoint tensor %s", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            _check_dtype(name, tensor, param)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from None
        loaded.setdefault(target, set()).add(shard)
        if finish is not None:
            finish.loaded(target, loaded[target], params)
    if float_only:
        raise ValueError(f"the checkpoint quantizes {', '.join(float_only[:4])}{' ...' if len(float_only) > 4 else ''}"
                         f": MoE routers and gates (ReplicatedLinear) run in the model's float dtype only")
    if experts:
        raise ValueError("MoE experts stored quantized are not supported in this form: the quantization_config "
                         "leaves these experts unquantized, or describes another form than the tensors have "
                         f"({', '.join(experts[:4])}{' ...' if len(experts) > 4 else ''})")
    if unused_quantized:
        shown = ", ".join(unused_quantized[:8]) + (f" and {len(unused_quantized) - 8} more" if len(unused_quantized) > 8
                                                   else "")
        raise ValueError(f"the checkpoint holds quantized tensors that no layer of the model takes ({shown}): its "
                         f"quantization_config is missing, unsupported, or does not cover these layers")
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


def build_model(factory, dtype: torch.dtype, device, max_model_len: int) -> nn.Module:
    """``factory()`` called with ``dtype`` as the default dtype on ``device``, its rotary
    caches extended to ``max_model_len`` positions (parameters uninitialized; fill them
    with ``load_weights``). For models built outside the registry (EAGLE-3 heads)."""
    with _default_dtype(dtype), torch.device(device):
        model = factory()
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.extend_to(max_model_len)
    return model


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
    quant_config = get_quantization_config(hf_config, getattr(config, "quantization", None))
    # Built on the meta device, then allocated: the float layers now, the quantized ones one at
    # a time as the checkpoint fills them (LayerwiseFinish), so a quantized model's load never
    # holds its float size.
    with _default_dtype(config.dtype), torch.device("meta"):
        model = model_cls(hf_config, attn_backend, tp_group=tp_group, **kwargs)
        if quant_config is not None:
            quantize_linear_layers(model, quant_config)
    dummy = getattr(config, "load_format", "auto") == "dummy"
    finish = None if dummy else LayerwiseFinish(model, config.device)
    materialize(model, config.device, skip=[] if dummy else [m for _, m in quantized_layers(model)])
    for m in model.modules():  # positions up to max_model_len (see EngineConfig.max_model_len)
        if isinstance(m, RotaryEmbedding):
            m.extend_to(config.max_model_len)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    with torch.no_grad():
        if dummy:
            init_dummy_weights(model, config.seed)
        else:
            load_weights(model, iterate_weights(config.model), tie_word_embeddings=tie, finish=finish)
        for prefix, m in quantized_layers(model):
            if finish is None or prefix not in finish.finished:
                _process(prefix, m)
        if getattr(config, "kv_cache_dtype", "auto") == "fp8" and getattr(config, "load_format", "auto") != "dummy":
            found = load_kv_cache_scales(model, iterate_weights(config.model))
            declared = quant_config is not None and quant_config.kv_cache_scales()
            if declared and not found:  # vLLM's behaviour (scale 1.0), but the checkpoint promised scales
                logger.warning("the checkpoint's quantization_config declares a kv_cache_scheme but holds no "
                               "k_scale / v_scale tensors: the FP8 KV cache runs with scale 1.0")
    return model.eval()


def materialize(model: nn.Module, device, skip=()) -> None:
    """Allocate on ``device``, uninitialized, every parameter of ``model`` that is on the
    meta device (its attributes — ``weight_loader``, ``output_dim``, ... — kept, which
    ``nn.Module.to_empty`` drops; a parameter shared by two modules stays shared), and have
    each module holding buffers compute them there (``init_buffers(device)``: rotary caches,
    expert maps). vLLM's layers create a quantized layer's parameters in their final form
    at construction (``create_weights`` in vllm/model_executor/layers/linear.py); here the
    quantization methods replace a built model's float ones, so the model is built on the
    meta device and allocated after that.

    ``skip``: modules left on the meta device with everything under them (the quantized
    layers ``LayerwiseFinish`` allocates one at a time).

    Raises RuntimeError naming a meta tensor no rule covers (a buffer of a module without
    ``init_buffers``, or a tensor attribute): it would have no value."""
    done: dict[int, nn.Parameter] = {}
    skipped = {id(m) for s in skip for m in s.modules()}
    for prefix, module in model.named_modules():
        if id(module) in skipped:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            new = done.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            setattr(module, name, new)
        if any(b.is_meta for _, b in module.named_buffers(recurse=False)):
            init = getattr(module, "init_buffers", None)
            if init is None:
                raise RuntimeError(f"{prefix or type(module).__name__}: a buffer built on the meta device and no "
                                   f"init_buffers(device) to compute it")
            init(device)
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                raise RuntimeError(f"{prefix}.{name}: a tensor built on the meta device that nothing computes")
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                raise RuntimeError(f"{prefix}.{name}: init_buffers left it on the meta device")


# Checkpoint names of a layer's FP8 KV cache scales, under its attention module (vLLM's set):
# compressed-tensors' kv_cache_scheme, ModelOpt/Quark's k_proj/v_proj output scales, the older
# one kv_scale for both.
_KV_SCALE_NAMES = {"k_scale": ("k",), "v_scale": ("v",), "k_proj.output_scale": ("k",),
                   "v_proj.output_scale": ("v",), "kv_scale": ("k", "v")}


def load_kv_cache_scales(model: nn.Module, weights) -> int:
    """Set each attention module's ``k_scale`` / ``v_scale`` (floats; modules that have them)
    from the checkpoint's scale tensors (see ``_KV_SCALE_NAMES``); modules the checkpoint
    gives none keep 1.0 (vLLM's default). Returns how many were set. Raises ValueError for a
    scale that is not one positive finite value."""
    modules = dict(model.named_modules())
    found = 0
    for name, tensor in weights:
        for suffix, which in _KV_SCALE_NAMES.items():
            if not name.endswith("." + suffix):
                continue
            module = modules.get(name[: -len(suffix) - 1])
            if module is None or not hasattr(module, "k_scale"):
                continue
            t = full_weight(tensor).float()
            if t.numel() != 1 or not (torch.isfinite(t).all() and float(t) > 0):
                raise ValueError(f"KV cache scale {name!r} must be one positive value, got {t.flatten()[:4].tolist()}")
            for w in which:
                setattr(module, f"{w}_scale", float(t))
            found += 1
    if found:
        logger.info("FP8 KV cache: %d per-layer scales from the checkpoint", found)
    return found


def quantize_linear_layers(model: nn.Module, quant_config) -> None:
    """Give every linear layer of ``model`` its method from ``quant_config`` (layers the
    config leaves out stay unquantized), and every MoE layer's experts theirs
    (``get_moe_method``, asked with the checkpoint names of the experts' projections,
    ``model.expert_checkpoint_names``). ``ReplicatedLinear`` layers (MoE routers, Qwen2-MoE's
    shared-expert gate) always stay in the model's dtype, as quantized checkpoints keep them
    (llm-compressor's recipes ignore ``mlp.gate``): a checkpoint that does quantize one is
    refused by ``load_weights`` (its quantization tensors fill no parameter). Raises
    ValueError (a fused layer whose parts the checkpoint quantizes differently, a shape the
    format cannot split)."""
    fused_parts: dict[str, list[str]] = {}
    for ckpt_name, (fused, _) in getattr(model, "packed_modules_mapping", {}).items():
        fused_parts.setdefault(fused, []).append(ckpt_name)
    for prefix, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            module.expert_proj_names = dict(model.expert_proj_names)  # the names its experts' tensors have
            method = quant_config.get_moe_method(module, prefix, model.expert_checkpoint_names(prefix, module))
            if method is not None:
                try:
                    module.set_quant_method(method)
                except ValueError as e:
                    raise ValueError(f"cannot quantize the experts {prefix!r}: {e}") from None
            continue
        if not isinstance(module, LinearBase) or isinstance(module, ReplicatedLinear):
            continue
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{n}" if head else n for n in fused_parts.get(leaf, [leaf])]
        method = quant_config.get_quant_method(module, prefix, names)
        if method is not None:
            try:
                module.set_quant_method(method)
            except ValueError as e:
                raise ValueError(f"cannot quantize {prefix!r}: {e}") from None


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(prefix, layer)`` of every linear or MoE layer a quantization method owns. The
    projections an MoE method loads its experts into (``moe_wna16``) are its own business:
    left out."""
    out: list[tuple[str, nn.Module]] = []
    for prefix, m in model.named_modules():
        if out and isinstance(out[-1][1], FusedMoE) and prefix.startswith(out[-1][0] + "."):
            continue
        if isinstance(m, (LinearBase, FusedMoE)) and m.quant_method is not None:
            out.append((prefix, m))
    return out


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights on the model's device (vLLM's load_format="dummy"), for benchmarks
    of a model shape without a checkpoint: uniform in [-0.02, 0.02], norm weights 1."""
    gen = None
    layers = quantized_layers(model)
    quantized = {id(p) for _, m in layers for n, p in m.named_parameters() if n != "bias"}
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if id(p) in quantized:
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.02, 0.02, generator=gen)
    for _, m in layers:  # quantized layers: random values of a valid quantized weight
        if gen is not None:
            m.quant_method.dummy_weights(m, gen)

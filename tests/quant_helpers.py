"""Quantized checkpoints for the tests, written from the tiny float models (nothing downloaded).

* ``compressed_tensors_checkpoint``: what llm-compressor's data-free ``oneshot`` writes
  (``QuantizationModifier(targets="Linear", scheme=..., ignore=["lm_head"])`` then
  ``save_pretrained(save_compressed=True)``), done with compressed-tensors' own machinery,
  which llm-compressor drives: ``apply_quantization_config``, weight scales from each
  weight's min/max (llm-compressor's default ``minmax`` observer) through
  ``calculate_qparams``, ``ModelCompressor.compress_model`` and ``update_config``. A static
  activation scheme (``FP8``) is calibrated on given token ids (input min/max per layer).
  llm-compressor itself pins transformers <= 5.17, below this project's, so the tests do not
  install it.
* ``gptq_checkpoint`` / ``awq_checkpoint`` / ``fp8_block_checkpoint`` / ``fp8_moe_checkpoint``:
  the GPTQ (v1 ``gptq`` and ``gptq_v2``), AutoAWQ GEMM, HF-native FP8 (``weight_block_size``)
  formats and FP8 MoE experts (compressed-tensors or HF ``fp8``) written from round-to-nearest
  quantization, together with the plain float model holding exactly
  the dequantized weights (the oracle).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # Qwen-MoE's and Mixtral's


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)


def compressed_tensors_checkpoint(src_dir, out_dir, scheme: str, group_size: int | None = None,
                                  block: Sequence[int] | None = None, ignore: Sequence[str] = ("lm_head",),
                                  calibration: list[list[int]] | None = None, kv_cache_fp8: bool = False,
                                  plain_dir=None) -> Path:
    """Quantize the HF model in ``src_dir`` with the compressed-tensors preset ``scheme``
    (``FP8_DYNAMIC``, ``FP8``, ``FP8_BLOCK``, ``W4A16``, ``W4A16_ASYM``, ``W8A16``, ...) and save
    it compressed into ``out_dir`` with the tokenizer files. ``group_size`` / ``block``
    override the preset's (the tiny models are 64 wide); ``calibration``: token id lists for
    static activation scales (and the FP8 KV cache scales with ``kv_cache_fp8``).
    ``plain_dir``: also save the float model whose weights are compressed-tensors' own
    decompression of the saved ones (the oracle where transformers cannot load the
    checkpoint: it mis-sizes the packed zero points of asymmetric INT4)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStatus,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    src, out = Path(src_dir), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        qscheme.weights.group_size = group_size
    if block is not None:
        qscheme.weights.block_structure = list(block)
        if qscheme.input_activations is not None and qscheme.input_activations.group_size:
            qscheme.input_activations.group_size = block[1]
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False) \
        if kv_cache_fp8 else None
    qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore), kv_cache_scheme=kv)
    apply_quantization_config(model, qconfig)
    for _, module in model.named_modules():
        s = getattr(module, "quantization_scheme", None)
        if s is None or not hasattr(module, "weight"):
            continue
        w, a = module.weight.data, s.weights
        if a.strategy == QuantizationStrategy.TENSOR:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif a.strategy == QuantizationStrategy.CHANNEL:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif a.strategy == QuantizationStrategy.GROUP:
            g = w.unflatten(-1, (-1, a.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        else:  # block
            bn, bk = a.block_structure
            b = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))  # [N/bn, bn, K/bk, bk]
            lo, hi = b.amin((1, 3)), b.amax((1, 3))
        scale, zp = calculate_qparams(lo, hi, a)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
    if calibration is not None:
        _calibrate(model, calibration, calculate_qparams)
    for _, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_status = QuantizationStatus.FROZEN
    if out.exists():
        shutil.rmtree(out)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_side_files(src, out)
    if plain_dir is not None:
        compressor.decompress_model(model)
        plain = _load_state(src)
        dense = dict(model.named_parameters())
        for name in _linear_weights(plain):
            if name in dense:
                plain[name] = dense[name].detach().float().clone()
        _save(plain, src, Path(plain_dir), None)
    return out


def compressed_tensors_moe_checkpoint(src_dir, out_dir, plain_dir, scheme: str = "W4A16",
                                      group_size: int | None = 16) -> tuple[Path, Path]:
    """A compressed-tensors ``pack-quantized`` checkpoint of the MoE model in ``src_dir`` with
    every expert's projections quantized too, and the plain model of the decompressed
    weights. transformers' MoE classes stack their experts in one module (not ``Linear``s),
    so ``compressed_tensors_checkpoint`` quantizes attention and shared experts only; each
    expert's weight is then quantized, packed and unpacked by compressed-tensors'
    ``PackedQuantizationCompressor`` itself (min/max qparams, as llm-compressor's default
    observer), which is what llm-compressor writes for an MoE model's experts. The routers
    are ignored, as llm-compressor's MoE recipes leave them."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]
    out = compressed_tensors_checkpoint(src_dir, out_dir, scheme, group_size=group_size, ignore=ignore,
                                        plain_dir=plain_dir)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None and qscheme.weights.strategy == QuantizationStrategy.GROUP:
        qscheme.weights.group_size = group_size
    a = qscheme.weights
    state, plain = _load_state(out), _load_state(Path(plain_dir))
    for name in [k for k in state if ".experts." in k and k.endswith(".weight")]:
        w = state.pop(name).float()
        v = w.unflatten(-1, (-1, a.group_size)) if a.strategy == QuantizationStrategy.GROUP else w.unsqueeze(-1)
        scale, zp = calculate_qparams(v.amin(-1), v.amax(-1), a)
        module = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        packed = PackedQuantizationCompressor.compress(module, qscheme)
        base = name[: -len(".weight")]
        state.update({f"{base}.{k}": t for k, t in packed.items() if t is not None})
        plain[name] = PackedQuantizationCompressor.decompress(packed, qscheme)["weight"].float()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in plain.items()}, str(Path(plain_dir) / "model.safetensors"))
    return out, Path(plain_dir)


def _calibrate(model, calibration, calculate_qparams) -> None:
    """Static input scales (and k/v scales) from the min/max over the calibration prompts, as
    llm-compressor's static min-max observer."""
    stats: dict = {}

    def observe(key, t):
        lo, hi = stats.get(key, (t.min(), t.max()))
        stats[key] = (torch.minimum(lo, t.min()), torch.maximum(hi, t.max()))

    hooks = []
    for name, module in model.named_modules():
        s = getattr(module, "quantization_scheme", None)
        if s is not None and s.input_activations is not None and hasattr(module, "input_scale"):
            hooks.append(module.register_forward_pre_hook(lambda m, args, n=name: observe((n, "input"), args[0])))
        if name.endswith("self_attn") and hasattr(module, "k_proj") and hasattr(module, "k_scale"):
            for which in ("k", "v"):
                proj = getattr(module, f"{which}_proj")
                hooks.append(proj.register_forward_hook(
                    lambda m, args, o, n=name, w=which: observe((n, w), o)))
    # Observers see the true activations: quantization off while calibrating.
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_enabled = False
    with torch.no_grad():
        for ids in calibration:
            model(torch.tensor([ids]))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_enabled = True
    for h in hooks:
        h.remove()
    modules = dict(model.named_modules())
    for (name, which), (lo, hi) in stats.items():
        module = modules[name]
        args = module.quantization_scheme.input_activations if which == "input" else None
        if args is None:
            from compressed_tensors.quantization import QuantizationArgs
            args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        scale, _ = calculate_qparams(lo.reshape(1), hi.reshape(1), args)
        getattr(module, f"{which}_scale").data.copy_(scale.reshape(getattr(module, f"{which}_scale").shape))


# ---- GPTQ / AWQ / HF fp8 -------------------------------------------------------------------
def _rtn_int(w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest of w [N, K] with rows of K grouped by g_idx: (q [K, N] unsigned,
    scales [G, N], zeros [G, N] integer-valued)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo = torch.minimum(cols.amin(1), torch.zeros(n))
        hi = torch.maximum(cols.amax(1), torch.zeros(n))
        if sym:
            s = torch.maximum(lo.abs(), hi) / (maxq / 2)
            z = torch.full((n,), float((maxq + 1) // 2))
        else:
            s = (hi - lo) / maxq
            z = torch.round(-lo / s.clamp(min=1e-12))
        s = s.clamp(min=1e-8)
        scales[g], zeros[g] = s, z
    sg, zg = scales[g_idx.long()], zeros[g_idx.long()]  # [K, N]
    q = torch.clamp(torch.round(w.t() / sg) + zg, 0, maxq).to(torch.int32)
    return q, scales, zeros


def _dequant(q, scales, zeros, g_idx) -> torch.Tensor:
    s, z = scales.float()[g_idx.long()], zeros.float()[g_idx.long()]
    return ((q.float() - z) * s).t().contiguous()


def _linear_weights(state: dict) -> list[str]:
    """The linear layers' weights: attention, MLPs and (Mixtral's ``w1``/``w2``/``w3`` too)
    MoE experts' projections."""
    return [k for k in state if k.endswith(".weight") and (k.split(".")[-2] in LINEARS or
                                                           (".experts." in k and k.split(".")[-2] in EXPERT_LINEARS))]


def _save(state: dict, src: Path, out: Path, quantization_config: dict | None) -> Path:
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _copy_side_files(src, out)
    return out


def _load_state(src: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def gptq_checkpoint(src_dir, out_dir, plain_dir, bits: int = 4, group_size: int = 32, desc_act: bool = False,
                    sym: bool = True, checkpoint_format: str = "gptq", seed: int = 0) -> tuple[Path, Path]:
    """A GPTQ checkpoint of the model in ``src_dir`` (qweight [K/8, N] packed along K,
    qzeros [G, N/8] packed along N — stored minus one in the v1 ``gptq`` format —, scales
    [G, N] fp16, g_idx [K]; ``desc_act``: a random activation order, g_idx a permutation of
    the groups) and the plain float model with its dequantized weights. Returns both dirs."""
    from pyengine.layers.quantization.utils import pack_int32

    src = Path(src_dir)
    state = _load_state(src)
    plain = dict(state)
    gen = torch.Generator().manual_seed(seed)
    orders: dict = {}  # act order comes from the input's statistics: one per input (q/k/v, gate/up share it)
    for name in _linear_weights(state):
        w = state[name].float()
        k = w.shape[1]
        gs = group_size if group_size != -1 else k
        g_idx = torch.arange(k) // gs
        if desc_act:
            base, proj = name.rsplit(".", 2)[0], name.split(".")[-2]
            key = (base, {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj))
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            g_idx = g_idx[orders[key]]
        q, scales, zeros = _rtn_int(w, bits, gs, sym, g_idx)
        scales = scales.half()
        base = name[: -len(".weight")]
        del state[name]
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        state[f"{base}.qweight"] = pack_int32(q, bits, 0)
        state[f"{base}.qzeros"] = pack_int32(stored_zeros.to(torch.int64) & ((1 << bits) - 1), bits, 1)
        state[f"{base}.scales"] = scales
        state[f"{base}.g_idx"] = g_idx.to(torch.int32)
        # v1 stores zero - 1 in `bits` bits; readers add 1 back (a zero of 0 reads as 2**bits)
        read_zeros = (stored_zeros.to(torch.int64) & ((1 << bits) - 1)) + 1 if checkpoint_format == "gptq" else zeros
        plain[name] = _dequant(q, scales, read_zeros, g_idx)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": checkpoint_format}
    return _save(state, src, Path(out_dir), qc), _save(plain, src, Path(plain_dir), None)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column AWQ_ORDER[j] of its 8


def awq_checkpoint(src_dir, out_dir, plain_dir, group_size: int = 32) -> tuple[Path, Path]:
    """An AutoAWQ GEMM checkpoint (qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's
    interleaved order, scales [G, N] fp16; asymmetric 4-bit) and the plain dequantized model."""
    from pyengine.layers.quantization.utils import pack_int32

    src = Path(src_dir)
    state = _load_state(src)
    plain = dict(state)
    for name in _linear_weights(state):
        w = state[name].float()
        g_idx = torch.arange(w.shape[1]) // group_size
        q, scales, zeros = _rtn_int(w, 4, group_size, False, g_idx)
        scales = scales.half()
        base = name[: -len(".weight")]
        del state[name]
        state[f"{base}.qweight"] = pack_int32(q, 4, 1, AWQ_ORDER)
        state[f"{base}.qzeros"] = pack_int32(zeros.to(torch.int64), 4, 1, AWQ_ORDER)
        state[f"{base}.scales"] = scales
        plain[name] = _dequant(q, scales, zeros, g_idx)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return _save(state, src, Path(out_dir), qc), _save(plain, src, Path(plain_dir), None)


def fp8_block_checkpoint(src_dir, out_dir, plain_dir, block: Sequence[int] = (32, 32)) -> tuple[Path, Path]:
    """An HF-native FP8 checkpoint (Qwen3-FP8 / DeepSeek style: F8_E4M3 ``weight`` and float32
    ``weight_scale_inv`` per ``block`` of [rows, cols], ``quant_method: fp8``,
    ``weight_block_size``) and the plain model with the dequantized weights."""
    from pyengine.layers.quantization.utils import FP8_DTYPE, FP8_MAX

    src = Path(src_dir)
    state = _load_state(src)
    plain = dict(state)
    bn, bk = block
    for name in _linear_weights(state):
        w = state[name].float()
        n, k = w.shape
        b = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))  # [N/bn, bn, K/bk, bk]
        scale = b.abs().amax((1, 3)) / FP8_MAX
        s = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        state[name] = q
        state[name + "_scale_inv"] = scale
        plain[name] = q.float() * s
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    return _save(state, src, Path(out_dir), qc), _save(plain, src, Path(plain_dir), None)


def _fp8_scales(w: torch.Tensor, form: str, block: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(checkpoint scale, scale broadcast to w's shape) of a [rows, cols] weight quantized
    per tensor ([1]), per channel ([rows, 1]) or per block ([ceil(rows/bn), ceil(cols/bk)])."""
    from pyengine.layers.quantization.utils import FP8_MAX

    n, k = w.shape
    if form == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        return scale, scale.expand(n, k)
    if form == "channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX
        return scale, scale.expand(n, k)
    bn, bk = block
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / FP8_MAX
    return scale, scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def fp8_moe_checkpoint(src_dir, out_dir, plain_dir, fmt: str = "compressed-tensors", form: str = "channel",
                       block: Sequence[int] | None = None, act: str | None = None,
                       experts_only: bool = False) -> tuple[Path, Path]:
    """An FP8 checkpoint of the MoE model in ``src_dir`` — every expert's projections (and,
    unless ``experts_only``, attention and shared experts) F8_E4M3 with float32 scales
    (``form`` "tensor", "channel" or "block" of ``block`` [rows, cols]) — and the plain model
    holding exactly the dequantized weights (the oracle: transformers cannot load per-expert
    FP8 tensors into its stacked experts). ``fmt``: "compressed-tensors" (``weight_scale``;
    ``act`` "token" declares FP8_DYNAMIC activations, None weight-only; the routers ignored,
    as llm-compressor's MoE recipes write them) or "fp8" (HF-native: ``weight_scale_inv``
    blocks, or a per-tensor ``weight_scale``; dynamic activations)."""
    from pyengine.layers.quantization.utils import FP8_DTYPE, FP8_MAX

    src = Path(src_dir)
    state = _load_state(src)
    plain = dict(state)
    for name in [k for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEARS + EXPERT_LINEARS]:
        if experts_only and ".experts." not in name:
            continue
        w = state[name].float()
        scale, s = _fp8_scales(w, form, block)
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        state[name] = q
        state[name + ("_scale_inv" if fmt == "fp8" and form == "block" else "_scale")] = scale
        plain[name] = q.float() * s
    if fmt == "fp8":
        qc: dict = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if form == "block":
            qc["weight_block_size"] = list(block)
        if experts_only:
            qc["modules_to_not_convert"] = ["self_attn", "shared_expert."]
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": form, "block_structure": list(block) if form == "block" else None}
        acts = None
        if act == "token":
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        ignore = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]
        if experts_only:
            ignore += ["re:.*self_attn.*", "re:.*shared_expert\\..*"]
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                            "output_activations": None, "format": "float-quantized"}}}
    return _save(state, src, Path(out_dir), qc), _save(plain, src, Path(plain_dir), None)


# ---- FP8 KV cache ---------------------------------------------------------------------------
def add_kv_cache_scales(model_dir, calibration: list[list[int]]) -> dict[int, tuple[float, float]]:
    """Give the checkpoint in ``model_dir`` per-layer FP8 KV cache scales, as llm-compressor's
    ``kv_cache_scheme`` writes them (``model.layers.N.self_attn.k_scale`` / ``v_scale``, one
    float32 each; ``kv_cache_scheme`` in its quantization_config): amax / 448 of the post-RoPE
    keys and the values over ``calibration``. (compressed-tensors 0.20 no longer finds the
    attention modules of transformers 5, whose forward takes ``cache``: its own KV
    quantization does not run, so the tests compute these and ``hf_greedy_fp8_kv`` applies
    them.) Returns {layer: (k_scale, v_scale)}."""
    from safetensors.torch import load_file, save_file

    d = Path(model_dir)
    amax: dict[int, list[float]] = {}

    def observe(layer, k, v):
        a = amax.setdefault(layer, [0.0, 0.0])
        a[0], a[1] = max(a[0], k.abs().max().item()), max(a[1], v.abs().max().item())

    model = load_hf_quantized(d)
    with torch.no_grad():
        for ids in calibration:
            model(torch.tensor([ids]), past_key_values=_ObservingCache(observe), use_cache=True)
    scales = {i: (a[0] / 448.0, a[1] / 448.0) for i, a in amax.items()}
    f = d / "model.safetensors"
    sd = load_file(str(f))
    for i, (ks, vs) in scales.items():
        sd[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([ks], dtype=torch.float32)
        sd[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([vs], dtype=torch.float32)
    save_file(sd, str(f))
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.setdefault("quantization_config", {"quant_method": "compressed-tensors", "config_groups": {}})
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                             "symmetric": True}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return scales


def load_hf_quantized(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _cache_cls():
    from transformers import DynamicCache

    class ObservingCache(DynamicCache):
        """A DynamicCache that hands each layer's new post-RoPE keys and values to ``fn``
        (which may return replacements) before storing them."""

        def __init__(self, fn):
            super().__init__()
            self._fn = fn

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            out = self._fn(layer_idx, key_states, value_states)
            if out is not None:
                key_states, value_states = out
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return ObservingCache


def _ObservingCache(fn):
    return _cache_cls()(fn)


def hf_greedy_fp8_kv(model_dir, prompts: list[list[int]], max_new_tokens: int,
                     scales: dict[int, tuple[float, float]]) -> list[list[int]]:
    """transformers' greedy tokens with the KV cache quantized to e4m3 per tensor
    (``clamp(k / k_scale)`` rounded, times ``k_scale``; the same for v), as an FP8 KV cache
    holds them: every key and value attention reads, the current token's too. EOS ends a
    sequence (included), as ``tests.helpers.hf_greedy``."""
    from pyengine.layers.quantization.utils import FP8_DTYPE, FP8_MAX

    def fq(t, s):
        return (t / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(t.dtype) * s

    model = load_hf_quantized(model_dir)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    results = []
    with torch.no_grad():
        for ids in prompts:
            cache = _ObservingCache(lambda i, k, v: (fq(k, scales[i][0]), fq(v, scales[i][1])))
            seq, new = list(ids), []
            inp = torch.tensor([seq])
            for _ in range(max_new_tokens):
                logits = model(inp, past_key_values=cache, use_cache=True).logits[0, -1]
                t = int(logits.argmax())
                new.append(t)
                if t in eos:
                    break
                inp = torch.tensor([[t]])
            results.append(new)
    return results

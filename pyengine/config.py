"""Engine configuration: ``EngineArgs`` (what a user passes) resolved into a frozen
``EngineConfig`` (what the engine reads). Mirrors vllm/engine/arg_utils.py + vllm/config.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pyengine import envs
from pyengine.core.sched.request_queue import SchedulingPolicy

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
# Built-in default model shipped inside the package (see tools/train_default_model.py).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# KV cache size on CPU when neither num_gpu_blocks_override nor kv_cache_memory_bytes is set.
CPU_DEFAULT_KV_BYTES = 256 << 20




def derive_max_model_len(hf_config) -> tuple[int, str]:
    """The model's context length and where it comes from (for messages):
    ``max_position_embeddings`` (2048 if the config has none), times the RoPE scaling
    factor for a ``linear`` rope type (whose ``max_position_embeddings`` is the length
    before scaling). A ``llama3`` config already states the scaled length. Mirrors
    vllm/config's ``_get_and_verify_max_len``."""
    from pyengine.layers.rotary import get_rope_params

    mpe = getattr(hf_config, "max_position_embeddings", None)
    if mpe is None:
        return 2048, "the default 2048 (config.json has no max_position_embeddings)"
    rope = get_rope_params(hf_config)
    if rope["rope_type"] == "linear" and float(rope.get("factor", 1.0)) > 1.0:
        factor = float(rope["factor"])
        return int(mpe * factor), f"max_position_embeddings={mpe} x linear RoPE scaling factor {factor:g}"
    return int(mpe), f"max_position_embeddings={mpe}"


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names. ``EngineArgs.create_engine_config()`` validates
    them and raises ``ValueError`` naming the bad field."""
    model: Optional[str] = None  # None: the built-in default model
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's fairness knob: a prefill takes at most this many tokens per step (0: no cap),
    # so concurrent long prompts advance together and decodes keep their share.
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # a SchedulingPolicy value
    seed: int = 0
    async_scheduling: Optional[bool] = None  # None: on where compatible
    enforce_eager: bool = False
    attention_backend: Optional[str] = None  # None: "triton" on CUDA, "torch" on CPU
    served_model_name: Optional[str] = None
    load_format: str = "auto"  # "dummy": random weights (benchmarks of a model shape)
    # Streamed outputs (DELTA / CUMULATIVE) are sent every this many tokens of a request;
    # its first token and its end go at once (vLLM's --stream-interval).
    stream_interval: int = 1
    tensor_parallel_size: int = 1  # ranks (one process and, on CUDA, one GPU each)
    # No periodic stats log line (vLLM's --disable-log-stats); LLM(...) sets it unless given.
    disable_log_stats: bool = False

    def create_engine_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


@dataclass(frozen=True)
class EngineConfig:
    """Resolved, validated configuration. Built by ``EngineArgs.create_engine_config``."""
    model: str
    tokenizer: str
    served_model_name: str
    hf_config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks_override: Optional[int]
    kv_cache_memory_bytes: Optional[int]
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    scheduling_policy: SchedulingPolicy
    seed: int
    async_scheduling: bool
    enforce_eager: bool
    attention_backend: str
    load_format: str = "auto"
    stream_interval: int = 1
    tensor_parallel_size: int = 1
    long_prefill_token_threshold: int = 0  # tokens; 0: no cap
    disable_log_stats: bool = False

    @classmethod
    def from_args(cls, a: EngineArgs) -> "EngineConfig":
        from transformers import AutoConfig

        model = a.model or str(DEFAULT_MODEL_DIR)
        if not Path(model).is_dir() or not (Path(model) / "config.json").is_file():  # no hub downloads
            raise ValueError(f"model must be a Hugging Face model directory with a config.json; "
                             f"{model!r} is not one.")
        policy = SchedulingPolicy.parse(a.scheduling_policy)
        if a.load_format not in ("auto", "dummy"):
            raise ValueError(f"Unknown load_format {a.load_format!r}; valid: auto, dummy.")
        if a.device not in DEVICES:
            raise ValueError(f"Unknown device {a.device!r}; valid devices: {', '.join(DEVICES)}.")
        if a.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {a.dtype!r}; valid dtypes: {', '.join(DTYPES)}.")
        for name in ("max_num_seqs", "block_size", "stream_interval"):
            if not isinstance(getattr(a, name), int) or getattr(a, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(a, name)!r}.")
        if a.num_gpu_blocks_override is not None and a.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {a.num_gpu_blocks_override}.")
        if not 0.0 < a.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {a.gpu_memory_utilization}.")
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available.")
        device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        hf_config = AutoConfig.from_pretrained(model)
        _check_tensor_parallel(a.tensor_parallel_size, hf_config, device)
        dtype = DTYPES[a.dtype]
        if dtype is None:
            # transformers 5 names it `dtype` (reading `torch_dtype` warns); 4.x `torch_dtype`.
            cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
            if isinstance(cfg_dtype, str):
                cfg_dtype = DTYPES.get(cfg_dtype)
            dtype = cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
            if device.type == "cpu" and dtype == torch.float16:
                dtype = torch.float32  # fp16 matmuls on CPU are slow and imprecise
        derived_len, source = derive_max_model_len(hf_config)
        max_model_len = a.max_model_len or derived_len
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        if max_model_len > derived_len:
            if not envs.allow_long_max_model_len():
                # Positions past the model's length used to crash the first long sequence
                # (IndexError in the rotary cache) and kill the engine for every request.
                raise ValueError(
                    f"max_model_len={max_model_len} is larger than the model's context length "
                    f"{derived_len} ({source} in {model}/config.json). Lower max_model_len, or set "
                    f"VENGINE_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway (RoPE then extrapolates "
                    f"past position {derived_len} and outputs there may be wrong).")
            logger.warning("max_model_len=%d is larger than the model's context length %d (%s); allowed by "
                           "VENGINE_ALLOW_LONG_MAX_MODEL_LEN. Outputs past it may be wrong.",
                           max_model_len, derived_len, source)
        max_num_batched_tokens = a.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if a.enable_chunked_prefill else max(max_model_len, 8192)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}.")
        if not a.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len when chunked prefill is off.")
        thr = a.long_prefill_token_threshold
        if isinstance(thr, bool) or not isinstance(thr, int) or thr < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), got {thr!r}.")
        if thr and not a.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prefills into chunks: it needs chunked prefill "
                             "(enable_chunked_prefill=True).")
        async_sched = a.async_scheduling
        if async_sched is None:
            async_sched = envs.async_scheduling_allowed()
        elif async_sched and not envs.async_scheduling_allowed():
            async_sched = False
        backend = a.attention_backend
        if backend is None:
            hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            # The triton kernels need a power-of-two head_dim >= 16.
            pow2 = hd >= 16 and hd & (hd - 1) == 0
            backend = "triton" if device.type == "cuda" and pow2 else "torch"
        return cls(
            model=model, tokenizer=a.tokenizer or model,
            served_model_name=a.served_model_name or model.rstrip("/").split("/")[-1],
            hf_config=hf_config, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=a.block_size, num_gpu_blocks_override=a.num_gpu_blocks_override,
            kv_cache_memory_bytes=a.kv_cache_memory_bytes,
            gpu_memory_utilization=a.gpu_memory_utilization,
            enable_prefix_caching=a.enable_prefix_caching,
            enable_chunked_prefill=a.enable_chunked_prefill,
            scheduling_policy=policy, seed=a.seed, async_scheduling=async_sched,
            enforce_eager=a.enforce_eager or device.type != "cuda", attention_backend=backend,
            load_format=a.load_format, stream_interval=a.stream_interval,
            tensor_parallel_size=a.tensor_parallel_size, long_prefill_token_threshold=thr,
            disable_log_stats=bool(a.disable_log_stats))

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _check_tensor_parallel(tp, hf_config, device: torch.device) -> None:
    """Raises ValueError unless the model's heads and MLP split evenly over ``tp`` ranks
    (KV heads may also be fewer than the ranks, a divisor of ``tp``: replicated) and, on
    CUDA, there are ``tp`` GPUs."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
    if tp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"The model's num_attention_heads ({heads}) must be divisible by "
                         f"tensor_parallel_size ({tp}).")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"The model's num_key_value_heads ({kv_heads}) must be divisible by "
                         f"tensor_parallel_size ({tp}), or divide it.")
    if hf_config.intermediate_size % tp:
        raise ValueError(f"The model's intermediate_size ({hf_config.intermediate_size}) must be divisible by "
                         f"tensor_parallel_size ({tp}).")
    if device.type == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible.")

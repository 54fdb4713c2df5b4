"""Engine configuration: ``EngineArgs`` (what a user passes) resolved into a frozen
``EngineConfig`` (what the engine reads). Mirrors vllm/engine/arg_utils.py + vllm/config.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self, get_args

import torch

from pyengine import envs
from pyengine.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


class SchedulingPolicy(enum.StrEnum):
    """How the waiting queue is ordered (vLLM's ``SchedulingPolicy``). A ``str`` whose
    value is the name users pass (``scheduling_policy="priority"``, ``--scheduling-policy
    priority``), so it compares equal to it.

    FCFS: arrival order; a preempted request goes back to the front, and the victim of a
    preemption is the latest admitted running request. PRIORITY: lowest ``priority``
    value first, ties by arrival; the victim is the running request with the largest
    ``(priority, arrival_time)``."""
    FCFS = "fcfs"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, value) -> SchedulingPolicy:
        """Raises ValueError naming the valid policies."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"Unknown scheduling_policy {value!r}; valid policies: "
                             f"{', '.join(p.value for p in cls)}.") from None


SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
# Value sets of the enum-like settings: the Literal types give the command line its
# choices (pyengine.arg_utils) and the validation below its valid values.
Device = Literal["auto", "cuda", "cpu"]
ModelDType = Literal["auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"]
LoadFormat = Literal["auto", "dummy"]
AttentionBackendName = Literal["torch", "triton"]
# pyengine.layers.quantization.QUANTIZATION_METHODS (vLLM's names)
QuantizationMethod = Literal["fp8", "compressed-tensors", "gptq", "awq"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
KV_CACHE_DTYPES = get_args(KVCacheDType)
DEVICES = get_args(Device)
LOAD_FORMATS = get_args(LoadFormat)
ATTENTION_BACKENDS = get_args(AttentionBackendName)
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
GENERATION_CONFIG_FILE = "generation_config.json"
# The generation config entries that are default sampling parameters (vLLM's set).
GENERATION_CONFIG_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                                     "max_new_tokens")
# Built-in default model shipped inside the package (see tools/train_default_model.py).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# KV cache size on CPU when neither num_gpu_blocks_override nor kv_cache_memory_bytes is set.
CPU_DEFAULT_KV_BYTES = 256 << 20




def get_rope_params(hf_config) -> dict:
    """Merged RoPE parameter dict with at least ``rope_type`` and ``rope_theta``."""
    params: dict = {}
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    rp = getattr(hf_config, "rope_parameters", None)
    if isinstance(rp, dict):
        params.update(rp)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def get_head_dim(hf_config) -> int:
    """The attention head size: the config's ``head_dim`` when set, else
    ``hidden_size // num_attention_heads`` (as transformers derives it)."""
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def derive_max_model_len(hf_config) -> tuple[int, str]:
    """The model's context length and where it comes from (for messages):
    ``max_position_embeddings`` (2048 if the config has none), times the RoPE scaling
    factor for a ``linear`` rope type (whose ``max_position_embeddings`` is the length
    before scaling). A ``llama3`` config already states the scaled length. Mirrors
    vllm/config's ``_get_and_verify_max_len``."""
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
    """Engine arguments with vLLM's names (mirrors vllm/engine/arg_utils.py's
    ``EngineArgs``). ``create_engine_config()`` validates them and raises ``ValueError``
    naming the bad field. ``add_cli_args`` / ``from_cli_args`` turn every field into a
    command-line flag (``vengine serve``) and back: the docstring under a field is its
    ``--help`` text."""
    model: str | None = None
    """Hugging Face model directory (config.json, *.safetensors, tokenizer files); None:
    the built-in default model."""
    tokenizer: str | None = None
    """Tokenizer directory (default: the model's)."""
    dtype: ModelDType = "auto"
    """Weights and activations dtype; auto: the model's (bfloat16 if it states none;
    float32 instead of float16 on CPU)."""
    device: Device = "auto"
    """auto: CUDA when available, else CPU."""
    max_model_len: int | None = field(default=None, metadata={"human_readable": True})
    """Context length (prompt + output tokens) of a request, e.g. 32k; default: the
    model's."""
    max_num_seqs: int = 256
    """Most requests running at once (one engine step's batch)."""
    max_num_batched_tokens: int | None = field(default=None, metadata={"human_readable": True})
    """Token budget of one engine step (default: 8192, or max_model_len without chunked
    prefill if larger)."""
    block_size: int = 16
    """Tokens per KV cache block."""
    num_gpu_blocks_override: int | None = None
    """KV cache blocks to allocate, instead of sizing the cache from memory."""
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"human_readable": True})
    """KV cache size in bytes (e.g. 4G), instead of gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations, KV cache)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed."""
    enable_chunked_prefill: bool = True
    """Split long prefills over several steps, mixed with decodes."""
    long_prefill_token_threshold: int = 0
    """A prefill takes at most this many tokens per step (0: no cap), so concurrent long
    prompts advance together and decodes keep their share."""
    scheduling_policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    """fcfs: arrival order; priority: by each request's priority (lower first), then
    arrival."""
    seed: int = 0
    """Random seed of the engine (requests without a seed)."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device; default: on where compatible."""
    enforce_eager: bool = False
    """No CUDA graphs (eager PyTorch only)."""
    attention_backend: AttentionBackendName | None = None
    """Attention implementation; default: triton on CUDA (power-of-two head size), torch
    otherwise."""
    served_model_name: str | list[str] | None = None
    """Model name(s) the API accepts; the first is the one reported (default: the model
    directory's name)."""
    load_format: LoadFormat = "auto"
    """auto: the model's safetensors; dummy: random weights of the model's shape
    (benchmarks)."""
    stream_interval: int = 1
    """Streamed outputs are sent every this many tokens of a request; its first token and
    its end go at once."""
    tensor_parallel_size: int = field(default=1, metadata={"flags": ("-tp",)})
    """Shard the model over this many ranks (one process and, on CUDA, one GPU each)."""
    data_parallel_size: int = field(default=1, metadata={"flags": ("-dp",)})
    """Run this many engine cores (vLLM's data parallelism), each with its own scheduler,
    KV cache and model replica (tensor_parallel_size devices each: rank r takes devices
    r*tp .. r*tp+tp-1 of CUDA_VISIBLE_DEVICES; on CPU, one process each), behind one
    endpoint; each request goes to the least-loaded core."""
    kv_events_config: dict | None = None
    """Publish KV cache events as vLLM does (a JSON object of vLLM's KVEventsConfig:
    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "topic": ""}): msgpack
    KVEventBatch messages of BlockStored / BlockRemoved / AllBlocksCleared on a ZMQ PUB
    socket (data-parallel rank r on port + r), for routers that follow prefix-cache
    content (vllm-router's kv_aware policy)."""
    enable_expert_parallel: bool = False
    """MoE models: each rank holds whole experts (num_experts / tensor_parallel_size of
    them) instead of a slice of every expert's intermediate dim (vLLM's flag)."""
    trust_remote_code: bool = False
    """Let transformers run code shipped in the model directory when it loads the config
    and the tokenizer (the model itself always runs on vengine's implementations)."""
    generation_config: str = "auto"
    """Default sampling parameters of requests that do not set them: auto: from the
    model's generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens); vllm: none (vLLM's neutral defaults); or a
    directory holding a generation_config.json."""
    override_generation_config: dict | None = None
    """JSON object of generation config values that override (or, with
    --generation-config vllm, set) the defaults, e.g. '{"temperature": 0.5}'."""
    max_logprobs: int = MAX_LOGPROBS
    """Most logprobs a request may ask for per token (-1: the vocabulary size)."""
    disable_log_stats: bool = False
    """No periodic stats log line (LLM(...) sets it unless given)."""
    quantization: QuantizationMethod | None = field(default=None, metadata={"flags": ("-q",)})
    """Quantization method; default: the checkpoint's (config.json quantization_config).
    fp8 on an unquantized checkpoint quantizes its linear layers at load (FP8 weights per
    output channel, activations per token)."""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV cache dtype; auto: the model's. fp8 (fp8_e4m3): e4m3 with the checkpoint's per-layer
    k_scale / v_scale (1.0 where it has none): twice the tokens in the same memory."""
    speculative_config: dict | None = None
    """Speculative decoding, as vLLM's JSON object: {"method": "ngram" | "draft_model" |
    "eagle3", "num_speculative_tokens": k, "model": draft model directory (draft_model,
    eagle3), "prompt_lookup_min" / "prompt_lookup_max" (ngram), "disable_by_batch_size":
    no drafts in steps with at least that many running requests}. Async scheduling stays
    on: the next step is scheduled with draft placeholders before this one's drafts are
    verified."""

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig.from_args(self)

    @classmethod
    def add_cli_args(cls, parser):
        """Add one flag per field to ``parser`` (an ``argparse`` parser or group), vLLM's
        ``EngineArgs.add_cli_args``. Returns ``parser``."""
        from pyengine.arg_utils import add_dataclass_args
        return add_dataclass_args(parser, cls)

    @classmethod
    def from_cli_args(cls, args, **overrides) -> Self:
        """The engine arguments in ``args`` (an ``argparse.Namespace`` made by a parser
        that ``add_cli_args`` filled); ``overrides`` win."""
        from pyengine.arg_utils import from_namespace
        return from_namespace(cls, args, **overrides)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` plus the options of a serving front end (``AsyncLLM``), as vLLM's
    class of the same name."""
    enable_log_requests: bool = True
    """Log one line per request (its id, prompt length and sampling parameters); on unless
    turned off, as older vLLM had it."""


@dataclass(frozen=True)
class EngineConfig:
    """Resolved, validated configuration. Built by ``EngineArgs.create_engine_config``."""
    model: str
    tokenizer: str
    served_model_name: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks_override: int | None
    kv_cache_memory_bytes: int | None
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
    enable_expert_parallel: bool = False
    long_prefill_token_threshold: int = 0  # tokens; 0: no cap
    disable_log_stats: bool = False
    trust_remote_code: bool = False
    generation_config: str = "auto"  # "auto" | "vllm" | a directory (see EngineArgs)
    override_generation_config: dict | None = None
    max_logprobs: int = 20  # already resolved: -1 became the vocabulary size
    quantization: str | None = None  # the method in effect: the checkpoint's, or applied at load
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (e4m3)
    data_parallel_size: int = 1  # engine cores behind the front end
    data_parallel_rank: int = 0  # this engine core's index (set per core by the client)
    kv_events_config: KVEventsConfig | None = None  # None: no KV events published
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    @classmethod
    def from_args(cls, a: EngineArgs) -> EngineConfig:
        from transformers import AutoConfig

        model = a.model or str(DEFAULT_MODEL_DIR)
        if not Path(model).is_dir() or not (Path(model) / "config.json").is_file():  # no hub downloads
            raise ValueError(f"model must be a Hugging Face model directory with a config.json; "
                             f"{model!r} is not one.")
        policy = SchedulingPolicy.parse(a.scheduling_policy)
        if a.load_format not in LOAD_FORMATS:
            raise ValueError(f"Unknown load_format {a.load_format!r}; valid: {', '.join(LOAD_FORMATS)}.")
        if a.attention_backend is not None and a.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"Unknown attention_backend {a.attention_backend!r}; "
                             f"valid: {', '.join(ATTENTION_BACKENDS)}.")
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
        try:
            hf_config = AutoConfig.from_pretrained(model, trust_remote_code=bool(a.trust_remote_code))
        except KeyError as e:  # transformers' own validation (e.g. a rope_scaling without its factor)
            raise ValueError(f"{model}: transformers could not read config.json: "
                             f"{e.args[0] if e.args else e}") from None
        _check_tensor_parallel(a.tensor_parallel_size, hf_config, device)
        _check_data_parallel(a.data_parallel_size, a.tensor_parallel_size, device)
        kv_events = KVEventsConfig.from_value(a.kv_events_config)
        if kv_events is not None and not a.enable_prefix_caching:
            raise ValueError("kv_events_config publishes prefix-cache content: it needs enable_prefix_caching.")
        quantization = _resolve_quantization(a.quantization, hf_config)
        if a.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Unknown kv_cache_dtype {a.kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}.")
        kv_cache_dtype = "fp8" if a.kv_cache_dtype.startswith("fp8") else "auto"
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
        spec = SpeculativeConfig.from_dict(a.speculative_config, hf_config, a.trust_remote_code)
        if spec is not None:
            if spec.draft_hf_config is not None:
                # the draft model / EAGLE-3 head is sharded on the target's ranks
                try:
                    _check_tensor_parallel(a.tensor_parallel_size, spec.draft_hf_config, device)
                except ValueError as e:
                    raise ValueError(f"speculative_config: the draft model is sharded over the target's "
                                     f"tensor-parallel ranks: {e}") from None
            if async_sched:
                # Step N+1 is scheduled with draft placeholders before step N's acceptance is
                # known; the model runner fills them and corrects the positions
                # (pyengine/core/sched/async_scheduler.py, pyengine/worker/model_runner.py).
                logger.info("Speculative decoding (%s) with asynchronous scheduling: each step is scheduled "
                            "before the previous one's drafts are verified (draft placeholders, corrected "
                            "a step later).", spec.method)
        backend = a.attention_backend
        if backend is None:
            hd = get_head_dim(hf_config)
            # The triton kernels need a power-of-two head_dim >= 16.
            pow2 = hd >= 16 and hd & (hd - 1) == 0
            backend = "triton" if device.type == "cuda" and pow2 else "torch"
        max_logprobs = a.max_logprobs
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary size), "
                             f"got {max_logprobs!r}.")
        if max_logprobs == -1:
            max_logprobs = hf_config.vocab_size
        names = a.served_model_name
        if isinstance(names, (list, tuple)):
            names = names[0] if names else None
        config = cls(
            model=model, tokenizer=a.tokenizer or model,
            served_model_name=names or model.rstrip("/").split("/")[-1],
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
            tensor_parallel_size=a.tensor_parallel_size, enable_expert_parallel=bool(a.enable_expert_parallel),
            long_prefill_token_threshold=thr,
            disable_log_stats=bool(a.disable_log_stats),
            trust_remote_code=bool(a.trust_remote_code), generation_config=a.generation_config,
            override_generation_config=_check_override_generation_config(a.override_generation_config),
            max_logprobs=max_logprobs, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            data_parallel_size=a.data_parallel_size, kv_events_config=kv_events, speculative_config=spec)
        config._check_generation_config()
        return config

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: float8_e4m3fn for ``kv_cache_dtype="fp8"``, else the
        model dtype."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.dtype

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def try_get_generation_config(self) -> dict:
        """The generation config file's values (``{}`` when there is none): the model's
        ``generation_config.json``, or the one in the ``generation_config`` directory.
        Mirrors vllm/config's ``ModelConfig.try_get_generation_config``."""
        folder = self.model if self.generation_config in ("auto", "vllm") else self.generation_config
        path = Path(folder) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"Cannot read {path}: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a JSON object.")
        return values

    def get_diff_sampling_param(self) -> dict:
        """The default sampling parameters that differ from vLLM's neutral ones, by
        ``SamplingParams`` field name: from the generation config (none with
        ``generation_config="vllm"``), then ``override_generation_config``; its
        ``max_new_tokens`` becomes ``max_tokens``. Mirrors vllm/config's
        ``ModelConfig.get_diff_sampling_param``."""
        values = {} if self.generation_config == "vllm" else self.try_get_generation_config()
        values = {**values, **(self.override_generation_config or {})}
        diff = {name: values[name] for name in GENERATION_CONFIG_SAMPLING_FIELDS if values.get(name) is not None}
        if "max_new_tokens" in diff:
            diff["max_tokens"] = diff.pop("max_new_tokens")
        return diff

    def _check_generation_config(self) -> None:
        """Raises ValueError unless the generation config exists (when it is a directory)
        and its sampling defaults are valid sampling parameters."""
        from pyengine.sampling_params import SamplingParams

        if self.generation_config not in ("auto", "vllm") and not (
                Path(self.generation_config) / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a "
                             f"{GENERATION_CONFIG_FILE}; {self.generation_config!r} is none of these.")
        diff = self.get_diff_sampling_param()
        try:
            SamplingParams(**diff)
        except ValueError as e:
            raise ValueError(f"The generation config gives invalid default sampling parameters {diff}: {e} "
                             f"(--generation-config vllm ignores it).") from None
        if diff:
            logger.info("Default sampling parameters from the generation config: %s "
                        "(--generation-config vllm ignores it).", diff)


SpecMethod = Literal["ngram", "draft_model", "eagle3"]
SPEC_METHODS = get_args(SpecMethod)
# Most draft tokens per step (a verify step's query length is 1 + this).
MAX_NUM_SPECULATIVE_TOKENS = 16
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``SpeculativeConfig``, the keys of its
    ``speculative_config`` dict). Built by ``from_dict``; every rule is checked there.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier
      occurrence of the context's last n-gram, n from ``prompt_lookup_max`` down to
      ``prompt_lookup_min``), "draft_model" (a smaller model with the target's vocabulary,
      greedy, with its own KV cache in the target's block tables) or "eagle3" (an EAGLE-3
      head in the HF format vLLM loads: one decoder layer over the target's hidden states
      of three auxiliary layers).
    num_speculative_tokens: k, draft tokens per step (1..MAX_NUM_SPECULATIVE_TOKENS).
    model: the draft model / EAGLE-3 head directory (None for ngram); draft_hf_config
      its transformers config.
    disable_by_batch_size: no drafts in a step with at least this many running requests
      (None: never disabled), so speculation does not cost throughput at high load."""
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    draft_hf_config: object = None

    @property
    def uses_draft_kv(self) -> bool:
        """The proposer runs a model with its own KV cache (needs lookahead slots)."""
        return self.method in ("draft_model", "eagle3")

    @classmethod
    def from_dict(cls, d, target_hf_config, trust_remote_code: bool = False) -> SpeculativeConfig | None:
        """None for None; raises ValueError for anything but a dict of the known keys with
        valid values (a draft model must be a local HF directory whose vocabulary size is
        the target's)."""
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {d!r}.")
        unknown = sorted(set(d) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"valid keys: {', '.join(_SPEC_KEYS)}.")
        method, model = d.get("method"), d.get("model")
        if method is None:
            method = "draft_model" if model is not None else None
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}.")

        def int_at_least(name, lo, default):
            v = d.get(name, default)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"speculative_config: {name} must be an integer >= {lo}, got {v!r}.")
            return v

        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}.")
        lo = int_at_least("prompt_lookup_min", 1, None)
        hi = int_at_least("prompt_lookup_max", 1, None)
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
        disable = int_at_least("disable_by_batch_size", 1, None)
        draft_hf = None
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model.")
        else:
            if not isinstance(model, str) or not (Path(model) / "config.json").is_file():
                raise ValueError(f"speculative_config: method {method!r} needs model, a Hugging Face model "
                                 f"directory with a config.json; got {model!r}.")
            from transformers import AutoConfig
            draft_hf = AutoConfig.from_pretrained(model, trust_remote_code=bool(trust_remote_code))
            if draft_hf.vocab_size != target_hf_config.vocab_size:
                raise ValueError(f"speculative_config: the draft model's vocab_size ({draft_hf.vocab_size}) must "
                                 f"be the target's ({target_hf_config.vocab_size}).")
            archs = getattr(draft_hf, "architectures", None) or []
            is_eagle3 = any("eagle3" in a.lower() for a in archs)
            if method == "eagle3" and not is_eagle3:
                raise ValueError(f"speculative_config: {model!r} is not an EAGLE-3 head (architectures {archs}).")
            if method == "draft_model" and is_eagle3:
                raise ValueError(f"speculative_config: {model!r} is an EAGLE-3 head; use method 'eagle3'.")
        return cls(method, k, model, lo, hi, disable, draft_hf)


def _resolve_quantization(quantization, hf_config) -> str | None:
    """The quantization method the model loads with (the checkpoint's, or ``quantization``
    applied at load), None for none. Raises ValueError naming a method or setting that
    cannot be honoured (pyengine.layers.quantization.get_quantization_config)."""
    from pyengine.layers.quantization import get_quantization_config

    if quantization is not None and not isinstance(quantization, str):
        raise ValueError(f"quantization must be a method name, got {quantization!r}.")
    qc = get_quantization_config(hf_config, quantization)
    return qc.get_name() if qc is not None else None


def _check_override_generation_config(values) -> dict | None:
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ValueError(f"override_generation_config must be a dict (a JSON object), got {values!r}.")
    return dict(values)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py): where the engine core
    publishes its KV cache events. ``endpoint``: a ZMQ address, bound when it has a
    wildcard (``tcp://*:5557``) or is ipc/inproc, else connected; data-parallel rank r
    publishes on the port + r. ``replay_endpoint``: a ZMQ ROUTER address where a
    subscriber asks for missed batches (the last ``buffer_steps``) by their sequence
    number. ``hwm``: the PUB socket's high-water mark (messages). ``topic``: the first
    frame of every message."""
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    PUBLISHERS = ("null", "zmq")

    @classmethod
    def from_value(cls, value) -> KVEventsConfig | None:
        """The config of ``value`` (a dict, a KVEventsConfig or None); None when events are
        off (no value, ``enable_kv_cache_events`` false, or the null publisher). Raises
        ValueError naming an unknown field or a bad value."""
        if value is None:
            return None
        if isinstance(value, cls):
            cfg = value
        else:
            if not isinstance(value, dict):
                raise ValueError(f"kv_events_config must be a JSON object, got {value!r}.")
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ValueError(f"Unknown kv_events_config field(s): {', '.join(unknown)}; "
                                 f"valid: {', '.join(sorted(names))}.")
            cfg = cls(**value)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false.")
        if cfg.publisher not in cls.PUBLISHERS:
            raise ValueError(f"Unknown kv_events_config.publisher {cfg.publisher!r}; "
                             f"valid: {', '.join(cls.PUBLISHERS)}.")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {v!r}.")
        if not isinstance(cfg.endpoint, str) or "://" not in cfg.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ address such as tcp://*:5557, "
                             f"got {cfg.endpoint!r}.")
        if not isinstance(cfg.topic, str):
            raise ValueError("kv_events_config.topic must be a string.")
        if not cfg.enable_kv_cache_events or cfg.publisher == "null":
            return None
        return cfg


def _check_data_parallel(dp, tp: int, device: torch.device) -> None:
    """Raises ValueError unless ``dp`` is a positive integer and, on CUDA, ``dp * tp`` GPUs
    are visible."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}.")
    if device.type == "cuda" and dp * tp > torch.cuda.device_count():
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs; "
                         f"{torch.cuda.device_count()} visible.")


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

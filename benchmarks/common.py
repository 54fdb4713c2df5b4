"""Shared pieces of the benchmark scripts: model directories of a named shape (config +
tokenizer, no weights: the engine runs them with ``load_format="dummy"``), device
checks, hardware records, markdown tables and JSON results.

Nothing here imports from ``tests/`` (the tokenizer builder is a local copy), so the
scripts run from a bare checkout.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(_REPO))

# ----------------------------------------------------------------------------------------
# Shapes

SHAPES = ("qwen3-0.6b", "llama-3.1-8b", "tiny")
DEFAULT_SHAPE = "qwen3-0.6b"
ARCHITECTURES = {"qwen3-0.6b": "Qwen3ForCausalLM", "llama-3.1-8b": "LlamaForCausalLM", "tiny": "Qwen3ForCausalLM"}

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS_MODULES = ["os", "collections/__init__", "functools", "typing", "argparse", "json/decoder",
                   "json/encoder", "logging/__init__", "threading", "subprocess", "pathlib", "shutil"]
_CORPUS_BYTES = 200_000
TOKENIZER_VOCAB = 512


def _corpus(modules: Sequence[str] = tuple(_CORPUS_MODULES), max_bytes: int = _CORPUS_BYTES) -> list[str]:
    root = Path(os.__file__).parent
    texts, total = [], 0
    for mod in modules:
        f = root / f"{mod}.py"
        if f.is_file():
            t = f.read_text(encoding="utf-8", errors="replace")
            texts.append(t)
            total += len(t)
            if total >= max_bytes:
                break
    if not texts:  # a Python install without sources: any text will do for a benchmark
        texts = ["def f(x):\n    return x + 1\n" * 200]
    return texts


def build_tokenizer(out_dir, vocab_size: int = TOKENIZER_VOCAB, corpus_modules: Sequence[str] = tuple(_CORPUS_MODULES),
                    corpus_bytes: int = _CORPUS_BYTES, fill_to: int | None = None) -> Path:
    """Train a small byte-level BPE tokenizer on stdlib sources and save it (with
    ``<s>``/``</s>``/``<pad>`` specials and a ChatML-like template) as a
    PreTrainedTokenizerFast in ``out_dir``; deterministic for a given Python install.
    The benchmarks feed token ids; ``fill_to`` extends the vocabulary to a model's size
    (see ``_fill_vocab``) so that every id they generate decodes to text. The tests
    (tests/helpers.py) use it with a larger corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(corpus_modules, corpus_bytes), trainer=trainer)
    if fill_to is not None and fill_to > tok.get_vocab_size():
        tok = _fill_vocab(tok, fill_to)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, chat_template=_CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    return out


def _fill_vocab(tok, size: int):
    """Extend a trained byte-level BPE to ``size`` tokens with merges that build every
    2-, 3- then 4-letter lowercase word: with random weights of a real model's shape the
    engine samples ids all over the vocabulary, and each must decode to text (1-4 ASCII
    letters, about a real token's length) or a streaming benchmark would send empty deltas."""
    import itertools
    import string

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    letters = string.ascii_lowercase
    for length in (2, 3, 4):
        for chars in itertools.product(letters, repeat=length):
            if len(vocab) >= size:  # the trained vocab already holds the specials
                break
            word = "".join(chars)
            if word in vocab:
                continue
            vocab[word] = len(vocab)
            merges.append([word[:-1], word[-1]])
    return Tokenizer.from_str(json.dumps(spec))


def shape_config(shape: str, bos: int = 0, eos: int = 1, pad: int = 2, vocab_size: int | None = None):
    """The transformers config object of a named shape (random-weight benchmarks)."""
    from transformers import LlamaConfig, Qwen3Config

    ids = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if shape == "qwen3-0.6b":
        return Qwen3Config(
            vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, intermediate_size=3072, hidden_act="silu",
            max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False, dtype="bfloat16", **ids)
    if shape == "llama-3.1-8b":
        return LlamaConfig(
            vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, intermediate_size=14336, hidden_act="silu",
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            attention_bias=False, mlp_bias=False, dtype="bfloat16", **ids)
    if shape == "tiny":
        return Qwen3Config(
            vocab_size=vocab_size or TOKENIZER_VOCAB, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=False, dtype="float32", **ids)
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def make_model_dir(shape: str, out_dir) -> Path:
    """Write ``config.json`` of the named shape and a small trained tokenizer into
    ``out_dir`` (no weights: use ``load_format="dummy"``). Returns ``out_dir``.
    Reuses a directory that already holds the same config."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / ".vengine_shape"
    if marker.is_file() and marker.read_text() == f"{shape} full-vocab" and (out / "config.json").is_file() \
            and (out / "tokenizer.json").is_file():
        return out
    model_vocab = shape_config(shape).vocab_size
    build_tokenizer(out, fill_to=model_vocab if model_vocab > TOKENIZER_VOCAB else None)
    tok = AutoTokenizer.from_pretrained(str(out))
    bos, eos, pad = tok.convert_tokens_to_ids([BOS, EOS, PAD])
    cfg = shape_config(shape, bos, eos, pad, vocab_size=len(tok))
    cfg.architectures = [ARCHITECTURES[shape]]
    cfg.save_pretrained(str(out))
    marker.write_text(f"{shape} full-vocab")
    return out


def default_model_dir(shape: str) -> Path:
    """A per-shape cache directory for ``make_model_dir`` (``$VENGINE_BENCH_DIR`` or the
    system temp dir)."""
    import tempfile
    root = Path(os.environ.get("VENGINE_BENCH_DIR") or Path(tempfile.gettempdir()) / "vengine_bench_models")
    return root / shape


def random_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0,
                   max_id: int = 10000, min_id: int = 8) -> list[list[int]]:
    """``n`` prompts of random token ids in [min_id, min(max_id, vocab_size)) with lengths
    uniform in [min_len, max_len] (nano-vllm's bench draws ids below 10000)."""
    rng = random.Random(seed)
    hi = min(max_id, vocab_size) - 1
    lo = min(min_id, hi)
    return [[rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


# ----------------------------------------------------------------------------------------
# Arguments and devices


def add_common_args(p: argparse.ArgumentParser, default_shape: str = DEFAULT_SHAPE, multi_shape: bool = False) -> None:
    if multi_shape:
        p.add_argument("--shape", type=parse_shapes, default=parse_shapes(default_shape),
                       help=f"comma-separated model shapes from {', '.join(SHAPES)} (random weights)")
    else:
        p.add_argument("--shape", choices=SHAPES, default=default_shape,
                       help="model shape (random weights, load_format=dummy)")
    p.add_argument("--model-dir", default=None,
                   help="where to write the shape's config.json + tokenizer (default: a per-shape temp dir)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write results as JSON to OUT")


def parse_shapes(text: str) -> list[str]:
    shapes = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {bad or text!r}; choose from {', '.join(SHAPES)}")
    return shapes


def parse_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def check_device(device: str, threads: int | None = None) -> None:
    """Exit with a clear message when CUDA is asked for but absent; apply --threads."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: CUDA is not available on this machine (torch {torch.__version__}). These benchmarks are "
                 "meant for a GPU; pass --device cpu (with --shape tiny) for a CPU smoke run.")


def resolve_dtype(args) -> str:
    return args.dtype or ("bfloat16" if args.device == "cuda" else "float32")


def prepare_model_dir(args, shape: str | None = None) -> Path:
    shape = shape or args.shape
    if args.model_dir:
        base = Path(args.model_dir)
        return make_model_dir(shape, base if shape == args.shape else base / shape)
    return make_model_dir(shape, default_model_dir(shape))


def free_cuda() -> None:
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:
        pass


def _model_runner(engine):
    """The ModelRunner behind an LLM or an AsyncLLM (None if not found)."""
    for path in (("llm_engine", "engine_core", "model_runner"),  # LLM
                 ("engine_core", "proc", "engine_core", "model_runner"),  # AsyncLLM -> InprocClient
                 ("engine_core", "model_runner")):
        obj = engine
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


def shutdown_llm(llm) -> None:
    """Drop an LLM's / AsyncLLM's model, KV cache and CUDA graphs so that the GPU memory
    goes back before the next engine is built (caller must drop its own refs too).
    An AsyncLLM must be shut down first."""
    if hasattr(llm, "shutdown"):  # LLM.shutdown / AsyncLLM.shutdown release device memory
        try:
            llm.shutdown()
        except Exception:
            pass
    try:
        runner = _model_runner(llm)
        if runner is not None:
            for name in ("graph_runner", "kv_caches", "model"):
                if hasattr(runner, name):
                    setattr(runner, name, None)
    except Exception:
        pass
    free_cuda()


# ----------------------------------------------------------------------------------------
# Records


def _git_commit() -> str | None:
    """Short HEAD, with "+dirty" when tracked files differ from it: a copy of the tree whose
    .git is older than its files (as on a remote runner) must not pass for that commit."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=str(_REPO), capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return None
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return None


def hardware_info(device: str = "cuda") -> dict:
    import torch
    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
    }
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]) if sys.argv else "python"] + sys.argv[1:])


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if v != v:
                return "n/a"
            return f"{v:,.0f}" if abs(v) >= 1000 else (f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}")
        return "n/a" if v is None else str(v)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(v) for v in r) + " |")
    return "\n".join(lines)


def header_md(title: str, hw: dict, cmd: str | None = None) -> str:
    gpu = hw.get("gpu") or f"CPU ({hw.get('cpu_count')} cores)"
    return (f"### {title}\n\n`{cmd or command_line()}`\n\n"
            f"{gpu}; torch {hw.get('torch')}, triton {hw.get('triton')}, transformers {hw.get('transformers')}, "
            f"python {hw.get('python')}; commit {hw.get('git_commit')}; {hw.get('date')}\n")


def start(parser: argparse.ArgumentParser, argv: list[str] | None, script: str):
    """A benchmark's opening: parse ``argv`` (None: sys.argv), check the device, turn on the
    engine's INFO logs with ``--verbose``. Returns (args, hardware info, command line)."""
    args = parser.parse_args(argv)
    check_device(args.device, args.threads)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cmd = command_line() if argv is None else f"benchmarks/{script} " + " ".join(argv)
    return args, hardware_info(args.device), cmd


def async_modes(text: str) -> list[str]:
    """``--modes`` ("on,off", "on" or "off") as a list; SystemExit on anything else."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise SystemExit(f"error: --modes takes on,off; got {text!r}")
    return modes


def finish(benchmark: str, args: argparse.Namespace, hw: dict, cmd: str, **fields: Any) -> dict:
    """Writes and returns the result payload: benchmark name, command, hardware, args and
    ``fields``, as JSON to ``--json`` when given."""
    payload = {"benchmark": benchmark, "command": cmd, "hardware": hw, "args": vars(args), **fields}
    write_json(args.json_out, payload)
    return payload


def cuda_graph_replay_us(fn: Callable[[], Any], iters: int, repeats: int,
                         before_each: Callable[[], Any] | None = None) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (after one eager call):
    the median over ``repeats`` timings of ``iters`` back-to-back replays (CUDA events);
    ``before_each`` runs before each timing (a barrier, for collectives)."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    del g
    return statistics.median(times)


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results written to {p}")


def stats_delta(before, after) -> dict:
    """Host time per step between two SchedulerStats snapshots, and the part of it spent
    filling structured-output bitmasks: ms per step (all steps), ms per step that had
    constrained rows, µs per constrained row."""
    def per(x, n, scale):
        return scale * x / n if n > 0 else float("nan")
    steps = after.num_steps - before.num_steps
    host = after.step_host_time_s - before.step_host_time_s
    gt = after.grammar_bitmask_time_s - before.grammar_bitmask_time_s
    gsteps = after.grammar_bitmask_steps - before.grammar_bitmask_steps
    grows = after.grammar_bitmask_rows - before.grammar_bitmask_rows
    return {"num_steps": steps, "step_host_time_s": host, "host_ms_per_step": per(host, steps, 1e3),
            "grammar_bitmask_time_s": gt, "grammar_bitmask_steps": gsteps, "grammar_bitmask_rows": grows,
            "grammar_bitmask_ms_per_step": per(gt, steps, 1e3),
            "grammar_bitmask_ms_per_constrained_step": per(gt, gsteps, 1e3),
            "grammar_bitmask_us_per_row": per(gt, grows, 1e6)}

"""Test helpers shared across suites: tiny HF model/tokenizer builders, the transformers
greedy oracle, random prompts and hand-built AttentionMetadata. Nothing is downloaded."""
from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

# One tokenizer recipe for tests and benchmarks (benchmarks/common.py).
from benchmarks.common import BOS, EOS, PAD

# Stdlib modules whose sources make the tokenizer corpus (present in every CPython install).
_CORPUS_MODULES = ["os", "collections/__init__", "functools", "typing", "argparse", "json/decoder",
                   "json/encoder", "logging/__init__", "threading", "subprocess", "pathlib", "shutil",
                   "tempfile", "random", "string", "textwrap", "dataclasses", "enum", "inspect"]
_CORPUS_BYTES = 400_000

FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
# Tiny MoE defaults on top of _config_for's: 8 experts, 2 per token, experts narrower
# than the dense MLP (what the real models do).
_MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}


def build_tokenizer(out_dir, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer on stdlib sources and save it as a
    PreTrainedTokenizerFast (bos ``<s>``, eos ``</s>``, pad ``<pad>``, ChatML-like
    template). Deterministic for a given Python install. Returns ``out_dir``."""
    from benchmarks.common import build_tokenizer as _build

    return _build(out_dir, vocab_size, corpus_modules=_CORPUS_MODULES, corpus_bytes=_CORPUS_BYTES)


TOKENIZER_KINDS = ("byte_level", "sentencepiece", "wordpiece")


def build_sentencepiece_tokenizer(out_dir, vocab_size: int = 2048) -> Path:
    """Train a SentencePiece-style BPE tokenizer (the Llama-2 / Mistral-v0.1 / TinyLlama
    kind of ``tokenizer.json``): normalizer ``Prepend("▁")`` + ``Replace(" ", "▁")``, BPE
    with ``byte_fallback`` and the 256 ``<0x00>``…``<0xFF>`` tokens, decoder
    ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``, ``Strip(" ", 1, 0)``; specials
    ``<s>``, ``</s>``, ``<pad>`` and the chat markers, as the byte-level tokenizer.
    Deterministic for a given Python install. Returns ``out_dir``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import _CHAT_TEMPLATE, SPECIAL_TOKENS, _corpus

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?=\u2581)"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + byte_tokens,
                                  show_progress=False, limit_alphabet=120)
    tok.train_from_iterator(_corpus(_CORPUS_MODULES, _CORPUS_BYTES), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def build_wordpiece_tokenizer(out_dir, vocab_size: int = 1024) -> Path:
    """Train a WordPiece tokenizer (the BERT kind: ``BertPreTokenizer``, ``##``
    continuation prefix, decoder ``WordPiece(cleanup=True)``, ``[UNK]``) with the same
    specials as the byte-level tokenizer. Returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import _CHAT_TEMPLATE, SPECIAL_TOKENS, _corpus

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + ["[UNK]"],
                                        show_progress=False)
    tok.train_from_iterator(_corpus(_CORPUS_MODULES, _CORPUS_BYTES), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token="[UNK]", chat_template=_CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def build_tokenizer_kind(out_dir, kind: str) -> Path:
    """A tokenizer of ``kind`` (one of ``TOKENIZER_KINDS``) in ``out_dir``."""
    builders = {"byte_level": build_tokenizer, "sentencepiece": build_sentencepiece_tokenizer,
                "wordpiece": build_wordpiece_tokenizer}
    if kind not in builders:
        raise ValueError(f"unknown tokenizer kind {kind!r}; one of {TOKENIZER_KINDS}")
    return builders[kind](out_dir)


def _config_for(family: str, vocab_size: int, bos: int, eos: int, pad: int, **overrides):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
           "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig}.get(family)
    if cls is None:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES + MOE_FAMILIES}")
    kw = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=128,
              max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-6,
              bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    kw.update(_MOE_DEFAULTS.get(family, {}))
    kw.update(overrides)
    return cls(**kw)


def triton_device(kind: str) -> str:
    """The device a Triton kernel test of ``kind`` ("cpu" | "cuda") runs on, or a skip: the CPU
    only under TRITON_INTERPRET=1 (triton's interpreter), CUDA only with a GPU and without it."""
    import os

    import pytest

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if kind == "cpu":
        if not interpret:
            pytest.skip("set TRITON_INTERPRET=1 to run triton on CPU")
        return "cpu"
    if not torch.cuda.is_available() or interpret:
        pytest.skip("needs CUDA")
    return "cuda"


def rank_expert_map(rank: int, num_experts: int, ranks: int, device) -> torch.Tensor:
    """Expert parallelism's global -> local map (int32 [num_experts], -1 for another rank's
    expert) of ``rank`` holding a contiguous 1/``ranks`` of the experts, as ``FusedMoE``
    builds it."""
    per = num_experts // ranks
    emap = torch.full((num_experts,), -1, dtype=torch.int32)
    emap[per * rank:per * (rank + 1)] = torch.arange(per, dtype=torch.int32)
    return emap.to(device)


def build_tiny_model(out_dir, family: str, tokenizer_dir, seed: int = 0,
                     max_shard_size: str | None = None, logit_scale: float = 4.0,
                     **config_overrides) -> Path:
    """Save a seeded random float32 HF model of ``family`` (one of ``FAMILIES`` or ``MOE_FAMILIES``)
    with the tokenizer files and a generation_config (eos) into ``out_dir``.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128,
    vocab = tokenizer's, max_position_embeddings 1024, initializer_range 0.2; norm
    weights and biases are perturbed too, so loading mistakes show up in the logits.
    The LM head (the embedding, when tied) is multiplied by ``logit_scale`` so the top-2
    logit gap is ~1.5 (median) and greedy choices are rarely near ties.
    ``config_overrides`` go to the config class (e.g. tie_word_embeddings=True).
    ``max_shard_size`` (e.g. "40KB") saves a sharded checkpoint. Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bos, eos, pad = tok.convert_tokens_to_ids([BOS, EOS, PAD])
    vocab = config_overrides.pop("vocab_size", len(tok))  # larger than the tokenizer's: ids it never makes
    cfg = _config_for(family, vocab, bos, eos, pad, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos,
                                                pad_token_id=pad, do_sample=False)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kw)
    tok.save_pretrained(str(out))
    return out


def with_generation_config(model_dir, out_dir, **values) -> Path:
    """A copy of ``model_dir`` (files linked, not copied) whose generation_config.json is
    the original's updated with ``values`` (e.g. temperature=0.0, max_new_tokens=3): a
    model whose creator recommends default sampling parameters. Returns ``out_dir``."""
    import json

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    gen = json.loads((src / "generation_config.json").read_text())
    gen.update(values)
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def self_signed_cert(out_dir, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """(key file, certificate file) of a fresh self-signed certificate for ``host`` (an IP
    address), made with the openssl command (callers skip where it is missing)."""
    import subprocess

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key, cert = out / "key.pem", out / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={host}",
                    "-addext", f"subjectAltName=IP:{host}"], check=True, capture_output=True, timeout=60)
    return key, cert


# The scripted model's tokenizer: byte-level BPE over the 256 byte symbols, with the merges
# below so that "DEF" and "HI" are single tokens (as in issue 17's stop-string case).
SCRIPTED_MERGES = [("D", "E"), ("DE", "F"), ("H", "I")]


def build_scripted_tokenizer(out_dir) -> Path:
    """A byte-level BPE tokenizer with no learned merges but ``SCRIPTED_MERGES``: every
    other character is one token per UTF-8 byte (so an emoji is 4 tokens), ``"DEF"`` and
    ``"HI"`` are one token each. Specials ``<s>``, ``</s>``, ``<pad>`` are ids 0-2 and the
    chat template is the benchmarks' one. Returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import _CHAT_TEMPLATE, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in SCRIPTED_MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(SCRIPTED_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


EMOJI = "\U0001F600"  # 4 UTF-8 bytes, 4 tokens of the scripted tokenizer


def scripted_script(tok) -> dict[int, int]:
    """The scripted model's next-token table (token ids of the scripted tokenizer ``tok``):
    a prompt ending in ``"A"`` gets ``DEF``, ``G``, ``HI``, EOS (issue 17's stop-string
    offsets); one ending in the first two bytes of ``EMOJI`` gets its last two bytes,
    ``"!"``, EOS (a character spanning the prompt/completion boundary)."""
    def one(text):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]
    e = tok.encode(EMOJI, add_special_tokens=False)
    assert len(e) == 4
    eos = tok.eos_token_id
    return {one("A"): one("DEF"), one("DEF"): one("G"), one("G"): one("HI"), one("HI"): eos,
            e[1]: e[2], e[2]: e[3], e[3]: one("!"), one("!"): eos}


# ---- a Qwen3-style reasoning model (issue 28) -------------------------------------------
# The tokenizer is the scripted one plus Qwen's tags as added, not special, tokens (so
# decoding with skip_special_tokens keeps them, as Qwen3's and DeepSeek-R1's tokenizers do),
# the words the scripts below emit as added tokens, and "\n\n" as one BPE token.
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REASONING_WORDS = ("Hmm", "OK", TOOL_CALL_JSON)
REASONING_ADDED_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END) + REASONING_WORDS

# Qwen3's template, cut to what the tests use: a system turn (with the tools as JSON lines
# between <tools> tags), user / assistant / tool turns (an assistant's reasoning_content in
# <think> tags, its tool calls as <tool_call> JSON), and the generation prompt, which with
# enable_thinking=false holds an empty, closed think block.
# (transformers renders with trim_blocks: no text right after a tag starts with a newline.)
QWEN3_STYLE_CHAT_TEMPLATE = (
    "{% if tools or messages[0].role == 'system' %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "{% if tools %}# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n\n{% endif %}"
    "{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's way: the generation prompt opens the reasoning.
R1_STYLE_CHAT_TEMPLATE = QWEN3_STYLE_CHAT_TEMPLATE.replace(
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}",
    "<think>")
assert R1_STYLE_CHAT_TEMPLATE != QWEN3_STYLE_CHAT_TEMPLATE


def build_reasoning_tokenizer(out_dir) -> Path:
    """The scripted tokenizer (one token per byte, ``SCRIPTED_MERGES``) plus: ``"\n\n"`` as
    one token, ``REASONING_ADDED_TOKENS`` (``<think>``, ``</think>``, ``<tool_call>``,
    ``</tool_call>`` and the scripts' words) as added tokens that are not special, and
    ``QWEN3_STYLE_CHAT_TEMPLATE``. Returns ``out_dir``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import SPECIAL_TOKENS

    merges = list(SCRIPTED_MERGES) + [("\u010a", "\u010a")]  # byte-level "\n" twice
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=QWEN3_STYLE_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def chain_script(tok, first: str, pieces: Sequence[str]) -> dict[int, int]:
    """A scripted model's table that makes the token of ``first`` (a prompt's last token)
    yield the tokens of ``pieces`` in order, then EOS. Each text must be one token of ``tok``
    and no token may repeat (the next token depends on the previous one only)."""
    ids = []
    for text in [first, *pieces]:
        t = tok.encode(text, add_special_tokens=False)
        assert len(t) == 1, (text, t)
        ids.append(t[0])
    ids.append(tok.eos_token_id)
    assert len(set(ids)) == len(ids), "a chain may not repeat a token"
    return dict(zip(ids, ids[1:]))


# What the reasoning models say after a Qwen3-style generation prompt (which ends in "\n";
# with enable_thinking=false, in "\n\n"; the R1-style one ends in "<think>").
REASONING_ANSWER = [THINK_START, "Hmm", THINK_END, "\n\n", "OK"]
REASONING_TOOL_CALL = [THINK_START, "Hmm", THINK_END, "\n\n", TOOL_CALL_START, TOOL_CALL_JSON, TOOL_CALL_END]


def reasoning_script(tok, pieces: Sequence[str] = tuple(REASONING_ANSWER)) -> dict[int, int]:
    """The reasoning model's table: after ``"\n"`` (a thinking prompt) the whole of
    ``pieces``; after ``"\n\n"`` or ``"<think>"`` the rest of it from there on (a prompt that
    closed, or opened, the reasoning)."""
    return chain_script(tok, "\n", pieces)


def thinking_loop_script(tok) -> dict[int, int]:
    """A reasoning model that never ends its reasoning by itself: after ``"\n"`` (a
    thinking prompt) ``<think>``, then ``Hmm`` after ``<think>`` and after every ``Hmm``;
    after ``</think>`` (only ever forced, by a thinking budget) ``"\n\n"``, ``OK``, EOS."""
    def one(text):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]
    nl, start, hmm, end, para, ok = map(one, ("\n", THINK_START, "Hmm", THINK_END, "\n\n", "OK"))
    return {nl: start, start: hmm, hmm: hmm, end: para, para: ok, ok: tok.eos_token_id}


def build_scripted_model(out_dir, tokenizer_dir, script: dict[int, int], logit_gap: float = 16.0,
                         max_position_embeddings: int = 1024) -> Path:
    """A Llama checkpoint whose greedy next token after token ``t`` is ``script[t]``,
    whatever came before, so a prompt ending in a script key yields a fixed token sequence
    (deterministic text tests: stop strings, offsets, UTF-8 boundaries).

    How: one decoder layer whose ``o_proj`` and ``down_proj`` are zero adds nothing to the
    residual, so the final hidden state of a position is its token's embedding, RMS-normed.
    Script keys get orthogonal one-hot embeddings (at most ``hidden_size`` = 64 keys), other
    tokens zero; the LM head row of ``script[t]`` reads ``t``'s direction, so that token
    leads by ``logit_gap``. transformers' own model gives the same tokens (it is a real
    checkpoint). Returns ``out_dir``."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bos, eos, pad = tok.convert_tokens_to_ids([BOS, EOS, PAD])
    hidden = 64
    if len(script) > hidden:
        raise ValueError(f"at most {hidden} script entries, got {len(script)}")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=max_position_embeddings,
                      rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        emb.zero_()
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        scale = logit_gap / hidden ** 0.5  # the normed hidden state is sqrt(hidden) on its axis
        for k, (t, nxt) in enumerate(script.items()):
            emb[t, k] = 1.0
            head[nxt, k] = scale
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                                               do_sample=False)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def load_hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model_dir_or_model, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' full-sequence forward: float32 logits [len(token_ids), vocab]."""
    model = model_dir_or_model
    if isinstance(model, (str, Path)):
        model = load_hf_model(model)
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def engine_greedy(model_dir, prompts_token_ids: list[list[int]], max_new_tokens: int, **llm_kwargs) -> list[list[int]]:
    """The engine's greedy ids per prompt (``ignore_eos``, no detokenizing) on the CPU, from a
    fresh ``LLM(model_dir, device="cpu", **llm_kwargs)`` shut down afterwards: what
    ``hf_greedy(..., ignore_eos=True)`` is compared with."""
    from pyengine import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", **llm_kwargs)
    try:
        outs = llm.generate(prompts_token_ids, SamplingParams(temperature=0, max_tokens=max_new_tokens,
                                                              ignore_eos=True, detokenize=False), use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_greedy(model_dir, prompts_token_ids: list[list[int]], max_new_tokens: int,
              ignore_eos: bool = False) -> list[list[int]]:
    """The correctness oracle: transformers' ``generate(do_sample=False)``, one prompt at a
    time (no padding). Returns the generated ids per prompt (prompt excluded); unless
    ``ignore_eos``, each stops after (and includes) the first EOS, as generate does."""
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    eos = _eos_ids(model)
    # generate() falls back to the model's own eos_token_id when ours is None: clear it.
    model.generation_config.eos_token_id = None
    # EOS is handled here rather than by generate so ignore_eos yields full-length outputs.
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=0, eos_token_id=None,
                            pad_token_id=model.generation_config.pad_token_id)
    results = []
    with torch.no_grad():
        for ids in prompts_token_ids:
            inp = torch.tensor([list(ids)])
            out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gcfg)
            new = out[0, len(ids):].tolist()
            if not ignore_eos:
                for i, t in enumerate(new):
                    if t in eos:
                        new = new[: i + 1]
                        break
            results.append(new)
    return results


def expected_text(tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text the engine reports for ``output_ids`` generated after ``prompt_ids``
    (special tokens skipped): the text of prompt + output past the prompt's own text,
    where the bytes of the prompt's last character, if incomplete, count as output; bytes
    that never complete a character come out at the end as U+FFFD, as ``decode`` gives them."""
    whole = tokenizer.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=True)
    prompt_text = tokenizer.decode(list(prompt_ids), skip_special_tokens=True).rstrip("\ufffd")
    assert whole.startswith(prompt_text)
    return whole[len(prompt_text):]


def prompt_token_ids(tokenizer, n: int, min_len: int = 4, max_len: int = 32,
                     seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ordinary (non-special) token ids, lengths in
    [min_len, max_len]; deterministic for a seed."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def make_attn_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                       block_tables: Sequence[Sequence[int]], block_size: int,
                       device="cpu", num_padded_tokens: int = 0):
    """Hand-built AttentionMetadata for a batch: request i has ``query_lens[i]`` new
    tokens at positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1 and the blocks
    ``block_tables[i]``. ``num_padded_tokens`` extra rows with slot -1 are appended.
    Returns (metadata, positions int64 [T])."""
    from pyengine.attention.backend import AttentionMetadata

    num_reqs = len(query_lens)
    max_blocks = max(len(b) for b in block_tables)
    bt = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, b in enumerate(block_tables):
        bt[i, : len(b)] = torch.tensor(list(b), dtype=torch.int32)
    qsl = [0]
    positions, slots = [], []
    for q, s, b in zip(query_lens, seq_lens, block_tables):
        assert q <= s and (s + block_size - 1) // block_size <= len(b)
        qsl.append(qsl[-1] + q)
        for p in range(s - q, s):
            positions.append(p)
            slots.append(b[p // block_size] * block_size + p % block_size)
    n_actual = len(positions)
    positions += [0] * num_padded_tokens
    slots += [-1] * num_padded_tokens
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl_t = torch.tensor(list(seq_lens), dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n_actual, num_reqs=num_reqs, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl_t.to(device), seq_lens=sl_t.to(device),
        block_table=bt.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl_t, seq_lens_cpu=sl_t)
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def new_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] cache per layer."""
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]


# ---- fault injection for the per-request error path (issue 12) -----------------------

def fail_request_add(monkeypatch, bad_prompt, message="injected: Overflow when unpacking long long"):
    """Make the engine core's ``Request(...)`` raise OverflowError(message) for the prompt
    ``bad_prompt`` (token ids), as a request the core cannot admit. In-process cores only."""
    import pyengine.engine.core as core_mod
    real = core_mod.Request

    def make(request_id, prompt_token_ids, *a, **k):
        if list(prompt_token_ids) == list(bad_prompt):
            raise OverflowError(message)
        return real(request_id, prompt_token_ids, *a, **k)
    monkeypatch.setattr(core_mod, "Request", make)


def fail_request_allocation(monkeypatch, engine_core, bad_prompt, after_tokens,
                            message="injected: block table corrupted"):
    """Make KV slot allocation raise RuntimeError(message) for the prompt ``bad_prompt``
    once it generated ``after_tokens`` tokens (a request failing while it runs)."""
    kv = engine_core.scheduler.kv_cache_manager
    real = kv.allocate_slots

    def allocate(req, *a, **k):
        if req.prompt_token_ids == list(bad_prompt) and req.num_output_tokens >= after_tokens:
            raise RuntimeError(message)
        return real(req, *a, **k)
    monkeypatch.setattr(kv, "allocate_slots", allocate)


# ---- processes (multi-process engine tests) --------------------------------------------

def process_gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def live_children(pid: int, recursive: bool = False) -> set[int]:
    """Live (not zombie) child processes of ``pid`` (all descendants with ``recursive``)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            if recursive:
                todo.append(k)
    return out


def _rank_main(target, rank: int, init_method: str, *rest) -> None:
    """One rank of ``run_two_ranks``: run ``target``, flush the report queue, then leave
    without interpreter teardown, as the engine's workers do (worker.py): torch's gloo
    threads destroyed at static-destruction time abort the process now and then
    ("terminate called without an active exception") after the test's work is done."""
    import os
    import sys
    import traceback

    q = rest[-1]
    code = 0
    try:
        target(rank, init_method, *rest)
    except BaseException:
        traceback.print_exc()
        code = 1
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_two_ranks(target, *args, timeout: float = 240.0) -> dict:
    """Run ``target(rank, init_method, *args, queue)`` in two spawned processes (a
    torch.distributed pair on ``tcp://127.0.0.1``); each puts ``(rank, report)`` on the
    queue. Returns {rank: report}; asserts both processes exit cleanly."""
    import torch.multiprocessing as mp

    from pyengine.distributed import get_distributed_init_method, get_open_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = get_distributed_init_method("127.0.0.1", get_open_port())
    procs = [ctx.Process(target=_rank_main, args=(target, r, init, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return reports


def banned_at(out, banned):
    """First index i where out[:i + 1] ends with one of the banned sequences (all of it in
    the output, as vLLM matches), or None."""
    for i in range(len(out)):
        for seq in banned:
            k = len(seq)
            if i + 1 >= k and list(out[i + 1 - k:i + 1]) == list(seq):
                return i
    return None


def find_bad_word(tok, processor, outputs, length):
    """A word whose engine tokenizations (bad_words_token_ids) include a ``length``-token
    span of one of the greedy outputs: (output index, word, its banned sequences)."""
    for n, out in enumerate(outputs):
        for j in range(len(out) - length + 1):
            word = tok.decode(out[j:j + length]).strip()
            if not any(c.isalnum() for c in word) or "\ufffd" in word or any(c.isspace() for c in word):
                continue
            seqs = processor.bad_words_token_ids([word])
            if any(len(s) == length for s in seqs) and banned_at(out, seqs) is not None:
                return n, word, seqs
    raise AssertionError(f"no {length}-token word in the greedy outputs")


def build_tiny_eagle3(out_dir, target_dir, seed: int = 0, draft_vocab_size: int | None = None,
                      with_embed: bool = False, aux_layer_ids: Sequence[int] | None = None) -> Path:
    """Save a random, untrained EAGLE-3 head for the tiny model in ``target_dir``, in the HF
    ``eagle3`` checkpoint format vLLM loads (``LlamaForCausalLMEagle3``: ``fc``, one
    ``midlayer`` whose q/k/v read 2 * hidden, ``norm``, ``lm_head`` over a draft vocabulary
    of ``draft_vocab_size`` (default: the target's) mapped by ``d2t``, ``t2d``; an
    ``embed_tokens`` only with ``with_embed``). Returns ``out_dir``."""
    import json

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    heads, kv, hd, inter = 4, 2, H // 4, 2 * H
    dv = draft_vocab_size or V
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "intermediate_size": inter, "vocab_size": V, "draft_vocab_size": dv, "target_hidden_size": H,
           "max_position_embeddings": tcfg["max_position_embeddings"], "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_theta": tcfg.get("rope_theta", 10000.0), "tie_word_embeddings": False, "torch_dtype": "float32"}
    if aux_layer_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return (scale * torch.randn(*shape, generator=g)).contiguous()

    t = {"fc.weight": w(H, 3 * H, scale=0.05), "norm.weight": 1 + w(H), "lm_head.weight": w(dv, H, scale=0.5),
         "midlayer.input_layernorm.weight": 1 + w(H), "midlayer.hidden_norm.weight": 1 + w(H),
         "midlayer.post_attention_layernorm.weight": 1 + w(H),
         "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * H), "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * H),
         "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, heads * hd),
         "midlayer.mlp.gate_proj.weight": w(inter, H), "midlayer.mlp.up_proj.weight": w(inter, H),
         "midlayer.mlp.down_proj.weight": w(H, inter)}
    # draft id i -> target id: a sorted random subset of the target vocabulary
    targets = torch.sort(torch.randperm(V, generator=g)[:dv]).values
    t["d2t"] = (targets - torch.arange(dv)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    if with_embed:
        t["embed_tokens.weight"] = w(V, H, scale=1.0)
    save_file(t, str(out / "model.safetensors"))
    return out


# A sitecustomize.py (format with root=, delay= seconds) that slows every engine step of the
# processes started with its directory on PYTHONPATH: a stream that surely is still running.
SLOW_STEP_SITECUSTOMIZE = """
import sys, time
sys.path.insert(0, {root!r})
import pyengine.worker.model_runner as _mr
_orig = _mr.ModelRunner.execute_model
def _slow(self, *a, **k):
    time.sleep({delay})
    return _orig(self, *a, **k)
_mr.ModelRunner.execute_model = _slow
"""

"""Processor: request validation and fan-out into engine-core requests."""
from __future__ import annotations

import pytest

from pyengine import EngineArgs, SamplingParams
from pyengine.engine.processor import Processor


@pytest.fixture(scope="module")
def processor(llama_dir, tokenizer):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    return Processor(cfg, tokenizer)


def test_eos_and_stop_ids_resolved(processor, tokenizer):
    out = processor.process("a", "def f(x):", SamplingParams(stop_token_ids=[7]))
    text, ids, reqs = out.prompt_text, out.prompt_token_ids, out.core_requests
    assert ids == tokenizer.encode("def f(x):") and text == "def f(x):"
    assert reqs[0].sampling_params.all_stop_token_ids == {7, tokenizer.eos_token_id}
    reqs = processor.process("b", [5, 6], SamplingParams(stop_token_ids=[7], ignore_eos=True)).core_requests
    assert reqs[0].sampling_params.all_stop_token_ids == {7}


def test_user_params_not_mutated(processor):
    sp = SamplingParams(max_tokens=5)
    processor.process("c", [5, 6], sp)
    assert sp.all_stop_token_ids == set()


def test_max_tokens_resolution(processor):
    reqs = processor.process("d", [5] * 10, SamplingParams(max_tokens=None)).core_requests
    assert reqs[0].max_tokens == 64 - 10
    reqs = processor.process("f", [5] * 10, SamplingParams(max_tokens=3)).core_requests
    assert reqs[0].max_tokens == 3
    reqs = processor.process("e", [5] * 10, SamplingParams(max_tokens=54)).core_requests
    assert reqs[0].max_tokens == 54


def test_default_max_tokens_capped_at_the_room_left(processor):
    # Issue 17: a 63-token prompt in a 64-token model with max_tokens not given gets the
    # default 16 lowered to the 1 token left, not an error.
    reqs = processor.process("g1", [5] * 63, SamplingParams()).core_requests
    assert reqs[0].max_tokens == 1
    reqs = processor.process("g2", [5] * 40, SamplingParams(temperature=0.5)).core_requests
    assert reqs[0].max_tokens == 16
    # also through clone() (LLM.generate clones the user's params) and with n > 1
    reqs = processor.process("g3", [5] * 60, SamplingParams(n=2, seed=1).clone(seed=3)).core_requests
    assert [r.max_tokens for r in reqs] == [4, 4]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16), SamplingParams(max_tokens=500),
                                    SamplingParams().clone(max_tokens=16)])
def test_explicit_max_tokens_that_does_not_fit_refused(processor, params):
    from pyengine import VLLMValidationError

    with pytest.raises(VLLMValidationError) as ei:
        processor.process("h1", [5] * 63, params)
    n = params.max_tokens
    assert str(ei.value).startswith(f"This model's maximum context length is 64 tokens. However, you requested "
                                    f"{63 + n} tokens (63 in the prompt, {n} in the completion).")
    assert ei.value.parameter == "max_tokens" and ei.value.value == n


def test_max_tokens_default_flag():
    assert SamplingParams().max_tokens_is_default
    assert SamplingParams(temperature=0).clone(seed=4).max_tokens_is_default
    assert not SamplingParams(max_tokens=16).max_tokens_is_default
    assert not SamplingParams().clone(max_tokens=16).max_tokens_is_default
    sp = SamplingParams()
    sp.max_tokens = 100  # set after construction: given
    assert not sp.max_tokens_is_default


def test_n_fans_out_with_distinct_seeds(processor):
    reqs = processor.process("g", [5, 6], SamplingParams(n=3, seed=10, temperature=1.0)).core_requests
    assert [r.request_id.rsplit("-", 1)[0] for r in reqs] == ["0_g", "1_g", "2_g"]
    assert len({r.request_id.rsplit("-", 1)[1] for r in reqs}) == 1
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r in reqs)


def test_core_request_ids_unique_per_request(processor):
    # an aborted id may be reused at once while its core request is still in flight
    a = processor.process("same", [5], None).core_requests[0].request_id
    b = processor.process("same", [5], None).core_requests[0].request_id
    assert a != b and a.startswith("same-") and b.startswith("same-")


def test_child_seeds_wrap_inside_the_seed_range(processor):
    from pyengine.sampling_params import INT64_MAX, INT64_MIN
    reqs = processor.process("s", [5], SamplingParams(n=3, seed=INT64_MAX - 1, temperature=1.0)).core_requests
    assert [r.sampling_params.seed for r in reqs] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]


def test_text_encoding_outside_the_model_vocabulary_is_refused(llama_dir, tokenizer):
    # a tokenizer larger than the model: refused at the door, not an IndexError in the model
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    small = Processor(cfg.replace(hf_config=type(cfg.hf_config)(**dict(cfg.hf_config.to_dict(), vocab_size=3))),
                      tokenizer)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        small.process("v", "def f(x): return x", None)


@pytest.mark.parametrize("prompt, params, priority, match", [
    ("", None, 0, "empty"),
    ([5] * 64, None, 0, "maximum context length is 64 tokens. However, your prompt has 64 tokens"),
    ([-1], None, 0, "vocabulary"),
    ([True], None, 0, "integers"),
    ({"text": "x"}, None, 0, "prompt_token_ids"),
    ("x", {"max_tokens": 3}, 0, "SamplingParams"),
    ("x", SamplingParams(stop_token_ids=[10**6]), 0, "stop_token_ids"),
    ("x", None, "high", "priority"),
    ("x", None, 2 ** 63, "priority must be an integer in"),
    ("x", None, True, "priority"),
])
def test_rejections(processor, prompt, params, priority, match):
    with pytest.raises(ValueError, match=match):
        processor.process("h", prompt, params, priority)


# --- the cheap prompt bound (issue 16 kind 2): characters against max_model_len ---

def _bpe_tokenizer(normalizer=None, pre_tokenizer="byte_level", byte_fallback=False, unk_token=None,
                   fuse_unk=False, added=(), corpus=None):
    """A small BPE tokenizer trained here on a few lines, wrapped as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk_token, fuse_unk=fuse_unk, byte_fallback=byte_fallback))
    alphabet = []
    if pre_tokenizer == "byte_level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    special = [unk_token] if unk_token else []
    if byte_fallback:
        special += [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=special,
                                  show_progress=False)
    lines = corpus or ["def main(): return self.value  # the quick brown fox",
                       "for i in range(10): print(i, '=' * 40)", "     indented     spaces     ",
                       "naïve café résumé Ωμέγα"] * 20
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if added:
        fast.add_special_tokens({"additional_special_tokens": list(added)})
    return fast


def _adversarial_texts(tok) -> list[str]:
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    longest = tok.convert_tokens_to_string([max(vocab, key=len)])
    import random
    rnd = random.Random(0)
    noise = "".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0x80, 0x3000)])) for _ in range(3000))
    return [longest * 200, " " * 4000, "\n" * 3000, "=" * 4000, "e\u0301" * 1500,
            "\u0391\u0314\u0342\u0345" * 800,  # NFC: 4 code points -> U+1F8F
            "\u1100\u1161\u11a8" * 1000,  # NFC: Hangul jamo L V T -> one syllable
            "\U0001F600" * 800, noise, "the quick brown fox " * 300]


def _bounded_tokenizers():
    from tokenizers import normalizers
    return {
        "byte_level": _bpe_tokenizer(),
        # trained on composed characters: its tokens cover many, each 4 (or 3) code points of input
        "byte_level_nfc": _bpe_tokenizer(normalizer=normalizers.NFC(),
                                         corpus=["\u1f8f" * 64, "\uac01" * 64, "x y"] * 20),
        "metaspace_byte_fallback": _bpe_tokenizer(
            normalizer=normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
            pre_tokenizer=None, byte_fallback=True, unk_token="<unk>", fuse_unk=True),
        "unk_per_char": _bpe_tokenizer(pre_tokenizer=None, unk_token="<unk>", fuse_unk=False),
    }


def test_max_chars_per_token_bounds_every_encoding(tokenizer, scripted_tokenizer):
    from pyengine.engine.processor import max_chars_per_token

    toks = dict(_bounded_tokenizers(), fixture=tokenizer, scripted=scripted_tokenizer)
    for name, tok in toks.items():
        bound = max_chars_per_token(tok)
        assert bound is not None, name
        for text in _adversarial_texts(tok):
            ids = tok(text, add_special_tokens=False).input_ids
            # C characters need at least C / bound tokens: the bound never refuses a prompt that fits
            assert len(ids) * bound >= len(text), (name, text[:20], len(ids), bound)


def test_no_character_bound_where_characters_may_vanish():
    from tokenizers import normalizers, pre_tokenizers

    from pyengine.engine.processor import max_chars_per_token

    unbounded = {
        "whitespace_split": _bpe_tokenizer(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
        "strip_accents": _bpe_tokenizer(normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])),
        "fused_unknown": _bpe_tokenizer(pre_tokenizer=None, unk_token="<unk>", fuse_unk=True),
        "no_unknown_token": _bpe_tokenizer(pre_tokenizer=None),
    }
    for name, tok in unbounded.items():
        assert max_chars_per_token(tok) is None, name
    # and where one did vanish, the bound would have been wrong: many characters, few tokens
    tok = unbounded["whitespace_split"]
    assert len(tok(" " * 4000 + "fox").input_ids) < 4000 / 100
    lstrip = _bpe_tokenizer()
    from tokenizers import AddedToken
    lstrip.add_special_tokens({"additional_special_tokens": [AddedToken("<|x|>", lstrip=True)]})
    assert max_chars_per_token(lstrip) is None


def test_text_prompt_over_the_character_bound_refused_before_tokenizing(llama_dir, tokenizer, monkeypatch):
    import time

    from pyengine import VLLMValidationError
    from pyengine.engine.processor import max_chars_per_token

    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    proc = Processor(cfg, tokenizer)
    assert proc.max_prompt_chars == int(63 * max_chars_per_token(tokenizer))
    calls = []
    encode = proc.encode
    monkeypatch.setattr(proc, "encode", lambda text, *a, **k: calls.append(len(text)) or encode(text, *a, **k))
    huge = "x" * (4 << 20)
    t0 = time.perf_counter()
    with pytest.raises(VLLMValidationError) as ei:
        proc.process("big", huge, SamplingParams())
    assert time.perf_counter() - t0 < 0.5 and not calls
    assert ei.value.parameter == "prompt" and ei.value.value == len(huge)
    assert f"it has {len(huge)} characters" in str(ei.value) and "64 tokens" in str(ei.value)
    # at the bound: tokenized as usual, and the token count decides
    with pytest.raises(ValueError, match=r"However, your prompt has \d+ tokens"):
        proc.process("edge", "x" * proc.max_prompt_chars, SamplingParams())
    assert calls == [proc.max_prompt_chars]
    proc.process("fits", "x y", SamplingParams())


def test_encode_matches_the_tokenizer(llama_dir, tokenizer, scripted_tokenizer):
    # Processor.encode calls the Rust tokenizer directly (GIL released); the ids must be
    # transformers' own, special tokens (a BOS template, added tokens in the text) included
    from tokenizers import processors

    with_bos = _bpe_tokenizer(added=["<|im_start|>", "<|im_end|>"])
    with_bos.add_special_tokens({"bos_token": "<s>"})
    bos = with_bos.convert_tokens_to_ids("<s>")
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    split_special = _bpe_tokenizer(added=["<|im_start|>"])
    split_special.split_special_tokens = True  # the slow path: transformers decides
    texts = ["def f(x): return x", "<|im_start|>user\nhi<|im_end|>\n", "  naïve  \n\n", "\U0001F600 ok"]
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    for tok in (tokenizer, scripted_tokenizer, with_bos, split_special):
        proc = Processor(cfg, tok)
        for text in texts:
            for special in (True, False):
                assert proc.encode(text, special) == tok(text, add_special_tokens=special).input_ids, (text, special)
    assert Processor(cfg, with_bos).encode("x")[0] == bos
def test_generation_config_defaults_when_no_params(llama_greedy_dir, tokenizer):
    # --generation-config: temperature 0, top_k 7, max_new_tokens 3 in the model's file
    cfg = EngineArgs(model=str(llama_greedy_dir), device="cpu", max_model_len=64).create_engine_config()
    proc = Processor(cfg, tokenizer)
    d = proc.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens, d.top_p) == (0.0, 7, 3, 1.0)
    _p = proc.process("gd1", [5] * 10, None)
    _, _, params, reqs = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert params.temperature == 0.0 and params.top_k == 7 and reqs[0].max_tokens == 3
    # the generation config's max_tokens is a default: capped at the room left, not refused
    _p = proc.process("gd2", [5] * 62, None)
    _, _, _, reqs = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert reqs[0].max_tokens == 2
    # it also caps requests that give no number of their own (chat's absent max_tokens is
    # None; a completion's is the default 16) ...
    assert proc.process("gd3", [5] * 10, SamplingParams(max_tokens=None)).core_requests[0].max_tokens == 3
    assert proc.process("gd4", [5] * 10, SamplingParams()).core_requests[0].max_tokens == 3
    # ... but not an explicit one, and explicit params are taken as they are (as vLLM's LLM)
    _p = proc.process("gd5", [5] * 10, SamplingParams(max_tokens=20))
    _, _, params, reqs = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert reqs[0].max_tokens == 20 and params.temperature == 1.0
    # fields a front end sets over the defaults
    _p = proc.process("gd6", [5] * 10, d.clone(top_k=2))
    _, _, params, reqs = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert (params.temperature, params.top_k, reqs[0].max_tokens) == (0.0, 2, 3)
    # --generation-config vllm: vLLM's neutral defaults
    neutral = Processor(cfg.replace(generation_config="vllm"), tokenizer)
    d = neutral.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (1.0, 0, 16)


def test_eos_ids_come_from_the_chosen_generation_config(llama_dir, tmp_path, tokenizer):
    from tests.helpers import with_generation_config

    gen = with_generation_config(llama_dir, tmp_path / "gen", eos_token_id=[11, 12])
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64,
                     generation_config=str(gen)).create_engine_config()
    assert Processor(cfg, tokenizer).eos_token_ids == {11, 12}


def test_max_logprobs_is_enforced(llama_dir, tokenizer):
    from pyengine import VLLMValidationError

    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    proc = Processor(cfg, tokenizer)
    proc.process("lp1", [5, 6], SamplingParams(logprobs=20))
    with pytest.raises(VLLMValidationError) as ei:
        proc.process("lp2", [5, 6], SamplingParams(logprobs=21))
    assert str(ei.value) == "logprobs must be at most 20 (the engine's max_logprobs), got 21."
    assert ei.value.parameter == "logprobs"
    wide = Processor(cfg.replace(max_logprobs=50), tokenizer)
    wide.process("lp3", [5, 6], SamplingParams(logprobs=50))
    with pytest.raises(VLLMValidationError, match="at most 50"):
        wide.process("lp4", [5, 6], SamplingParams(logprobs=51))
    # never past the vocabulary, whatever max_logprobs says
    huge = Processor(cfg.replace(max_logprobs=10 ** 9), tokenizer)
    with pytest.raises(VLLMValidationError, match=f"at most {cfg.hf_config.vocab_size} "):
        huge.process("lp5", [5, 6], SamplingParams(logprobs=10 ** 8))


# --- bad_words, allowed_token_ids, truncate_prompt_tokens (issue 23) ---

@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_bad_words_tokenized_as_vllm(kind, llama_dir, llama_sp_dir, tokenizer):
    """Each word without and with a leading space (vLLM's update_from_tokenizer): the
    spaced form is kept only when it is another sequence of the same length."""
    from transformers import AutoTokenizer

    model = llama_dir if kind == "byte_level" else llama_sp_dir
    tok = tokenizer if kind == "byte_level" else AutoTokenizer.from_pretrained(str(llama_sp_dir))
    proc = Processor(EngineArgs(model=str(model), device="cpu", max_model_len=64).create_engine_config(), tok)
    words = ["self", "  return", "value", "import os"]
    got = proc.bad_words_token_ids(words)
    want = []
    for w in words:
        plain = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        want.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(spaced)
    assert got == want
    for ids in got:  # every kept sequence decodes back to the word, with or without its space
        assert tok.decode(ids).strip() in [w.strip() for w in words]
    if kind == "byte_level":  # "self" and " self" are different single tokens here
        assert [tok.encode("self", add_special_tokens=False), tok.encode(" self", add_special_tokens=False)] \
            == got[:2] and got[0] != got[1]
    else:  # SentencePiece prepends "▁": the word already is its mid-text form, and " self" is longer
        assert tok.convert_ids_to_tokens(got[0])[0].startswith("\u2581") and len(got) == len(words)
    out = proc.process("b", "def f(x):", SamplingParams(bad_words=["self"]))
    assert out.core_requests[0].sampling_params.bad_words_token_ids == got[:2 if kind == "byte_level" else 1]


def test_allowed_token_ids_checked_and_normalized(processor):
    out = processor.process("a", "def f(x):", SamplingParams(allowed_token_ids=[9, 3, 9]))
    assert out.core_requests[0].sampling_params.allowed_token_ids == [3, 9]
    with pytest.raises(ValueError, match="Token id 100000 in allowed_token_ids is out of vocabulary"):
        processor.process("a", "x", SamplingParams(allowed_token_ids=[3, 100000]))
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])


def test_truncate_prompt_tokens_keeps_the_last_tokens(processor):
    long = list(range(10, 110))  # 100 tokens: more than max_model_len (64)
    _p = processor.process("t", long, SamplingParams(truncate_prompt_tokens=20, max_tokens=5))
    _, ids, _, reqs = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert ids == long[-20:] and reqs[0].prompt_token_ids == long[-20:]
    # -1: as many as fit next to the given max_tokens
    _p = processor.process("t", long, SamplingParams(truncate_prompt_tokens=-1, max_tokens=10))
    _, ids, _, _ = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert ids == long[-54:]
    _p = processor.process("t", long[:5], SamplingParams(truncate_prompt_tokens=20))
    _, ids, _, _ = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert ids == long[:5]
    _p = processor.process("t", "def f(x): return x " * 40, SamplingParams(truncate_prompt_tokens=8))
    text, ids, _, _ = _p.prompt_text, _p.prompt_token_ids, _p.params, _p.core_requests
    assert text is None and len(ids) == 8  # the text no longer matches the prompt
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=60 cannot be greater than max_model_len - "
                                         r"max_tokens = 54"):
        processor.process("t", long, SamplingParams(truncate_prompt_tokens=60, max_tokens=10))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or an integer"):
        SamplingParams(truncate_prompt_tokens=0)

"""Tests for pyengine/engine/detokenizer.py with an in-memory byte-level BPE tokenizer."""
import random

import pytest

from pyengine.engine import detokenizer as detok_module
from pyengine.engine.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    decode_logprob_token,
    decode_output,
    prompt_text_for_echo,
)
from pyengine.sampling_params import SamplingParams


class _CachedFast(detok_module.FastIncrementalDetokenizer):
    """The DecodeStream detokenizer with a token-text cache, as the output processor
    makes it for byte-level BPE tokenizers."""

    def __init__(self, tokenizer, prompt_token_ids, params, token_texts=None):
        if token_texts is None and tokenizer is not None:
            token_texts = detok_module.TokenTexts.for_tokenizer(tokenizer)
        super().__init__(tokenizer, prompt_token_ids, params, token_texts)


@pytest.fixture(autouse=True, params=["window", "fast", "fast+cache"])
def detokenizer_class(request, monkeypatch):
    """Every test runs against each implementation (the window-based one, the
    DecodeStream one the output processor picks for fast tokenizers, and that one with
    the token-text cache): same contract."""
    cls = {"window": detok_module.IncrementalDetokenizer, "fast": detok_module.FastIncrementalDetokenizer,
           "fast+cache": _CachedFast}[request.param]
    monkeypatch.setitem(globals(), "IncrementalDetokenizer", cls)
    return cls

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, déjà vu. 日本語のテキスト。",
    "Emoji: 😀 🚀 👍🏽 ❤️ 🎉 done",
    "日本は美しい国です。😀😀 naïve 東京",
    "plain ascii with\nnew lines\n\nUser: hi",
]


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt_ids, out_ids, params, chunks=None, finish_at_end=True):
    """Feed ``out_ids`` (in ``chunks`` sizes, default 1) and collect the deltas."""
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop = [], None
    i = 0
    sizes = list(chunks) if chunks else [1] * len(out_ids)
    for n in sizes:
        new = out_ids[i:i + n]
        i += n
        stop = d.update(new, stop_terminated=False)
        last = i >= len(out_ids) or stop is not None
        deltas.append(d.get_next_output_text(finished=last and finish_at_end, delta=True))
        if stop is not None:
            break
    return d, deltas, stop


def test_tokenizer_splits_multibyte_chars(bpe_tokenizer):
    # Sanity of the fixture: some character needs several tokens.
    pieces = [bpe_tokenizer.decode([t]) for t in enc(bpe_tokenizer, "日本😀")]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(bpe_tokenizer, text):
    tok = bpe_tokenizer
    ids = enc(tok, text)
    d, deltas, stop = stream(tok, [], ids, SamplingParams())
    assert stop is None
    assert "".join(deltas) == tok.decode(ids) == text
    assert d.output_text == text
    assert d.output_token_ids == ids
    for delta in deltas:
        assert "\ufffd" not in delta


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_batch_and_random_chunks(bpe_tokenizer, text):
    tok = bpe_tokenizer
    prompt = enc(tok, "<|im_start|>user 日本")
    ids = enc(tok, text)
    one, deltas1, _ = stream(tok, prompt, ids, SamplingParams())
    batch, deltas_b, _ = stream(tok, prompt, ids, SamplingParams(), chunks=[len(ids)])
    rng = random.Random(0)
    sizes, left = [], len(ids)
    while left:
        sizes.append(min(left, rng.randint(1, 4)))
        left -= sizes[-1]
    rand, deltas_r, _ = stream(tok, prompt, ids, SamplingParams(), chunks=sizes)
    assert one.output_text == batch.output_text == rand.output_text == text
    assert "".join(deltas1) == "".join(deltas_b) == "".join(deltas_r) == text
    assert all("\ufffd" not in x for x in deltas1 + deltas_r)


def test_multibyte_character_waits_for_last_byte(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = enc(tok, "日本")
    assert len(ids) >= 2 and "\ufffd" in tok.decode(ids[:1])
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    d.update(ids[:1], False)
    assert "\ufffd" not in d.output_text
    assert d.get_next_output_text(False, True) == d.output_text
    d.update(ids[1:], False)
    assert d.output_text == "日本"


def test_long_output_window_slides(bpe_tokenizer):
    tok = bpe_tokenizer
    text = " ".join(TEXTS) * 5
    ids = enc(tok, text)
    d, deltas, _ = stream(tok, [], ids, SamplingParams())
    assert "".join(deltas) == text
    assert len(d._ids) < 200  # the decoding window does not grow with the output


def test_prompt_context_and_special_tokens(bpe_tokenizer):
    tok = bpe_tokenizer
    prompt = enc(tok, "<|im_start|>Say hi<|im_end|>")
    out = enc(tok, "hi <|im_end|> there") + [tok.eos_token_id]
    d, deltas, _ = stream(tok, prompt, out, SamplingParams())
    assert d.output_text == "hi  there" == tok.decode(out, skip_special_tokens=True)
    d, deltas, _ = stream(tok, prompt, out, SamplingParams(skip_special_tokens=False))
    assert d.output_text == "hi <|im_end|> there<|endoftext|>"
    assert "".join(deltas) == d.output_text


@pytest.mark.parametrize("split", [3, 4, 5])
def test_character_spanning_prompt_and_output_in_first_delta(scripted_tokenizer, split):
    # Issue 17: a token-id prompt ending in the first bytes of an emoji, the output
    # starting with the rest: the emoji was lost (in no delta, not in echo + text).
    from tests.helpers import EMOJI

    tok = scripted_tokenizer
    ids = enc(tok, "ok" + EMOJI + "!")  # o, k, 4 emoji bytes, !
    prompt, out = ids[:split], ids[split:]
    d, deltas, _ = stream(tok, prompt, out, SamplingParams())
    assert "".join(deltas) == d.output_text == EMOJI + "!"
    assert next(x for x in deltas if x).startswith(EMOJI)
    assert prompt_text_for_echo(tok, prompt) == "ok"
    assert decode_output(tok, prompt, out) == EMOJI + "!"


@pytest.mark.parametrize("text", TEXTS)
def test_echo_plus_output_is_the_whole_text_at_any_split(bpe_tokenizer, text):
    tok = bpe_tokenizer
    ids = enc(tok, "User: " + text)
    for k in range(1, len(ids)):
        _, deltas, _ = stream(tok, ids[:k], ids[k:], SamplingParams())
        assert prompt_text_for_echo(tok, ids[:k]) + "".join(deltas) == tok.decode(ids), k
        assert decode_output(tok, ids[:k], ids[k:]) == "".join(deltas), k


def test_incomplete_prompt_tail_never_completed(scripted_tokenizer):
    # Bytes that never form a character still come out once (as U+FFFD), with the output.
    from tests.helpers import EMOJI

    tok = scripted_tokenizer
    prompt = enc(tok, "ok" + EMOJI)[:3]
    out = enc(tok, "!")
    _, deltas, _ = stream(tok, prompt, out, SamplingParams())
    assert prompt_text_for_echo(tok, prompt) + "".join(deltas) == tok.decode(prompt + out) == "ok\ufffd!"


def test_stop_token_not_detokenized(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = enc(tok, "Hello") + [tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], params)
    assert d.update(ids, stop_terminated=True) is None
    assert d.output_text == "Hello"
    assert d.output_token_ids == ids
    d = IncrementalDetokenizer(tok, [], params.clone(include_stop_str_in_output=True))
    d.update(ids, stop_terminated=True)
    assert d.output_text == "Hello<|endoftext|>"
    # A non-special stop token id is also left out of the text.
    stop_id = enc(tok, "!")[0]
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[stop_id]))
    d.update(enc(tok, "Hello") + [stop_id], stop_terminated=True)
    assert d.output_text == "Hello" and d.output_token_ids[-1] == stop_id


def test_stop_string_spanning_tokens(bpe_tokenizer):
    tok = bpe_tokenizer
    text = "Hello world! The quick brown fox"
    ids = enc(tok, text)
    stop = "o wor"
    # The stop string covers several tokens.
    pieces = [tok.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)
    d, deltas, matched = stream(tok, [], ids, SamplingParams(stop=[stop]))
    assert matched == stop
    assert d.output_text == "Hell"
    assert "".join(deltas) == "Hell"
    assert len(d.output_token_ids) < len(ids)  # stopped early


def test_stop_string_held_back_then_released(bpe_tokenizer):
    tok = bpe_tokenizer
    text = "The quick brown fox jumps"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["fox!"]))
    released = ""
    saw_hold = False
    for t in ids:
        assert d.update([t], False) is None
        released += d.get_next_output_text(finished=False, delta=True)
        assert d.output_text.startswith(released)
        held = d.output_text[len(released):]
        # Whatever is held back could still start "fox!"; all else is released.
        assert len(held) <= 3 and "fox!".startswith(held)
        if held:
            saw_hold = True
            assert released == "The quick brown "
    assert saw_hold
    released += d.get_next_output_text(finished=True, delta=True)
    assert released == text


def test_hold_back_cumulative_and_finish(bpe_tokenizer):
    tok = bpe_tokenizer
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    d.update(enc(tok, "Stop here. ST"), False)
    assert d.get_next_output_text(finished=False, delta=False) == "Stop here. "
    assert d.get_next_output_text(finished=True, delta=False) == "Stop here. ST"
    # Delta after a cumulative call is independent of it.
    assert d.get_next_output_text(finished=False, delta=True) == "Stop here. "
    assert d.get_next_output_text(finished=False, delta=True) == ""
    assert d.update(enc(tok, "OP! The end."), False) == "STOP"
    assert d.output_text == "Stop here. "
    assert d.get_next_output_text(finished=True, delta=True) == ""


def test_stop_truncates_within_one_update(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = enc(tok, "Hello world! The quick brown fox")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["!"]))
    assert d.update(ids, False) == "!"
    assert d.output_text == "Hello world"
    assert d.get_next_output_text(finished=True, delta=True) == "Hello world"


def test_include_stop_str_in_output(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = enc(tok, "Hello world! The quick brown fox")
    params = SamplingParams(stop=["world!"], include_stop_str_in_output=True)
    d, deltas, matched = stream(tok, [], ids, params)
    assert matched == "world!"
    assert d.output_text == "Hello world!"
    assert "".join(deltas) == "Hello world!"
    # Nothing is held back with include_stop_str_in_output.
    d = IncrementalDetokenizer(tok, [], params)
    d.update(enc(tok, "Hello wor"), False)
    assert d.get_next_output_text(finished=False, delta=True) == "Hello wor"
    # Text after the stop string in the same update is cut.
    d = IncrementalDetokenizer(tok, [], params)
    assert d.update(ids, False) == "world!"
    assert d.output_text == "Hello world!"


def test_multiple_stop_strings_earliest_wins(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = enc(tok, "The quick brown fox jumps over the lazy dog.")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["lazy", "fox", "quick brown"]))
    assert d.update(ids, False) == "quick brown"
    assert d.output_text == "The "
    # Streaming: the first one to appear wins.
    d, deltas, matched = stream(tok, [], ids, SamplingParams(stop=["lazy", "jumps"]))
    assert matched == "jumps" and d.output_text == "The quick brown fox "
    assert "".join(deltas) == d.output_text


def test_min_tokens_delays_stop_strings(bpe_tokenizer):
    tok = bpe_tokenizer
    text = "Hello world! The quick brown fox"
    ids = enc(tok, text)
    # Without min_tokens the first "o" stops (inside "Hello").
    d, _, matched = stream(tok, [], ids, SamplingParams(stop=["o"]))
    assert matched == "o" and d.output_text == "Hell"
    # With min_tokens covering "Hello wo", the text of those tokens is not searched.
    n_min = next(i for i in range(1, len(ids) + 1) if tok.decode(ids[:i]).startswith("Hello wo"))
    params = SamplingParams(stop=["o"], min_tokens=n_min, max_tokens=100)
    d, deltas, matched = stream(tok, [], ids, params)
    assert matched == "o"
    assert d.output_text == "Hello world! The quick br"
    assert "".join(deltas) == d.output_text
    # Batch feeding behaves the same.
    d = IncrementalDetokenizer(tok, [], params)
    assert d.update(ids, False) == "o"
    assert d.output_text == "Hello world! The quick br"


def test_no_tokenizer_tracks_ids_only():
    d = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["x"]))
    assert d.update([5, 6, 7], stop_terminated=True) is None
    assert d.output_token_ids == [5, 6, 7] and d.output_text == ""
    assert d.get_next_output_text(True, True) == ""


def test_decode_logprob_token(bpe_tokenizer):
    tok = bpe_tokenizer
    assert decode_logprob_token(tok, enc(tok, "é")[0]) == "é"
    assert decode_logprob_token(tok, tok.eos_token_id) == "<|endoftext|>"
    assert decode_logprob_token(None, 3) == ""


def test_check_stop_strings_unit():
    assert check_stop_strings("abc", 0, ["a"], False) is None
    assert check_stop_strings("xxabc", 1, ["ab", "bc"], False) == ("bc", 3)
    # "ab" ends before the new char, so it was already searched.
    assert check_stop_strings("xxabc", 1, ["ab"], False) is None
    assert check_stop_strings("xxabc", 2, ["bc", "ab"], False) == ("ab", 2)
    assert check_stop_strings("xxabc", 2, ["ab"], True) == ("ab", 4)
    assert check_stop_strings("xxabc", 2, ["bc"], True) == ("bc", -1)


@pytest.mark.parametrize("skip_special", [True, False])
def test_token_text_cache_gives_the_streams_text(bpe_tokenizer, skip_special):
    """Random token ids (pieces of multi-byte characters, special tokens, whole words),
    one at a time and in chunks: the detokenizer with the token-text cache gives the
    deltas the plain DecodeStream one gives, and serves most tokens from the cache."""
    cache = detok_module.TokenTexts.for_tokenizer(bpe_tokenizer)
    assert cache is not None  # a ByteLevel decoder
    vocab = len(bpe_tokenizer)
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special)
    for trial in range(30):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        out = [rng.randrange(vocab) for _ in range(60)]
        chunks = [1] * 60 if trial % 2 == 0 else None
        if chunks is None:
            chunks, left = [], 60
            while left:
                chunks.append(min(left, rng.randrange(1, 4)))
                left -= chunks[-1]
        plain = detok_module.FastIncrementalDetokenizer(bpe_tokenizer, prompt, params)
        cached = detok_module.FastIncrementalDetokenizer(bpe_tokenizer, prompt, params, cache)
        i = 0
        for n in chunks:
            a = plain.update(out[i:i + n], False), plain.get_next_output_text(False, True)
            b = cached.update(out[i:i + n], False), cached.get_next_output_text(False, True)
            assert a == b, (trial, i)
            i += n
        assert plain.output_text == cached.output_text
        assert plain.get_next_output_text(True, True) == cached.get_next_output_text(True, True)
    assert len(cache.texts) > vocab // 2  # most single tokens are whole characters, and were learnt
    for tid, text in cache.texts.items():
        assert text == bpe_tokenizer.decode([tid]) and "\ufffd" not in text
    assert not set(cache.texts) & cache.added


def test_token_text_cache_only_for_byte_level_decoders(bpe_tokenizer, scripted_tokenizer):
    from types import SimpleNamespace

    from tokenizers import decoders
    assert detok_module.TokenTexts.for_tokenizer(bpe_tokenizer) is not None
    metaspace = SimpleNamespace(backend_tokenizer=SimpleNamespace(decoder=decoders.Metaspace(),
                                                                  get_added_tokens_decoder=dict))
    assert detok_module.TokenTexts.for_tokenizer(metaspace) is None
    assert detok_module.TokenTexts.for_tokenizer(SimpleNamespace()) is None

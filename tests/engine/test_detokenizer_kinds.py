"""Incremental detokenization against ``tokenizer.decode`` for every tokenizer kind the
engine meets (byte-level BPE, SentencePiece-style BPE with byte fallback, WordPiece with
cleanup), on random token-id sequences (hypothesis): streamed text == non-streamed text ==
the decode of all the ids, multi-byte characters split over tokens included."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine.engine.detokenizer import (
    DecoderTraits,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    TokenTexts,
    decode_output,
    make_incremental_detokenizer,
    prompt_text_for_echo,
)
from pyengine.sampling_params import SamplingParams
from tests.helpers import TOKENIZER_KINDS, build_tokenizer_kind

# Text whose tokens the generated ids are drawn from, beside uniform ids: multi-byte
# characters (2-, 3- and 4-byte UTF-8), contractions and punctuation (WordPiece cleanup).
SAMPLES = ["Café crème brûlée, déjà vu.", "日本語のテキスト。東京", "Emoji: 😀 🚀 👍🏽 ❤️ done",
           "I don't think it's 'quoted' , right ? Yes !", "def f(x):\n    return x  # naïve"]


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def kind_tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer_kind(tmp_path_factory.mktemp(request.param),
                                                                  request.param)))


def _pool(tok) -> list[int]:
    ids = []
    for text in SAMPLES:
        ids += tok.encode(text, add_special_tokens=False)
    return ids


def _ids(tok):
    pool = _pool(tok)
    one = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(pool))
    return st.lists(one, max_size=40)


def _stream(detok, out, chunks):
    deltas, i = [], 0
    for n in chunks:
        part, i = out[i:i + n], i + n
        last = i >= len(out)
        detok.update(part, False, finished=last)
        deltas.append(detok.get_next_output_text(last, True))
        if last:
            break
    if not out:
        detok.update([], False, finished=True)
        deltas.append(detok.get_next_output_text(True, True))
    return "".join(deltas)


def _decode(tok, ids, skip):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_equals_decode_of_all_ids(kind_tokenizer, data):
    tok = kind_tokenizer
    out = data.draw(_ids(tok), "out")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(out) + 1, max_size=len(out) + 1), "chunks")
    skip = data.draw(st.booleans(), "skip_special_tokens")
    params = SamplingParams(skip_special_tokens=skip)
    traits = DecoderTraits.of(tok)
    texts = TokenTexts.for_tokenizer(tok)
    expected = _decode(tok, out, skip)
    for detok in (make_incremental_detokenizer(tok, [], params, texts, traits),
                  IncrementalDetokenizer(tok, [], params)):
        assert _stream(detok, out, chunks) == expected
        assert detok.output_text == expected
    assert decode_output(tok, [], out, skip) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_echo_plus_stream_is_the_text_of_prompt_and_output(kind_tokenizer, data):
    """A prompt of real text, output of any ids: echo + streamed text == decode(all),
    and the non-streamed text is the streamed text."""
    tok = kind_tokenizer
    prompt = tok.encode(data.draw(st.sampled_from(SAMPLES), "prompt"), add_special_tokens=False)
    out = data.draw(_ids(tok), "out")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(out) + 1, max_size=len(out) + 1), "chunks")
    params = SamplingParams()
    streamed = _stream(make_incremental_detokenizer(tok, prompt, params, TokenTexts.for_tokenizer(tok),
                                                    DecoderTraits.of(tok)), out, chunks)
    assert decode_output(tok, prompt, out) == streamed
    whole = _decode(tok, prompt + out, True)
    echo = prompt_text_for_echo(tok, prompt)
    if whole.startswith(echo):  # else a byte run or rewrite spans the boundary: echo changes
        assert echo + streamed == whole


def test_decoder_traits_per_kind(kind_tokenizer):
    traits = DecoderTraits.of(kind_tokenizer)
    kind = {"ByteLevel": "byte_level"}.get(type(kind_tokenizer.backend_tokenizer.decoder).__name__)
    assert traits.byte_level == (kind == "byte_level")
    assert bool(traits.byte_fallback_ids) == (len(traits.byte_fallback_ids) == 256)


def test_sentencepiece_stream_that_broke_decodestream(kind_tokenizer):
    """The issue-23 failure: a byte-fallback token whose run later turns invalid made
    DecodeStream raise "Invalid prefix encountered"; now the stream is the decode."""
    tok = kind_tokenizer
    traits = DecoderTraits.of(tok)
    if not traits.byte_fallback_ids:
        pytest.skip("byte fallback only")
    a, c3 = tok.convert_tokens_to_ids(["<0x71>", "<0xC3>"])  # 'q' as a byte, then a lead byte
    word = tok.encode("ature", add_special_tokens=False)
    out = [a, c3, c3] + word
    d = FastIncrementalDetokenizer(tok, [], SamplingParams(), traits=traits)
    assert _stream(d, out, [1] * len(out)) == _decode(tok, out, True)


def test_stream_failure_goes_over_to_window_decoding(kind_tokenizer, monkeypatch):
    """A DecodeStream step that raises (any reason) costs the request its fast path,
    not its text."""
    tok = kind_tokenizer
    if not DecoderTraits.of(tok).byte_level:
        pytest.skip("DecodeStream only for byte-level decoders")
    prompt = tok.encode(SAMPLES[1], add_special_tokens=False)
    out = tok.encode(SAMPLES[2] + SAMPLES[0], add_special_tokens=False)
    d = FastIncrementalDetokenizer(tok, prompt, SamplingParams(), traits=DecoderTraits.of(tok))
    real, calls = d._stream, []

    class Failing:
        def step(self, backend, ids):
            calls.append(ids)
            if len(calls) == 6:
                raise Exception("Invalid prefix encountered while decoding stream (injected)")
            return real.step(backend, ids)

    d._stream = Failing()
    assert _stream(d, out, [1] * len(out)) == decode_output(tok, prompt, out)
    assert len(calls) == 6 and d._stream is None

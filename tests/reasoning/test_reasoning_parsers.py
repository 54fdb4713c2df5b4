"""The reasoning parsers (pyengine/reasoning): think tags found by token id, whole outputs
and streams split the same way whatever the delta boundaries (a tag's text split over two
deltas, text arriving after its ids), the start state from the prompt and
``enable_thinking``, and the structured-output helpers."""
from __future__ import annotations

import random

import pytest

from pyengine.reasoning import DeepSeekR1ReasoningParser, DeltaMessage, Qwen3ReasoningParser, ReasoningParserManager
from tests.helpers import R1_STYLE_CHAT_TEMPLATE, THINK_END, THINK_START, TOOL_CALL_JSON


def ids_of(tok, *pieces: str) -> list[int]:
    """One token per piece (each an added token or a single BPE token)."""
    out = []
    for p in pieces:
        t = tok.encode(p, add_special_tokens=False)
        assert len(t) == 1, (p, t)
        out += t
    return out


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as one byte-level token per character (ASCII), never an added token."""
    return [tok.convert_tokens_to_ids(ch) for ch in text]


def prompt_ids(tok, template=None, **kw) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False,
                                   add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def stream(parser, deltas) -> tuple[str, str]:
    """Feed ``(text, ids)`` deltas, then finish; the joined reasoning and content."""
    r, c = [], []
    for text, ids in deltas:
        m = parser.extract_reasoning_streaming(text, ids)
        for msg in ([m] if m else []):
            assert isinstance(msg, DeltaMessage) and (msg.reasoning_content or msg.content)
            r.append(msg.reasoning_content or "")
            c.append(msg.content or "")
    m = parser.finish_streaming()
    if m:
        r.append(m.reasoning_content or "")
        c.append(m.content or "")
    return "".join(r), "".join(c)


def lagging_deltas(tok, ids: list[int], rng: random.Random) -> list[tuple[str, list[int]]]:
    """The ids cut into random deltas, with the text cut at other random points that never
    run ahead of the ids (a detokenizer or a stop-string check holding text back)."""
    pieces = [tok.decode([t]) for t in ids]
    ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
    text = "".join(pieces)
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if len(ids) > 1 else []
    bounds = [0] + cuts + [len(ids)]
    out, sent = [], 0
    for a, b in zip(bounds, bounds[1:]):
        upto = len(text) if b == len(ids) else rng.randint(sent, ends[b - 1])
        out.append((text[sent:upto], ids[a:b]))
        sent = upto
    return out


# ---- construction ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_tokenizer_without_think_tokens_is_refused(name, tokenizer):
    cls = ReasoningParserManager.get_reasoning_parser(name)
    with pytest.raises(ValueError, match="<think>"):
        cls(tokenizer)


def test_think_tokens_that_decoding_skips_are_refused(scripted_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(scripted_tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": [THINK_START, THINK_END]})
    with pytest.raises(ValueError, match="special token that decoding skips"):
        Qwen3ReasoningParser(tok)


def test_registry(reasoning_tokenizer):
    assert ReasoningParserManager.list_registered() == ["deepseek_r1", "qwen3"]
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="available: deepseek_r1, qwen3"):
        ReasoningParserManager.get_reasoning_parser("granite")
    p = Qwen3ReasoningParser(reasoning_tokenizer)
    assert (p.start_token_id, p.end_token_id) == tuple(ids_of(reasoning_tokenizer, THINK_START, THINK_END))


# ---- whole outputs and streams ----------------------------------------------------------

# (parser, how the prompt ends, output pieces, expected reasoning, expected content)
CASES = [
    ("qwen3", {}, [THINK_START, "Hmm", THINK_END, "\n\n", "OK"], "Hmm", "\n\nOK"),
    ("qwen3", {}, ["OK"], None, "OK"),  # a model that answers at once
    ("qwen3", {}, [THINK_START, "Hmm"], "Hmm", None),  # cut short while thinking
    ("qwen3", {}, [THINK_START, THINK_END, "OK"], None, "OK"),
    ("qwen3", {"enable_thinking": False}, ["OK"], None, "OK"),  # the template closed the reasoning
    ("qwen3", {"template": R1_STYLE_CHAT_TEMPLATE}, ["Hmm", THINK_END, "\n\n", "OK"], "Hmm", "\n\nOK"),
    ("qwen3", {}, [THINK_START, "Hmm", THINK_END, "\n\n", "<tool_call>", TOOL_CALL_JSON, "</tool_call>"], "Hmm",
     f"\n\n<tool_call>{TOOL_CALL_JSON}</tool_call>"),
    ("qwen3", {}, ["OK", THINK_START, "Hmm", THINK_END], None, "OK<think>Hmm</think>"),  # tags in content are text
    ("deepseek_r1", {"template": R1_STYLE_CHAT_TEMPLATE}, ["Hmm", THINK_END, "\n\n", "OK"], "Hmm", "\n\nOK"),
    ("deepseek_r1", {"template": R1_STYLE_CHAT_TEMPLATE}, [THINK_START, "Hmm", THINK_END, "OK"], "Hmm", "OK"),
    ("deepseek_r1", {"template": R1_STYLE_CHAT_TEMPLATE}, ["Hmm"], "Hmm", None),
    ("deepseek_r1", {}, ["Hmm", THINK_END, "OK"], "Hmm", "OK"),  # no prompt tag: reasoning first, as R1's
    ("deepseek_r1", {"enable_thinking": False}, ["OK"], None, "OK"),  # the prompt closed it
]


def _parser(tok, name, prompt_kw):
    kw = dict(prompt_kw)
    template = kw.pop("template", None)
    cls = ReasoningParserManager.get_reasoning_parser(name)
    return lambda: cls(tok, chat_template_kwargs=kw, prompt_token_ids=prompt_ids(tok, template, **kw))


@pytest.mark.parametrize("name,prompt_kw,pieces,reasoning,content", CASES)
def test_whole_output(reasoning_tokenizer, name, prompt_kw, pieces, reasoning, content):
    tok = reasoning_tokenizer
    make = _parser(tok, name, prompt_kw)
    ids = ids_of(tok, *pieces)
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "".join(pieces)
    assert make().extract_reasoning(text, ids) == (reasoning, content)
    assert make().extract_reasoning(text) == (reasoning, content)  # tags taken from the text


@pytest.mark.parametrize("name,prompt_kw,pieces,reasoning,content", CASES)
def test_stream_equals_whole_output_for_every_split(reasoning_tokenizer, name, prompt_kw, pieces, reasoning,
                                                    content):
    tok = reasoning_tokenizer
    make = _parser(tok, name, prompt_kw)
    ids = ids_of(tok, *pieces)
    want = (reasoning or "", content or "")
    n = len(ids)
    for mask in range(2 ** (n - 1)):  # every way to cut the ids into deltas, text with its ids
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        deltas = [(tok.decode(ids[a:b]), ids[a:b]) for a, b in zip(cuts, cuts[1:])]
        assert stream(make(), deltas) == want, deltas
    rng = random.Random(0)
    for _ in range(200):  # text that lags its ids, cut anywhere (inside a tag too)
        deltas = lagging_deltas(tok, ids, rng)
        assert stream(make(), deltas) == want, deltas


def test_tag_split_over_two_deltas(reasoning_tokenizer):
    tok = reasoning_tokenizer
    p = Qwen3ReasoningParser(tok)
    think, hmm, end, nl, ok = ids_of(tok, THINK_START, "Hmm", THINK_END, "\n\n", "OK")
    assert p.extract_reasoning_streaming("<thi", [think]) is None  # held: the start of the announced tag
    assert p.extract_reasoning_streaming("nk>Hm", [hmm]) == DeltaMessage("Hm", None)
    assert p.extract_reasoning_streaming("m</th", [end, nl]) == DeltaMessage("m", None)
    assert p.reasoning_ended  # by the ids, while the tag's text is still held
    assert p.extract_reasoning_streaming("ink>\n", []) == DeltaMessage(None, "\n")
    assert p.extract_reasoning_streaming("\nOK", [ok]) == DeltaMessage(None, "\nOK")
    assert p.finish_streaming() is None
    assert p.reasoning_ended and p.num_reasoning_tokens == 1


def test_tag_text_that_is_not_the_tag_token_is_reasoning(reasoning_tokenizer):
    # "</think>" typed out byte by byte is not the end of the reasoning: only the token is
    tok = reasoning_tokenizer
    ids = ids_of(tok, THINK_START, "Hmm") + byte_ids(tok, "</think>x") + ids_of(tok, THINK_END, "OK")
    text = tok.decode(ids)
    assert text == "<think>Hmm</think>x</think>OK"
    assert Qwen3ReasoningParser(tok).extract_reasoning(text, ids) == ("Hmm</think>x", "OK")
    deltas = [(tok.decode([t]), [t]) for t in ids]
    assert stream(Qwen3ReasoningParser(tok), deltas) == ("Hmm</think>x", "OK")


def test_earlier_turns_tags_do_not_decide_the_start(reasoning_tokenizer):
    # a conversation whose history holds a closed think block: the new turn still thinks
    tok = reasoning_tokenizer
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "user", "content": "c"}]
    prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert ids_of(tok, THINK_END)[0] in prompt
    p = Qwen3ReasoningParser(tok, prompt_token_ids=prompt)
    assert not p.prompt_is_reasoning_end()
    ids = ids_of(tok, THINK_START, "Hmm", THINK_END, "OK")
    assert p.extract_reasoning(tok.decode(ids), ids) == ("Hmm", "OK")
    r1 = DeepSeekR1ReasoningParser(tok, prompt_token_ids=prompt)
    assert not r1.prompt_is_reasoning_end()


# ---- structured-output helpers -----------------------------------------------------------


def test_reasoning_end_helpers(reasoning_tokenizer):
    tok = reasoning_tokenizer
    think, hmm, end, nl, ok = ids_of(tok, THINK_START, "Hmm", THINK_END, "\n\n", "OK")
    p = Qwen3ReasoningParser(tok, prompt_token_ids=prompt_ids(tok))
    assert not p.prompt_is_reasoning_end()
    assert not p.is_reasoning_end([think, hmm])
    assert p.is_reasoning_end([think, hmm, end])
    assert p.is_reasoning_end([think, hmm, end, think])  # a tag in the content is text
    assert p.is_reasoning_end([ok])  # a model that answers at once
    assert p.is_reasoning_end_streaming([think, hmm, end], [end]) and not p.is_reasoning_end_streaming([think], [think])
    assert not p.is_reasoning_end_streaming([think, hmm], [hmm])
    assert p.is_reasoning_end_streaming([ok], [ok])  # the first token decided: content
    assert not p.is_reasoning_end_streaming([think, ok], [ok])
    assert p.extract_content_ids([think, hmm, end, nl, ok]) == [nl, ok]
    assert p.extract_content_ids([ok, think]) == [ok, think]  # no reasoning: all content
    assert p.extract_content_ids([think, hmm]) == []
    assert p.count_reasoning_tokens([think, hmm, hmm, end, ok]) == 2
    off = Qwen3ReasoningParser(tok, chat_template_kwargs={"enable_thinking": False},
                               prompt_token_ids=prompt_ids(tok, enable_thinking=False))
    assert off.prompt_is_reasoning_end() and off.is_reasoning_end([ok])
    assert off.extract_content_ids([ok]) == [ok] and off.count_reasoning_tokens([ok]) == 0
    r1 = DeepSeekR1ReasoningParser(tok, prompt_token_ids=prompt_ids(tok, R1_STYLE_CHAT_TEMPLATE))
    assert not r1.prompt_is_reasoning_end() and not r1.is_reasoning_end([hmm]) and r1.is_reasoning_end([hmm, end])
    assert not r1.is_reasoning_end_streaming([ok], [ok])  # R1 starts in the reasoning: no first-token decision
    assert r1.extract_content_ids([hmm, end, ok]) == [ok] and r1.count_reasoning_tokens([hmm, end, ok]) == 1

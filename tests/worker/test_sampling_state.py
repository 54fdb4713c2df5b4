"""SamplingState's reuse of metadata: a step whose rows read no per-step state gets the
metadata built for the same rows before; a step with penalties, min_tokens, bad words, a
thinking budget or a seeded generator, or with other rows, gets metadata built for it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pyengine.sampling_params import SamplingParams
from pyengine.worker.sampler import SamplingMetadata
from pyengine.worker.sampling_state import SamplingState

V = 32


def _row(rid, sp, drafts=(), out=(5, 6)):
    prompt = [1, 2, 3]
    req = SimpleNamespace(request_id=rid, sampling_params=sp, prompt_token_ids=prompt,
                          all_token_ids=prompt + list(out), num_prompt_tokens=3, output_token_ids=list(out))
    req.num_tokens = len(req.all_token_ids)
    return SimpleNamespace(request=req, spec_token_ids=list(drafts))


def _same(a: SamplingMetadata, b: SamplingMetadata) -> bool:
    for f in ("all_greedy", "all_random", "no_top_p", "no_top_k", "no_min_p", "no_penalties", "max_top_k",
              "max_num_logprobs"):
        if getattr(a, f) != getattr(b, f):
            return False
    for f in ("temperature", "top_p", "top_k", "min_p", "allowed_rows", "allowed_idx"):
        x, y = getattr(a, f), getattr(b, f)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def test_static_rows_reuse_their_metadata():
    st = SamplingState(torch.device("cpu"), V)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    warm = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, logprobs=2, allowed_token_ids=[1, 4, 9])
    a, b = _row("a", greedy), _row("b", warm)
    m1 = st.metadata([a, b], [False, False])
    m2 = st.metadata([a, b], [True, False])  # placeholders matter only to per-step state
    assert m2 is m1
    fresh = SamplingState(torch.device("cpu"), V).metadata([a, b], [False, False])
    assert _same(m1, fresh)
    # other params (equal but not the same object), another order, another row count: built anew
    assert st.metadata([_row("a", SamplingParams(temperature=0, max_tokens=8)), b], [False, False]) is not m1
    assert st.metadata([b, a], [False, False]) is not m1
    v1 = st.metadata([_row("a", greedy, drafts=[7, 8]), b], [False, False], spec=True)
    assert v1.batch_size == 4 and v1 is not m1
    assert st.metadata([_row("a", greedy, drafts=[3, 3]), b], [False, False], spec=True) is v1  # drafts differ: same rows
    assert st.metadata([a, b], [False, False]) is m1  # still kept
    st.clear()
    assert st.metadata([a, b], [False, False]) is not m1


def test_rows_with_per_step_state_are_built_each_step():
    for sp in (SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5),
               SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2),
               SamplingParams(temperature=0, max_tokens=8, min_tokens=4),
               SamplingParams(temperature=0.8, max_tokens=8, seed=3),
               SamplingParams(temperature=0, max_tokens=8, thinking_token_budget=4, thinking_end_token_id=9)):
        for spec, drafts in ((False, ()), (True, (4, 4))):
            st = SamplingState(torch.device("cpu"), V)
            r = _row("a", sp, drafts=drafts)
            assert st.metadata([r], [False], spec=spec) is not st.metadata([r], [False], spec=spec)


def test_bad_words_follow_the_output():
    st = SamplingState(torch.device("cpu"), V)
    sp = SamplingParams(temperature=0, max_tokens=8)
    sp.bad_words_token_ids = [[6, 9]]  # (the processor fills this from bad_words)
    m1 = st.metadata([_row("a", sp, out=(5, 6))], [False])
    m2 = st.metadata([_row("a", sp, out=(5, 7))], [False])
    assert m1.bad_words_idx is not None and m1.bad_words_idx[:, 0].tolist() == [0, 9, -1]
    assert m2.bad_words_idx is None

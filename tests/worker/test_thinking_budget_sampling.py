"""The thinking token budget on the worker side (CPU): ``SamplingState`` works out, from a
request's output, whether its next token must be the reasoning's end token
(``ThinkingBudgetState``: the reasoning parsers' count), ``SamplingMetadata`` carries it,
and ``Sampler`` / ``RejectionSampler`` force it, also where the newest token is a
placeholder on the device (async scheduling) and on speculative rows."""
from __future__ import annotations

import itertools

import pytest
import torch

from pyengine.core.sched.output import ScheduledRequest
from pyengine.request import Request
from pyengine.sampling_params import SamplingParams
from pyengine.worker.rejection_sampler import RejectionSampler
from pyengine.worker.sampler import Sampler, SamplingMetadata
from pyengine.worker.sampling_state import SamplingState

V = 16
START, END, OTHER, FAV = 3, 4, 5, 7  # FAV: every row's favourite token


def budget(b, *, open_=True, temperature=0.0, **kw):
    return SamplingParams(temperature=temperature, thinking_token_budget=b, thinking_start_token_id=START,
                          thinking_end_token_id=END, thinking_open=open_, max_tokens=100, **kw)


_ids = itertools.count()


def scheduled(params, output=(), drafts=(), placeholder=False):
    r = Request(f"r{next(_ids)}", [1, 2], params, 100)
    r.all_token_ids += list(output)
    return ScheduledRequest(r, 1, r.num_tokens - 1, [0], True, placeholder, 0, list(drafts))


def sample(rows, last=None, state=None, favourite=FAV):
    """One step's tokens (and metadata) for these rows, whose logits favour ``favourite``
    and make the end token unlikely (-50) unless forced."""
    st = state or SamplingState(torch.device("cpu"), V)
    meta = st.metadata(rows, [s.placeholder_input for s in rows])
    meta.positions = torch.tensor([s.num_computed_tokens + s.num_new_tokens - 1 for s in rows])  # (seeded rows)
    if last is not None:
        meta.last_token_ids = torch.tensor(last)
    logits = torch.zeros(len(rows), V)
    logits[:, favourite] = 5.0
    logits[:, END] = -50.0
    return Sampler()(logits, meta).sampled_token_ids.tolist(), meta


def test_forced_exactly_when_the_reasoning_reaches_the_budget():
    rows = [scheduled(budget(2), [OTHER]),  # open: 1 reasoning token, under budget
            scheduled(budget(2), [OTHER, OTHER]),  # 2: the end is forced
            scheduled(budget(2), [START, OTHER, START, OTHER]),  # a repeated start tag is not counted: 2
            scheduled(budget(2), [OTHER, OTHER, END]),  # ended: free
            scheduled(budget(2, open_=False), [OTHER, OTHER, OTHER]),  # undecided, first token not <think>: content
            scheduled(budget(2, open_=False), [START, OTHER, OTHER]),  # opened by <think>, then 2
            scheduled(budget(0), []),  # budget 0, open: the first token is the end
            scheduled(budget(0, open_=False), []),  # budget 0, undecided: the first token is free
            scheduled(budget(0, open_=False), [START]),  # ... and after <think> the end comes at once
            scheduled(SamplingParams(temperature=0.0), [OTHER] * 5)]  # no budget
    out, meta = sample(rows)
    assert out == [FAV, END, END, FAV, FAV, END, END, FAV, END, FAV]
    assert not meta.thinking_need_last and meta.thinking_idx[0].tolist() == [1, 2, 5, 6, 8]


def test_random_rows_and_penalties_still_give_the_end_token():
    p = budget(1, temperature=1.0, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5, frequency_penalty=1.0,
               presence_penalty=1.0)
    for seed in range(5):
        torch.manual_seed(seed)
        out, _ = sample([scheduled(p, [OTHER]), scheduled(p, [OTHER, END, OTHER]), scheduled(p.clone(seed=seed), [OTHER])])
        assert out[0] == END and out[1] != END and out[2] == END


# (host state, newest token on the device) -> forced? Each case against the plain sync answer.
@pytest.mark.parametrize("params,known", [
    (budget(3), [OTHER, OTHER]),  # the placeholder makes 3 unless it is <think> or </think>
    (budget(3), [OTHER]),  # 2 at most: never forced
    (budget(2), [OTHER, OTHER]),  # already at the budget: the placeholder is the forced end
    (budget(2, open_=False), [START, OTHER]),
    (budget(0, open_=False), []),  # the placeholder is the first token: only <think> opens a reasoning
    (budget(1, open_=False), []),
    (budget(2), [OTHER, OTHER, END]),  # ended before
])
def test_a_placeholder_newest_token_is_resolved_on_the_device(params, known):
    for newest in (START, END, OTHER):
        ph, _ = sample([scheduled(params, known, placeholder=True)], last=[newest])
        sync, _ = sample([scheduled(params, known + [newest])])
        assert ph == sync, (known, newest)


def test_placeholder_rows_need_last_token_ids():
    _, meta = sample([scheduled(budget(3), [OTHER, OTHER], placeholder=True)], last=[OTHER])
    assert meta.thinking_need_last
    meta.last_token_ids = None
    with pytest.raises(ValueError, match="last_token_ids"):
        Sampler()(torch.zeros(1, V), meta)


def test_the_state_follows_the_output_across_steps_and_is_forgotten():
    st = SamplingState(torch.device("cpu"), V)
    row = scheduled(budget(3, open_=False))
    r = row.request
    for step in range(8):
        out, _ = sample([row], state=st, favourite=START if step == 0 else FAV)  # the model opens <think>
        r.all_token_ids.append(out[0])
    assert r.output_token_ids == [START, FAV, FAV, FAV, END, FAV, FAV, FAV]
    assert st.thinking_state(r).seen == 8 and st.thinking_state(r).count == 3
    st.forget([r.request_id])
    assert r.request_id not in st._thinking


def test_speculative_rows_see_the_drafts_before_them():
    """Row j's state includes the first j drafts: the end is forced at the row where the
    budget is reached, so the rejection sampler rejects a draft that overruns it."""
    p = budget(2)
    row = scheduled(p, [OTHER], drafts=[OTHER, FAV, FAV])
    st = SamplingState(torch.device("cpu"), V)
    meta = st.metadata([row], [False], spec=True)
    logits = torch.zeros(4, V)
    logits[:, FAV] = 5.0
    logits[0, OTHER] = 9.0  # row 0's argmax is the draft: accepted
    d = torch.tensor([OTHER, FAV, FAV, -1])
    out = RejectionSampler()(logits, meta, d)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [OTHER, END]
    # a random row: the forced end is what the rejection emits, whatever the draws
    pr = budget(2, temperature=1.0)
    meta = SamplingState(torch.device("cpu"), V).metadata([scheduled(pr, [OTHER, OTHER], [FAV])], [False],
                                                                 spec=True)
    d = torch.tensor([FAV, -1])
    for _ in range(20):
        out = RejectionSampler()(torch.randn(2, V), meta, d)
        assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 1) == [END]
    d = torch.tensor([END, -1])
    out = RejectionSampler()(torch.randn(2, V), meta, d)
    assert out.accepted.tolist()[0]  # a draft that is the end token is accepted


def test_metadata_without_a_budget_builds_nothing():
    _, meta = sample([scheduled(SamplingParams(temperature=0.0), [OTHER])])
    assert meta.thinking_idx is None and not meta.need_last_token_ids
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[]], [[]], [None], V, "cpu", thinking=[])


@pytest.mark.parametrize("kw,param", [
    (dict(thinking_token_budget=-1), "thinking_token_budget"),
    (dict(thinking_token_budget=True), "thinking_token_budget"),
    (dict(thinking_end_token_id=4), "thinking_end_token_id"),
    (dict(thinking_open=False), "thinking_open"),
    (dict(thinking_token_budget=3, thinking_end_token_id=4, thinking_open=False), "thinking_start_token_id"),
    (dict(thinking_token_budget=3, thinking_end_token_id=4, thinking_start_token_id=4), "thinking_end_token_id"),
    (dict(thinking_token_budget=3, thinking_end_token_id=-2), "thinking_end_token_id"),
])
def test_sampling_params_refuse_inconsistent_budgets(kw, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert e.value.parameter == param

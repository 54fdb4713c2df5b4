"""The rejection sampler (pyengine/worker/rejection_sampler.py): speculative sampling keeps
the target distribution (a statistical test on synthetic p and q, for one-hot and general
draft distributions); greedy verification accepts exactly the target's argmax run and
emits the bonus token; processing (top-k, penalties) applies to the target rows; a seeded
request draws the same tokens again; a row without drafts samples what Sampler samples."""
from __future__ import annotations

import pytest
import torch

from pyengine.sampling_params import SamplingParams
from pyengine.worker.rejection_sampler import RejectionSampler, draw_randomness, rejection_sample
from pyengine.worker.sampler import Sampler, SamplingMetadata

V = 6
N = 200_000


def _chi2_ok(tokens: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * tokens.numel()
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    # V - 1 = 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4
    assert chi2 < 25.0, (chi2, (counts / tokens.numel()).tolist(), p.tolist())


@pytest.mark.parametrize("one_hot", [False, True])
def test_output_distribution_is_the_target(one_hot):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)
    if one_hot:  # a deterministic proposer: always token 2, q is one-hot there
        draft = torch.full((N,), 2, dtype=torch.int64)
        qs = None
    else:
        draft = torch.multinomial(q, N, replacement=True, generator=g)
        qs = q.expand(N, V)
    u = torch.rand(N, generator=g)
    e = torch.empty(N, V).exponential_(generator=g)
    accepted, tok = rejection_sample(p.expand(N, V), draft, u, e, qs)
    _chi2_ok(tok, p)
    # acceptance rate: sum_x min(p(x), q(x)) (one-hot: p(2))
    rate = float(p[2]) if one_hot else float(torch.minimum(p, q).sum())
    assert float(accepted.double().mean()) == pytest.approx(rate, abs=0.005)


def test_rows_without_draft_sample_the_target():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g), dim=0)
    e = torch.empty(N, V).exponential_(generator=g)
    accepted, tok = rejection_sample(p.expand(N, V), torch.full((N,), -1), torch.rand(N, generator=g), e)
    assert not accepted.any()
    _chi2_ok(tok, p)


def _meta(params, outs=None, gens=None):
    n = len(params)
    return SamplingMetadata.build(params, [[]] * n, outs or [[]] * n, gens or [None] * n, V, "cpu")


def test_greedy_accepts_the_argmax_run_then_the_target_token():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [5, 0, 0, 0, 0, 0.]])
    sp = SamplingParams(temperature=0)
    rs = RejectionSampler()
    # drafts 1, 2 accepted, 4 rejected (argmax 3): emits 1, 2, 3
    d = torch.tensor([1, 2, 4, -1])
    out = rs(logits, _meta([sp] * 4), d, d >= 0)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1, 2, 3]
    # all accepted: the bonus token (argmax of the last row) follows
    d = torch.tensor([1, 2, 3, -1])
    out = rs(logits, _meta([sp] * 4), d, d >= 0)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1, 2, 3, 0]
    # first rejected: only the target's token
    d = torch.tensor([0, 2, 3, -1])
    out = rs(logits, _meta([sp] * 4), d, d >= 0)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1]


def test_greedy_rows_verify_without_their_draft_ids():
    """All-greedy rows need no draft ids on the device: the candidates are the argmaxes,
    the caller compares them with its drafts; other rows must have them."""
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [5, 0, 0, 0, 0, 0.]])
    sp = SamplingParams(temperature=0, presence_penalty=2.0)  # (penalties apply to the rows)
    meta = _meta([sp] * 4, outs=[[], [1], [1, 2], [1, 2, 4]])
    drafts = [1, 2, 4, -1]
    d = torch.tensor(drafts)
    with_ids, without = RejectionSampler()(logits, meta, d, d >= 0), RejectionSampler()(logits, meta, None)
    assert without.accepted is None and torch.equal(without.candidate, with_ids.candidate)
    cand = without.candidate.tolist()
    acc = [c == x for c, x in zip(cand, drafts)]
    assert acc == with_ids.accepted.tolist()
    assert RejectionSampler.emitted(cand, acc, 0, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="draft_ids"):
        RejectionSampler()(logits, _meta([SamplingParams(temperature=1.0)] * 4), None)


def test_penalties_and_top_k_apply_to_the_target_rows():
    # token 1 leads every row, but row j's context holds the drafts before it: with a huge
    # presence penalty a draft of 1 at row 1 is rejected (1 was already drafted at row 0)
    logits = torch.tensor([[0, 5, 4, 0, 0, 0]] * 3)
    sp = SamplingParams(temperature=0, presence_penalty=2.0)
    d = torch.tensor([1, 1, -1])
    meta = _meta([sp] * 3, outs=[[], [1], [1, 1]])
    out = RejectionSampler()(logits, meta, d, d >= 0)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 2) == [1, 2]
    # top_k=1 random sampling verifies like greedy: a draft off the argmax is never accepted
    sp = SamplingParams(temperature=1.0, top_k=1)
    d = torch.tensor([2, -1])
    for _ in range(20):
        out = RejectionSampler()(logits[:2], _meta([sp] * 2), d, d >= 0)
        assert out.candidate.tolist()[0] == 1 and not out.accepted[0]


def test_seeded_rows_reproduce_and_match_sampler_without_drafts():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    sp = SamplingParams(temperature=1.0, seed=11)
    d = torch.tensor([3, 4, -1])

    def run():
        gen = torch.Generator().manual_seed(11)
        return RejectionSampler()(logits, _meta([sp] * 3, gens=[gen] * 3), d, d >= 0).candidate.tolist()

    assert run() == run()
    # a request without drafts: the same draw and token as the plain sampler
    for seed in range(5):
        a = Sampler()(logits[:1], _meta([sp], gens=[torch.Generator().manual_seed(seed)])).sampled_token_ids
        none = torch.tensor([-1])
        b = RejectionSampler()(logits[:1], _meta([sp], gens=[torch.Generator().manual_seed(seed)]), none, none >= 0)
        assert a.tolist() == b.candidate.tolist()


def test_draw_randomness_order():
    """A seeded draft row draws its uniform before its exponentials; others only the latter."""
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    u, e = draw_randomness(2, V, torch.tensor([True, False]), {0: g1, 1: g2}, "cpu")
    ref = torch.Generator().manual_seed(3)
    assert float(u[0]) == float(torch.rand(1, generator=ref))
    assert torch.equal(e[0], torch.empty(V).exponential_(generator=ref).clamp_(min=torch.finfo(torch.float32).tiny))
    ref = torch.Generator().manual_seed(3)
    assert torch.equal(e[1], torch.empty(V).exponential_(generator=ref).clamp_(min=torch.finfo(torch.float32).tiny))

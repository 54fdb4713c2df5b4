"""The rejection sampler (pyengine/worker/rejection_sampler.py): speculative sampling keeps
the target distribution (a statistical test on synthetic p and q, for one-hot and general
draft distributions); greedy verification accepts exactly the target's argmax run and
emits the bonus token; processing (top-k, penalties) applies to the target rows; a seeded
request draws the same tokens again; a row samples what Sampler samples from the same
draws, with or without a one-hot draft."""
from __future__ import annotations

import pytest
import torch

from pyengine.sampling_params import SamplingParams
from pyengine.worker.rejection_sampler import RejectionSampler, rejection_sample
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
    accepted, tok = rejection_sample(p.expand(N, V), draft, e, qs, u if qs is not None else None)
    _chi2_ok(tok, p)
    # acceptance rate: sum_x min(p(x), q(x)) (one-hot: p(2))
    rate = float(p[2]) if one_hot else float(torch.minimum(p, q).sum())
    assert float(accepted.double().mean()) == pytest.approx(rate, abs=0.005)


def test_rows_without_draft_sample_the_target():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g), dim=0)
    e = torch.empty(N, V).exponential_(generator=g)
    accepted, tok = rejection_sample(p.expand(N, V), torch.full((N,), -1), e)
    assert not accepted.any()
    _chi2_ok(tok, p)


def test_one_hot_draft_is_coupled_to_the_rows_own_sample():
    """With a one-hot draft the row emits the token it samples without one from the same
    exponentials (accepted iff that token is the draft), so speculation changes no token."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(V, generator=g), dim=0).expand(2000, V)
    e = torch.empty(2000, V).exponential_(generator=g)
    draft = torch.randint(0, V, (2000,), generator=g)
    acc, tok = rejection_sample(p, draft, e)
    plain_acc, plain = rejection_sample(p, torch.full((2000,), -1), e)
    assert torch.equal(tok, plain) and not plain_acc.any()
    assert torch.equal(acc, tok == draft) and 0 < int(acc.sum()) < 2000
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(p, draft, e, p)


def _meta(params, outs=None, positions=None):
    """Seeded rows (``params[i].seed``) draw at ``positions`` (default 0, 1, ...)."""
    n = len(params)
    meta = SamplingMetadata.build(params, [[]] * n, outs or [[]] * n, [p.seed for p in params], V, "cpu")
    meta.positions = torch.tensor(positions if positions is not None else list(range(n)), dtype=torch.int64)
    return meta


def test_greedy_accepts_the_argmax_run_then_the_target_token():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [5, 0, 0, 0, 0, 0.]])
    sp = SamplingParams(temperature=0)
    rs = RejectionSampler()
    # drafts 1, 2 accepted, 4 rejected (argmax 3): emits 1, 2, 3
    d = torch.tensor([1, 2, 4, -1])
    out = rs(logits, _meta([sp] * 4), d)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1, 2, 3]
    # all accepted: the bonus token (argmax of the last row) follows
    d = torch.tensor([1, 2, 3, -1])
    out = rs(logits, _meta([sp] * 4), d)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1, 2, 3, 0]
    # first rejected: only the target's token
    d = torch.tensor([0, 2, 3, -1])
    out = rs(logits, _meta([sp] * 4), d)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 3) == [1]


def test_greedy_rows_verify_without_their_draft_ids():
    """All-greedy rows need no draft ids on the device: the candidates are the argmaxes,
    the caller compares them with its drafts; other rows must have them."""
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [5, 0, 0, 0, 0, 0.]])
    sp = SamplingParams(temperature=0, presence_penalty=2.0)  # (penalties apply to the rows)
    meta = _meta([sp] * 4, outs=[[], [1], [1, 2], [1, 2, 4]])
    drafts = [1, 2, 4, -1]
    d = torch.tensor(drafts)
    with_ids, without = RejectionSampler()(logits, meta, d), RejectionSampler()(logits, meta, None)
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
    out = RejectionSampler()(logits, meta, d)
    assert RejectionSampler.emitted(out.candidate.tolist(), out.accepted.tolist(), 0, 2) == [1, 2]
    # top_k=1 random sampling verifies like greedy: a draft off the argmax is never accepted
    sp = SamplingParams(temperature=1.0, top_k=1)
    d = torch.tensor([2, -1])
    for _ in range(20):
        out = RejectionSampler()(logits[:2], _meta([sp] * 2), d)
        assert out.candidate.tolist()[0] == 1 and not out.accepted[0]


def test_seeded_rows_reproduce_and_match_sampler_with_and_without_drafts():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    sp = SamplingParams(temperature=1.0, seed=11)
    d = torch.tensor([3, 4, -1])

    def run():
        return RejectionSampler()(logits, _meta([sp] * 3, positions=[20, 21, 22]), d).candidate.tolist()

    assert run() == run()
    # each row's token: what the plain sampler draws at that row's position, draft or not
    for seed in range(5):
        for pos in (0, 7, 21):
            spx = sp.clone(seed=seed)
            a = Sampler()(logits[:1], _meta([spx], positions=[pos])).sampled_token_ids
            for draft in (-1, 0, 3):
                dt = torch.tensor([draft])
                b = RejectionSampler()(logits[:1], _meta([spx], positions=[pos]), dt)
                assert a.tolist() == b.candidate.tolist()
                assert bool(b.accepted[0]) == (draft == int(a[0]))

"""The n-gram proposer's lookup against a brute-force statement of its rule, and its
per-request contexts (grown step by step, forgotten, replaced under a reused id) against a
lookup over the whole context."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from pyengine.config import SpeculativeConfig
from pyengine.spec_decode.ngram_proposer import NgramProposer, ngram_draft


def brute_force(ctx: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The rule: the largest n in [n_min, n_max] whose last-n-gram occurs earlier (followed
    by a token), the tokens after its latest such occurrence."""
    L = len(ctx)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if ctx[i:i + n] == ctx[L - n:]:
                return ctx[i + n:i + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_matches_brute_force(vocab):
    rng = random.Random(vocab)
    hits = 0
    for _ in range(400):
        L = rng.randint(1, 60)
        ctx = [rng.randrange(vocab) for _ in range(L)]
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        k = rng.randint(1, 8)
        want = brute_force(ctx, k, n_min, n_max)
        hits += bool(want)
        assert ngram_draft(ctx, k, n_min, n_max) == want, (ctx, k, n_min, n_max)
        assert ngram_draft(np.array(ctx, dtype=np.int64), k, n_min, n_max) == want
    assert hits > 20  # the cases exercise matches, not only misses


def test_longest_ngram_wins_over_a_later_shorter_one():
    # "1 2 3" occurs at 0 (followed by 7); "2 3" alone later at 5 (followed by 9)
    ctx = [1, 2, 3, 7, 0, 2, 3, 9, 1, 2, 3]
    assert ngram_draft(ctx, 2, 2, 3) == [7, 0]
    assert ngram_draft(ctx, 2, 2, 2) == [9, 1]  # n = 2 only: the latest "2 3"
    assert ngram_draft(ctx, 2, 4, 5) == []  # no earlier 4-gram


def _spec(n_min, n_max, k):
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n_min,
                                        "prompt_lookup_max": n_max}, None)


class _Req:
    def __init__(self, rid, prompt, max_tokens=10_000):
        self.request_id, self.all_token_ids, self.num_prompt_tokens = rid, list(prompt), len(prompt)
        self.max_tokens, self.structured_output_request = max_tokens, None

    @property
    def num_tokens(self):
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.all_token_ids) - self.num_prompt_tokens


def test_incremental_contexts_match_a_full_lookup():
    rng = random.Random(0)
    k = 4
    prop = NgramProposer(_spec(1, 3, k), max_model_len=100_000)
    so = SimpleNamespace(speculative=True)
    reqs = [_Req(f"r{i}", [rng.randrange(6) for _ in range(rng.randint(2, 40))]) for i in range(3)]
    for step in range(60):
        live = [r for r in reqs if r is not None]
        gen = [[rng.randrange(6) for _ in range(rng.randint(1, k + 1))] for _ in live]
        sampled = [SimpleNamespace(request=r) for r in live]
        drafts = prop.propose(so, sampled, gen, None)
        for r, g, d in zip(live, gen, drafts):
            assert d == brute_force(r.all_token_ids + g, k, 1, 3)
            r.all_token_ids.extend(g)  # the scheduler appends the step's tokens after the proposer ran
        if step == 20:  # r0 finishes; a new request takes its id
            prop.forget(["r0"])
            reqs[0] = _Req("r0", [5, 5, 1])
        if step == 40:  # a new request under r1's id without forget (the runner forgets a step later)
            reqs[1] = _Req("r1", [rng.randrange(6) for _ in range(7)])


def test_no_drafts_when_the_request_has_no_room():
    prop = NgramProposer(_spec(1, 2, 4), max_model_len=100_000)
    r = _Req("a", [1, 2, 1, 2], max_tokens=1)
    drafts = prop.propose(SimpleNamespace(speculative=True), [SimpleNamespace(request=r)], [[1]], None)
    assert drafts == [[]]

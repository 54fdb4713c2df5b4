"""Tests for pyengine/worker/sampler.py (CPU)."""
import math

import pytest
import torch

from pyengine.sampling_params import SamplingParams
from pyengine.worker.sampler import Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p

V = 32


def build(params, prompts=None, outputs=None, vocab=V, positions=None):
    """The rows' metadata; a seeded row (``params[i].seed``) draws at ``positions[i]``
    (default: position 0 for every row)."""
    B = len(params)
    meta = SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(B)],
        outputs if outputs is not None else [[] for _ in range(B)],
        [p.seed for p in params],
        vocab, "cpu")
    meta.positions = torch.tensor(positions if positions is not None else [0] * B, dtype=torch.int64)
    return meta


def logits_from_probs(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def draw_counts(logits_row, params, n=20000, seed=0):
    """Sample ``n`` times from one distribution by batching ``n`` identical rows."""
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    meta = build([params] * n, vocab=logits.shape[1])
    out = Sampler()(logits, meta).sampled_token_ids
    return torch.bincount(out, minlength=logits.shape[1]).float() / n


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    meta = build([SamplingParams(temperature=0.0)] * 8)
    assert meta.all_greedy and not meta.all_random
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprobs_token_ids is None


def test_input_logits_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_p=0.5, top_k=5, min_p=0.1,
                            repetition_penalty=1.5, presence_penalty=0.5, logprobs=2)
    Sampler()(logits, build([params] * 4, prompts=[[1, 2]] * 4, outputs=[[3]] * 4))
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy_and_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_k=1, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1),
              SamplingParams(temperature=0.5, top_k=1, min_p=0.2)]
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(20):
        out = Sampler()(logits, meta).sampled_token_ids
        assert torch.equal(out, logits.argmax(-1))


def test_top_p_keeps_exact_nucleus_mass():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    row = logits_from_probs(probs)
    # Smallest set with mass >= 0.65 is {0, 1}: renormalised 4/7, 3/7.
    freq = draw_counts(row, SamplingParams(temperature=1.0, top_p=0.65), n=40000)
    assert freq[2:].sum().item() == 0.0, "tokens outside the nucleus were drawn"
    assert abs(freq[0].item() - 4 / 7) < 0.015
    assert abs(freq[1].item() - 3 / 7) < 0.015
    # p = 0.8 -> {0, 1, 2} (mass 0.85); 0.8 > 0.7 so token 2 is needed.
    freq = draw_counts(row, SamplingParams(temperature=1.0, top_p=0.8), n=40000, seed=1)
    assert freq[3:].sum().item() == 0.0
    for t, p in enumerate(probs[:3]):
        assert abs(freq[t].item() - p / 0.85) < 0.015
    # Tiny p keeps only the top token.
    freq = draw_counts(row, SamplingParams(temperature=1.0, top_p=0.01), n=2000)
    assert freq[0].item() == 1.0


def test_top_p_mask_exact():
    logits = logits_from_probs([0.05, 0.4, 0.1, 0.3, 0.15]).unsqueeze(0).repeat(2, 1)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.65, 0.9]), 0)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    assert torch.isfinite(out[1]).tolist() == [False, True, True, True, True]
    # Kept logits are unchanged.
    assert torch.equal(out[0][torch.isfinite(out[0])], logits[0, [1, 3]])


def test_top_k_mask_and_with_top_p():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0]] * 3)
    k = torch.tensor([2, 6, 3])
    out = apply_top_k_top_p(logits, k, None, 3)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False, False]
    assert torch.isfinite(out[1]).all()  # k == V: disabled
    assert torch.isfinite(out[2]).tolist() == [False, True, False, True, True, False]
    out = apply_top_k_top_p(logits, k, torch.tensor([1.0, 1.0, 0.01]), 3)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False, False]
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).tolist() == [False, True, False, False, False, False]


def test_top_k_ties_kept_alike_with_and_without_top_p():
    # a probe found a seeded top_k row changing when another row used top_p: the threshold
    # path kept every token tied with the k-th value, the sorted path exactly k
    logits = torch.tensor([[3.0, 1.0, 1.0, 2.0, 1.0, 0.0]] * 2)
    k = torch.tensor([3, 3])
    alone = apply_top_k_top_p(logits, k, None, 3)
    beside_top_p = apply_top_k_top_p(logits, k, torch.tensor([1.0, 0.5]), 3)
    assert torch.isfinite(alone[0]).tolist() == [True, True, True, True, True, False]
    assert torch.equal(beside_top_p[0], alone[0])


def test_top_p_one_drops_nothing():
    # a long flat tail: float32's running sum reaches 1.0 before the last tokens
    logits = torch.cat([torch.tensor([30.0]), torch.zeros(200_000)]).unsqueeze(0)
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0]), 0)
    assert torch.isfinite(out).all()
    out = apply_top_k_top_p(logits, torch.tensor([200_001]), torch.tensor([1.0]), 0)
    assert torch.isfinite(out).all()


def test_top_k_sampling_frequencies():
    probs = [0.1, 0.2, 0.3, 0.4]
    freq = draw_counts(logits_from_probs(probs), SamplingParams(top_k=2), n=40000)
    assert freq[:2].sum().item() == 0.0
    assert abs(freq[2].item() - 3 / 7) < 0.015
    assert abs(freq[3].item() - 4 / 7) < 0.015


def test_unfiltered_sampling_matches_distribution():
    probs = [0.5, 0.25, 0.125, 0.0625, 0.0625]
    freq = draw_counts(logits_from_probs(probs), SamplingParams(), n=40000)
    for t, p in enumerate(probs):
        assert abs(freq[t].item() - p) < 0.012


def test_min_p_filters():
    probs = [0.5, 0.3, 0.12, 0.08]
    # min_p=0.2 -> threshold 0.1: token 3 (0.08) removed, token 2 (0.12) kept.
    freq = draw_counts(logits_from_probs(probs), SamplingParams(min_p=0.2), n=40000)
    assert freq[3].item() == 0.0
    for t, p in enumerate(probs[:3]):
        assert abs(freq[t].item() - p / 0.92) < 0.015
    freq = draw_counts(logits_from_probs(probs), SamplingParams(min_p=0.7), n=4000)
    assert freq[0].item() == 1.0


def test_temperature_sharpens_and_flattens():
    probs = [0.4, 0.3, 0.2, 0.1]
    row = logits_from_probs(probs)
    cold = draw_counts(row, SamplingParams(temperature=0.5), n=40000)
    hot = draw_counts(row, SamplingParams(temperature=2.0), n=40000, seed=3)
    for freq, temp in ((cold, 0.5), (hot, 2.0)):
        expected = torch.softmax(row / temp, -1)
        assert torch.allclose(freq, expected, atol=0.015), (temp, freq, expected)
    assert cold[0] > 0.4 + 0.1 and hot[0] < 0.4 - 0.05


def _seeded_run(seed, logits_row, position, batch_size, other_seed, steps=8):
    """Run ``steps`` sampling steps with the seeded row at ``position`` among others."""
    others = torch.Generator().manual_seed(other_seed)
    tokens = []
    for step in range(steps):
        logits = torch.randn(batch_size, V, generator=others)
        logits[position] = logits_row
        params = [SamplingParams(temperature=1.0) for _ in range(batch_size)]
        # Other rows: mixed greedy / random / another seeded request.
        if batch_size > 1:
            params[(position + 1) % batch_size] = SamplingParams(temperature=0.0)
        if batch_size > 2:
            j = (position + 2) % batch_size
            params[j] = SamplingParams(temperature=0.8, top_p=0.9, seed=other_seed)
        params[position] = SamplingParams(temperature=1.0, seed=seed)
        torch.manual_seed(other_seed)  # perturb the default generator too
        # the seeded row's position is its step's; the others' anything
        positions = torch.randint(0, 1000, (batch_size,), generator=others).tolist()
        positions[position] = 40 + step
        out = Sampler()(logits, build(params, positions=positions)).sampled_token_ids
        tokens.append(int(out[position]))
    return tokens


def test_seeded_row_reproducible_across_batches():
    row = torch.zeros(V)  # uniform: maximally sensitive to the random draw
    ref = _seeded_run(1234, row, 0, 1, 7)
    assert len(set(ref)) > 1
    assert _seeded_run(1234, row, 3, 5, 99) == ref
    assert _seeded_run(1234, row, 1, 2, 5) == ref
    assert _seeded_run(1234, row, 6, 7, 11) == ref
    assert _seeded_run(4321, row, 0, 1, 7) != ref


def test_unseeded_rows_use_default_generator():
    logits = torch.zeros(4, V)
    meta = build([SamplingParams()] * 4)
    torch.manual_seed(5)
    a = Sampler()(logits, meta).sampled_token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(a, b)


def test_greedy_row_with_seed_draws_nothing():
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams()]
    meta = build(params)
    assert meta.seeds == {}
    meta.positions = None  # not needed: no seeded random row
    out = Sampler()(logits, meta).sampled_token_ids
    assert out[0] == logits[0].argmax()


def test_seeded_draw_depends_on_seed_and_position_only():
    """A seeded row's token is a function of (seed, position, its probabilities): the same
    at the same position whatever was drawn before; other positions and seeds differ."""
    row = torch.zeros(V)  # uniform
    sp = SamplingParams(temperature=1.0, seed=77)

    def tok(position, seed=77):
        return int(Sampler()(row.unsqueeze(0), build([sp.clone(seed=seed)], positions=[position])).sampled_token_ids)

    first = [tok(p) for p in range(64)]
    assert [tok(p) for p in reversed(range(64))] == first[::-1]  # order of the draws: irrelevant
    assert len(set(first)) > V // 2  # positions draw different tokens ...
    assert [tok(p, seed=78) for p in range(64)] != first  # ... and so do seeds
    # frequencies over positions follow the row's distribution (here: two tokens, 3:1)
    skewed = torch.full((V,), float("-inf"))
    skewed[3], skewed[9] = math.log(0.75), math.log(0.25)
    toks = Sampler()(skewed.expand(4000, V), build([sp] * 4000, positions=list(range(4000)))).sampled_token_ids
    assert set(toks.tolist()) == {3, 9}
    assert abs(float((toks == 3).double().mean()) - 0.75) < 0.03


def test_seeded_rows_need_positions():
    meta = build([SamplingParams(temperature=1.0, seed=1)])
    meta.positions = None
    with pytest.raises(ValueError, match="positions"):
        Sampler()(torch.zeros(1, V), meta)


def test_penalties_hand_computed():
    logits = torch.tensor([[4.0, -1.0, 0.5, -0.5, 3.0, 1.0],
                           [5.0, 1.0, -2.0, 4.0, 0.0, -3.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(repetition_penalty=1.0, frequency_penalty=-1.0)]
    prompts = [[0, 1, 1], [5]]
    outputs = [[2, 3, 3, 3], [3, 3, 2]]
    meta = build(params, prompts, outputs, vocab=6)
    assert not meta.no_penalties
    assert meta.output_token_counts.tolist() == [[0, 0, 1, 3, 0, 0], [0, 0, 1, 2, 0, 0]]
    assert meta.prompt_token_mask.tolist() == [[True, True, False, False, False, False],
                                               [False, False, False, False, False, True]]
    expected = torch.tensor([
        # row 0: rep 2 on tokens {0,1,2,3}; freq 0.5*count; presence 0.25 on {2,3}
        [4.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 1 - 0.25, -0.5 * 2 - 0.5 * 3 - 0.25, 3.0, 1.0],
        # row 1: frequency -1 => +count on {2: 1, 3: 2}; prompt-only token 5 untouched
        [5.0, 1.0, -2.0 + 1, 4.0 + 2, 0.0, -3.0],
    ])
    assert torch.allclose(apply_penalties(logits, meta), expected)
    # And the sampler uses them: greedy after penalties.
    greedy = [p.clone(temperature=0.0) for p in params]
    meta = build(greedy, prompts, outputs, vocab=6)
    out = Sampler()(logits, meta).sampled_token_ids
    assert out.tolist() == expected.argmax(-1).tolist()
    assert out.tolist() != logits.argmax(-1).tolist()


def test_extreme_values_stay_finite():
    # a repetition penalty at float32's smallest normal overflows the seen positive logits,
    # the largest temperature leaves masked (-inf) logits -inf: neither may NaN the row
    logits = torch.tensor([[5.0, 4.0, -1.0, float("-inf")]] * 2)
    params = [SamplingParams(repetition_penalty=1.2e-38, seed=1),
              SamplingParams(temperature=3.4e38, seed=2)]
    meta = build(params, prompts=[[0, 1], [0]], vocab=4)
    assert torch.isfinite(apply_penalties(logits, meta)[0]).tolist() == [True, True, True, False]
    for _ in range(20):
        meta = build(params, prompts=[[0, 1], [0]], vocab=4, positions=[_, _])
        out = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert out[0] in (0, 1) and out[1] in (0, 1, 2)  # never the masked token 3


def test_no_penalty_metadata_is_light():
    meta = build([SamplingParams(), SamplingParams(temperature=0)], prompts=[[1], [2]],
                 outputs=[[3], [4]])
    assert meta.no_penalties and meta.prompt_token_mask is None
    assert meta.output_token_counts is None and meta.top_p is None and meta.top_k is None
    assert meta.min_p is None and meta.max_num_logprobs is None


def test_logprobs_and_ranks():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.0, logprobs=1, repetition_penalty=1.3),
              SamplingParams(temperature=0.5)]
    meta = build(params, prompts=[[0], [1], [2]], outputs=[[4], [5], [6]])
    assert meta.max_num_logprobs == 3
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, -1)  # raw model logprobs (pre-penalty)
    sampled = out.sampled_token_ids
    assert out.logprobs_token_ids.shape == (3, 4) and out.logprobs.shape == (3, 4)
    assert out.logprobs_token_ids.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    assert out.sampled_token_ranks.dtype == torch.int64
    assert torch.equal(out.logprobs_token_ids[:, 0], sampled)
    top = torch.topk(raw, 3, -1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    order = raw.argsort(-1, descending=True)
    for b in range(3):
        rank = (order[b] == sampled[b]).nonzero().item() + 1
        assert out.sampled_token_ranks[b].item() == rank
    assert out.sampled_token_ranks[0].item() == 1  # greedy row


def test_logprobs_zero_gives_only_sampled():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=0)], vocab=3))
    assert out.logprobs_token_ids.tolist() == [[2]]
    assert out.sampled_token_ranks.tolist() == [1]
    assert math.isclose(out.logprobs[0, 0].item(),
                        torch.log_softmax(logits, -1)[0, 2].item(), rel_tol=1e-6)


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]] * 2)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    meta = build([p, p], outputs=[[1], [1, 1]], vocab=4)
    out = Sampler()(logits, meta).sampled_token_ids
    assert out.tolist() == [3, 2]  # row 0 still below min_tokens


def test_allowed_token_ids_restrict_only_their_rows():
    torch.manual_seed(3)
    logits = torch.randn(3, V)
    restricted = SamplingParams(temperature=0.0, allowed_token_ids=[4, 9, 17])
    meta = build([restricted, SamplingParams(temperature=0.0), restricted])
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    for row in (0, 2):
        assert out[row] == max((4, 9, 17), key=lambda t: logits[row, t].item())
    assert out[1] == logits[1].argmax().item()
    # random rows never leave the allowed set, and reach every member of it
    seen = draw_counts(torch.zeros(V), SamplingParams(temperature=1.0, allowed_token_ids=[2, 30]), n=4000)
    assert set(torch.nonzero(seen).flatten().tolist()) == {2, 30}


def _bad(params_words):
    """SamplingParams with engine-tokenized bad words (as Processor.process fills them)."""
    return SamplingParams(temperature=0.0).clone(bad_words_token_ids=params_words)


def test_bad_words_one_token_always_banned_multi_token_after_its_prefix():
    logits = torch.zeros(4, V)
    logits[:, 7] = 5.0  # the favourite everywhere
    logits[:, 8] = 4.0
    logits[:, 9] = 3.0
    p = _bad([[7], [3, 4, 8], [5, 9]])
    # row 0: no history; row 1: ends with 3, 4 -> 8 banned too; row 2: 3, 4 earlier, not
    # at the end; row 3: ends with 5 -> 9 banned (8 still allowed)
    meta = build([p] * 4, outputs=[[], [1, 3, 4], [3, 4, 1], [5]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [8, 9, 8, 8]
    # vLLM: a sequence longer than the history + 1 is not matched
    meta = build([_bad([[1, 2, 8]])], outputs=[[2]])
    assert Sampler()(logits[:1].clone().index_fill_(1, torch.tensor([7]), 0.0), meta).sampled_token_ids.tolist() == [8]


def test_bad_words_with_a_device_only_newest_token():
    """Async scheduling: the row's newest token (-1 in the host's history) is compared on
    the device (last_token_ids); the rest of the sequence is matched on the host."""
    logits = torch.zeros(3, V)
    logits[:, 8] = 5.0
    p = _bad([[3, 4, 8], [6, 8]])
    meta = build([p] * 3, outputs=[[3, -1], [3, -1], [0, -1]])
    assert meta.bad_words_need_last
    meta.last_token_ids = torch.tensor([4, 5, 6])  # row 0 completes 3 4; row 2 completes 6
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, 8, 0]
    with pytest.raises(ValueError, match="last_token_ids"):
        meta.last_token_ids = None
        Sampler()(logits, meta)


def test_no_bad_words_or_allowed_ids_build_nothing():
    meta = build([SamplingParams(temperature=0.0)] * 2, outputs=[[1], [2]])
    assert meta.bad_words_idx is None and meta.allowed_rows is None and not meta.bad_words_need_last


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[]], [], [None], V, "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), build([SamplingParams()]))


@pytest.mark.gpu
def test_cuda_sampler_has_no_host_sync():
    dev = torch.device("cuda")
    B, Vg = 6, 1000
    logits = torch.randn(B, Vg, device=dev)
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1),
              SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2),
              SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.3),
              SamplingParams(temperature=1.1, frequency_penalty=0.2, min_tokens=3,
                             stop_token_ids=[5]),
              SamplingParams(temperature=0.5, seed=2, allowed_token_ids=[3, 7, 900]).clone(
                  bad_words_token_ids=[[7], [4, 9], [2, 3]])]
    # thinking budget: row 4 forced by the host, row 5 depending on its device-only newest token
    thinking = [None] * 4 + [(9, 0, -1, 1, 1), (900, 1, 3, 1, 0)]
    meta = SamplingMetadata.build(params, [[1, 2, 3]] * B, [[4, 4]] * (B - 1) + [[4, 2, -1]],
                                  [p.seed for p in params], Vg, dev, thinking)
    meta.positions = torch.arange(B, device=dev) + 30
    assert meta.bad_words_need_last and meta.allowed_rows is not None and meta.thinking_need_last
    meta.last_token_ids = torch.full((B,), 3, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (B,)
    assert out.sampled_token_ids[0].item() == logits[0].argmax().item()
    assert out.sampled_token_ids[4].item() == 9 and out.sampled_token_ids[5].item() == 900  # newest: 3, the start tag

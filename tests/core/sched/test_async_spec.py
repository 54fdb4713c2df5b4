"""AsyncScheduler with speculative decoding (no model): a decode row of a speculative step
is scheduled with k draft placeholders before the step in flight is verified,
``num_computed_tokens`` and the output placeholders advance as if every draft were
accepted, and the output of each step takes back what it rejected; the drafts' cut counts
every placeholder in flight against max_tokens; the counters count only the drafts the
runner fed; disable_by_batch_size steps carry no placeholders; no KV block leak."""
from types import SimpleNamespace

from pyengine.config import SpeculativeConfig
from pyengine.core.sched.async_scheduler import AsyncScheduler
from tests.core.sched.test_scheduler import assert_no_leak, make_req, make_sched

K = 3


def _sched(method="draft_model", disable=None, **kw):
    spec = SpeculativeConfig(method, K, model="x" if method != "ngram" else None, disable_by_batch_size=disable)
    return make_sched(cls=AsyncScheduler, speculative_config=spec, **kw)


def _out(gen, fed=None):
    return SimpleNamespace(sampled_token_ids=[g[0] for g in gen], logprobs=None, generated_token_ids=gen,
                           generated_logprobs=None, draft_token_ids=None, num_draft_tokens=fed)


def test_placeholders_scheduled_before_acceptance_and_corrected_a_step_later():
    sched = _sched()
    r = make_req("a", 5, max_tokens=20)
    sched.add_request(r)
    so1 = sched.schedule()  # the prefill: no drafts
    (s1,) = so1.scheduled
    assert (s1.num_new_tokens, s1.spec_token_ids, r.num_output_placeholders) == (5, (), 1)
    so2 = sched.schedule()  # before so1's token is known: the newest token and k placeholders
    (s2,) = so2.scheduled
    assert so2.speculative and s2.placeholder_input and s2.sample
    assert (s2.num_new_tokens, tuple(s2.spec_token_ids), s2.num_computed_tokens) == (1 + K, (-1,) * K, 5)
    assert (r.num_computed_tokens, r.num_output_placeholders) == (5 + 1 + K, 1 + 1 + K)
    out1 = sched.update_from_output(so1, _out([[100]]))
    assert out1.outputs[0].new_token_ids == [100]
    assert (r.num_tokens, r.num_output_placeholders, r.num_computed_tokens) == (6, 1 + K, 9)
    so3 = sched.schedule()  # so2 still in flight: placed as if all its drafts were accepted
    (s3,) = so3.scheduled
    assert s3.placeholder_input and (s3.num_computed_tokens, s3.num_new_tokens) == (9, 1 + K)
    out2 = sched.update_from_output(so2, _out([[101, 102]]))  # one draft of three accepted
    assert out2.outputs[0].new_token_ids == [101, 102]
    # so2 fed positions 5..8 and kept 6, 7: its two rejected drafts are taken back (the
    # runner placed so3 at 9 - 2 = 7, the newest token's position)
    assert (r.num_tokens, r.num_computed_tokens, r.num_output_placeholders) == (8, 9 + 1 + K - 2, 1 + K)
    st = sched.make_stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == (1, K, 1)
    assert st.spec_accepted_per_pos == [1, 0, 0]
    # so3's runner had no drafts to fill its placeholders with: none fed, none counted
    sched.update_from_output(so3, _out([[103]], fed=[0]))
    assert (r.num_tokens, r.num_computed_tokens, r.num_output_placeholders) == (9, 8, 0)
    assert sched.make_stats().spec_num_draft_tokens == K
    sched.finish_requests(["a"], r.status.FINISHED_ABORTED)
    assert_no_leak(sched)


def test_draft_cut_counts_placeholders_in_flight():
    sched = _sched()
    r = make_req("a", 5, max_tokens=4)
    sched.add_request(r)
    so1 = sched.schedule()
    so2 = sched.schedule()  # 1 token in flight: at most 4 - 1 - 1 = 2 drafts
    assert len(so2.scheduled[0].spec_token_ids) == 2
    assert r.num_output_placeholders == 4  # max_tokens reached if all are accepted
    assert sched.schedule().is_empty  # so the next step waits for an output
    sched.update_from_output(so1, _out([[100]]))
    out = sched.update_from_output(so2, _out([[101, 102, 103]]))  # all accepted: max_tokens
    assert out.outputs[0].new_token_ids == [101, 102, 103]
    assert out.outputs[0].finish_reason == "length" and r.num_output_tokens == 4
    assert_no_leak(sched)


def test_no_placeholders_at_or_above_the_cutoff_and_for_constrained_rows():
    sched = _sched(method="ngram", disable=2)
    a, b = make_req("a", 5, max_tokens=20), make_req("b", 5, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()
    so2 = sched.schedule()  # two running: not speculative
    assert not so2.speculative and all(not s.spec_token_ids for s in so2.scheduled)
    assert all(s.num_new_tokens == 1 for s in so2.scheduled)
    sched.update_from_output(so1, _out([[100], [200]]))
    sched.update_from_output(so2, _out([[101], [201]]))
    sched.finish_requests(["b"], b.status.FINISHED_ABORTED)
    so3 = sched.schedule()  # one running: speculative again
    assert so3.speculative and len(so3.scheduled[0].spec_token_ids) == K
    sched.finish_requests(["a"], a.status.FINISHED_ABORTED)
    sched.update_from_output(so3, _out([[102]]))  # (finished meanwhile: dropped)
    assert_no_leak(sched)


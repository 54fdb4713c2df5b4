"""The packed step format: the small-step packer (Python lists) gives the same bytes as the
vectorised one on every kind of row (decode, prefill chunk, placeholder input, drafts),
and both hold what the layout says."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyengine.core.sched.output import ScheduledRequest, SchedulerOutput
from pyengine.worker.step_codec import SMALL_STEP_TOKENS, _fill_block_table, _pack_small, _pack_vectorised, pack_step

BS = 4


def _random_step(rng: random.Random, max_tokens: int) -> tuple[SchedulerOutput, dict[str, int]]:
    sched, prev_rows, total = [], {}, 0
    for i in range(rng.randint(1, 5)):
        kind = rng.choice(["decode", "prefill", "placeholder", "drafts"])
        start = rng.randint(0, 40)
        drafts: list[int] = []
        if kind == "decode":
            n = 1
        elif kind == "drafts":
            drafts = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
            n = 1 + len(drafts)
        else:
            n = rng.randint(1, 9)
        if total + n > max_tokens:
            break
        total += n
        known = start + n - len(drafts)
        req = SimpleNamespace(request_id=f"r{i}", all_token_ids=[rng.randrange(100) for _ in range(known)])
        blocks = rng.sample(range(1, 200), -(-(start + n) // BS) + rng.randint(0, 2))
        ph = kind == "placeholder"
        if ph:
            prev_rows[req.request_id] = rng.randrange(8)
        sample = kind != "prefill" or rng.random() < 0.5
        sched.append(ScheduledRequest(req, n, start, blocks, sample, ph, 0, drafts))
    return SchedulerOutput(sched, total), prev_rows


def _check_layout(step, so, prev_rows):
    sh, b64, b32 = step.shape, step.buf64, step.buf32
    T, R = sh.num_tokens, sh.num_reqs
    pos = b64[sh.positions_offset:sh.positions_offset + T]
    slots = b64[sh.slot_mapping_offset:sh.slot_mapping_offset + T]
    qsl = b32[:R + 1]
    bt = b32[sh.block_table_offset:].reshape(R, sh.max_blocks)
    rows = b64[sh.sample_rows_offset:sh.sample_rows_offset + sh.num_sampled].tolist()
    want_rows = []
    for i, s in enumerate(so.scheduled):
        a, b = int(qsl[i]), int(qsl[i + 1])
        assert b - a == s.num_new_tokens
        assert pos[a:b].tolist() == list(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        assert slots[a:b].tolist() == [s.block_ids[p // BS] * BS + p % BS for p in pos[a:b].tolist()]
        assert bt[i, :len(s.block_ids)].tolist() == s.block_ids and not bt[i, len(s.block_ids):].any()
        ids = b64[a:b].tolist()
        if s.spec_token_ids:
            assert ids[len(ids) - len(s.spec_token_ids):] == s.spec_token_ids
        if not s.placeholder_input:
            known = s.num_new_tokens - len(s.spec_token_ids)
            assert ids[:known] == s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + known]
        if s.sample:
            want_rows += list(range(b - 1 - len(s.spec_token_ids), b))
    assert rows == want_rows
    o, p2, P = sh.placeholder_offset, sh.placeholders_padded, sh.num_placeholders
    ph = [s for s in so.scheduled if s.placeholder_input]
    assert b64[o + p2:o + p2 + P].tolist() == [prev_rows[s.request.request_id] for s in ph]
    assert b64[o:o + P].tolist() == [int(qsl[so.scheduled.index(s) + 1]) - 1 for s in ph]


@pytest.mark.parametrize("seed", range(40))
def test_small_packer_equals_vectorised(seed):
    rng = random.Random(seed)
    so, prev_rows = _random_step(rng, SMALL_STEP_TOKENS)
    small, vec = _pack_small(so, BS, prev_rows), _pack_vectorised(so, BS, prev_rows)
    assert small.shape == vec.shape
    assert small.buf64.dtype == np.int64 and small.buf32.dtype == np.int32
    assert np.array_equal(small.buf64, vec.buf64) and np.array_equal(small.buf32, vec.buf32)
    _check_layout(small, so, prev_rows)


def test_large_steps_take_the_vectorised_path():
    rng = random.Random(1)
    so, prev_rows = _random_step(rng, 10_000)
    req = SimpleNamespace(request_id="big", all_token_ids=list(range(SMALL_STEP_TOKENS + 1)))
    so.scheduled.append(ScheduledRequest(req, SMALL_STEP_TOKENS + 1, 0, list(range(1, 20)), True, False, 0))
    so.total_num_scheduled_tokens += SMALL_STEP_TOKENS + 1
    step = pack_step(so, BS, prev_rows)
    _check_layout(step, so, prev_rows)


@pytest.mark.parametrize("ragged", [False, True])
def test_vectorised_block_table_rows(ragged):
    # every request with as many blocks (one array assignment) or not (scattered): each row
    # holds its request's blocks, then zeros, as the small packer writes it
    sched = []
    for i in range(6):
        req = SimpleNamespace(request_id=f"r{i}", all_token_ids=list(range(10 + i)))
        blocks = [100 + 10 * i + j for j in range(4 + (i % 3 if ragged else 0))]
        sched.append(ScheduledRequest(req, 1, 9 + i, blocks, True, False, 0))
    so = SchedulerOutput(sched, len(sched))
    vec = _pack_vectorised(so, BS, {})
    _check_layout(vec, so, {})
    small = _pack_small(so, BS, {})
    assert np.array_equal(small.buf32, vec.buf32) and np.array_equal(small.buf64, vec.buf64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=12), min_size=1, max_size=20)
       .filter(lambda bl: any(bl)))
def test_fill_block_table_matches_a_row_per_request(block_lists):
    """Rows of unequal length (a decode batch) and of equal length (the fast path) alike."""
    lens = [len(b) for b in block_lists]
    got = np.zeros((len(lens), max(lens)), dtype=np.int32)
    _fill_block_table(got, block_lists, lens)
    want = np.zeros_like(got)
    for i, b in enumerate(block_lists):
        want[i, :len(b)] = b
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(20))
def test_padded_verification_rows(seed):
    """``pad_query_to``: every request of a few-row decode / verification step padded to Q
    rows (token 0 at its last position, slot -1, its sequence length counting them), the
    real rows as unpadded and the sampled rows the real ones; a step it cannot pad (a
    prefill chunk that samples nothing, a request past the cap, nothing longer than one
    row) is packed as without it."""
    rng = random.Random(seed)
    Q = 5
    sched, prev_rows = [], {}
    for i in range(rng.randint(1, 4)):
        drafts = [rng.randrange(100) for _ in range(rng.randint(0, Q - 1))]
        start = rng.randint(0, 30)
        n = 1 + len(drafts)
        ph = rng.random() < 0.5
        req = SimpleNamespace(request_id=f"r{i}", all_token_ids=[rng.randrange(100) for _ in range(start + n)])
        if ph:
            prev_rows[req.request_id] = rng.randrange(8)
        blocks = rng.sample(range(1, 200), -(-(start + n) // BS))
        sched.append(ScheduledRequest(req, n, start, blocks, True, ph, 0, drafts))
    sched[0] = ScheduledRequest(sched[0].request, 2, sched[0].num_computed_tokens, sched[0].block_ids, True,
                                sched[0].placeholder_input, 0, [7])  # (one row longer than one)
    so = SchedulerOutput(sched, sum(s.num_new_tokens for s in sched))
    plain = pack_step(so, BS, prev_rows)
    step = pack_step(so, BS, prev_rows, Q, 64)
    sh, b64, b32 = step.shape, step.buf64, step.buf32
    R = len(sched)
    assert sh.num_tokens == R * Q and sh.max_query_len == Q
    qsl = b32[:R + 1].tolist()
    assert qsl == [Q * i for i in range(R + 1)]
    seq = b32[sh.seq_lens_offset:sh.seq_lens_offset + R].tolist()
    psh = plain.shape
    p_qsl = plain.buf32[:R + 1].tolist()
    p_rows = plain.buf64[psh.sample_rows_offset:psh.sample_rows_offset + psh.num_sampled].tolist()
    rows = b64[sh.sample_rows_offset:sh.sample_rows_offset + sh.num_sampled].tolist()
    want_rows = []
    for i, s in enumerate(sched):
        n, a, pa = s.num_new_tokens, Q * i, p_qsl[i]
        assert seq[i] == s.num_computed_tokens + Q
        # ids, positions, slots of the real rows: as unpadded
        for off, po in ((0, 0), (sh.positions_offset, psh.positions_offset),
                        (sh.slot_mapping_offset, psh.slot_mapping_offset)):
            assert b64[off + a:off + a + n].tolist() == plain.buf64[po + pa:po + pa + n].tolist()
        assert b64[a + n:a + Q].tolist() == [0] * (Q - n)
        assert b64[sh.positions_offset + a + n:sh.positions_offset + a + Q].tolist() == \
            [s.num_computed_tokens + n - 1] * (Q - n)
        assert b64[sh.slot_mapping_offset + a + n:sh.slot_mapping_offset + a + Q].tolist() == [-1] * (Q - n)
        bt = b32[sh.block_table_offset + i * sh.max_blocks:sh.block_table_offset + (i + 1) * sh.max_blocks]
        assert sh.max_blocks * BS >= s.num_computed_tokens + Q
        assert bt[:len(s.block_ids)].tolist() == s.block_ids and not bt[len(s.block_ids):].any()
        want_rows += [r - pa + a for r in p_rows if pa <= r < pa + n]
    assert rows == want_rows
    o, P = sh.placeholder_offset, sh.num_placeholders
    assert b64[o + sh.placeholders_padded:o + sh.placeholders_padded + P].tolist() == \
        [prev_rows[s.request.request_id] for s in sched if s.placeholder_input]
    # not padded: a prefill chunk, a request whose padding passes the cap, all rows one long
    chunk = ScheduledRequest(sched[0].request, 2, 0, sched[0].block_ids, False, False, 0)
    bad = SchedulerOutput(sched + [chunk], so.total_num_scheduled_tokens + 2)
    assert pack_step(bad, BS, prev_rows, Q, 64).shape.num_tokens == bad.total_num_scheduled_tokens
    cap = max(s.num_computed_tokens for s in sched) + Q - 1
    assert pack_step(so, BS, prev_rows, Q, cap).shape == plain.shape
    ones = [ScheduledRequest(s.request, 1, s.num_computed_tokens, s.block_ids, True, s.placeholder_input, 0)
            for s in sched]
    one_so = SchedulerOutput(ones, R)
    assert pack_step(one_so, BS, prev_rows, Q, 64).shape.num_tokens == R

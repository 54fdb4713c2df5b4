"""One engine step's integer inputs packed into two host buffers (the model runner copies
them to the device in two transfers; tensor-parallel rank 0 sends the same bytes to the
other ranks, ``pyengine.worker.tp_follower``). ``StepShape`` names the sizes and every
region's offset; ``pack_step`` builds the buffers from a ``SchedulerOutput``.

Layout (elements, each region 16-byte aligned: Triton specialises kernels on pointer
alignment, so an odd offset would compile, and when cold stall a step for, another variant
of each kernel):

- int64 ``[input ids | positions | slot mapping | placeholder rows | their source rows |
  rows to sample]``;
- int32 ``[query_start_loc | seq_lens | block table]``.

The message header is ``[kind, *StepShape]`` (``HEADER_LEN`` int64s): kind 0 stop, 1 a
step, 3 a step whose rows the rejection sampler verifies (speculative decoding: rank 0
broadcasts no sampled ids after it), 2 a control message (``[2, op, payload bytes,
0...]``, then the payload), 4 a proposer's draft forwards (``[4, int64 count, 0...]``, then
``pyengine.spec_decode.base.DraftPlan.encode``'s int64 array), 5 the newest token of each
row of a verified step (async scheduling: ``[5, rows, 0...]``, then int64 [rows]; the next
step's placeholders take them)."""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np

from pyengine.core.sched.output import SchedulerOutput
from pyengine.spec_decode.base import DraftRow

__all__ = ["StepShape", "PackedStep", "pack_step", "payload_bytes", "control_header", "int64_header",
           "HEADER_LEN", "KIND_STOP", "KIND_STEP", "KIND_CONTROL", "KIND_VERIFY", "KIND_DRAFT", "KIND_TOKENS"]

HEADER_LEN = 8
KIND_STOP, KIND_STEP, KIND_CONTROL, KIND_VERIFY, KIND_DRAFT, KIND_TOKENS = 0, 1, 2, 3, 4, 5


def _align(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


class StepShape(NamedTuple):
    """Sizes of one packed step; every buffer offset follows from them."""
    num_tokens: int  # T: scheduled tokens
    num_reqs: int  # R: scheduled requests
    num_placeholders: int  # P: tokens fed from the previous step's sampled ids (async scheduling)
    num_sampled: int  # S: rows to sample
    max_blocks: int  # block-table width
    max_query_len: int
    max_seq_len: int

    # int64 regions
    @property
    def tokens_padded(self) -> int:
        return _align(self.num_tokens, 2)

    @property
    def placeholders_padded(self) -> int:
        return _align(self.num_placeholders, 2)

    @property
    def positions_offset(self) -> int:
        return self.tokens_padded

    @property
    def slot_mapping_offset(self) -> int:
        return 2 * self.tokens_padded

    @property
    def placeholder_offset(self) -> int:
        return 3 * self.tokens_padded

    @property
    def sample_rows_offset(self) -> int:
        return self.placeholder_offset + 2 * self.placeholders_padded

    @property
    def int64_len(self) -> int:
        return self.sample_rows_offset + self.num_sampled

    # int32 regions (query_start_loc at 0)
    @property
    def seq_lens_offset(self) -> int:
        return _align(self.num_reqs + 1, 4)

    @property
    def block_table_offset(self) -> int:
        return self.seq_lens_offset + _align(self.num_reqs, 4)

    @property
    def int32_len(self) -> int:
        return self.block_table_offset + self.num_reqs * self.max_blocks

    def header(self, verify: bool = False) -> list[int]:
        """``verify``: the rejection sampler verifies the step's rows (``KIND_VERIFY``)."""
        return [KIND_VERIFY if verify else KIND_STEP, *self]

    @staticmethod
    def stop_header() -> list[int]:
        return [KIND_STOP] * HEADER_LEN

    @staticmethod
    def from_header(h) -> StepShape | None:
        """None for the stop header."""
        return StepShape(*(int(x) for x in h[1:])) if h[0] in (KIND_STEP, KIND_VERIFY) else None


class PackedStep(NamedTuple):
    shape: StepShape
    buf64: np.ndarray  # int64 [shape.int64_len]
    buf32: np.ndarray  # int32 [shape.int32_len]


def payload_bytes(head) -> int:
    """Size of the payload that follows a step message's header."""
    kind = head[0]
    if kind in (KIND_STEP, KIND_VERIFY):
        sh = StepShape.from_header(head)
        return sh.int64_len * 8 + sh.int32_len * 4
    if kind in (KIND_DRAFT, KIND_TOKENS):
        return int(head[1]) * 8
    return int(head[2]) if kind == KIND_CONTROL else 0


def control_header(op: int, n: int) -> np.ndarray:
    """The header of a control message ``op`` with ``n`` payload bytes."""
    return np.array([KIND_CONTROL, op, n] + [0] * (HEADER_LEN - 3), dtype=np.int64)


def int64_header(kind: int, n: int) -> np.ndarray:
    """The header of a ``KIND_DRAFT`` / ``KIND_TOKENS`` message of ``n`` int64s."""
    return np.array([kind, n] + [0] * (HEADER_LEN - 2), dtype=np.int64)


# Steps of at most this many tokens are packed with Python lists and one array per buffer
# (``_pack_small``): at batch 1 the vectorised path's ~25 numpy calls cost more than the work.
SMALL_STEP_TOKENS = 32


def pack_step(so: SchedulerOutput, block_size: int, prev_rows: dict[str, int], pad_query_to: int = 0,
              pad_cap: int = 0) -> PackedStep:
    """All integer inputs of the step, host side (the layout above). ``prev_rows``: the
    row of each request in the previous step's sampled ids, for its placeholder input.
    A request with draft tokens (``spec_token_ids``, k of them) feeds them after its
    known tokens and has its last 1 + k rows sampled (verification).

    ``pad_query_to`` Q > 1 (the verification CUDA graph's query length): a step where
    every request samples and feeds at most Q tokens, one of them more than one, and whose
    R * Q rows are at most ``SMALL_STEP_TOKENS``, is packed with every request padded to
    Q rows, so that it replays that graph instead of running eagerly (a request with fewer
    drafts: the end of its max_tokens, an n-gram that found fewer). A padding row feeds
    token 0 at the request's last position into slot -1 (written nowhere); the request's
    sequence length counts its padding rows (causal attention keeps the real rows from
    them), which must stay within ``pad_cap`` positions (max_model_len: no kernel sees a
    longer sequence than the engine's); the sampled rows are the real ones."""
    if pad_query_to > 1 and _paddable(so, pad_query_to, pad_cap):
        return _pack_small(so, block_size, prev_rows, pad_query_to)
    if so.total_num_scheduled_tokens <= SMALL_STEP_TOKENS:
        return _pack_small(so, block_size, prev_rows)
    return _pack_vectorised(so, block_size, prev_rows)


def _paddable(so: SchedulerOutput, q: int, cap: int) -> bool:
    sched = so.scheduled
    if not sched or len(sched) * q > SMALL_STEP_TOKENS:
        return False
    longer = False
    for s in sched:
        n = s.num_new_tokens
        if not s.sample or n > q or s.num_computed_tokens + q > cap:
            return False
        longer |= n > 1
    return longer and so.total_num_scheduled_tokens < len(sched) * q


def _step_tokens(s, toks: list[int], ph_rows: list[int], ph_src: list[int], prev_rows: dict[str, int]) -> None:
    """Append the tokens ``s`` (a ScheduledRequest) feeds; a placeholder's row and source."""
    start, n = s.num_computed_tokens, s.num_new_tokens
    all_ids = s.request.all_token_ids
    if s.placeholder_input:
        # Fed from the previous step's sampled ids, still on the device; then the drafts
        # (async scheduling with speculative decoding: the runner's own, filled in)
        d = s.spec_token_ids
        toks.extend(all_ids[start:start + n - 1 - len(d)])
        ph_rows.append(len(toks))
        ph_src.append(prev_rows[s.request.request_id])
        toks.append(0)
        if isinstance(d, DraftRow):  # drafts on the device: gathered like the newest token
            for src in d.sources():
                ph_rows.append(len(toks))
                ph_src.append(src)
                toks.append(0)
        elif d:
            toks.extend(d)
    elif n == 1:
        toks.append(all_ids[start])
    elif s.spec_token_ids:  # the known tokens, then the drafts (speculative decoding)
        toks.extend(all_ids[start:start + n - len(s.spec_token_ids)])
        toks.extend(s.spec_token_ids)
    else:
        toks.extend(all_ids[start:start + n])


def _pack_small(so: SchedulerOutput, bs: int, prev_rows: dict[str, int], pad_q: int = 0) -> PackedStep:
    """``pack_step`` of a step of few tokens: the same buffers, built in Python; with
    ``pad_q`` every request padded to that many rows (``pack_step``)."""
    sched = so.scheduled
    R = len(sched)
    T = R * pad_q if pad_q else so.total_num_scheduled_tokens
    toks: list[int] = []
    ph_rows: list[int] = []
    ph_src: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    rows: list[int] = []
    max_blocks = max_q = max_seq = 0
    for s in sched:
        start, n = s.num_computed_tokens, s.num_new_tokens
        _step_tokens(s, toks, ph_rows, ph_src, prev_rows)
        blocks = s.block_ids
        for p in range(start, start + n):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        end = qsl[-1] + n
        if s.sample:
            rows.extend(range(end - 1 - len(s.spec_token_ids), end))
        q = n
        nb = len(blocks)
        if pad_q:
            q, pad = pad_q, pad_q - n
            toks.extend([0] * pad)
            positions.extend([start + n - 1] * pad)
            slots.extend([-1] * pad)
            nb = max(nb, -(-(start + q) // bs))  # (the padding rows' reads: the null block past its blocks)
        qsl.append(qsl[-1] + q)
        seq_lens.append(start + q)
        max_blocks = max(max_blocks, nb)
        max_q = max(max_q, q)
        max_seq = max(max_seq, start + q)
    shape = StepShape(T, R, len(ph_rows), len(rows), max_blocks, max_q, max_seq)
    tp, pp = shape.tokens_padded - T, shape.placeholders_padded - len(ph_rows)
    z = [0] * max(tp, pp)
    buf64 = np.array(toks + z[:tp] + positions + z[:tp] + slots + z[:tp] + ph_rows + z[:pp] + ph_src + z[:pp]
                     + rows, dtype=np.int64)
    buf32 = np.zeros(shape.int32_len, dtype=np.int32)
    buf32[:R + 1] = qsl
    buf32[shape.seq_lens_offset:shape.seq_lens_offset + R] = seq_lens
    bto = shape.block_table_offset
    for i, s in enumerate(sched):
        o = bto + i * max_blocks
        buf32[o:o + len(s.block_ids)] = s.block_ids
    return PackedStep(shape, buf64, buf32)


def _fill_block_table(block_table: np.ndarray, block_lists: list[list[int]], lens: list[int]) -> None:
    """Row i of ``block_table`` (int32 [R, max_blocks], zeroed) gets ``block_lists[i]``
    (``lens[i]`` ids) at its start; the rest of the row stays 0."""
    if min(lens) == block_table.shape[1]:  # every request as long (most decode batches)
        block_table[:] = block_lists
        return
    # a boolean mask fills in row-major order, the order of the chained lists (faster than
    # index arrays or a row assignment per request)
    mask = np.arange(block_table.shape[1]) < np.array(lens)[:, None]
    block_table[mask] = np.fromiter(chain.from_iterable(block_lists), np.int32, sum(lens))


def _pack_vectorised(so: SchedulerOutput, block_size: int, prev_rows: dict[str, int]) -> PackedStep:
    """``pack_step`` of a large step: positions and slots computed by numpy."""
    sched = so.scheduled
    T, R, bs = so.total_num_scheduled_tokens, len(sched), block_size
    toks: list[int] = []
    ph_rows, ph_src = [], []
    for s in sched:
        _step_tokens(s, toks, ph_rows, ph_src, prev_rows)
    # (lists made into arrays at once: a numpy element or row assignment per request costs more)
    starts = np.array([s.num_computed_tokens for s in sched], dtype=np.int64)
    ns = np.array([s.num_new_tokens for s in sched], dtype=np.int64)
    block_lists = [s.block_ids for s in sched]
    lens = [len(b) for b in block_lists]
    max_blocks = max(lens)
    shape = StepShape(T, R, 0, 0, max_blocks, 0, 0)
    buf32 = np.zeros(shape.int32_len, dtype=np.int32)
    block_table = buf32[shape.block_table_offset:].reshape(R, max_blocks)
    _fill_block_table(block_table, block_lists, lens)
    qsl = buf32[:R + 1]
    np.cumsum(ns, out=qsl[1:])
    seq_lens = buf32[shape.seq_lens_offset:shape.seq_lens_offset + R]
    seq_lens[:] = starts + ns
    rows = []  # the last row of each sampling request; its last 1 + k rows when it has k drafts
    ends = qsl[1:].tolist()  # (one conversion, not a numpy scalar per request)
    for s, end in zip(sched, ends):
        if s.sample:
            if s.spec_token_ids:
                rows.extend(range(end - 1 - len(s.spec_token_ids), end))
            else:
                rows.append(end - 1)
    shape = StepShape(T, R, len(ph_rows), len(rows), max_blocks, int(ns.max()), int(seq_lens.max()))
    buf64 = np.zeros(shape.int64_len, dtype=np.int64)  # (padding zeroed: the same bytes as _pack_small's)
    buf64[:T] = toks
    req_of_tok = np.repeat(np.arange(R), ns)
    positions = buf64[shape.positions_offset:shape.positions_offset + T]
    positions[:] = starts[req_of_tok] + (np.arange(T) - qsl[:-1][req_of_tok])
    slots = buf64[shape.slot_mapping_offset:shape.slot_mapping_offset + T]
    slots[:] = block_table[req_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
    o, p2, P = shape.placeholder_offset, shape.placeholders_padded, shape.num_placeholders
    buf64[o:o + P] = ph_rows
    buf64[o + p2:o + p2 + P] = ph_src
    buf64[shape.sample_rows_offset:] = rows
    return PackedStep(shape, buf64, buf32)

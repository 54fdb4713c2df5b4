"""The proposer interface the model runner calls (vLLM's proposers have no common base;
this is the one shape ours share)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Proposer", "TokenProposer", "DraftPlan", "DeviceDrafts", "DraftRow", "num_drafts_wanted",
           "drafts_by_depth"]


def num_drafts_wanted(spec, so, s, num_new_tokens: int, max_model_len: int) -> int:
    """How many drafts request ``s`` (a sampled ``ScheduledRequest``) should get after
    this step, which gave it ``num_new_tokens`` tokens: 0 for a constrained request, in a
    step of at least ``disable_by_batch_size`` requests, or at the end of its room
    (max_tokens, max_model_len); else ``num_speculative_tokens`` capped by that room."""
    req = s.request
    if req.structured_output_request is not None:
        return 0
    if not so.speculative:  # disable_by_batch_size: as many running requests or more
        return 0
    num_out = req.num_output_tokens + num_new_tokens
    num_tok = req.num_tokens + num_new_tokens
    return max(0, min(spec.num_speculative_tokens, req.max_tokens - num_out - 1, max_model_len - num_tok - 1))


class DraftPlan(NamedTuple):
    """A model-based proposer's forwards of one step, decided by tensor-parallel rank 0 (the
    one that holds the requests) and run the same way on every rank (its model is sharded
    on the target's group: every rank runs every forward, every collective).

    ``seqs``: the first forward, per request (start position, token ids, block ids), as
    ``draft_attn_metadata`` takes them. ``active``: (index into ``seqs``, k >= 1) of the
    requests that get k drafts: the first draft from the last row of its first-forward
    tokens, then one one-token forward per further depth, at the positions after it, each
    fed the depth before's tokens (``ParallelLMHead.greedy``: the same on every rank).
    ``row_starts``: EAGLE-3, per request the row of the target step's hidden states under its
    first token (its rows are consecutive); None for a draft model."""
    seqs: list[tuple[int, list[int], list[int]]]
    active: list[tuple[int, int]]
    row_starts: list[int] | None = None

    def encode(self) -> np.ndarray:
        """int64 [n]: ``[R, A, has row_starts, (start, #tokens, #blocks, tokens..., blocks...)
        per request, (index, k) per active request, row_starts...]``."""
        out = [len(self.seqs), len(self.active), int(self.row_starts is not None)]
        for start, toks, blocks in self.seqs:
            out += (start, len(toks), len(blocks))
            out += toks
            out += blocks
        for i, k in self.active:
            out += (i, k)
        if self.row_starts is not None:
            out += self.row_starts
        return np.array(out, dtype=np.int64)

    @staticmethod
    def decode(a: np.ndarray) -> DraftPlan:
        """The plan ``encode`` gave ``a`` (int64)."""
        v = a.tolist()
        R, A, has_rows = v[0], v[1], v[2]
        o = 3
        seqs = []
        for _ in range(R):
            start, nt, nb = v[o], v[o + 1], v[o + 2]
            o += 3
            seqs.append((start, v[o:o + nt], v[o + nt:o + nt + nb]))
            o += nt + nb
        active = [(v[o + 2 * j], v[o + 2 * j + 1]) for j in range(A)]
        o += 2 * A
        return DraftPlan(seqs, active, v[o:o + R] if has_rows else None)

    def depth_batch(self, active: Sequence[tuple[int, int]], j: int) -> list[tuple[int, tuple, list[int]]]:
        """``draft_attn_metadata``'s seqs of depth ``j`` >= 1 for the ``active`` entries:
        one token each, at the position ``j`` after its first forward's last one."""
        seqs = self.seqs
        return [(seqs[i][0] + len(seqs[i][1]) - 1 + j, (0,), seqs[i][2]) for i, _ in active]


class DeviceDrafts:
    """A model proposer's drafts of one step left on the device: ``tokens`` int64 [n, k]
    (row r: the r-th drafting request's k drafts). Their copy to the host is queued at
    once (pinned, with an event, on CUDA), so ``host()`` later costs no sync of its own;
    the next step's input ids take the drafts on the device (the runner gathers them with
    its placeholder rows, ``base``: where row 0's first draft sits in that gather's
    source). The role of the GPU-side drafts vLLM's EAGLE / draft-model proposers keep
    under async scheduling (vllm/v1/spec_decode/eagle.py)."""

    def __init__(self, tokens: torch.Tensor):
        self.k = int(tokens.shape[1])
        self.tokens = tokens
        self.base = -1  # set by the runner once the gather source holds them
        self._event = None
        self._rows: list[list[int]] | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens.clone()  # (the chain's output buffer is reused next step)

    def host(self) -> list[list[int]]:
        """The drafts as host lists (waits for the copy the first time)."""
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows


class DraftRow(Sequence):
    """One request's drafts in a ``DeviceDrafts`` (row ``row``): a sequence of its first
    ``n`` drafts (default all k; fewer for a request whose room, max_tokens or
    max_model_len, takes fewer) whose length is known at once and whose values are read
    from the host copy only when asked for (a verification checks them there after its
    own copy back)."""

    __slots__ = ("drafts", "row", "n")

    def __init__(self, drafts: DeviceDrafts, row: int, n: int | None = None):
        self.drafts, self.row = drafts, row
        self.n = drafts.k if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            if start == 0 and step == 1:  # a prefix stays on the device
                return self if stop == self.n else DraftRow(self.drafts, self.row, stop)
        return self.drafts.host()[self.row][:self.n][i]

    def __iter__(self):
        return iter(self.drafts.host()[self.row][:self.n])

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def sources(self) -> range:
        """The rows of the runner's gather source that hold these drafts, in order."""
        if self.drafts.base < 0:
            raise RuntimeError("device drafts fed before the runner placed them")
        o = self.drafts.base + self.row * self.drafts.k
        return range(o, o + self.n)


class Proposer:
    """Drafts the next step's tokens. ``propose`` runs once per step after verification
    (also for steps that sample nothing: a model-based proposer writes its KV of prefill
    chunks then).

    Tensor parallelism: a model-based proposer turns each step into a ``DraftPlan`` on rank
    0, hands it to ``plan_sink`` (rank 0's sender to the other ranks; None with one rank)
    and runs it; the other ranks run it in ``follow``."""

    allows_cuda_graphs = True  # the target's decode steps may replay CUDA graphs
    plan_sink: Callable[[DraftPlan], None] | None = None
    # set by the runner (async scheduling, one rank): a model proposer may return
    # ``DraftRow``s (its drafts on the device) instead of host lists
    device_drafts = False

    def follow(self, plan: DraftPlan) -> None:
        """Ranks > 0: run rank 0's ``plan`` (the same forwards and collectives, drafts
        discarded). Raises RuntimeError for a proposer that sends none."""
        raise RuntimeError(f"{type(self).__name__} runs on rank 0 only; it sends no draft plans")

    def kv_bytes_per_block(self) -> int:
        """Bytes of the proposer's own KV cache per block (0: none)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's KV cache of ``num_blocks`` blocks (the target's count)."""

    def forget(self, request_ids) -> None:
        """These requests finished."""
    def capture_cuda_graphs(self, capture_error_mode: str) -> float:
        """Capture the proposer's own CUDA graphs (CUDA, after ``initialize_kv_cache``);
        returns seconds (0: none)."""
        return 0.0

    def propose_early(self, so, sampled: Sequence, starts: Sequence[int], input_ids: torch.Tensor,
                      candidate: torch.Tensor, accepted: torch.Tensor | None) -> bool:
        """Async scheduling: start this verified step's proposal on the device before its
        result reaches the host (``sampled[i]``'s logits rows start at ``starts[i]``; the
        tensors as ``DraftChain.run_verified`` takes them). ``propose`` then uses it where
        the result agrees. Returns whether anything was launched (default: never)."""
        return False

    def propose(self, so, sampled: Sequence, generated: Sequence[Sequence[int]],
                hidden: torch.Tensor | None) -> list[list[int]]:
        """Drafts per sampled row (``sampled[i]``, a ``ScheduledRequest``, got the tokens
        ``generated[i]`` this step, not yet in its ``all_token_ids``). ``so``: the step's
        ``SchedulerOutput``; ``hidden``: the target's hidden states of the step's tokens
        [T, H] (device). With ``device_drafts`` a row's drafts may be a ``DraftRow``."""
        raise NotImplementedError


class TokenProposer(Proposer):
    """A host-side proposer: ``draft(request, context, k)`` per sampled request, where
    ``context`` is its prompt and output tokens including this step's."""

    def __init__(self, spec, max_model_len: int):
        self.spec, self.max_model_len = spec, max_model_len

    def draft(self, request, context: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, so, sampled, generated, hidden) -> list[list[int]]:
        out = []
        for s, g in zip(sampled, generated):
            k = num_drafts_wanted(self.spec, so, s, len(g), self.max_model_len)
            out.append(list(self.draft(s.request, s.request.all_token_ids + list(g), k))[:k] if k else [])
        return out


def draft_attn_metadata(seqs, block_size: int, device, token_ids: torch.Tensor | None = None):
    """Inputs of a proposer model's forward over ``seqs``: (start position, token ids,
    block ids) per request, its tokens at positions start .. start + len - 1 over the
    cached context before ``start``. Returns (ids int64 [T], positions int64 [T],
    ``AttentionMetadata``) on ``device``; a position past the request's blocks gets slot
    -1 (not written). ``token_ids``: the T ids already on the device (the previous draft
    step's tokens: no host round trip), returned as the ids; only the lengths of the
    ``seqs``' token lists are read then. Raises ValueError for an empty ``seqs``."""
    import numpy as np

    from pyengine.attention.backend import AttentionMetadata

    if not seqs:
        raise ValueError("no sequences")
    R = len(seqs)
    width = max(1, max(len(b) for _, _, b in seqs))
    bt = np.zeros((R, width), dtype=np.int32)
    ids, pos, slots, qsl, seq = [], [], [], [0], []
    for i, (start, toks, blocks) in enumerate(seqs):
        bt[i, :len(blocks)] = blocks
        cap = len(blocks) * block_size
        for j, t in enumerate(toks):
            p = start + j
            ids.append(t)
            pos.append(p)
            slots.append(int(blocks[p // block_size]) * block_size + p % block_size if p < cap else -1)
        qsl.append(qsl[-1] + len(toks))
        seq.append(start + len(toks))
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    T = len(ids)
    meta = AttentionMetadata(T, R, max(len(t) for _, t, _ in seqs), max(seq), qsl_t.to(device), seq_t.to(device),
                             torch.from_numpy(bt).to(device), torch.tensor(slots, dtype=torch.int64).to(device),
                             qsl_t, seq_t)
    if token_ids is None:
        token_ids = torch.tensor(ids, dtype=torch.int64).to(device)
    return token_ids, torch.tensor(pos, dtype=torch.int64).to(device), meta


def drafts_by_depth(cols: list[torch.Tensor], rows: list[list]) -> list[tuple[object, int]]:
    """The draft tokens of a proposer's steps, copied to the host at once (one sync):
    ``cols[j]``: the tokens drafted at depth j (int64, device), one per entry of
    ``rows[j]``; returns (entry, token) pairs, depth by depth."""
    flat = torch.cat(cols).tolist()
    return list(zip((e for r in rows for e in r), flat))


def load_draft(config, hf_config, model_dir: str, block_size: int, tp_group=None):
    """(model, attention backend, dims) of a proposer checkpoint ``model_dir`` with
    ``hf_config``, in the target's dtype and device and attention backend kind; with
    ``tp_group`` (the target's) this rank's shard, dims per rank."""
    from pyengine.attention.backend import get_backend_cls
    from pyengine.models.loader import load_model
    from pyengine.models.registry import model_dims

    dims = model_dims(hf_config, tp_group.world_size if tp_group is not None else 1)
    attn = get_backend_cls(config.attention_backend)(dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                                     dims.head_dim ** -0.5, block_size, config.dtype, config.device)
    dcfg = config.replace(model=model_dir, tokenizer=model_dir, hf_config=hf_config, quantization=None,
                          kv_cache_dtype="auto", speculative_config=None, enable_expert_parallel=False,
                          load_format="auto")
    return load_model(dcfg, attn, tp_group), attn, dims


def kv_bytes(dims, block_size: int, dtype) -> int:
    """KV cache bytes per block of a model of ``dims`` (ModelDims) in ``dtype``."""
    return 2 * dims.num_layers * block_size * dims.num_kv_heads * dims.head_dim * torch.empty((), dtype=dtype).element_size()

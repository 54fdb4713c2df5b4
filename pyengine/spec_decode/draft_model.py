"""Draft-model proposer (the role of vllm/v1/spec_decode/draft_model.py): a smaller model
with the target's vocabulary drafts greedily. Its KV cache has the target's block count
and lives in the target's block tables (the same block ids and slots), so the scheduler
manages one set of blocks; the scheduler reserves ``num_speculative_tokens`` lookahead
slots past each sampling step for the draft positions.

Per step, for every scheduled request: one forward over the tokens whose draft KV is not
yet written (``_valid``: how many leading positions of the request hold valid draft KV;
this step's accepted tokens and its new token, and those of steps without speculation
it missed), whose last row gives the first draft;
then ``k - 1`` one-token forwards, each feeding the previous draft. A rejected draft's
KV is overwritten when a real token takes its position. Under async scheduling a step that
the chain takes is launched on the device right after its verification
(``propose_early``), before the result is on the host; ``propose`` keeps those drafts when
the result gives the first forward that was assumed. On CUDA with one rank (unless ``VENGINE_DRAFT_CHAIN=0``), a step
where every request drafts all ``k`` after a short first forward (the steady state of
batch-1 and small-batch decoding) replays one CUDA graph of all those forwards
(``DraftChain``); the rest runs forward by forward (the one-token ones as graphs).

Tensor parallelism: the draft model is sharded on the target's group; rank 0 decides each
step's forwards (a ``DraftPlan``), sends them, and every rank runs them."""
from __future__ import annotations

import torch

from pyengine import envs
from pyengine.spec_decode.base import (
    DeviceDrafts,
    DraftPlan,
    DraftRow,
    Proposer,
    draft_attn_metadata,
    drafts_by_depth,
    kv_bytes,
    load_draft,
    num_drafts_wanted,
)

__all__ = ["DraftModelProposer"]


class DraftModelProposer(Proposer):
    """``DraftModelProposer(config, runner)``: loads ``config.speculative_config.model``."""

    def __init__(self, config, runner):
        self.spec = config.speculative_config
        self.config, self.block_size, self.device = config, config.block_size, config.device
        self.model, self.attn, self.dims = load_draft(config, self.spec.draft_hf_config, self.spec.model,
                                                      config.block_size, runner.tp)
        self.kv_caches: list[torch.Tensor] = []
        # request id -> (epoch, positions with valid draft KV, its blocks marked in _draft_blocks)
        self._valid: dict[str, tuple[int, int, int]] = {}
        # block id -> the prefix-cache hash of the content the draft filled it with: a hit
        # trusts a block's draft KV only while the block still holds that content (a block
        # computed in a step without speculation, or reused, has another hash or no mark)
        self._draft_blocks: dict[int, int] = {}
        self._graphs = None  # CUDAGraphRunner of the one-token draft steps (CUDA)
        self._chain = None  # DraftChain: a step's whole proposal in one replay (one rank, CUDA)
        self._chain_out: torch.Tensor | None = None  # the last _run's drafts [n, k] when the chain ran
        self._tp_world = runner.tp.world_size if runner.tp is not None else 1
        self.early_chain = True  # propose_early launches the chain (off: only after the result)
        self.early_chain_steps = 0  # steps whose drafts came from an early launch
        self._early = None  # (the verified step, each request's start, its DeviceDrafts)

    def capture_cuda_graphs(self, capture_error_mode: str) -> float:
        from pyengine.core.kv_cache_manager import cdiv
        from pyengine.worker.cuda_graph import CUDAGraphRunner

        c = self.config
        self._graphs = CUDAGraphRunner(self.model, self.attn, c.max_num_seqs, cdiv(c.max_model_len, c.block_size),
                                       c.max_model_len, self.device, capture_error_mode=capture_error_mode)
        dt = self._graphs.capture()
        # (ranks > 1 keep the depth-by-depth path: its collectives are per forward)
        if self._tp_world == 1 and envs.draft_chain():
            dt += self.enable_draft_chain(capture_error_mode)
        return dt

    def enable_draft_chain(self, capture_error_mode: str | None = None) -> float:
        """Take the steps a ``DraftChain`` fits through it: batches up to 32 requests (and
        below ``disable_by_batch_size``), each drafting ``num_speculative_tokens``. With a
        ``capture_error_mode`` (CUDA) its graphs are captured; without, it runs eagerly (the
        same computation: how the CPU tests check it). Returns the capture's seconds."""
        from pyengine.core.kv_cache_manager import cdiv
        from pyengine.spec_decode.draft_chain import DraftChain
        from pyengine.worker.cuda_graph import capture_sizes

        c = self.config
        top = min(c.max_num_seqs, 32, (self.spec.disable_by_batch_size or 33) - 1)
        if top < 1:
            return 0.0
        self._chain = DraftChain(self.model, self.attn, self.spec.num_speculative_tokens, capture_sizes(top),
                                 cdiv(c.max_model_len, c.block_size), c.max_model_len, c.block_size, self.device)
        return self._chain.capture(capture_error_mode) if capture_error_mode is not None else 0.0

    def _forward(self, ids, pos, meta):
        g = self._graphs
        if g is not None and meta.max_query_len == 1 and g.covers(meta):
            return g.run(ids, pos, meta)
        return self.model(ids, pos, meta)

    def kv_bytes_per_block(self) -> int:
        return kv_bytes(self.dims, self.block_size, self.config.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        d = self.dims
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, d.num_kv_heads, d.head_dim,
                                      dtype=self.config.dtype, device=self.device) for _ in range(d.num_layers)]
        self.model.bind_kv_caches(self.kv_caches)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._valid.pop(rid, None)

    def _trusted_hit(self, s) -> int:
        """Positions of ``s``'s prefix-cache hit whose draft KV was written: its leading hit
        blocks the draft filled with the content they hold (all of the hit when every block
        is one)."""
        r = s.request
        hit = max(r.num_cached_tokens, 0)
        blocks, hashes, marked, blk = s.block_ids, r.block_hashes, self._draft_blocks, self.block_size
        n = 0
        while n * blk < hit and n < min(len(blocks), len(hashes)) and marked.get(blocks[n]) == hashes[n]:
            n += 1
        return min(hit, n * blk)

    @torch.inference_mode()
    def propose_early(self, so, sampled, starts, input_ids, candidate, accepted) -> bool:
        """The chain of every request of ``so`` (all sampled), launched before the result:
        each request's draft KV must be valid up to its verified step's start (the steady
        state, where its first forward is that step's first token and its emitted ones)."""
        self._early = None
        chain = self._chain
        if chain is None or not self.device_drafts or not self.early_chain or len(sampled) != len(so.scheduled):
            return False
        reqs = []
        for s, st in zip(sampled, starts):
            epoch, v, _ = self._valid.get(s.request.request_id, (-1, 0, 0))
            if epoch != s.epoch or v < s.num_computed_tokens:
                return False
            reqs.append((s.num_computed_tokens, st, len(s.spec_token_ids), s.block_ids))
        if not chain.fits_verified(reqs):
            return False
        self._early = (so, [r[0] for r in reqs], DeviceDrafts(chain.run_verified(reqs, input_ids, candidate, accepted)))
        return True

    def _early_drafts(self, early, so, seqs, want, gen) -> DeviceDrafts | None:
        """The early launch's drafts when it ran the first forwards ``seqs`` holds: the same
        step and requests, each starting where assumed, its tokens the one before this step's
        emitted ones and those."""
        if early is None or early[0] is not so or len(seqs) != len(early[1]):
            return None
        for (start, toks, _), assumed, w in zip(seqs, early[1], want):
            g = gen.get(id(w))
            if g is None or start != assumed or len(toks) != len(g) + 1:
                return None
        return early[2]

    @torch.inference_mode()
    def propose(self, so, sampled, generated, hidden) -> list[list[int]]:
        early, self._early = self._early, None
        gen = {id(s): g for s, g in zip(sampled, generated)}
        seqs, want, active = [], [], []
        for s in so.scheduled:
            r = s.request
            g = gen.get(id(s))
            epoch, v, m = self._valid.get(r.request_id, (-1, 0, 0))
            if epoch != s.epoch:
                # first sight: trust the draft KV of its prefix-cache hit where the draft wrote
                # it (the leading hit blocks it filled); after a preemption start over
                v = self._trusted_hit(s) if s.epoch == 0 else 0
                m = v // self.block_size
            v = min(v, s.num_computed_tokens)
            if g is not None:
                end = r.num_tokens + len(g)
                k = num_drafts_wanted(self.spec, so, s, len(g), self.config.max_model_len)
                k = max(0, min(k, len(s.block_ids) * self.block_size - end + 1))
            else:
                end = s.num_computed_tokens + s.num_new_tokens
                k = 0
            if v >= end:
                continue
            if k:
                active.append((len(seqs), k))
            # (only the tail past the valid draft KV is copied, not the whole context)
            toks = r.all_token_ids[v:end] if g is None else r.all_token_ids[v:] + list(g)
            seqs.append((v, toks, s.block_ids))
            want.append(s)
            # blocks full of valid draft KV after this step's forward, marked once their hash is known
            hashes, blocks = r.block_hashes, s.block_ids
            hi = min(end // self.block_size, len(hashes), len(blocks))
            for i in range(m, hi):
                self._draft_blocks[blocks[i]] = hashes[i]
            self._valid[r.request_id] = (s.epoch, end, max(m, hi))
        drafts: dict[int, list[int]] = {}
        if seqs:
            dd = self._early_drafts(early, so, seqs, want, gen)
            if dd is not None:
                self.early_chain_steps += 1
                row_of = {id(want[i]): (i, k) for i, k in active}
                return [DraftRow(dd, *row_of[id(s)]) if id(s) in row_of else [] for s in sampled]
            plan = DraftPlan(seqs, active)
            if self.plan_sink is not None:
                self.plan_sink(plan)
            self._chain_out = None
            cols, rows = self._run(plan)
            if self.device_drafts and self._chain_out is not None:
                # (the chain: every entry of seqs drafts k, of which it keeps its own count)
                # the drafts stay on the device
                dd = DeviceDrafts(self._chain_out)
                self._chain_out = None
                row_of = {id(w): (j, k) for j, (w, (_, k)) in enumerate(zip(want, active))}
                return [DraftRow(dd, *row_of[id(s)]) if id(s) in row_of else [] for s in sampled]
            if cols:
                for (i, k), t in drafts_by_depth(cols, rows):
                    d = drafts.setdefault(id(want[i]), [])
                    if len(d) < k:  # (the chain drafts k for every request)
                        d.append(t)
        return [drafts.get(id(s), []) for s in sampled]

    def follow(self, plan: DraftPlan) -> None:
        with torch.inference_mode():
            self._run(plan)

    def _run(self, plan: DraftPlan) -> tuple[list[torch.Tensor], list[list[tuple[int, int]]]]:
        """The forwards of ``plan`` (every rank): (each depth's draft tokens int64 on the
        device, the ``plan.active`` entries they belong to); ([], []) without drafts."""
        chain = self._chain
        if chain is not None and chain.fits(plan):
            toks = chain.run(plan)  # [n, k]
            self._chain_out = toks
            return list(toks.t()), [plan.active] * chain.k
        ids, pos, meta = draft_attn_metadata(plan.seqs, self.block_size, self.device)
        h = self._forward(ids, pos, meta)
        active = plan.active
        if not active:
            return [], []
        qsl = meta.query_start_loc_cpu.tolist()
        last = torch.tensor([qsl[i + 1] - 1 for i, _ in active], dtype=torch.int64).to(self.device)
        # each depth's tokens stay on the device and feed the next depth; one copy at the end
        tok = self.model.compute_greedy(h[last])
        cols, rows = [tok], [active]
        for j in range(1, max(k for _, k in active)):
            keep = [a for a, (_, k) in enumerate(active) if k > j]
            if not keep:
                break
            if len(keep) < len(active):
                tok = tok[torch.tensor(keep, dtype=torch.int64).to(self.device)]
                active = [active[a] for a in keep]
            ids, pos, meta = draft_attn_metadata(plan.depth_batch(active, j), self.block_size, self.device,
                                                 token_ids=tok)
            tok = self.model.compute_greedy(self._forward(ids, pos, meta))
            cols.append(tok)
            rows.append(active)
        return cols, rows

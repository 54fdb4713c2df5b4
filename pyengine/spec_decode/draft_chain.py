"""A draft model's whole proposal of one step as one function of persistent buffers,
replayed as one CUDA graph per padded batch size (the role of the CUDA graphs vLLM's
draft-model / EAGLE proposers capture in vllm/v1/spec_decode/eagle.py's ``propose``).

It takes a step (a ``DraftPlan``) where every request drafts 1..``k`` tokens (the chain
drafts ``k`` for each; one with less room keeps its first ones) after a first forward of
at most ``k + 2`` tokens: batch-1 and small-batch decoding once each
request's prompt is in the draft KV (its first forward holds that step's accepted tokens,
its new one, and the one before them: ``DraftModelProposer`` counts draft KV as valid only
up to the target's computed tokens). The first forward runs every request padded to
``Q = k + 2`` query rows
(padding rows: slot -1, written nowhere, the last real position for RoPE; the extend
kernel's causal offset ``seq_len - Q`` keeps real rows from seeing them); its last real row
gives the first draft, then ``k - 1`` one-token forwards at the following positions, each
fed the previous depth's tokens, their slots and sequence lengths computed on the device
from the block table. Between the host and the device per step: two copies in, one replay
(CUDA; eager elsewhere), the [n, k] drafts out. Everything else takes the depth-by-depth
path (``DraftModelProposer._run``).

``run_verified`` launches the same chain straight after a verification, before its result
reaches the host (async scheduling): the first forward's tokens (the verified step's first
token, then its candidates up to the first rejected row) and its length come from the
verification's device tensors, so the device goes from the verification to the chain
without waiting for the host (the role of the GPU-side ``prepare_inputs`` of vLLM's EAGLE
proposer, vllm/v1/spec_decode/eagle.py)."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pyengine.attention.backend import AttentionMetadata

__all__ = ["DraftChain"]

logger = logging.getLogger(__name__)


class DraftChain:
    """``DraftChain(model, attn, k, sizes, max_blocks_per_req, max_model_len, block_size, device)``:
    ``model(ids, positions, meta)`` -> hidden [T, H] and ``model.compute_greedy(hidden)`` ->
    int64 [N]; ``sizes``: the padded batch sizes (ascending; CUDA graphs of each once
    ``capture`` ran). Raises ValueError for ``k`` < 1 or no sizes."""

    def __init__(self, model, attn, k: int, sizes: list[int], max_blocks_per_req: int, max_model_len: int,
                 block_size: int, device: torch.device):
        if k < 1 or not sizes:
            raise ValueError(f"a draft chain needs k >= 1 and batch sizes, got k={k}, sizes={sizes}")
        self.model, self.attn, self.k, self.sizes = model, attn, k, sorted(sizes)
        self.Q = Q = k + 2
        self.W, self.max_model_len, self.block_size = max_blocks_per_req, max_model_len, block_size
        self.device = torch.device(device)
        B = self.sizes[-1]
        # one int64 and one int32 buffer, each a host staging copy (pinned on CUDA) and its
        # device twin, so a step's inputs cross in two copies; the fields are views of both
        self._i64_fields = {"ids": B * Q, "pos": B * Q, "slots": B * Q, "last": B, "plast": B, "cap": B,
                            # run_verified's staging: the device computes ids .. plast from them
                            "start": B, "slot_all": B * Q, "gidx": B * Q, "aidx": B * k, "didx": B * k,
                            "amask": B * k}
        self._i32_fields = {"seq0": B, "bt": B * max_blocks_per_req}
        pin = self.device.type == "cuda"
        self._h64 = torch.zeros(sum(self._i64_fields.values()), dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(sum(self._i32_fields.values()), dtype=torch.int32, pin_memory=pin)
        self._d64 = self._h64.to(self.device) if pin else self._h64
        self._d32 = self._h32.to(self.device) if pin else self._h32
        self._host = {**self._views(self._h64, self._i64_fields), **self._views(self._h32, self._i32_fields)}
        self._np = {name: t.numpy() for name, t in self._host.items()}  # (the same memory)
        self._arange = np.arange(Q, dtype=np.int64)
        self._dev = {**self._views(self._d64, self._i64_fields), **self._views(self._d32, self._i32_fields)}
        self._qsl0 = torch.arange(B + 1, dtype=torch.int32, device=self.device) * Q
        self._qsl1 = torch.arange(B + 1, dtype=torch.int32, device=self.device)
        self._qsl_host = {Q: torch.arange(B + 1, dtype=torch.int32) * Q, 1: torch.arange(B + 1, dtype=torch.int32)}
        self._seq_host = torch.full((B,), Q, dtype=torch.int32)
        self._ar_q = torch.arange(Q, dtype=torch.int64, device=self.device)
        self._row_q = torch.arange(B, dtype=torch.int64, device=self.device) * Q
        self._staged = None  # CUDA event after the last staging copy (the host buffer is free after it)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @staticmethod
    def _views(flat: torch.Tensor, fields: dict[str, int]) -> dict[str, torch.Tensor]:
        out, o = {}, 0
        for name, n in fields.items():
            out[name] = flat[o:o + n]
            o += n
        return out

    def fits(self, plan) -> bool:
        """Whether ``run`` takes ``plan``: every request active with 1..``k`` drafts (the
        chain drafts ``k`` for each; a request with less room keeps its first ones), at most
        ``k + 2`` first-forward tokens, at most the largest size of requests, and its
        padded first forward and block list inside the block-table width."""
        seqs, act = plan.seqs, plan.active
        if not seqs or len(act) != len(seqs) or len(seqs) > self.sizes[-1]:
            return False
        cap = self.W * self.block_size
        return (all(1 <= k <= self.k for _, k in act) and [i for i, _ in act] == list(range(len(seqs)))
                and all(len(t) <= self.Q and len(b) <= self.W and s + self.Q <= cap for s, t, b in seqs))

    def _fill(self, plan, bs: int) -> None:
        """The staging rows of ``plan``'s requests and of ``bs - n`` padding requests
        (numpy views of the staging buffers: on the step's critical path, between the
        verification's result and the replay)."""
        self._wait_staged()
        h, Q, W, blk = self._np, self.Q, self.W, self.block_size
        n = len(plan.seqs)
        ids, pos, slots = h["ids"][:bs * Q].reshape(bs, Q), h["pos"][:bs * Q].reshape(bs, Q), h["slots"][:bs * Q]
        ids[:] = 0
        slots[:] = -1
        slots = slots.reshape(bs, Q)
        bt = h["bt"][:bs * W].reshape(bs, W)
        bt[:] = 0
        last, plast, cap, seq0 = h["last"], h["plast"], h["cap"], h["seq0"]
        ar = self._arange
        for r, (start, toks, blocks) in enumerate(plan.seqs):
            q = len(toks)
            p_last = start + q - 1
            ids[r, :q] = toks
            p = np.minimum(ar + start, p_last)  # padding rows: the last real position (RoPE)
            pos[r] = p
            nb = len(blocks)
            bt[r, :nb] = blocks
            slots[r, :q] = bt[r, p[:q] // blk].astype(np.int64) * blk + p[:q] % blk
            last[r], plast[r], cap[r], seq0[r] = r * Q + q - 1, p_last, nb * blk, start + Q
        if bs > n:  # padding requests: read the null block, write nothing
            pos[n:bs] = Q - 1
            last[n:bs] = np.arange(n, bs) * Q + Q - 1
            plast[n:bs] = Q - 1
            cap[n:bs] = 0
            seq0[n:bs] = Q

    def _meta(self, T: int, bs: int, q: int, qsl, seq, bt, slots) -> AttentionMetadata:
        # off CUDA the "device" tensors are host tensors: the torch backend reads them as its
        # host copies. On CUDA the triton backend reads no host copy (a graph cannot sync
        # for one): the padded layout stands in
        if self.device.type == "cuda":
            qsl_h, seq_h = self._qsl_host[q][:bs + 1], self._seq_host[:bs]
        else:
            qsl_h, seq_h = qsl, seq
        return AttentionMetadata(T, bs, q, self.max_model_len, qsl, seq, bt, slots, qsl_h, seq_h)

    def _body(self, bs: int) -> torch.Tensor:
        """The chain at padded batch ``bs`` over the device buffers: int64 [bs, k]."""
        d, Q, blk = self._dev, self.Q, self.block_size
        bt = d["bt"][:bs * self.W].view(bs, self.W)
        seq0 = d["seq0"][:bs]
        meta = self._meta(bs * Q, bs, Q, self._qsl0[:bs + 1], seq0, bt, d["slots"][:bs * Q])
        h = self.model(d["ids"][:bs * Q], d["pos"][:bs * Q], meta)
        tok = self.model.compute_greedy(h.index_select(0, d["last"][:bs]))
        outs = [tok]
        plast, cap = d["plast"][:bs], d["cap"][:bs]
        for j in range(1, self.k):
            p = plast + j
            col = torch.div(p, blk, rounding_mode="floor").clamp(max=self.W - 1).unsqueeze(1)
            b = bt.gather(1, col).squeeze(1).to(torch.int64)
            inside = p < cap
            slots = torch.where(inside, b * blk + p % blk, torch.full_like(p, -1))
            seq = torch.where(inside, p + 1, torch.zeros_like(p)).to(torch.int32)
            meta = self._meta(bs, bs, 1, self._qsl1[:bs + 1], seq, bt, slots)
            # (a request with less room than k drafts past max_model_len: RoPE's table ends
            # there; those drafts are dropped, their KV written nowhere)
            tok = self.model.compute_greedy(self.model(tok, p.clamp(max=self.max_model_len - 1), meta))
            outs.append(tok)
        return torch.stack(outs, dim=1)

    def _size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture(self, capture_error_mode: str = "global") -> float:
        """Capture a graph of every size, largest first (one memory pool). CUDA only;
        returns seconds."""
        t0 = time.perf_counter()
        if hasattr(self.attn, "reserve"):
            self.attn.reserve(self.sizes[-1])
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._host["seq0"][:bs].fill_(self.Q)
            self._host["slots"].fill_(-1)
            self._d64.copy_(self._h64)
            self._d32.copy_(self._h32)
            self._body(bs)  # warm-up (triton compile / autotune)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode=capture_error_mode):
                self.outputs[bs] = self._body(bs)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("Captured %d draft-chain CUDA graphs (k=%d, batch sizes %s..%s) in %.2f s", len(self.sizes),
                    self.k, self.sizes[0], self.sizes[-1], dt)
        return dt

    def run(self, plan) -> torch.Tensor:
        """The drafts of a ``plan`` that ``fits``: int64 [n, k] on the device, request by
        request (``plan.seqs`` order). Without captured graphs the chain runs eagerly at
        the exact batch size."""
        n = len(plan.seqs)
        bs = self._size(n) if self.graphs else n
        self._fill(plan, bs)
        self._copy_staged()
        return self._replay(n, bs)

    def _replay(self, n: int, bs: int) -> torch.Tensor:
        if self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._body(bs)

    def _wait_staged(self) -> None:
        """Before the host staging buffers are refilled: the last copy out of them is done."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def _copy_staged(self) -> None:
        if self._d64 is not self._h64:
            self._d64.copy_(self._h64, non_blocking=True)
            self._d32.copy_(self._h32, non_blocking=True)
            self._staged = torch.cuda.Event()
            self._staged.record()

    def fits_verified(self, reqs) -> bool:
        """Whether ``run_verified`` takes ``reqs``: (start position, first logits row, drafts
        fed, block ids) per request of the verification; at most the largest size of
        requests, and each request's padded first forward and block list inside the table."""
        if not reqs or len(reqs) > self.sizes[-1]:
            return False
        cap = self.W * self.block_size
        return all(0 <= k <= self.k and len(b) <= self.W and s + self.Q <= cap for s, _, k, b in reqs)

    def run_verified(self, reqs, input_ids: torch.Tensor, candidate: torch.Tensor,
                     accepted: torch.Tensor | None) -> torch.Tensor:
        """The chain after a verification, launched before its result is on the host; for
        ``reqs`` that ``fits_verified``. Request r (start ``P``, logits rows ``st .. st +
        k_r``) gets the first forward ``[input_ids[st], candidate[st .. st + a]]`` at
        positions ``P ..``, where ``a`` (0..k_r) is the number of leading accepted drafts:
        what ``DraftModelProposer.propose`` gives it once the result is on the host.

        Args:
            input_ids: int64 [N] (device), the verification's input token per logits row
                (a request's newest token, then its drafts).
            candidate: int64 [N] (device), ``RejectionOutput.candidate``.
            accepted: bool [N] (device), ``RejectionOutput.accepted``; None for greedy
                rows verified without their drafts (a row accepts when its candidate is
                the next row's input token).
        Returns the drafts int64 [n, k] on the device (request by request)."""
        n = len(reqs)
        bs = self._size(n) if self.graphs else n
        self._stage_verified(reqs, bs, int(input_ids.shape[0]))
        self._copy_staged()
        self._derive_verified(n, input_ids, candidate, accepted)
        return self._replay(n, bs)

    def _stage_verified(self, reqs, bs: int, N: int) -> None:
        """Host staging of ``run_verified``: block tables, caps, sequence lengths, each
        request's start, the slot of each of its ``Q`` positions and the gather indices the
        device derives its first forward from; the padding requests' rows as in ``_fill``."""
        self._wait_staged()
        h, Q, K, W, blk = self._np, self.Q, self.k, self.W, self.block_size
        n = len(reqs)
        bt = h["bt"][:bs * W].reshape(bs, W)
        bt[:] = 0
        slot_all, gidx = h["slot_all"][:n * Q].reshape(n, Q), h["gidx"][:n * Q].reshape(n, Q)
        aidx, didx, amask = (h[f][:n * K].reshape(n, K) for f in ("aidx", "didx", "amask"))
        ar, arK = self._arange, self._arange[:K]
        for r, (start, st, k, blocks) in enumerate(reqs):
            nb = len(blocks)
            bt[r, :nb] = blocks
            p = ar + start  # (as _fill: a position past its blocks maps to the null block)
            slot_all[r] = bt[r, p // blk].astype(np.int64) * blk + p % blk
            gidx[r, 0] = st
            gidx[r, 1:] = np.where(ar[:Q - 1] <= k, N + st + ar[:Q - 1], 0)
            j = np.minimum(arK, k)  # (rows past its drafts: masked out)
            aidx[r] = st + j
            didx[r] = st + np.minimum(j + 1, k)
            amask[r] = arK < k
            h["start"][r], h["cap"][r], h["seq0"][r] = start, nb * blk, start + Q
        if bs > n:  # padding requests: read the null block, write nothing
            h["ids"][n * Q:bs * Q] = 0
            h["slots"][n * Q:bs * Q] = -1
            h["pos"][n * Q:bs * Q] = Q - 1
            h["last"][n:bs] = np.arange(n, bs) * Q + Q - 1
            h["plast"][n:bs] = Q - 1
            h["cap"][n:bs] = 0
            h["seq0"][n:bs] = Q

    def _derive_verified(self, n: int, input_ids, candidate, accepted) -> None:
        """Device part of ``run_verified``: the first ``n`` requests' ids, positions, slots,
        last rows and last positions from the verification's tensors (no host read)."""
        d, Q, K = self._dev, self.Q, self.k
        src = torch.cat((input_ids, candidate))
        ok = (candidate[d["aidx"][:n * K]] == input_ids[d["didx"][:n * K]] if accepted is None
              else accepted[d["aidx"][:n * K]])
        ok = (ok & d["amask"][:n * K].bool()).view(n, K)
        a1 = ok.to(torch.int64).cumprod(1).sum(1) + 1  # the last real row: 1 + accepted drafts
        start = d["start"][:n]
        ar = self._ar_q
        real = ar.unsqueeze(0) <= a1.unsqueeze(1)
        d["ids"][:n * Q].copy_(torch.where(real, src[d["gidx"][:n * Q]].view(n, Q), 0).view(-1))
        d["pos"][:n * Q].copy_((start.unsqueeze(1) + torch.minimum(ar, a1.unsqueeze(1))).view(-1))
        d["slots"][:n * Q].copy_(torch.where(real, d["slot_all"][:n * Q].view(n, Q), -1).view(-1))
        d["last"][:n].copy_(self._row_q[:n] + a1)
        d["plast"][:n].copy_(start + a1)

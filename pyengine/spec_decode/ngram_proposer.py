"""N-gram (prompt lookup) proposer (the role of vllm/v1/spec_decode/ngram_proposer.py).

The draft for a context is the run of tokens that followed the latest earlier occurrence
of the context's last ``n`` tokens, for the largest ``n`` in
[``prompt_lookup_min``, ``prompt_lookup_max``] that occurs; none when no such n-gram
occurs. Code editing, summarisation and retrieval answers copy long runs of the prompt,
which is where this pays off.

Cost per request and step (it runs on the host between the target's verification and the
next step, so it adds to every speculative step's wall time): one vectorised comparison of
the context with its last token, then at most ``n_max - 1`` comparisons over the positions
that still match; the context lives in a numpy array per request that grows by the step's
tokens (``all_token_ids`` only ever grows), so no step converts the whole context again."""
from __future__ import annotations

import numpy as np

from pyengine.spec_decode.base import TokenProposer, num_drafts_wanted

__all__ = ["NgramProposer", "ngram_draft"]


def ngram_draft(context, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``context``'s
    last n tokens (n from ``n_max`` down to ``n_min``); [] when none occurs. ``context``:
    a sequence of token ids (non-negative)."""
    pad = max(n_max, 1)
    buf = np.full(pad + len(context), -1, dtype=np.int64)
    buf[pad:] = context
    return _lookup(buf, pad, len(buf), k, n_min, n_max)


def _lookup(buf: np.ndarray, start: int, end: int, k: int, n_min: int, n_max: int) -> list[int]:
    """``ngram_draft`` of the context ``buf[start:end]``, where ``buf[start - n_max:start]``
    holds -1 (so a match running off the context's start fails without a bounds test)."""
    L = end - start
    n_max = min(n_max, L - 1)  # an earlier occurrence needs a token after it
    if n_max < n_min or k <= 0 or n_min < 1:
        return []
    last = end - 1
    # ends of earlier windows (each followed by a token; the suffix itself excluded) whose
    # last token is the context's last token, then those that also match further back
    best = np.flatnonzero(buf[start:last] == buf[last]) + start
    if best.size == 0:
        return []
    best_n = 1
    for d in range(1, n_max):
        nxt = best[buf[best - d] == buf[last - d]]
        if nxt.size == 0:
            break
        best, best_n = nxt, d + 1
    if best_n < n_min:
        return []
    i = int(best[-1]) + 1  # after the latest occurrence of the longest n-gram found
    return buf[i:min(i + k, end)].tolist()


class _Context:
    """A request's tokens in a growing numpy array, after ``pad`` entries of -1 (see
    ``_lookup``): ``committed`` of them are its ``all_token_ids``; the step's new tokens
    are written after those for one lookup."""

    __slots__ = ("request", "buf", "pad", "committed")

    def __init__(self, request, capacity: int, pad: int):
        self.request, self.pad, self.committed = request, pad, 0
        self.buf = np.full(pad + max(capacity, 16), -1, dtype=np.int64)

    def extend(self, all_ids: list[int], new) -> int:
        """Write the tokens the array lacks and the step's ``new`` ones; returns the end."""
        p, c, n = self.pad, self.committed, len(all_ids)
        end = p + n + len(new)
        if end > len(self.buf):
            grown = np.full(max(end, 2 * len(self.buf)), -1, dtype=np.int64)
            grown[:p + c] = self.buf[:p + c]
            self.buf = grown
        if n > c:
            self.buf[p + c:p + n] = all_ids[c:n]
            self.committed = n
        if new:
            self.buf[p + n:end] = new
        return end


class NgramProposer(TokenProposer):
    """``NgramProposer(spec, max_model_len)`` with ``spec`` a ``SpeculativeConfig``."""

    def __init__(self, spec, max_model_len: int):
        super().__init__(spec, max_model_len)
        self._contexts: dict[str, _Context] = {}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._contexts.pop(rid, None)

    def draft(self, request, context, k: int) -> list[int]:
        return ngram_draft(context, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)

    def propose(self, so, sampled, generated, hidden) -> list[list[int]]:
        spec, out = self.spec, []
        for s, g in zip(sampled, generated):
            k = num_drafts_wanted(spec, so, s, len(g), self.max_model_len)
            if not k:
                out.append([])
                continue
            req = s.request
            ctx = self._contexts.get(req.request_id)
            if ctx is None or ctx.request is not req or ctx.committed > req.num_tokens:
                # a new request (or a new one under a finished one's id)
                ctx = self._contexts[req.request_id] = _Context(req, req.num_tokens + 2 * (k + 1),
                                                                spec.prompt_lookup_max)
            end = ctx.extend(req.all_token_ids, g)
            out.append(_lookup(ctx.buf, ctx.pad, end, k, spec.prompt_lookup_min, spec.prompt_lookup_max))
        return out

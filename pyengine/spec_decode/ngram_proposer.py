"""N-gram (prompt lookup) proposer (the role of vllm/v1/spec_decode/ngram_proposer.py).

The draft for a context is the run of tokens that followed the latest earlier occurrence
of the context's last ``n`` tokens, for the largest ``n`` in
[``prompt_lookup_min``, ``prompt_lookup_max``] that occurs; none when no such n-gram
occurs. Code editing, summarisation and retrieval answers copy long runs of the prompt,
which is where this pays off."""
from __future__ import annotations

import numpy as np

from pyengine.spec_decode.base import TokenProposer

__all__ = ["NgramProposer", "ngram_draft"]


def ngram_draft(context, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``context``'s
    last n tokens (n from ``n_max`` down to ``n_min``); [] when none occurs. ``context``:
    a sequence of token ids."""
    a = np.asarray(context, dtype=np.int64)
    L = len(a)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting at 0 .. L-n-1: each is followed by at least one token, none is the suffix
        win = np.lib.stride_tricks.sliding_window_view(a[:L - 1], n)
        hits = np.flatnonzero((win == a[L - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return a[i:i + k].tolist()
    return []


class NgramProposer(TokenProposer):
    """``NgramProposer(spec, max_model_len)`` with ``spec`` a ``SpeculativeConfig``."""

    def draft(self, request, context, k: int) -> list[int]:
        return ngram_draft(context, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)

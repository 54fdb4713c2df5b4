"""The proposer interface the model runner calls (vLLM's proposers have no common base;
this is the one shape ours share)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["Proposer", "TokenProposer", "num_drafts_wanted"]


def num_drafts_wanted(spec, so, s, num_new_tokens: int, max_model_len: int) -> int:
    """How many drafts request ``s`` (a sampled ``ScheduledRequest``) should get after
    this step, which gave it ``num_new_tokens`` tokens: 0 for a constrained request, in a
    step of at least ``disable_by_batch_size`` requests, or at the end of its room
    (max_tokens, max_model_len); else ``num_speculative_tokens`` capped by that room."""
    req = s.request
    if req.structured_output_request is not None:
        return 0
    if spec.disable_by_batch_size is not None and len(so.scheduled) >= spec.disable_by_batch_size:
        return 0
    num_out = req.num_output_tokens + num_new_tokens
    num_tok = req.num_tokens + num_new_tokens
    return max(0, min(spec.num_speculative_tokens, req.max_tokens - num_out - 1, max_model_len - num_tok - 1))


class Proposer:
    """Drafts the next step's tokens. ``propose`` runs once per step after verification
    (also for steps that sample nothing: a model-based proposer writes its KV of prefill
    chunks then)."""

    allows_cuda_graphs = True  # the target's decode steps may replay CUDA graphs

    def kv_bytes_per_block(self) -> int:
        """Bytes of the proposer's own KV cache per block (0: none)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's KV cache of ``num_blocks`` blocks (the target's count)."""

    def forget(self, request_ids) -> None:
        """These requests finished."""

    def propose(self, so, sampled: Sequence, generated: Sequence[Sequence[int]],
                hidden: Optional[torch.Tensor]) -> list[list[int]]:
        """Drafts per sampled row (``sampled[i]``, a ``ScheduledRequest``, got the tokens
        ``generated[i]`` this step, not yet in its ``all_token_ids``). ``so``: the step's
        ``SchedulerOutput``; ``hidden``: the target's hidden states of the step's tokens
        [T, H] (device)."""
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

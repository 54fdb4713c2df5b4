"""Rejection sampler of speculative decoding (the role of vllm/v1/sample/rejection_sampler.py).

A request that fed ``k`` draft tokens ``d_0 .. d_{k-1}`` after its newest token has
``k + 1`` logits rows: row ``j`` is the target's distribution of the token after
``d_{j-1}`` (row 0: after the newest token). The rows are processed exactly as the plain
sampler processes a row (``pyengine.worker.sampler``: allowed ids, bad words, min_tokens,
penalties, the thinking budget, then temperature / min-p / top-k / top-p), with each row's metadata built as
if the drafts before it were already output tokens (``SamplingState.metadata`` with
``drafts``). Then, row by row:

- greedy rows: the draft is accepted while it equals the row's argmax; the first row
  whose argmax differs gives that argmax instead; when all ``k`` are accepted, row ``k``'s
  argmax is the bonus token. The output is the target's own greedy continuation.
- random rows (speculative sampling, Leviathan et al. / Chen et al.): draft ``d_j`` drawn
  from ``q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first
  rejected row gives a sample of ``normalize(max(p_j - q_j, 0))``; the bonus row a sample
  of ``p_k``. Each emitted token is then distributed as ``p`` (the test
  ``tests/worker/test_rejection_sampler.py`` checks it on synthetic p and q). Every
  proposer here drafts deterministically, so ``q_j`` is one-hot at ``d_j``: accept with
  probability ``p_j(d_j)``, recover from ``p_j`` with ``d_j`` removed.

Randomness: every row takes one ``V``-sized exponential vector (``draw_exponentials``:
a seeded row's is a function of its seed and position), and with one-hot drafts the
decision is coupled to the row's own sample: the row samples ``t`` as ``Sampler`` would
and accepts its draft iff ``t`` is the draft. So a seeded request emits, position by
position, the tokens it emits without speculation, whatever the drafts, the rows a step
verified or threw away, or the scheduling — given the same target logits: bit-equal in
float32; in bf16 a verification forward of several tokens rounds differently from one-token
decode, so the outputs can part where a draw falls within that rounding (as greedy's do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.worker.sampler import (
    SamplingMetadata,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_thinking_budget,
    apply_top_k_top_p,
    compute_logprobs,
    draw_exponentials,
    gather_logprobs,
)

__all__ = ["RejectionSampler", "RejectionOutput", "rejection_sample"]

_SAMPLING_EPS = 1e-5


@dataclass
class RejectionOutput:
    """Per logits row (``N`` rows, all on the device).

    candidate: int64 [N], the token the row emits if the run gets that far: the draft
      when it was accepted, else the target's (greedy argmax, recovered or bonus sample).
    accepted: bool [N], the row's draft was accepted (False on rows without a draft); None
      for all-greedy rows verified without their draft ids (see ``RejectionSampler``).
    logprobs_token_ids / logprobs / ranks: as ``SamplerOutput``'s, for ``candidate``
      (raw model logprobs); None when no row asked for logprobs.

    A request's emitted tokens are ``candidate`` over its rows up to and including the
    first row that is not accepted (``RejectionSampler.emitted``)."""
    candidate: torch.Tensor
    accepted: torch.Tensor | None
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


def rejection_sample(probs: torch.Tensor, draft_ids: torch.Tensor, exponentials: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, uniforms: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative-sampling decision per row.

    Args:
        probs: float32 [N, V], the target distribution p of each row (rows sum to 1).
        draft_ids: int64 [N], the row's draft token, -1 on rows without one (bonus rows).
        exponentials: float32 [N, V], Exp(1), > 0.
        draft_probs: float32 [N, V], the distribution q each draft was drawn from; None:
            one-hot at the draft (deterministic proposers, every proposer here).
        uniforms: float32 [N] in [0, 1); needed with ``draft_probs`` only.
    Returns:
        (accepted bool [N], token int64 [N]): ``token`` is the draft where accepted, else
        a sample of ``normalize(max(p - q, 0))`` (of ``p`` on rows without a draft),
        drawn by the exponential race ``argmax(w / E)`` (exact for unnormalized weights).
        One-hot q: the row's own sample ``t = argmax(p / E)``, accepted iff ``t`` is the
        draft (probability p(d); rejected, ``t`` is distributed as p without d,
        renormalised: the residual). So a row emits the token it would emit with no
        draft from the same ``E`` and the same ``p`` (a seeded row: the same token as without
        speculation where its logits are the same).
    Raises:
        ValueError: ``draft_probs`` without ``uniforms``.
    """
    has = draft_ids >= 0
    if draft_probs is None:
        t = probs.div(exponentials).argmax(dim=-1)
        return has & (t == draft_ids), t
    if uniforms is None:
        raise ValueError("rejection_sample: a general draft distribution needs uniforms.")
    d = draft_ids.clamp(min=0).unsqueeze(1)
    p_d = probs.gather(1, d).squeeze(1)
    q_d = draft_probs.gather(1, d).squeeze(1)
    accepted = has & (uniforms * q_d < p_d)
    residual = (probs - draft_probs).clamp_(min=0.0)
    weights = torch.where(has.unsqueeze(1), residual, probs)
    recovered = weights.div(exponentials).argmax(dim=-1)
    return accepted, torch.where(accepted, draft_ids, recovered)


class RejectionSampler:
    """Stateless; ``sampler(logits, meta, draft_ids)``."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, draft_ids: torch.Tensor | None
                 ) -> RejectionOutput:
        """Verify a batch of rows.

        Args:
            logits: float32 [N, V] (device), the target's logits at every verified row.
            meta: ``SamplingMetadata`` of the N rows (each request's rows share its
                parameters and generator; row j's output tokens include the drafts
                before it).
            draft_ids: int64 [N] (device), the draft token each row checks, -1 for none.
                May be None when ``meta.all_greedy``: the candidates are then the argmaxes
                whatever the drafts, ``accepted`` is None, and the caller compares them
                with its drafts (a greedy row accepts its draft when it is the argmax).
        Raises:
            ValueError: if ``logits`` is not [N, V] with N = meta's rows, ``draft_ids``
                is missing for rows that are not all greedy, or ``meta`` has seeds but no
                positions.
        """
        n_drafts = meta.batch_size if draft_ids is None else draft_ids.shape[0]
        if logits.dim() != 2 or logits.shape[0] != meta.batch_size or n_drafts != meta.batch_size:
            raise ValueError(f"logits must be [N={meta.batch_size}, V] with one draft id per row, got "
                             f"{tuple(logits.shape)} and {n_drafts} draft ids.")
        if draft_ids is None and not meta.all_greedy:
            raise ValueError("draft_ids are needed for rows that are not all greedy.")
        logits = logits.float()
        raw = compute_logprobs(logits) if meta.max_num_logprobs is not None else None
        x = apply_allowed_token_ids(logits, meta)
        x = apply_bad_words(x, meta)
        x = apply_min_tokens(x, meta)
        x = apply_penalties(x, meta)
        x = apply_thinking_budget(x, meta)
        if meta.all_greedy:
            # the argmax, accepted or not; a row without a draft (-1) never equals it
            target = x.argmax(dim=-1)
            out = RejectionOutput(target, None if draft_ids is None else target == draft_ids)
        else:
            t = apply_temperature(x, meta.temperature, meta.all_random)
            if not meta.no_min_p:
                t = apply_min_p(t, meta.min_p)
            t = apply_top_k_top_p(t, meta.top_k, meta.top_p, meta.max_top_k)
            probs = torch.softmax(t, dim=-1)
            e = draw_exponentials(meta, probs.shape[0], probs.shape[1], probs.device)
            accepted, target = rejection_sample(probs, draft_ids, e)
            if not meta.all_random:
                greedy_rows = meta.temperature < _SAMPLING_EPS
                g = x.argmax(dim=-1)
                target = torch.where(greedy_rows, g, target)
                accepted = torch.where(greedy_rows, g == draft_ids, accepted)
            out = RejectionOutput(torch.where(accepted, draft_ids, target), accepted)
        if raw is not None:
            out.logprobs_token_ids, out.logprobs, out.ranks = gather_logprobs(raw, meta.max_num_logprobs, out.candidate)
        return out

    @staticmethod
    def emitted(candidate: list[int], accepted: list[bool], start: int, num_drafts: int) -> list[int]:
        """A request's emitted tokens from its rows ``start .. start + num_drafts`` (host
        lists): the accepted drafts, then the first non-accepted row's token."""
        out = []
        for j in range(start, start + num_drafts + 1):
            out.append(candidate[j])
            if j == start + num_drafts or not accepted[j]:
                break
        return out

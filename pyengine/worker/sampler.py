"""Token sampler: penalties, greedy/random sampling, top-k/top-p/min-p, logprobs.

Mirrors ``vllm/v1/sample/sampler.py`` (with the pieces of ``vllm/v1/sample/metadata.py``,
``vllm/v1/sample/ops/penalties.py`` and ``vllm/v1/sample/ops/topk_topp_sampler.py`` that it
uses).

Everything in :meth:`Sampler.__call__` runs on the logits' device with no host
synchronisation: no ``.item()``, ``.tolist()``, ``.cpu()`` and no Python branch on a tensor
value. The only branches are on host-side flags that :meth:`SamplingMetadata.build`
computed from the Python ``SamplingParams`` (``all_greedy``, ``no_top_p``, ...), so a
step whose requests need no penalties, seeds or filters pays for none of them.

Order of operations, per row (as vLLM v1 by default):

1. ``raw logprobs = log_softmax(logits)`` (only if some row asked for logprobs) -- the
   logprobs reported to the user are those of the model, before any processing.
2. ``allowed_token_ids``: every other token of the row gets ``-inf``.
3. ``bad_words`` (vLLM's ``vllm/v1/sample/ops/bad_words.py``): the last token of each
   banned token sequence gets ``-inf`` where the row's output ends with the sequence's
   other tokens (always, for a one-token sequence). Under async scheduling the newest
   output token may exist only on the device: the host then matches the rest and the
   device compares that token (``SamplingMetadata.last_token_ids``), with no sync.
4. ``min_tokens``: while a row has produced fewer than ``min_tokens`` tokens, its stop
   token ids (``SamplingParams.all_stop_token_ids``, which include EOS) get ``-inf``.
5. Penalties: repetition (prompt and output tokens), frequency and presence (output
   tokens only).
6. ``thinking_token_budget``: a row whose reasoning has used its budget and not ended gets
   ``-inf`` everywhere but the reasoning's end token (forced next). The host decides from
   the request's output (``SamplingState``); where the newest token is a placeholder it
   gives, per row, the outcome for each kind of that token (the end tag: no; the start tag
   or any other: yes or no) and the device picks by ``last_token_ids``, with no sync.
7. Greedy rows (``temperature < 1e-5``): argmax.
8. Random rows: temperature, min-p, top-k, top-p, then one draw with the
   exponential-race trick ``argmax(probs / q)``, ``q ~ Exp(1)``, which is an exact sample
   from ``probs``. A seeded row's ``q`` is a function of its seed and its position only
   (``pyengine.ops.seeded_exponentials``), so a seeded request's draws are the same
   whatever else is in the batch, under sync or async scheduling, with or without
   speculative decoding, and across preemptions; its tokens are then the same wherever
   its logits are. They are bit-equal in float32; in bf16 a multi-token forward
   (verification, a preempted request's recompute) or another batch shape can round the
   logits differently, so there, as for greedy, the tokens agree only until a draw falls
   within that rounding of another token's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pyengine import ops
from pyengine.sampling_params import SamplingParams

__all__ = [
    "SamplingMetadata",
    "SamplerOutput",
    "Sampler",
    "apply_allowed_token_ids",
    "apply_bad_words",
    "apply_min_tokens",
    "apply_thinking_budget",
    "apply_penalties",
    "apply_temperature",
    "apply_min_p",
    "apply_top_k_top_p",
    "random_sample",
    "draw_exponentials",
    "compute_logprobs",
    "gather_logprobs",
]

# Same threshold as SamplingParams.sampling_type_greedy.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of ``B`` rows over a vocabulary of ``V``.

    Mirrors ``vllm/v1/sample/metadata.py``. Build it with :meth:`build`. All tensors live
    on ``device``; the flags and ints are host-side values computed from the Python
    parameters, and they are the only things the sampler branches on.

    Attributes:
        temperature: float32 [B]; the request's temperature (0 for greedy rows).
        top_p: float32 [B] in (0, 1], or None when ``no_top_p``.
        top_k: int64 [B], ``V`` for rows without top-k, or None when ``no_top_k``.
        min_p: float32 [B] in [0, 1], or None when ``no_min_p``.
        seeds: row index -> ``SamplingParams.seed`` for seeded *random* rows (greedy rows
            never consume randomness); their draws need ``positions``.
        positions: int64 [B], each row's input position (the token it samples goes at
            ``position + 1``); set by the caller (the model runner) when ``seeds``.
        all_greedy / all_random: every row greedy / every row random.
        no_top_p / no_top_k / no_min_p / no_penalties: no row uses that feature.
        max_top_k: the largest top-k among rows that use top-k (0 when ``no_top_k``);
            host int, so ``torch.topk`` needs no host sync.
        max_num_logprobs: the largest ``SamplingParams.logprobs`` of any row, or None if no
            row asked for logprobs.
        prompt_token_mask: bool [B, V], True where the token occurs in the row's prompt
            (None when ``no_penalties``).
        output_token_counts: int32 [B, V], occurrences of each token in the row's output
            so far (None when ``no_penalties``).
        presence_penalties / frequency_penalties / repetition_penalties: float32 [B] (None
            when ``no_penalties``).
        min_tokens_rows / min_tokens_cols: int64 [N] coordinates of (row, stop token)
            pairs to mask with ``-inf`` because the row has not reached ``min_tokens``
            yet; None when there are none.
        allowed_rows: int64 [R], the rows restricted to their ``allowed_token_ids``;
            allowed_idx: int64 [2, A], the (row, token) pairs they may sample; None when
            no row has ``allowed_token_ids``.
        bad_words_idx: int64 [3, M], (row, token, required newest token) triples: the
            token gets ``-inf`` in the row when the third entry is -1 or equals the row's
            newest output token held on the device (``last_token_ids``); None when no
            token is banned this step.
        bad_words_need_last: some triple depends on ``last_token_ids`` (async scheduling's
            placeholders); the caller must then set ``last_token_ids``.
        thinking_idx: int64 [6, F], per row that the thinking budget may force: (row, end
            token, depends on the newest token, start token or -1, forced if the newest
            token is the start token, forced if it is any other but the end token); a row
            that does not depend on the newest token is forced. None when no row is.
        thinking_need_last: some row of ``thinking_idx`` depends on ``last_token_ids``.
        last_token_ids: int64 [B], per row the newest output token where the host has not
            seen it (a placeholder), anything elsewhere; set by the caller (the model
            runner, from the previous step's sampled ids) when ``bad_words_need_last`` or
            ``thinking_need_last``.
    """
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: dict[int, int] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    no_top_p: bool = True
    no_top_k: bool = True
    no_min_p: bool = True
    no_penalties: bool = True
    max_top_k: int = 0
    max_num_logprobs: int | None = None
    prompt_token_mask: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_cols: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None
    allowed_idx: torch.Tensor | None = None
    bad_words_idx: torch.Tensor | None = None
    bad_words_need_last: bool = False
    thinking_idx: torch.Tensor | None = None
    thinking_need_last: bool = False
    last_token_ids: torch.Tensor | None = None

    @property
    def need_last_token_ids(self) -> bool:
        """Some mask compares the newest output token on the device (``last_token_ids``)."""
        return self.bad_words_need_last or self.thinking_need_last

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int | None],
        vocab_size: int,
        device: torch.device | str,
        thinking: Sequence[tuple[int, int, int, int, int] | None] | None = None,
    ) -> SamplingMetadata:
        """Build the metadata of one step from per-row Python values.

        Args:
            params: one ``SamplingParams`` per row (length ``B``).
            prompt_token_ids: per row, the prompt token ids (only read when some row has a
                penalty).
            output_token_ids: per row, the tokens generated so far (read when some row has
                a penalty, an unmet ``min_tokens`` or ``bad_words``; for bad words alone
                the last ``longest banned sequence - 1`` tokens suffice). A last entry of
                -1 stands for a token sampled on the device that the host has not seen
                (async scheduling): a banned sequence that needs it is resolved on the
                device through ``last_token_ids``.
            seeds: per row, the request's ``SamplingParams.seed`` or None. Ignored for
                greedy rows.
            vocab_size: ``V``, the width of the logits.
            device: where the tensors go (the logits' device).
            thinking: per row, None (the thinking budget does not force it) or ``(end token,
                depends on the newest token (0/1), start token or -1, forced if the newest
                token is the start token (0/1), forced if it is another token but the end
                token (0/1))``, as ``SamplingState`` works it out; None: no row.

        Raises:
            ValueError: if the per-row sequences do not all have length ``B``.

        Cost: one small host-to-device copy in the common case (no penalties, no
        ``min_tokens``); the ``[B, V]`` penalty tensors are built only when some row needs
        them.
        """
        B = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(seeds) == B) or (
                thinking is not None and len(thinking) != B):
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and seeds must have the "
                f"same length, got {B}, {len(prompt_token_ids)}, {len(output_token_ids)}, "
                f"{len(seeds)}.")
        device = torch.device(device)
        pin = device.type == "cuda" and torch.cuda.is_available()

        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        pres: list[float] = []
        freq: list[float] = []
        rep: list[float] = []
        row_seeds: dict[int, int] = {}
        num_greedy = 0
        no_top_p = no_top_k = no_min_p = no_penalties = True
        max_top_k = 0
        max_num_logprobs: int | None = None
        mt_rows: list[int] = []
        mt_cols: list[int] = []
        al_rows: list[int] = []
        al_r: list[int] = []
        al_c: list[int] = []
        bw: list[tuple[int, int, int]] = []
        for i, p in enumerate(params):
            greedy = p.temperature < _SAMPLING_EPS
            temps.append(p.temperature)
            if greedy:
                num_greedy += 1
                # Filters are irrelevant for greedy rows: neutral values keep the random
                # path cheap (and the rows are overwritten by argmax anyway).
                top_ps.append(1.0)
                top_ks.append(vocab_size)
                min_ps.append(0.0)
            else:
                top_ps.append(p.top_p)
                k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
                top_ks.append(k)
                min_ps.append(p.min_p)
                if p.top_p < 1.0:
                    no_top_p = False
                if k < vocab_size:
                    no_top_k = False
                    max_top_k = max(max_top_k, k)
                if p.min_p > _SAMPLING_EPS:
                    no_min_p = False
                if seeds[i] is not None:
                    row_seeds[i] = seeds[i]
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    or p.repetition_penalty != 1.0):
                no_penalties = False
            if p.logprobs is not None:
                max_num_logprobs = (p.logprobs if max_num_logprobs is None
                                    else max(max_num_logprobs, p.logprobs))
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                for t in p.all_stop_token_ids:
                    if 0 <= t < vocab_size:
                        mt_rows.append(i)
                        mt_cols.append(t)
            if p.allowed_token_ids is not None:
                al_rows.append(i)
                al_r.extend([i] * len(p.allowed_token_ids))
                al_c.extend(p.allowed_token_ids)
            if p.bad_words_token_ids:
                _match_bad_words(i, p.bad_words_token_ids, output_token_ids[i], bw)
        # One host->device copy for all per-row float parameters.
        rows = [temps, top_ps, min_ps]
        if not no_penalties:
            rows += [pres, freq, rep]
        packed = torch.tensor(rows, dtype=torch.float32, pin_memory=pin)
        packed = packed.to(device, non_blocking=True)
        meta = cls(
            temperature=packed[0],
            all_greedy=num_greedy == B,
            all_random=num_greedy == 0,
            top_p=None if no_top_p else packed[1],
            min_p=None if no_min_p else packed[2],
            seeds=row_seeds,
            no_top_p=no_top_p,
            no_top_k=no_top_k,
            no_min_p=no_min_p,
            no_penalties=no_penalties,
            max_top_k=max_top_k,
            max_num_logprobs=max_num_logprobs,
        )
        if not no_top_k:
            meta.top_k = torch.tensor(top_ks, dtype=torch.int64, pin_memory=pin).to(
                device, non_blocking=True)
        if not no_penalties:
            meta.presence_penalties = packed[3]
            meta.frequency_penalties = packed[4]
            meta.repetition_penalties = packed[5]
            meta.prompt_token_mask = _token_presence(prompt_token_ids, vocab_size, device,
                                                     pin)
            meta.output_token_counts = _token_counts(output_token_ids, vocab_size, device,
                                                     pin)
        if mt_rows:
            idx = torch.tensor([mt_rows, mt_cols], dtype=torch.int64, pin_memory=pin).to(
                device, non_blocking=True)
            meta.min_tokens_rows = idx[0]
            meta.min_tokens_cols = idx[1]
        if al_rows:
            # one copy: [restricted rows | allowed (row) | allowed (token)]
            flat = torch.tensor(al_rows + al_r + al_c, dtype=torch.int64, pin_memory=pin).to(
                device, non_blocking=True)
            R = len(al_rows)
            meta.allowed_rows = flat[:R]
            meta.allowed_idx = flat[R:].view(2, -1)
        if bw:
            meta.bad_words_idx = torch.tensor([list(c) for c in zip(*bw)], dtype=torch.int64,
                                              pin_memory=pin).to(device, non_blocking=True)
            meta.bad_words_need_last = any(t[2] >= 0 for t in bw)
        th = [(i, *t) for i, t in enumerate(thinking or ()) if t is not None]
        if th:
            meta.thinking_idx = torch.tensor([list(c) for c in zip(*th)], dtype=torch.int64,
                                             pin_memory=pin).to(device, non_blocking=True)
            meta.thinking_need_last = any(t[2] for t in th)
        return meta


def _match_bad_words(row: int, words: Sequence[Sequence[int]], out: Sequence[int],
                     found: list[tuple[int, int, int]]) -> None:
    """Append ``(row, token, required newest token or -1)`` for each banned sequence of
    ``words`` whose last token must be masked after output ``out`` (vLLM's
    ``_apply_bad_words_single_batch``; ``out``'s trailing -1: see ``build``)."""
    n = len(out)
    pending = n > 0 and out[-1] == -1  # the newest token is on the device only
    for word in words:
        k = len(word) - 1  # tokens that must precede the banned one
        if k == 0:
            found.append((row, word[0], -1))
            continue
        if k > n:
            continue
        if not pending:
            if all(out[n - k + j] == word[j] for j in range(k)):
                found.append((row, word[k], -1))
        elif all(out[n - k + j] == word[j] for j in range(k - 1)):
            found.append((row, word[k], word[k - 1]))


def _padded_ids(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                pin: bool) -> torch.Tensor | None:
    """Ragged rows right-padded with ``V`` (an extra bin dropped later): int64 [B, L] on
    ``device``, or None when every row is empty. Ids outside ``[0, V)`` also go to ``V``."""
    max_len = max((len(t) for t in token_ids), default=0)
    if max_len == 0:
        return None
    padded = torch.tensor([list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids],
                          dtype=torch.int64, pin_memory=pin)
    padded.masked_fill_((padded < 0) | (padded > vocab_size), vocab_size)
    return padded.to(device, non_blocking=True)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device, pin: bool) -> torch.Tensor:
    """Per-row token histograms: int32 [B, V] via ``scatter_add`` on ``device``."""
    counts = torch.zeros((len(token_ids), vocab_size + 1), dtype=torch.int32, device=device)
    padded = _padded_ids(token_ids, vocab_size, device, pin)
    if padded is not None:
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def _token_presence(token_ids: Sequence[Sequence[int]], vocab_size: int,
                    device: torch.device, pin: bool) -> torch.Tensor:
    """Per-row presence mask: bool [B, V], True where the token occurs in the row."""
    mask = torch.zeros((len(token_ids), vocab_size + 1), dtype=torch.bool, device=device)
    padded = _padded_ids(token_ids, vocab_size, device, pin)
    if padded is not None:
        mask.scatter_(1, padded, True)
    return mask[:, :vocab_size]


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of ``B`` rows (all tensors on the device).

    Attributes:
        sampled_token_ids: int64 [B].
        logprobs_token_ids: int64 [B, k+1] with ``k = meta.max_num_logprobs``: column 0 is
            the sampled token, columns 1.. the top-k tokens by raw logprob (descending);
            None when no row asked for logprobs.
        logprobs: float32 [B, k+1], the raw model log-probabilities of those tokens.
        sampled_token_ranks: int64 [B], rank of the sampled token under the raw logprobs
            (1 = most likely): the number of tokens whose logprob is >= the sampled one's.
    """
    sampled_token_ids: torch.Tensor
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


# ----------------------------------------------------------------------------- ops


def apply_allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``-inf`` for every token a restricted row may not sample: returns float32 [B, V]
    (new tensor if any row is restricted, else ``logits`` itself)."""
    if meta.allowed_rows is None:
        return logits
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    # device-side values: ``banned[rows] = True`` would copy a host scalar (a sync on CUDA)
    true = torch.ones((), dtype=torch.bool, device=logits.device)
    banned.index_put_((meta.allowed_rows,), true)
    banned.index_put_((meta.allowed_idx[0], meta.allowed_idx[1]), ~true)
    return logits.masked_fill(banned, float("-inf"))


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``-inf`` for the banned tokens of ``meta.bad_words_idx`` (see ``SamplingMetadata``):
    returns float32 [B, V] (new tensor if any, else ``logits`` itself). The conditional
    ones compare ``meta.last_token_ids`` on the device: adding 0 or ``-inf`` at each
    triple (``accumulate``) leaves no race between triples that share a cell."""
    if meta.bad_words_idx is None:
        return logits
    rows, cols, need = meta.bad_words_idx
    if not meta.bad_words_need_last:
        neg_inf = torch.full((), float("-inf"), device=logits.device, dtype=logits.dtype)
        return logits.index_put((rows, cols), neg_inf)
    if meta.last_token_ids is None:
        raise ValueError("SamplingMetadata.last_token_ids must be set when bad_words_need_last.")
    ban = (need < 0) | (need == meta.last_token_ids[rows])
    zero = torch.zeros((), device=logits.device, dtype=logits.dtype)
    add = torch.where(ban, torch.full_like(zero, float("-inf")), zero)
    return logits.index_put((rows, cols), add, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask stop tokens of rows below ``min_tokens``: returns float32 [B, V] (new tensor
    if anything is masked, else ``logits`` itself)."""
    if meta.min_tokens_rows is None:
        return logits
    neg_inf = torch.full((), float("-inf"), device=logits.device, dtype=logits.dtype)
    return logits.index_put((meta.min_tokens_rows, meta.min_tokens_cols), neg_inf)


def apply_thinking_budget(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Force the reasoning's end token in the rows of ``meta.thinking_idx`` that the budget
    stops (see ``SamplingMetadata``): such a row becomes ``-inf`` but 0 at its end token, so
    greedy, random and rejection sampling all pick it. Returns float32 [B, V] (new tensor
    if any row may be forced, else ``logits`` itself)."""
    if meta.thinking_idx is None:
        return logits
    rows, ends, dep, start, if_start, if_other = meta.thinking_idx
    forced = torch.full((rows.shape[0], logits.shape[1]), float("-inf"), device=logits.device,
                        dtype=logits.dtype).scatter_(1, ends.unsqueeze(1), 0.0)
    if meta.thinking_need_last:
        if meta.last_token_ids is None:
            raise ValueError("SamplingMetadata.last_token_ids must be set when thinking_need_last.")
        last = meta.last_token_ids[rows]
        on = (dep == 0) | ((last != ends) & (torch.where(last == start, if_start, if_other) != 0))
        forced = torch.where(on.unsqueeze(1), forced, logits[rows])
    return logits.index_put((rows,), forced)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (``vllm/v1/sample/ops/penalties.py``).

    For every token seen in the prompt *or* the output, a positive logit is divided by the
    row's ``repetition_penalty`` and a non-positive one multiplied by it (HF/vLLM rule).
    Then ``logit -= frequency_penalty * count_in_output`` and
    ``logit -= presence_penalty * (count_in_output > 0)``.

    Args:
        logits: float32 [B, V]; not modified.
    Returns:
        float32 [B, V] (``logits`` itself when ``meta.no_penalties``).
    """
    if meta.no_penalties:
        return logits
    counts = meta.output_token_counts
    in_output = counts > 0
    seen = meta.prompt_token_mask | in_output
    rep = meta.repetition_penalties.unsqueeze(1)
    scale = torch.where(seen, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    # a penalty near float32's smallest normal overflows a positive logit: keep it the largest
    # finite value, not inf (softmax of inf is NaN)
    logits = logits.clamp_(max=torch.finfo(torch.float32).max)
    logits = logits - meta.frequency_penalties.unsqueeze(1) * counts.to(logits.dtype)
    logits = logits - meta.presence_penalties.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                      all_random: bool) -> torch.Tensor:
    """Divide each row by its temperature (float32 [B]); greedy rows (temperature ~ 0) are
    divided by 1 instead so they stay finite. Returns a new float32 [B, V]."""
    if not all_random:
        temperature = torch.where(temperature < _SAMPLING_EPS,
                                  torch.ones_like(temperature), temperature)
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (``-inf``) tokens whose probability is below ``min_p * max_prob`` of the row.

    Args:
        logits: float32 [B, V] (after temperature); min_p: float32 [B].
    Returns:
        a new float32 [B, V].
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """Keep, per row, the ``k`` most likely tokens, then the smallest set of the most
    likely ones whose probability mass is >= ``p`` (the top token is always kept); the
    rest get ``-inf``. Mirrors ``vllm/v1/sample/ops/topk_topp_sampler.py``.

    Args:
        logits: float32 [B, V] (after temperature).
        top_k: int64 [B] in [1, V] (``V`` = disabled) or None.
        top_p: float32 [B] in (0, 1] or None.
        max_top_k: host int, the largest value in ``top_k`` below ``V`` (lets the
            top-k-only path use ``torch.topk`` without a host sync).
    Returns:
        float32 [B, V] (``logits`` itself when both are None).

    Every token tied with the k-th largest value is kept, on both paths (as vLLM's), so a
    row's kept set never depends on whether another row of the batch uses top-p. Among
    tokens tied at the top-p boundary the stable sort's order (lower token id first)
    decides. A row with ``p == 1`` drops nothing (a float32 cumulative sum can reach 1.0
    before the tail); a boundary that falls exactly on a float32 cumulative sum is
    resolved by its rounding.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_p is None:
        # Top-k only: no full sort. The k-th largest value of each row is the threshold.
        k = min(max(max_top_k, 1), V)
        topk_vals = torch.topk(logits, k, dim=-1).values  # [B, k], descending
        kk = top_k.clamp(1, k) - 1
        threshold = topk_vals.gather(1, kk.unsqueeze(1))
        disabled = (top_k >= V).unsqueeze(1)
        threshold = threshold.masked_fill(disabled, float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))

    # stable: ties keep token-id order, so a row's result does not depend on its batch
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    if top_k is not None:
        # the k-th value as threshold (not the k-th position): ties with it stay, as above
        kth = sorted_logits.gather(1, (top_k.clamp(1, V) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly above each position; keep while it is below p.
    mass_above = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def draw_exponentials(meta: SamplingMetadata, num_rows: int, vocab_size: int, device) -> torch.Tensor:
    """float32 [num_rows, vocab_size] of Exp(1) draws, > 0: the seeded rows' from their
    (seed, position) (``pyengine.ops.seeded_exponentials``), the others' from torch's
    default generator. Raises ValueError when ``meta`` has seeds but no ``positions``."""
    q = torch.empty(num_rows, vocab_size, device=device)
    if len(meta.seeds) != num_rows:
        q.exponential_()
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would make 0/0 = nan win the argmax
    if meta.seeds:
        if meta.positions is None:
            raise ValueError("SamplingMetadata.positions is needed for seeded rows.")
        rows = sorted(meta.seeds)
        seeds = [meta.seeds[r] for r in rows]
        if len(rows) == num_rows:
            return ops.seeded_exponentials(seeds, meta.positions, vocab_size)
        idx = torch.tensor(rows, dtype=torch.int64, pin_memory=q.is_cuda).to(device, non_blocking=True)  # (no sync)
        q.index_copy_(0, idx, ops.seeded_exponentials(seeds, meta.positions.index_select(0, idx), vocab_size))
    return q


def random_sample(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One draw per row from ``probs`` (float32 [B, V], rows sum to 1), int64 [B].

    ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. picks token ``i`` with probability
    ``probs[i]`` and needs no host round trip. A seeded row's ``q`` depends only on its
    seed and position (``draw_exponentials``), so its result depends only on its own
    probabilities, seed and position. Zero-probability tokens are never drawn.
    """
    return probs.div(draw_exponentials(meta, probs.shape[0], probs.shape[1], probs.device)).argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] log-softmax of the raw logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled-token logprob plus the top ``num_logprobs`` (``vllm`` ``gather_logprobs``).

    Args:
        logprobs: float32 [B, V]; num_logprobs: k >= 0; token_ids: int64 [B].
    Returns:
        (ids int64 [B, k+1], logprobs float32 [B, k+1], ranks int64 [B]); column 0 is the
        sampled token; rank = number of tokens whose logprob is >= the sampled one's.
    """
    token_ids = token_ids.unsqueeze(1)
    token_lp = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_lp).sum(dim=-1)
    if num_logprobs > 0:
        top_lp, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        lps = torch.cat([token_lp, top_lp], dim=1)
    else:
        ids, lps = token_ids, token_lp
    return ids, lps, ranks


# ------------------------------------------------------------------------- sampler


class Sampler:
    """Samples one token per row. Mirrors ``vllm/v1/sample/sampler.py``.

    Stateless; call it as ``sampler(logits, meta)``.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample a batch.

        Args:
            logits: float32 [B, V] on the device (other float dtypes are upcast); not
                modified.
            meta: from :meth:`SamplingMetadata.build` for the same ``B`` and ``V``.
        Returns:
            :class:`SamplerOutput`; logprobs are raw model logprobs (before penalties and
            temperature), as vLLM v1's default ``raw_logprobs`` mode.
        Raises:
            ValueError: if ``logits`` is not 2-D with ``B`` rows.
        """
        if logits.dim() != 2 or logits.shape[0] != meta.batch_size:
            raise ValueError(f"logits must be [B={meta.batch_size}, V], got "
                             f"{tuple(logits.shape)}.")
        logits = logits.float()
        raw_logprobs = (compute_logprobs(logits) if meta.max_num_logprobs is not None
                        else None)
        logits = apply_allowed_token_ids(logits, meta)
        logits = apply_bad_words(logits, meta)
        logits = apply_min_tokens(logits, meta)
        logits = apply_penalties(logits, meta)
        logits = apply_thinking_budget(logits, meta)
        sampled = self.sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps, ranks = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_token_ids=ids,
                             logprobs=lps, sampled_token_ranks=ranks)

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy and/or random sampling of processed logits float32 [B, V] -> int64 [B]."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        x = apply_temperature(logits, meta.temperature, meta.all_random)
        if not meta.no_min_p:
            x = apply_min_p(x, meta.min_p)
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p, meta.max_top_k)
        probs = torch.softmax(x, dim=-1)
        sampled = random_sample(probs, meta)
        if greedy is None:
            return sampled
        return torch.where(meta.temperature < _SAMPLING_EPS, greedy, sampled)

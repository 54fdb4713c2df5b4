"""Per-request sampling state kept by the model runner across steps: the seeded
``torch.Generator`` of each seeded random request, and (async scheduling) the state it
had before its last draw, so a draw whose token was dropped can be undone. Builds each
step's ``SamplingMetadata`` (mirrors the role of vllm/v1/worker/gpu_input_batch.py's
sampling state)."""
from __future__ import annotations

import torch

from pyengine.worker.sampler import SamplingMetadata

__all__ = ["SamplingState"]


class SamplingState:
    """``device``: where the generators and the metadata live; ``vocab_size``: the
    logits' width; ``async_scheduling``: keep pre-draw generator states (only async
    scheduling drops drawn tokens)."""

    def __init__(self, device: torch.device, vocab_size: int, async_scheduling: bool):
        self.device, self.vocab_size, self.async_scheduling = device, vocab_size, async_scheduling
        self.generators: dict[str, torch.Generator] = {}
        self._state_before_draw: dict[str, torch.Tensor] = {}

    def forget(self, request_ids) -> None:
        """These requests finished: drop their generators."""
        for rid in request_ids:
            self.generators.pop(rid, None)
            self._state_before_draw.pop(rid, None)

    def rewind(self, request_ids) -> None:
        """Undo the last draw of these requests' seeded generators: its token was dropped
        (async scheduling; the request was preempted while the step was in flight), and
        the request has not drawn since, so its next draw must repeat that one, as it would
        under sync scheduling."""
        for rid in request_ids:
            g, state = self.generators.get(rid), self._state_before_draw.pop(rid, None)
            if g is not None and state is not None:
                g.set_state(state)

    def clear(self) -> None:
        self.generators.clear()
        self._state_before_draw.clear()

    def metadata(self, sampled, ph_flags, spec: bool = False) -> SamplingMetadata:
        """The step's ``SamplingMetadata`` for the ``sampled`` rows (``ScheduledRequest``s);
        ``ph_flags[i]``: row i's newest token is a placeholder (on the device only).

        ``spec`` (speculative decoding): a request with ``k`` draft tokens
        (``ScheduledRequest.spec_token_ids``) gets ``k + 1`` rows, row ``j`` with the
        request's parameters and generator and, as output tokens, its output followed by
        its first ``j`` drafts (so penalties, min_tokens and bad words see the context
        that row is verified in)."""
        if spec and any(s.spec_token_ids for s in sampled):
            return self._spec_metadata(sampled)
        params = [s.request.sampling_params for s in sampled]
        need_tokens = any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                          for p in params)
        # bad words alone need only the last (longest banned sequence - 1) output tokens
        banned = [p.bad_words_token_ids for p in params if p.bad_words_token_ids]  # (no generator per row)
        tail = max(len(w) for words in banned for w in words) - 1 if banned else 0
        if need_tokens or tail:
            # A placeholder counts as one more output token (-1: its id is on the device only;
            # the penalties add it there, bad words compare it there).
            outs = []
            for s, ph in zip(sampled, ph_flags):
                r = s.request
                if need_tokens:
                    o = r.output_token_ids
                else:  # a slice of the tail only, not a copy of the whole output each step
                    o = r.all_token_ids[max(r.num_prompt_tokens, r.num_tokens - tail):]
                outs.append(o + [-1] if ph else o)
            prompts = [s.request.prompt_token_ids for s in sampled] if need_tokens else [()] * len(sampled)
        else:
            outs = prompts = [()] * len(sampled)
        gens = []
        for s in sampled:
            sp, rid = s.request.sampling_params, s.request.request_id
            g = None
            if sp.seed is not None and not sp.sampling_type_greedy:
                g = self.generators.get(rid)
                if g is None:
                    g = self.generators[rid] = torch.Generator(device=self.device)
                    g.manual_seed(sp.seed)
                if self.async_scheduling:
                    self._state_before_draw[rid] = g.get_state()  # host-side copy, no sync
            gens.append(g)
        return SamplingMetadata.build(params, prompts, outs, gens, self.vocab_size, self.device)

    def _spec_metadata(self, sampled) -> SamplingMetadata:
        params, prompts, outs, gens = [], [], [], []
        need_tokens = any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                          or p.bad_words_token_ids for p in (s.request.sampling_params for s in sampled))
        for s in sampled:
            r, sp, rid = s.request, s.request.sampling_params, s.request.request_id
            g = None
            if sp.seed is not None and not sp.sampling_type_greedy:
                g = self.generators.get(rid)
                if g is None:
                    g = self.generators[rid] = torch.Generator(device=self.device)
                    g.manual_seed(sp.seed)
            o = r.output_token_ids if need_tokens else ()
            for j in range(len(s.spec_token_ids) + 1):
                params.append(sp)
                prompts.append(r.prompt_token_ids if need_tokens else ())
                outs.append(list(o) + list(s.spec_token_ids[:j]) if need_tokens else ())
                gens.append(g)
        return SamplingMetadata.build(params, prompts, outs, gens, self.vocab_size, self.device)

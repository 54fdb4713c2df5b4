"""Speculative decoding proposers (the role of vllm/v1/spec_decode/): each step, after the
target verified the drafts, a proposer drafts up to ``num_speculative_tokens`` tokens per
sampled request for the next step. The scheduler feeds them as lookahead tokens
(``Request.spec_token_ids``), the model runner verifies them
(``pyengine.worker.rejection_sampler``).

- ``ngram`` (``NgramProposer``): prompt lookup on the host.
- ``draft_model`` (``DraftModelProposer``): a smaller model with the target's vocabulary,
  its own KV cache in the target's blocks.
- ``eagle3`` (``Eagle3Proposer``): an EAGLE-3 head over the target's hidden states.

Every proposer drafts deterministically (greedy), so the rejection sampler's draft
distribution is one-hot and the output distribution is the target's."""
from __future__ import annotations

from pyengine.spec_decode.base import Proposer, TokenProposer

__all__ = ["Proposer", "TokenProposer", "make_proposer"]


def make_proposer(config, runner) -> Proposer:
    """The proposer of ``config.speculative_config`` for ``runner`` (a ModelRunner whose
    target model is loaded). Raises ValueError for a draft model that cannot be used."""
    spec = config.speculative_config
    if spec.method == "ngram":
        from pyengine.spec_decode.ngram_proposer import NgramProposer
        return NgramProposer(spec, config.max_model_len)
    if spec.method == "draft_model":
        from pyengine.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config, runner)
    from pyengine.spec_decode.eagle import Eagle3Proposer
    return Eagle3Proposer(config, runner)

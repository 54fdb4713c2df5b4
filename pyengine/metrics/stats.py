"""Per-step statistics counted by the front end from the engine core's outputs (mirrors
vllm/v1/metrics/stats.py). ``SchedulerStats`` is the engine core's own report; it lives
with the other engine-core messages and is re-exported here."""
from __future__ import annotations

from dataclasses import dataclass

from pyengine.engine.messages import SchedulerStats

__all__ = ["IterationStats", "SchedulerStats"]


@dataclass(slots=True)
class IterationStats:
    """What the outputs of one engine step brought, in tokens.

    ``num_prompt_tokens``: prompt tokens computed for the requests whose first token came
    in this step (prefix-cache hits excluded: those were not computed);
    ``num_generation_tokens``: tokens generated in this step."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

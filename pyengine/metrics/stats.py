"""Per-step statistics (mirrors vllm/v1/metrics/stats.py): ``SchedulerStats``, the engine
core's own report sent with its outputs, and ``IterationStats``, counted by the front end
from those outputs. Bottom vocabulary: imports nothing of the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

__all__ = ["IterationStats", "SchedulerStats", "combine_scheduler_stats"]


@dataclass
class SchedulerStats:
    """The scheduler's state after one engine step (mirrors vllm/v1/metrics/stats.py's
    SchedulerStats); counters are cumulative since start-up. ``kv_cache_usage`` is a
    fraction in [0, 1]; prefix-cache queries and hits are in tokens;
    ``num_batched_tokens`` is the number of tokens the step that produced these outputs
    ran through the model (0 for outputs that no model step produced: aborts, start-up,
    utility calls). ``engine_index``: which engine core (data-parallel rank) sent them."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_gpu_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0
    step_host_time_s: float = 0.0  # cumulative host time spent in schedule + launch + update, seconds
    num_batched_tokens: int = 0
    grammar_bitmask_time_s: float = 0.0  # cumulative host time filling structured-output bitmasks, seconds
    grammar_bitmask_steps: int = 0  # cumulative steps that had constrained rows (a bitmask filled)
    grammar_bitmask_rows: int = 0  # cumulative constrained rows (one per constrained request per such step)
    engine_index: int = 0  # the data-parallel rank of the engine core that reported these

    # Speculative decoding (vLLM's SpecDecodingStats), cumulative: verified draft runs (one per
    # request per step that carried drafts), their draft tokens, the accepted ones, and the
    # accepted ones by position in the run ([k], position 0 first; empty without speculation).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list = field(default_factory=list)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """1 + accepted draft tokens per verified run (tokens per target forward of a
        request that carried drafts); 0.0 before any draft."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


def combine_scheduler_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """One ``SchedulerStats`` for several engine cores (data parallelism): counts and
    times summed, ``kv_cache_usage`` the fraction of all their blocks in use,
    ``engine_index`` 0. The one element itself when there is one."""
    if len(per_engine) == 1:
        return per_engine[0]
    out = SchedulerStats()
    for name in SchedulerStats.__dataclass_fields__:
        if name == "spec_accepted_per_pos":  # per draft position: summed position by position
            lists = [st.spec_accepted_per_pos for st in per_engine]
            out.spec_accepted_per_pos = [sum(x) for x in itertools.zip_longest(*lists, fillvalue=0)]
        elif name not in ("kv_cache_usage", "engine_index"):
            setattr(out, name, sum(getattr(st, name) for st in per_engine))
    blocks = sum(st.num_gpu_blocks for st in per_engine)
    used = sum(st.kv_cache_usage * st.num_gpu_blocks for st in per_engine)
    out.kv_cache_usage = used / blocks if blocks else 0.0
    return out


@dataclass(slots=True)
class IterationStats:
    """What the outputs of one engine step brought, in tokens.

    ``num_prompt_tokens``: prompt tokens computed for the requests whose first token came
    in this step (prefix-cache hits excluded: those were not computed);
    ``num_generation_tokens``: tokens generated in this step."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

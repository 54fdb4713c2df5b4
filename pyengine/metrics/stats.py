"""Per-step statistics (mirrors vllm/v1/metrics/stats.py): ``SchedulerStats``, the engine
core's own report sent with its outputs, and ``IterationStats``, counted by the front end
from those outputs. Bottom vocabulary: imports nothing of the engine."""
from __future__ import annotations

from dataclasses import dataclass

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


def combine_scheduler_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """One ``SchedulerStats`` for several engine cores (data parallelism): counts and
    times summed, ``kv_cache_usage`` the fraction of all their blocks in use,
    ``engine_index`` 0. The one element itself when there is one."""
    if len(per_engine) == 1:
        return per_engine[0]
    out = SchedulerStats()
    for name in SchedulerStats.__dataclass_fields__:
        if name not in ("kv_cache_usage", "engine_index"):
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

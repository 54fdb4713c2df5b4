"""Speculative decoding's statistics: the SchedulerStats counters, their cbor2 round trip,
the /metrics counters (vLLM's names) and the mean acceptance length in the stats line."""
from __future__ import annotations

import logging

from prometheus_client import generate_latest

from pyengine.codec import decode, encode
from pyengine.messages import EngineCoreOutputs
from pyengine.metrics import LoggingStatLogger, SchedulerStats

LOGGER = "pyengine.metrics.loggers"


def _stats(drafts, draft_toks, accepted, per_pos):
    return SchedulerStats(num_running=1, spec_num_drafts=drafts, spec_num_draft_tokens=draft_toks,
                          spec_num_accepted_tokens=accepted, spec_accepted_per_pos=per_pos)


def test_stats_round_trip_and_mean_length():
    st = _stats(10, 30, 15, [8, 5, 2])
    back = decode(encode(EngineCoreOutputs([], st, 1.0))).scheduler_stats
    assert back == st
    assert st.spec_mean_acceptance_length == 2.5
    assert SchedulerStats().spec_mean_acceptance_length == 0.0


def test_stats_line_shows_mean_acceptance_length(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    sl = LoggingStatLogger()
    sl.record(_stats(10, 30, 15, [8, 5, 2]), None)
    sl.log()
    sl.record(_stats(14, 42, 27, [12, 9, 6]), None)  # this interval: 4 drafts, 12 accepted
    sl.log()
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "Mean acceptance length: 2.50, Draft acceptance rate: 50.0%" in msgs[0]
    assert "Mean acceptance length: 4.00, Draft acceptance rate: 100.0%" in msgs[1]
    caplog.clear()
    sl.record(SchedulerStats(num_running=1), None)  # no speculation: nothing added
    sl.log()
    assert "acceptance" not in caplog.records[0].getMessage()


def test_prometheus_counters():
    from prometheus_client import CollectorRegistry

    from server.metrics import _EngineStatsCollector  # noqa: PLC2701 - the collector under test

    class Engine:
        def get_stats_per_engine(self):
            return [_stats(10, 30, 15, [8, 5, 2])]

    reg = CollectorRegistry()
    reg.register(_EngineStatsCollector(Engine(), "m"))
    text = generate_latest(reg).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0' in text


def test_data_parallel_stats_sum_position_by_position():
    from pyengine.metrics.stats import combine_scheduler_stats

    both = combine_scheduler_stats([_stats(10, 30, 15, [8, 5, 2]), _stats(4, 8, 3, [2, 1])])
    assert (both.spec_num_drafts, both.spec_num_draft_tokens, both.spec_num_accepted_tokens) == (14, 38, 18)
    assert both.spec_accepted_per_pos == [10, 6, 2]

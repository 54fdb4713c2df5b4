"""pyengine/envs.py: one prefix, vLLM's aliases, and clear errors for bad values."""
import pytest

from pyengine import envs


def test_defaults_and_vllm_aliases(monkeypatch):
    for v in ("VENGINE_API_KEY", "VLLM_API_KEY", "VENGINE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE",
              "VENGINE_ENABLE_MULTIPROCESSING"):
        monkeypatch.delenv(v, raising=False)
    assert envs.api_key() is None and not envs.server_dev_mode() and envs.enable_multiprocessing() is None
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert envs.api_key() == "k1" and envs.server_dev_mode()
    monkeypatch.setenv("VENGINE_API_KEY", "k2")  # ours wins over the alias
    monkeypatch.setenv("VENGINE_SERVER_DEV_MODE", "0")
    assert envs.api_key() == "k2" and not envs.server_dev_mode()


def test_bad_flag_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("VENGINE_ENABLE_MULTIPROCESSING", "maybe")
    with pytest.raises(ValueError, match="VENGINE_ENABLE_MULTIPROCESSING='maybe'"):
        envs.enable_multiprocessing()
    monkeypatch.setenv("VENGINE_ASYNC_SCHED", "off")
    assert not envs.async_scheduling_allowed()


def test_http_timeout_keep_alive(monkeypatch):
    for v in ("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        monkeypatch.delenv(v, raising=False)
    assert envs.http_timeout_keep_alive(5.0) == 5.0
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "12")
    assert envs.http_timeout_keep_alive(5.0) == 12.0
    for bad in ("0", "-3", "nan", "inf", "soon"):
        monkeypatch.setenv("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", bad)
        with pytest.raises(ValueError, match=f"VENGINE_HTTP_TIMEOUT_KEEP_ALIVE='{bad}'"):
            envs.http_timeout_keep_alive(5.0)


def test_log_stats_interval(monkeypatch):
    monkeypatch.delenv("VENGINE_LOG_STATS_INTERVAL", raising=False)
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    assert envs.log_stats_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert envs.log_stats_interval() == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv("VENGINE_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="VENGINE_LOG_STATS_INTERVAL="):
            envs.log_stats_interval()


def test_grammar_fill_threads(monkeypatch):
    from pyengine.structured_output.backend_xgrammar import default_fill_threads
    monkeypatch.delenv("VENGINE_GRAMMAR_FILL_THREADS", raising=False)
    assert envs.grammar_fill_threads() is None
    assert default_fill_threads() == 1
    monkeypatch.setenv("VENGINE_GRAMMAR_FILL_THREADS", "5")
    assert default_fill_threads() == 5
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("VENGINE_GRAMMAR_FILL_THREADS", bad)
        with pytest.raises(ValueError, match="VENGINE_GRAMMAR_FILL_THREADS"):
            envs.grammar_fill_threads()


def test_symm_mem_allreduce_default_is_set_only_when_unset(monkeypatch):
    """The engine-core process turns symmetric memory on unless the user chose."""
    monkeypatch.delenv("VENGINE_SYMM_MEM_ALLREDUCE", raising=False)
    assert envs.symm_mem_allreduce() is False  # a front end's own process: NCCL
    envs.default_symm_mem_allreduce_on()
    assert envs.symm_mem_allreduce() is True
    monkeypatch.setenv("VENGINE_SYMM_MEM_ALLREDUCE", "0")
    envs.default_symm_mem_allreduce_on()
    assert envs.symm_mem_allreduce() is False
    assert envs.fused_allreduce_rmsnorm() is True
    monkeypatch.setenv("VENGINE_FUSED_ALLREDUCE_RMSNORM", "0")
    assert envs.fused_allreduce_rmsnorm() is False

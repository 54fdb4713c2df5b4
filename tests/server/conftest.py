"""Server fixtures: one real AsyncLLM on the tiny CPU llama, served in-process by gevent's
pywsgi on a background thread bound to a free port (port 0)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

MODEL_NAME = "tiny-llama"
API_KEY = "test-key-123"


def make_engine(model_dir, multiprocess=None, **kw):
    from pyengine import AsyncLLM, EngineArgs

    args = dict(model=str(model_dir), device="cpu", max_model_len=512, num_gpu_blocks_override=2048)
    args.update(kw)
    return AsyncLLM.from_engine_args(EngineArgs(**args), multiprocess)


def slow_steps(engine, delay: float) -> None:
    """Make every model step of an in-process engine (``multiprocess=False``) take at least
    ``delay`` seconds more: a steady token rate, and long streams surely in flight."""
    import time

    runner = engine.engine_core.engine_core.model_runner
    orig = runner.execute_model

    def slow(*a, **k):
        time.sleep(delay)
        return orig(*a, **k)
    runner.execute_model = slow


@pytest.fixture(scope="session")
def engine(llama_dir):
    eng = make_engine(llama_dir)
    yield eng
    eng.shutdown()


def serve_app(engine, **args):
    """An app over ``engine`` with these CLI args, served on a free port until the
    generator is closed (a fixture's body: ``yield from serve_app(...)``)."""
    from server import BackgroundServer, create_app

    srv = BackgroundServer(create_app(engine, SimpleNamespace(**args)), port=0).start()
    yield srv
    srv.stop()


def openai_client(srv):
    import openai

    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def server(engine):
    yield from serve_app(engine, served_model_name=[MODEL_NAME, "alias"])


@pytest.fixture(scope="session")
def keyed_server(engine):
    """A second app over the same engine: API key required, 4 KiB body limit."""
    yield from serve_app(engine, served_model_name=[MODEL_NAME], api_key=API_KEY, max_request_body_bytes=4096)


@pytest.fixture(scope="session")
def client(server):
    return openai_client(server)

"""GET /v1/models and /v1/models/{model} (server/serving_models.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import get
from tests.server.test_errors import _check_envelope


def test_list_and_retrieve_with_the_openai_client(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL_NAME, "alias"]
    for name in (MODEL_NAME, "alias"):
        m = client.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "vengine"
        assert m.model_dump() == next(x for x in listed if x.id == name).model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_unknown_model_is_an_openai_404(server):
    status, headers, body = get(server.port, "/v1/models/no-such-model")
    _check_envelope(status, headers, body, 404, "model")
    assert "no-such-model" in json.loads(body)["error"]["message"]


def test_names_with_a_slash(engine):
    from server import BackgroundServer, create_app

    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=["org/tiny"])), port=0).start()
    try:
        status, _, body = get(srv.port, "/v1/models/org/tiny")
        assert status == 200 and json.loads(body)["id"] == "org/tiny" and json.loads(body)["max_model_len"] == 512
        assert get(srv.port, "/v1/models/org")[0] == 404
    finally:
        srv.stop()

"""``GET /v1/models`` and ``GET /v1/models/{model}`` (mirrors
vllm/entrypoints/openai/serving_models.py): the served model names as OpenAI model
objects; an unknown name is a 404 with OpenAI's error body."""
from __future__ import annotations

from flask import Flask

from .http import json_response


def model_card(st, name: str) -> dict:
    """One served name as an OpenAI ``Model`` object (vLLM's extra fields: ``root``,
    ``parent``, ``max_model_len``)."""
    cfg = st.cfg
    return {"id": name, "object": "model", "created": st.created, "owned_by": "vengine",
            "root": cfg.model_path, "parent": None, "max_model_len": cfg.max_model_len}


def register_model_routes(app: Flask, st) -> None:
    """Add the model routes to ``app`` (``st``: its ``server.app.ServerState``)."""
    @app.get("/v1/models")
    def models():
        return json_response({"object": "list", "data": [model_card(st, n) for n in st.cfg.served_model_names]})

    @app.get("/v1/models/<path:model>")  # path: served names may hold "/" ("org/name")
    def retrieve_model(model: str):
        return json_response(model_card(st, st.check_model(model)))

"""The served model names (mirrors vllm/entrypoints/openai/serving_models.py): which names
a request's ``model`` may give, and each as an OpenAI ``Model`` object
(``GET /v1/models``)."""
from __future__ import annotations

import time

from pyengine.entrypoints.openai.errors import APIError


class OpenAIServingModels:
    """``served_model_names`` (the first is the default); ``model_path`` and
    ``max_model_len``: the engine's, shown in the model objects (vLLM's ``root`` and
    ``max_model_len``)."""

    def __init__(self, served_model_names: list[str], model_path: str = "", max_model_len: int = 0):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.served_model_names = list(served_model_names)
        self.model_path, self.max_model_len = model_path, max_model_len
        self.created = int(time.time())

    def check_model(self, model: str | None) -> str:
        """The served name a request's ``model`` names (None: the first). Raises
        ``APIError`` 404 for a name this server does not serve."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def model_card(self, name: str) -> dict:
        """One served name as an OpenAI ``Model`` object (vLLM's extra fields: ``root``,
        ``parent``, ``max_model_len``). Raises ``APIError`` 404 for an unknown name."""
        return {"id": self.check_model(name), "object": "model", "created": self.created, "owned_by": "vengine",
                "root": self.model_path, "parent": None, "max_model_len": self.max_model_len}

    def show_available_models(self) -> dict:
        """``GET /v1/models``: every served name."""
        return {"object": "list", "data": [self.model_card(n) for n in self.served_model_names]}

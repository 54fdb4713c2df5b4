"""What the agent-API request models share (``openai/protocol_responses.py``,
``anthropic/protocol.py``): a pydantic base that keeps fields it does not know in
``model_extra`` (strict JSON types, as ``openai/protocol.py``), the walk that lists those
unknown fields at any depth, a tagged-union helper whose unknown tags land in a catch-all
model (so an unsupported block or tool type is reported by name, not as a pydantic union
error), and the check that refuses a request with either kind of field.

Why refuse rather than ignore: a field the engine cannot honour (a hosted tool, a stored
conversation, a thinking budget the server would not enforce, ...) silently dropped gives
the client an answer to a question it did not ask."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag

from pyengine.exceptions import VLLMValidationError


class CaptureModel(BaseModel):
    """Strict JSON types; unknown fields kept in ``model_extra`` (reported by
    ``unknown_fields``, refused by ``check_fields``)."""
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class OtherTyped(CaptureModel):
    """A tagged object whose ``type`` no model here knows (refused by name)."""
    type: str


def tagged(models: dict[str, type], other: type = OtherTyped, key: str = "type", default: str | None = None):
    """A union of ``models`` picked by the value of ``key`` (``default`` when the key is
    absent or null), ``other`` for any other value."""
    def pick(v: Any) -> str:
        t = v.get(key) if isinstance(v, dict) else getattr(v, key, None)
        t = default if t is None else t
        return t if isinstance(t, str) and t in models else "__other__"
    members = [Annotated[m, Tag(name)] for name, m in models.items()] + [Annotated[other, Tag("__other__")]]
    return Annotated[Union[tuple(members)], Discriminator(pick)]  # noqa: UP007 - a union of a computed tuple


def _walk(value: Any, path: str) -> Iterable[tuple[str, BaseModel]]:
    if isinstance(value, BaseModel):
        yield path, value
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def unknown_fields(req: BaseModel) -> list[str]:
    """Paths of the fields no model knows, at any depth (``tools[0].cache_ttl``), and of
    tagged objects of an unknown type (``messages[1].content[0].type='image'``)."""
    out = []
    for path, m in _walk(req, ""):
        if isinstance(m, OtherTyped):
            out.append(f"{path}.type={m.type!r}")
            continue
        for k in sorted(m.model_extra or {}):
            out.append(f"{path}.{k}" if path else k)
    return out


def check_fields(req: BaseModel, unsupported: Callable[[BaseModel], list[tuple[str, str]]]) -> None:
    """Refuse ``req`` if it has unknown fields or fields ``unsupported(req)`` lists
    (``(path, why)`` pairs): a ``VLLMValidationError`` naming the first field (``parameter``)
    and listing all of them."""
    problems = [(p, "is not a field of this API" if not p.endswith("'") else "is not supported")
                for p in unknown_fields(req)] + unsupported(req)
    if not problems:
        return
    first = problems[0][0].split("=")[0].removesuffix(".type")
    msg = "; ".join(f"{p} {why}" for p, why in problems[:8])
    raise VLLMValidationError(f"Unsupported request: {msg}.", parameter=first)

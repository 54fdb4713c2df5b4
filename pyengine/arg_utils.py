"""Command-line flags generated from a dataclass's fields, so that a setting is declared
once (its type, default and help) and every command line that exposes it agrees with
the Python API. Mirrors the ``get_kwargs`` / ``add_cli_args`` pattern of
vllm/engine/arg_utils.py.

A field becomes ``--field-name`` (underscores as dashes):

| field type | flag |
| --- | --- |
| ``bool`` / ``Optional[bool]`` | ``--x`` / ``--no-x`` (``argparse.BooleanOptionalAction``) |
| ``Literal[...]`` or an ``Enum`` | ``choices`` |
| ``list[T]`` (or ``Union[T, list[T]]``) | one or more values (``nargs="+"``) |
| ``dict`` | a JSON object |
| ``int`` / ``float`` / ``str`` | that type |

``Optional[T]`` also accepts ``None`` (the word) for None. The help text is the field's
attribute docstring (the string literal under it) or ``field(metadata={"help": ...})``.
Field metadata may also give ``"flags"`` (extra option strings such as ``-tp``),
``"choices"``, ``"human_readable": True`` (an integer that may be written ``32k``, as
vLLM's sizes) and ``"cli": False`` (no flag).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` from the string literals written under the fields of
    ``cls`` and of its dataclass bases. Empty when the source is not available."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _members(hint) -> tuple[set, bool]:
    """The types a (possibly Optional / Union) hint allows, and whether None is one."""
    if get_origin(hint) in (Union, types.UnionType):
        args = set(get_args(hint))
        return args - {type(None)}, type(None) in args
    return {hint}, False


def optional_type(convert):
    """An argparse ``type`` that reads ``None`` (the word) or ``""`` as None."""
    def parse(value: str):
        return None if value in ("", "None") else convert(value)
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


_SUFFIXES = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
             "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(value: str) -> int:
    """An integer, or one with a size suffix as vLLM reads ``--max-model-len 32k``:
    k/m/g/t are powers of 1000, K/M/G/T of 1024 (``1.5k`` = 1500, ``25.6k`` = 25600)."""
    text = value.strip()
    mult = _SUFFIXES.get(text[-1:], 1) if text else 1
    number = text[:-1] if mult != 1 else text
    try:
        if mult == 1:
            return int(number)
        result = float(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer (or one with a k/m/g/K/M/G suffix): {value!r}") from None
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


human_readable_int.__name__ = "int"


def json_object(value: str) -> dict:
    """An argparse ``type`` for a JSON object."""
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


json_object.__name__ = "JSON"


def _choices_of(t) -> tuple[list, Any] | None:
    """(choices, type) of a Literal (its values) or an Enum (its members, read by value)."""
    if get_origin(t) is Literal:
        values = list(get_args(t))
        return values, type(values[0])
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return list(t), t
    return None


def _type_kwargs(name: str, hint) -> dict:
    members, optional = _members(hint)
    if bool in members:
        return {"action": argparse.BooleanOptionalAction}
    kw: dict = {}
    lists = [m for m in members if get_origin(m) is list]
    if lists:  # list[T], or T | list[T]: one or more values
        (item,) = get_args(lists[0]) or (str,)
        kw["nargs"] = "+"
        members = {item}
    choices = next((c for c in map(_choices_of, members) if c is not None), None)
    if choices is not None:
        kw["choices"], convert = choices
        if isinstance(convert, type) and issubclass(convert, enum.Enum):
            kw["metavar"] = "{" + ",".join(str(m.value) for m in convert) + "}"
        if optional:
            kw["choices"] = kw["choices"] + [None]
    elif dict in members or any(get_origin(m) is dict for m in members):
        convert = json_object
    elif int in members:
        convert = int
    elif float in members:
        convert = float
    elif str in members:
        convert = str
    else:
        raise TypeError(f"No command-line form for field {name!r} of type {hint!r}.")
    kw["type"] = optional_type(convert) if optional else convert
    return kw


def field_kwargs(cls: type) -> dict[str, dict]:
    """``{field name: argparse add_argument keyword arguments}`` for every field of the
    dataclass ``cls`` that has a flag. Raises TypeError for a field type with no
    command-line form (a bug in the dataclass, caught by the tests)."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    out: dict[str, dict] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kw = _type_kwargs(f.name, hints[f.name])
        if f.metadata.get("human_readable"):  # "32k" for an integer (vLLM's sizes)
            optional = _members(hints[f.name])[1]
            kw["type"] = optional_type(human_readable_int) if optional else human_readable_int
        if "choices" in f.metadata:
            kw["choices"] = list(f.metadata["choices"])
        kw["default"] = default
        kw["help"] = (f.metadata.get("help") or docs.get(f.name, "")).replace("%", "%%")
        out[f.name] = kw
    return out


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_dataclass_args(parser, cls: type):
    """Add one flag per field of ``cls`` to ``parser`` (a parser or an argument group);
    each stores into the field's name. Returns ``parser``."""
    extra = {f.name: tuple(f.metadata.get("flags", ())) for f in dataclasses.fields(cls)}
    for name, kw in field_kwargs(cls).items():
        action = parser.add_argument(flag_name(name), *extra[name], dest=name, **kw)
        # (some Pythons' BooleanOptionalAction states the default itself)
        if action.default is not None and action.help and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"
    return parser


def from_namespace(cls: type, ns: argparse.Namespace, **overrides):
    """``cls(**{field: ns.field})`` over the fields ``ns`` has (vLLM's ``from_cli_args``);
    ``overrides`` win."""
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    kw.update(overrides)
    return cls(**kw)

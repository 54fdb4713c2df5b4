"""The floors of the house (issue 24; ../shared/DESIGN.md "Floors"): each module imports
only from its own floor or below, no files import each other in a circle except the
backend registries, and the front ends import no ``_``-prefixed name of another module.
The import graph is read from the sources (ast), so a lazy import inside a function
counts as much as one at the top."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pyengine", "server", "capi")

# From the bottom. A module's floor is that of the longest prefix listed; within a floor
# any import is allowed (circles aside).
FLOORS: list[tuple[str, ...]] = [
    # 0: the vocabulary every floor shares
    ("pyengine.exceptions", "pyengine.envs", "pyengine.utils", "pyengine.arg_utils", "pyengine.sampling_params",
     "pyengine.metrics.stats", "pyengine.messages", "pyengine.codec", "pyengine.config", "pyengine.tokenizer",
     "pyengine.outputs", "pyengine.chat_utils"),
    # 1: kernels (nothing of the model above them)
    ("pyengine.ops",),
    # 2: model building blocks, models, the scheduler, KV cache and the workers
    ("pyengine.distributed", "pyengine.layers", "pyengine.attention", "pyengine.models", "pyengine.request",
     "pyengine.core", "pyengine.structured_output", "pyengine.worker", "pyengine.spec_decode", "pyengine.executor",
     "pyengine.metrics",
     "pyengine.tool_parsers", "pyengine.reasoning"),
    # 3: the engine: core, core process host, clients, output processing, LLM, AsyncLLM
    ("pyengine.engine", "pyengine.llm"),
    # 4: the OpenAI protocol and one serving object per endpoint
    ("pyengine.entrypoints",),
    # 5: the public facade (pyengine/__init__.py)
    ("pyengine",),
    # 6: the front ends
    ("server", "capi"),
]
# Registries (../shared/DESIGN.md: the one sanctioned way a lower floor names an
# implementation): (importer, registry) pairs allowed to run up a floor.
REGISTRY_IMPORTS = {("pyengine.config", "pyengine.layers.quantization")}  # refuse a checkpoint at config time
# Backend registries: a base that names its implementations, which import the base.
ALLOWED_CIRCLES = [{"pyengine.attention.backend", "pyengine.attention.torch_backend",
                    "pyengine.attention.triton_backend"},
                   {"pyengine.executor.abstract", "pyengine.executor.multiproc_executor",
                    "pyengine.executor.uniproc_executor"}]


def modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = p
    return mods


def _resolve(mods, cur: str, node) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) of one import statement, inside PACKAGES."""
    out = []
    if isinstance(node, ast.Import):
        out = [(a.name, []) for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = cur.split(".")
            if mods[cur].name != "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        for a in node.names:
            full = f"{base}.{a.name}"
            out.append((full, []) if full in mods else (base, [a.name]))
    res = []
    for name, taken in out:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != cur:
            res.append((name, taken))
    return res


def import_graph() -> dict[str, dict[str, list[str]]]:
    mods = modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for m, p in mods.items():
        edges: dict[str, list[str]] = {}
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, taken in _resolve(mods, m, node):
                    edges.setdefault(target, []).extend(taken)
        graph[m] = edges
    return graph


def floor_of(module: str) -> int:
    best, floor = -1, None
    for i, prefixes in enumerate(FLOORS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best:
                best, floor = len(pre), i
    assert floor is not None, f"{module} is on no floor: add it to FLOORS"
    return floor


def circles(graph) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_runs_up_a_floor():
    graph = import_graph()
    up = [f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})"
          for m, edges in graph.items() for t in edges
          if floor_of(t) > floor_of(m) and (m, t) not in REGISTRY_IMPORTS]
    assert up == []


def test_no_circles_but_the_registries():
    assert [c for c in circles(import_graph()) if c not in ALLOWED_CIRCLES] == []


def test_front_ends_import_no_private_names():
    graph = import_graph()
    private = [f"{m} imports {name} from {t}" for m, edges in graph.items()
               if m.split(".")[0] in ("server", "capi") for t, names in edges.items()
               for name in names if name.startswith("_") and t != m]
    assert private == []


def test_the_checks_see_a_violation(tmp_path, monkeypatch):
    """The graph itself: a lazy upward import and a private name are found."""
    pkg = tmp_path / "pyengine"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("X = 1\n")
    (pkg / "ops" / "__init__.py").write_text("def f():\n    from pyengine.engine import X\n    return X\n")
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__init__.py").write_text("from pyengine.engine import _private\n")
    (tmp_path / "capi").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert "pyengine.engine" in graph["pyengine.ops"]
    assert graph["server"]["pyengine.engine"] == ["_private"]

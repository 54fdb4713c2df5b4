"""The code's shape (issue 13): no function in the front ends (``server/``, ``capi/``) over
60 lines, and ``ruff check`` clean with the repository's ``ruff.toml``."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _long_functions(path: Path, base: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [f"{path.relative_to(base)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_front_end_functions_are_short():
    files = sorted(p for d in ("server", "capi") for p in (ROOT / d).rglob("*.py"))
    assert files
    assert [f for p in files for f in _long_functions(p)] == []


def test_long_function_is_found(tmp_path):
    # the check itself: a 61-line function is reported, a 60-line one is not
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\n\n\ndef long():\n{body}\n    return 0\n")
    assert _long_functions(tmp_path / "m.py", tmp_path) == ["m.py:63 long (61 lines)"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is not None:
        return [exe]
    try:
        import ruff  # noqa: F401 - the package ships the binary
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e .[test])")
    return [sys.executable, "-m", "ruff"]


def test_ruff_clean():
    assert (ROOT / "ruff.toml").is_file()
    proc = subprocess.run([*_ruff(), "check", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""What ``pip install .`` (non-editable) ships: setup.py's build puts every data file the
code reads at run time beside the modules (the kernels' JSON tile tables included), and
setuptools has nothing to warn about ("Package would be ignored": a data folder that
Python would take for a package, left out of ``packages``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_build_ships_the_tile_tables_quietly(tmp_path):
    out = subprocess.run([sys.executable, "setup.py", "egg_info", "--egg-base", str(tmp_path),
                          "build_py", "--build-lib", str(tmp_path / "lib")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "would be ignored" not in out.stdout + out.stderr, out.stderr[-3000:]
    tables = sorted(p.relative_to(ROOT) for d in ("pyengine/layers/fused_moe/configs", "pyengine/ops/configs")
                    for p in (ROOT / d).glob("*.json"))
    assert tables  # the folders this checks are still there
    assert [t for t in tables if not (tmp_path / "lib" / t).is_file()] == []

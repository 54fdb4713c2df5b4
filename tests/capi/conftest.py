"""C ABI fixtures: libvengine.so built once per session (capi.build) and the C test
host (capi_test.c) compiled with gcc."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HEADER_DIR = ROOT / "include"


def _cc(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="session")
def capi_lib(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT))
    from capi.build import build
    return build(tmp_path_factory.mktemp("capi_lib"))


@pytest.fixture(scope="session")
def capi_test_bin(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("capi_bin") / "capi_test"
    _cc(["gcc", "-std=c11", "-D_GNU_SOURCE", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
         f"-I{HEADER_DIR}", str(HERE / "capi_test.c"), "-o", str(out), "-ldl"])
    return out

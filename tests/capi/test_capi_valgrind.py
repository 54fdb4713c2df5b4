"""The C ABI under valgrind: a freed engine handle (in a file of its own: it takes minutes,
and the test runner's workers take a file at a time, so it runs beside the rest of
tests/capi rather than after it)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.capi.test_capi import PROMPTS

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(shutil.which("valgrind") is None,
                    reason="valgrind is not installed (apt-get install valgrind)")
def test_freed_engine_handle_under_valgrind(capi_test_bin, capi_lib, llama_dir):
    # the engine behind the handle is really gone (its last request freed first); every
    # later call must return VLLM_ERR_RUNTIME without touching freed memory. Addressability
    # errors (invalid reads/writes/frees) are what this checks; definedness tracking is off:
    # it doubles the run time and reports only libpython/libtorch internals (docs/capi.md)
    supps = [f"--suppressions={HERE / 'valgrind.supp'}"]
    if Path("/usr/lib/valgrind/python3.supp").is_file():
        supps.append("--suppressions=/usr/lib/valgrind/python3.supp")
    cmd = ["valgrind", "--error-exitcode=99", "--undef-value-errors=no", *supps, str(capi_test_bin),
           str(capi_lib), "local", "freed_engine", str(llama_dir), PROMPTS[0], "once"]
    e = dict(os.environ, PYTHONMALLOC="malloc")
    e.pop("VENGINE_PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=900)
    assert proc.returncode == 0 and "RESULT OK" in proc.stdout, \
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "ERROR SUMMARY: 0 errors" in proc.stderr

"""tools/train_default_model.py on the CPU, ``--tiny --steps 3``: the eager run, ``--compile``
(each decoder layer through torch.compile), and ``--compile`` when compiling fails (no C++
compiler), which must restart eagerly and then be the eager run step for step."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_default_model.py"


def _train(out: Path, *extra: str, env: dict | None = None) -> tuple[str, dict]:
    """Run the script; returns (its stdout, the figures its log reports)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--tiny", "--steps", "3", *extra],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = proc.stdout
    m = re.search(r"last train loss ([0-9.]+), held-out loss \(eval windows\) ([0-9.]+)", log)
    ppl = re.search(r"held-out perplexity: ([0-9.]+) per token", log)
    assert m and ppl, log[-2000:]
    return log, {"train": float(m[1]), "held": float(m[2]), "ppl": float(ppl[1])}


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    log, figs = _train(out)
    return out, figs


def test_eager_run_writes_a_loadable_model(eager):
    out, figs = eager
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "heldout_headers.json", "README.md"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert 0 < figs["train"] < 10 and figs["ppl"] > 1


def test_compile_failure_falls_back_to_the_eager_run(eager, tmp_path):
    # no working C++ compiler: inductor raises on the first step
    log, figs = _train(tmp_path / "m", "--compile", env={"CXX": str(tmp_path / "no-such-compiler")})
    assert "torch.compile failed" in log and "training eagerly" in log
    assert figs == eager[1]  # the same initialisation, data and learning rates: the same run


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler for inductor")
def test_compiled_run_trains_the_same_model(eager, tmp_path):
    log, figs = _train(tmp_path / "m", "--compile")
    assert "compiled the decoder layers" in log and "torch.compile failed" not in log
    for key in ("train", "held"):
        assert figs[key] == pytest.approx(eager[1][key], abs=2e-3)  # (compiled kernels round differently)

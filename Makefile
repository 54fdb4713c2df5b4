# Two entry points for a fresh machine (each sets itself up): `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A pinned torch: on a CPU-only machine of this project's kind pip takes the local CPU
# wheel; on a GPU machine PyPI's wheel of the same version is the CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup serve test lint clean

setup: $(VENV)/.installed $(VENV)/.chromium

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Headless Chromium for the page test (tests/server/test_page.py), once per venv and best
# effort: Debian's packages where apt-get and root (or passwordless sudo) are there; else a
# message, and that test skips. `rm $(VENV)/.chromium` to try again.
$(VENV)/.chromium: tools/install_chromium.sh | $(VENV)/.installed
	bash tools/install_chromium.sh
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/vengine serve $(ARGS)

# Two pytest workers (pytest-xdist), a test file per worker at a time (its module fixtures,
# a served model, start once): on this project's 2-core machines the suite waits on engine
# and server processes often enough that two workers overlap well. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2
# Every run lists its skipped tests with their reasons: pytest.ini's addopts has -rs.
# The second run takes the GPU compute path (triton attention + fused triton ops) through
# triton's CPU interpreter, so kernel/runner integration is checked without a GPU. The third
# spreads its tests, not its files, over the workers: one file (test_kernel_path.py) holds
# most of its minutes.
test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -p no:cacheprovider \
		tests/ops tests/attention tests/layers/fused_moe
	TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist load -p no:cacheprovider \
		tests/test_llm_triton_interpret.py tests/models/test_moe_triton_interpret.py tests/quantization/test_kernel_path.py \
		tests/spec_decode/test_draft_chain.py::test_chain_on_the_triton_kernels

# ruff with the repository's ruff.toml, mypy with its mypy.ini (tests/test_code_shape.py runs both too)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info

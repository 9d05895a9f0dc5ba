# Two commands set up a fresh machine and run: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.overmind-installed

.PHONY: venv demo docs test test-slow clean

venv: $(STAMP)

# torch==2.13.0 first and alone: it is the local CPU wheel. Everything after it finds torch
# already satisfied, so no CUDA build is ever pulled in.
$(STAMP): pyproject.toml setup.py csrc/overmind.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q "setuptools>=64" wheel ninja
	$(PIP) install -q --no-build-isolation -e ".[hf,test]"
	$(PY) -m compileall -q src/overmind  # what pip does for a wheel: a shell with PYTHONDONTWRITEBYTECODE=1 would compile them in every process
	$(PY) -c "import torch, overmind.shared.segments.native as n; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert n.HAVE_EXTENSION"
	touch $(STAMP)

# The main job: overmind-bench --quick, plain vs cold vs warm loads, memory and start-up of
# small models it generates (into ~/.cache/overmind-bench; OVERMIND_BENCH_CACHE moves it).
demo: venv
	$(VENV)/bin/overmind-bench --quick

# docs/benchmarks.md is generated: the manual in src/overmind/bench/page.md with the results
# committed in docs/results/ (tests/unit/test_bench_report.py fails when the two drift apart).
docs: venv
	$(VENV)/bin/overmind-bench --report docs/results/*.json --output docs/benchmarks.md

# Each test file whole on one worker (its server and models are built once per file); two
# workers keep a 2-core machine busy without starving the servers the tests start.
# `make test` leaves out the tests marked slow (a minute or more each: overmind-bench end to end,
# torch.compile, the heaviest whole-model checks); `make test-slow` runs those alone. CI runs both.
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q --timeout=600 -n $(TEST_WORKERS) --dist loadfile
test: venv
	$(PYTEST) -m "not slow" tests

test-slow: venv
	$(PYTEST) -m slow tests

clean:
	rm -rf build src/*.egg-info src/overmind/_C*.so

# Two commands set up a fresh machine and run: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.overmind-installed

.PHONY: venv demo docs test test-slow test-pythons clean

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

# Every other Python the project claims, each in a venv of its own with the torch that
# `pip install torch==2.13.0` gives there (the registry's CUDA build, about 5 GB; the CPU wheel on
# disk is for 3.11 only): the unit tests and the warm-hit checks, not the whole suite.
# PYTHONS names the interpreters; venvs go to .venv-<version>.
PYTHONS ?= $(foreach v,3.10 3.12 3.13,$(firstword $(wildcard $(HOME)/.pyenv/versions/$(v).*/bin/python$(v))))
PYTHON_TESTS ?= tests/unit tests/integration/test_steady_hits.py tests/integration/test_warm_start.py
test-pythons:
	@test -n "$(strip $(PYTHONS))" || { echo "no other Python found; set PYTHONS=/path/to/python3.X ..."; exit 2; }
	set -e; for py in $(PYTHONS); do \
	    v=$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])'); venv=.venv-$$v; \
	    test -x $$venv/bin/python || $$py -m venv $$venv; \
	    $$venv/bin/pip install -q "torch==2.13.0" "setuptools>=64" wheel ninja; \
	    $$venv/bin/pip install -q --no-build-isolation -e ".[hf,test]"; \
	    echo "== Python $$v, torch $$($$venv/bin/python -c 'import torch; print(torch.__version__)')"; \
	    HF_HUB_OFFLINE=1 $$venv/bin/python -m pytest -q --timeout=600 -n $(TEST_WORKERS) --dist loadfile \
	        -m "not slow" $(PYTHON_TESTS); \
	done

clean:
	rm -rf build src/*.egg-info src/overmind/_C*.so

# Quick start: `make tour` (main job) and `make test` (whole suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
HYPOTHESIS_PROFILE ?= ci
# pytest workers (pytest-xdist): one per core, each single-threaded (BLAS and torch
# thread pools would otherwise compete for the same cores); JOBS=0 runs in one process
JOBS ?= auto
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

.PHONY: setup tour test test-gpu bench report static mutate clean

setup:
	@scripts/setup.sh

tour: setup
	$(PY) -m laminae.triton_ops.tour

test: setup
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(ONE_THREAD) $(PY) -m pytest -q -n $(JOBS) --dist worksteal $(PYTEST_ARGS) tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

# BENCH=EXPR benchmarks a subset (a pytest -k expression: `make bench BENCH=derf`,
# `make bench BENCH="derf and not compiled"`)
bench: setup
	mkdir -p bench/results
	$(PY) -m pytest -q bench $(if $(BENCH),-k "$(BENCH)") --benchmark-json=bench/results/latest.json

report: setup
	$(PY) bench/report.py bench/results/latest.json --static

# Recompile what changed since the committed table, rewrite it and the docs' static
# section (STEMS="a b" limits it to some mechanisms).
static: setup
	env -u TRITON_INTERPRET $(PY) -m bench.static_sm90 --write $(STEMS)
	$(PY) bench/report.py --update-docs docs/benchmarks.md

# Plant each bug of scripts/mutants/<stem>.toml in a scratch copy, one at a time, and
# run the stem's tests (`make mutate STEM=laurel`, STEM="laurel xsa"; MUTATE_JOBS
# mutants at once, each in its own copy). Fails when a mutant survives unargued or
# its text is no longer in the file.
MUTATE_JOBS ?= 1
mutate: setup
	$(ONE_THREAD) $(PY) scripts/mutate.py $(STEM) --jobs $(MUTATE_JOBS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks

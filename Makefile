# Quick start: `make tour` (main job) and `make test` (whole suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
HYPOTHESIS_PROFILE ?= ci
# pytest workers (pytest-xdist): one per core, each single-threaded (BLAS and torch
# thread pools would otherwise compete for the same cores); JOBS=0 runs in one process
JOBS ?= auto
# fails `make test` when a launch configuration of a kernel never runs (tests/_launch_coverage.py);
# LAUNCH_COVERAGE= turns it off for a partial run (PYTEST_ARGS="-k ...")
LAUNCH_COVERAGE ?= --launch-coverage
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

.PHONY: setup tour test test-gpu thorough bench report static mutate clean

setup:
	@scripts/setup.sh

tour: setup
	$(PY) -m laminae.triton_ops.tour

test: setup
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(ONE_THREAD) $(PY) -m pytest -q -n $(JOBS) --dist worksteal $(LAUNCH_COVERAGE) $(PYTEST_ARGS) tests

# Every kernel property (the tests hypothesis drives) at 1,000 examples, one mechanism
# at a time: hours on the interpreter in all, so outside CI and in parts
# (`make thorough STEMS="laurel xsa"`); a mechanism with no property is skipped. `flash`
# is the causal flash attention that LUCID, affine-scaled attention and MoSRAH share.
thorough: setup
	@fail=0; for s in $(or $(STEMS),$(shell $(PY) -c "from laminae.triton_ops.tour import MECHANISMS; print(*MECHANISMS)") flash); do \
	  echo "== $$s"; HYPOTHESIS_PROFILE=thorough $(ONE_THREAD) $(PY) -m pytest -q -n $(JOBS) -m hypothesis \
	    $(PYTEST_ARGS) tests/triton_ops/test_$$s.py; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || fail=1; \
	done; exit $$fail

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

# Quick start: `make tour` (main job) and `make test` (whole suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
HYPOTHESIS_PROFILE ?= ci

.PHONY: setup tour test test-gpu bench report static clean

setup:
	@scripts/setup.sh

tour: setup
	$(PY) -m laminae.triton_ops.tour

test: setup
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -q tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

bench: setup
	mkdir -p bench/results
	$(PY) -m pytest -q bench --benchmark-json=bench/results/latest.json

report: setup
	$(PY) bench/report.py bench/results/latest.json --static

# Recompile what changed since the committed table, rewrite it and the docs' static
# section (STEMS="a b" limits it to some mechanisms).
static: setup
	env -u TRITON_INTERPRET $(PY) -m laminae.triton_ops._static --write $(STEMS)
	$(PY) bench/report.py --update-docs docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks

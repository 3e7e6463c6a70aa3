#!/usr/bin/env bash
# One prepared GPU run that fits about 9 minutes on an H200: the gpu-marked tests,
# the tour (fp32, then bf16 on CUDA), then the benchmarks in three runs (Triton ops
# and SDPA first, then the eager references, then the torch.compile'd references),
# each stopped with SIGINT at its budget (pytest-benchmark still writes its JSON:
# bench/conftest.py drops the benchmark caught before its first round, on which the
# writer would fail), and the report over all three. Logs and JSON go under $OUT (default ./gpu-out).
#
# Dependencies: the machine's own python3 (its torch and triton); laminae installs
# without dependencies; wheels under .whl/ (if any) install first, offline, for what
# the image lacks (hypothesis, pytest-benchmark).
#   OUT=... TEST_S=120 TOUR_S=45 TRITON_S=150 EAGER_S=60 COMPILED_S=90 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
  date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/laminae-site .whl/*.whl \
    > "$OUT/install.log" 2>&1 && export PYTHONPATH="/tmp/laminae-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
"$PY" -c "import hypothesis, pytest_benchmark, laminae; print('laminae', laminae.__version__)" \
  || { echo "missing dependencies: put their wheels under .whl/"; exit 1; }

# SIGINT first (pytest then reports, and pytest-benchmark writes its JSON), SIGKILL 20 s later
stop_at() { local s="$1"; shift; timeout -s INT -k 20 "$s" "$@"; }

stop_at "${TEST_S:-120}" "$PY" -m pytest -q -m gpu tests -p no:cacheprovider --no-header 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
stop_at "${TOUR_S:-45}" "$PY" -m laminae.triton_ops.tour --reps 20 2>&1 | tee "$OUT/tour.log" | tail -22
stop_at "${TOUR_S:-45}" "$PY" -m laminae.triton_ops.tour --reps 3 --device cuda --dtype bfloat16 2>&1 \
  | tee "$OUT/tour_bf16.log" | tail -22

bench() {  # name seconds -k-expression
  stop_at "$2" "$PY" -m pytest -q bench -p no:cacheprovider -k "$3" \
    --benchmark-json="$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1
  "$PY" -c "import json, sys; print('bench $1:', len(json.load(open(sys.argv[1]))['benchmarks']), 'cases')" \
    "$OUT/bench_$1.json" 2>/dev/null || echo "bench $1: no JSON written (see $OUT/bench_$1.log)"
}
bench triton "${TRITON_S:-150}" "triton or sdpa"
bench eager "${EAGER_S:-60}" "eager and not sdpa"
bench compiled "${COMPILED_S:-90}" "compiled"

"$PY" bench/report.py $(ls "$OUT"/bench_*.json 2>/dev/null) --png "$OUT/bench.png" > "$OUT/bench.md" 2>&1
cat "$OUT/bench.md"

#!/usr/bin/env bash
# One prepared GPU run: gpu-marked tests, the tour with compiled kernels, and the
# benchmarks, each writing its log under $OUT (default ./gpu-out). Uses the machine's
# own python3 (its torch/triton) and installs laminae without dependencies.
#   OUT=... BENCH_FILTER="not compiled" TEST_TIMEOUT=240 scripts/gpu_check.sh
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
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }

timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 120 "$PY" -m laminae.triton_ops.tour --reps 20 2>&1 | tee "$OUT/tour.log" | tail -20
timeout 120 "$PY" -m laminae.triton_ops.tour --reps 3 --device cuda --dtype bfloat16 2>&1 | tee "$OUT/tour_bf16.log" | tail -20
timeout "${BENCH_TIMEOUT:-300}" "$PY" -m pytest -q bench -p no:cacheprovider -k "${BENCH_FILTER:-not compiled}" \
  --benchmark-json="$OUT/bench.json" > "$OUT/bench.log" 2>&1
"$PY" bench/report.py "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.md" 2>&1
tail -40 "$OUT/bench.md"

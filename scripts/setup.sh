#!/usr/bin/env bash
# Idempotent setup: a local virtual environment in .venv with laminae (editable)
# and its test/bench/transformers extras. Re-running it only reinstalls when pyproject.toml or
# the constraints changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${LAMINAE_VENV:-.venv}"
CONSTRAINTS="${LAMINAE_CONSTRAINTS:-scripts/constraints-cpu.txt}"
stamp="$VENV/.laminae-installed"
want="$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import laminae.triton_ops" 2>/dev/null; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, from the pinned CPU build, so nothing later can pull a CUDA build.
"${pip[@]}" -c "$CONSTRAINTS" "$(grep -E '^torch==' "$CONSTRAINTS")"
"${pip[@]}" -c "$CONSTRAINTS" -e ".[test,io,bench,transformers]"
echo "$want" > "$stamp"

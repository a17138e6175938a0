#!/usr/bin/env bash
# What a new user pays before gradops is fast (issue 39): a fresh venv, `pip install torch==2.13.0`, then
# `pip install <this checkout>` as README shows, an empty ~/.cache; then the first training step of a small model of
# gradops modules in a fresh process (cold cache) and in a second one (warm), against torch's own first step.
# Appends one JSON line to benchmarks/results/first-use-cpu-<date>.jsonl. Options: src/gradops/bench/first_use.py
# (--sweep adds `gradops bench --sweep` with what the install gave; --dry-run is the flow in seconds, no venv).
#
#   scripts/first_use.sh [--sweep --sweep-args "--processes 1 --sizes 8x8,64x128"] [--keep] [--no-save]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The harness needs only the standard library (it makes its own venv): any Python >= 3.10 with venv will do.
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
fi
# Run by path, not as gradops.bench.first_use: importing the package would import torch into the harness.
exec "$PY" -c 'import runpy, sys; sys.argv[0] = "scripts/first_use.sh"; runpy.run_path(sys.argv.pop(1), run_name="__main__")' \
  "$ROOT/src/gradops/bench/first_use.py" "$@"

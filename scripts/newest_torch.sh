#!/usr/bin/env bash
# The tests on the torch `pip install torch` gives today (the newest release), in a virtual environment of their own
# (.venv-newest; GRADOPS_NEWEST_VENV moves it): the torch a new user gets, beside the pinned one of scripts/test.sh.
# Run it before each change to pyproject's torch range, and whenever a torch release comes out; CI does not, since
# the newest torch is a download of several GB (with its CUDA libraries) and a second main suite: ~10 minutes more
# than CI's budget on 2 cores.
#
#   bash scripts/newest_torch.sh            # install (or upgrade to) the newest torch, then tiers 1 and 2
#   bash scripts/newest_torch.sh -k embed   # arguments go to tier 1's pytest
#
# Prints the torch and Triton versions it tested; exits non-zero when a tier fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRADOPS_NEWEST_VENV:-$ROOT/.venv-newest}"
PY="${PYTHON:-python3}"
workers="${GRADOPS_TEST_WORKERS:-2}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "newest-torch: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
echo "newest-torch: installing the newest torch and gradops[bench,dev,transformers] (torch brings its own triton)" >&2
python -m pip install -q --upgrade torch
python -m pip install -q -e "$ROOT[bench,dev,transformers]"
# The CPU kernels for this torch (a build of their own: the cache's tag names the torch version).
python -m gradops.native --quiet
export GRADOPS_REQUIRE_NATIVE=1
python - <<'EOF'
import importlib.util

import torch

triton = importlib.util.find_spec("triton")
version = __import__("triton").__version__ if triton else "absent"
print(f"newest-torch: torch {torch.__version__}, triton {version}")
EOF
cd "$ROOT"
echo "== newest torch, tier 1: main suite (pytest -n $workers)"
python -m pytest -q -p no:cacheprovider -n "$workers" "$@"
echo "== newest torch, tier 2: Triton kernels under TRITON_INTERPRET=1"
TRITON_INTERPRET=1 GRADOPS_BACKEND=triton python -m pytest -q -p no:cacheprovider -n "$workers" -m interpreter \
  tests/interpreter

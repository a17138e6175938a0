# Sourced by scripts/main.sh and scripts/test.sh: a virtual environment with gradops and what it needs.
# Idempotent and quick when nothing changed (a stamp file records the installed pyproject).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRADOPS_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

stamp="$VENV/.gradops-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first, pinned only when absent: 2.13.0 is the local CPU wheel on our machines, while an unpinned
  # or newer requirement would download several GB of CUDA packages.
  if ! python -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0" >&2
    python -m pip install -q "torch==2.13.0"
  fi
  # triton 3.6 is what the lent GPU machines run: the interpreter tier tests the same Triton.
  # accelerate: transformers' distributed loading (expert parallel, tests/test_transformers_ep.py) imports it.
  # The install builds gradops' CPU kernels (C++, against this torch: build_backend/gradops_build.py).
  echo "setup: installing gradops[bench,dev] and triton==3.6.0, transformers==5.24.0, accelerate==1.15.0" >&2
  python -m pip install -q -e "$ROOT[bench,dev]" "triton==3.6.0" "transformers==5.24.0" "accelerate==1.15.0"
  echo "$want" > "$stamp"
fi
# The CPU kernels and native nodes (src/gradops/native): built once per source / torch / Python / CPU into gradops'
# cache (~2 min with g++ on 2 cores; by the install above, else here), then only a file check. No GRADOPS_CACHE_DIR
# here, on purpose: the default cache (~/.cache/gradops) is the one every other way of running gradops uses too (an
# activated .venv, an IDE), so the library is built once, into one place. Without a C++ compiler gradops runs the
# pure-torch reference and says so here; the tests then skip what needs the kernels, which they require once built.
if python -m gradops.native --quiet; then
  export GRADOPS_REQUIRE_NATIVE=1
else
  echo "setup: gradops' CPU kernels could not be built (above); CPU tensors take the pure-torch reference" >&2
fi

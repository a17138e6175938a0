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
  # native: ninja, which torch's C++ extension builder needs for gradops.native (below).
  echo "setup: installing gradops[cpu,bench,dev,native] and triton==3.6.0, transformers==5.23.0, accelerate==1.15.0" >&2
  python -m pip install -q -e "$ROOT[cpu,bench,dev,native]" "triton==3.6.0" "transformers==5.23.0" "accelerate==1.15.0"
  echo "$want" > "$stamp"
fi
# No GRADOPS_CACHE_DIR here, on purpose: the compiled CPU kernels then go to gradops' default cache
# (~/.cache/gradops/numba, one folder per version of the kernel sources: src/gradops/cpu/__init__.py), the one
# every other way of running gradops uses too - an activated .venv, `.venv/bin/python examples/...`, an IDE -
# so the README's commands and a user's own compile each kernel once, into one place. (Exporting a checkout folder
# here reached only the processes these scripts start: an activated venv compiled everything a second time
# elsewhere.) A GRADOPS_CACHE_DIR set by the caller is still honoured, by gradops itself; where the default cannot
# be written, gradops compiles into a private temporary folder and says so once.

# The native autograd nodes (src/gradops/native): gradops.nn's eager CPU training path without Python in the
# backward. Built once per source / torch / Python into gradops' cache (~1-1.5 min with g++ on 2 cores), then only a
# file check. Without a C++ compiler gradops runs its Python path (the same results, ~50 µs more per training step
# at small sizes) and says so here; the tests then skip the native ones, which they require once it is built.
if python -m gradops.native --quiet; then
  export GRADOPS_REQUIRE_NATIVE=1
else
  echo "setup: gradops.native could not be built (above); gradops runs its Python autograd path" >&2
fi

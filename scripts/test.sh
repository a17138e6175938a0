#!/usr/bin/env bash
# The tests: sets itself up, runs the lint gate (ruff), then the two CPU tiers.
#   1. the main suite (reference and compiled-CPU backends, nn, compile, aclnn, examples, CLI);
#   2. the Triton kernels in Triton's CPU interpreter, in their own process: TRITON_INTERPRET must be set
#      before triton is imported.
# GPU-marked tests skip themselves without CUDA. pytest's exit code 5 (nothing collected) fails the run.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
cd "$ROOT"
workers="${GRADOPS_TEST_WORKERS:-2}"
echo "== lint: ruff check (rules in pyproject.toml)"
python -m ruff check src tests examples benchmarks scripts
echo "== tier 1: main suite (pytest -n $workers)"
python -m pytest -q -p no:cacheprovider -n "$workers" "$@"
echo "== tier 2: Triton kernels under TRITON_INTERPRET=1"
TRITON_INTERPRET=1 GRADOPS_BACKEND=triton python -m pytest -q -p no:cacheprovider -n "$workers" -m interpreter tests/interpreter

#!/usr/bin/env bash
# The whole GPU check in one command, for a short GPU window on a machine with its own python, torch and triton and
# nothing to download:
#
#   scripts/gpu_check.sh OUT_DIR            on one H100 / H200: at most ~8 minutes, every part included
#   scripts/gpu_check.sh --dry-run OUT_DIR  the same flow on the CPU, Triton's interpreter, toy sizes, no times
#                                           (at most 5 minutes; tests/test_gpu_check.py runs it, so it cannot rot)
#
# Parts, each under its own time limit (timeout(1)), so that one that fails or hangs still leaves the others'
# results: the GPU tier (tests/gpu), gradops check (every op and dtype against float64), gradops bench (vs eager,
# torch.compile and Liger-Kernel; GB/s and % of copy_), host µs per call, the size sweep, the whole-model row, the
# CUDA-graph capture of a patched training step (the last two need transformers). OUT_DIR gets each
# part's log and results (JSONL, PNG), env.json (device, driver, versions, commit, date), parts.tsv, and
# summary.json; the summary is printed last. Exit status 1 when any part failed or timed out, 2 on a bad argument.
#
# gradops runs from this checkout's src/ (nothing is installed). Liger-Kernel, pytest and pytest's dependencies are
# taken from third_party/wheels when the machine lacks them (unpacked into a temporary folder on PYTHONPATH).
# GRADOPS_COMMIT names the commit where this copy of the tree has no .git. PYTHON picks the interpreter.
# Limits: GPU_CHECK_LIMIT_<PART> (seconds; PART in ENV GPU_TIER CHECK BENCH PER_CALL SWEEP MODELS GRAPHS SUMMARY).
set -uo pipefail

usage() { echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2; exit 2; }
DRY=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "scripts/gpu_check.sh: error: unknown option $arg" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$arg" ;;
  esac
done
[ -n "$OUT" ] || usage
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT" || { echo "scripts/gpu_check.sh: error: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/parts.tsv"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
[ -n "$PYTHON" ] || { echo "scripts/gpu_check.sh: error: no python on PATH (set PYTHON)" >&2; exit 2; }
cd "$ROOT"

# Worst case (every part at its limit): 60 + 45 + 45 + 95 + 25 + 85 + 40 + 60 + 15 = 470 s on a GPU, 300 s dry
# (per-call and cuda-graphs measure the device only: skipped there). The dry
# run's parts take a seventh to a third of their limits on 2 idle cores (8-13 s each), up to 33 s beside the rest
# of the test command on 2 busy cores, where the summary alone (3 s idle: torch, gradops and the PNGs) ran past
# a 10 s limit. On an H100 (16 cores) the parts take: the GPU tier ~20 s and check ~20 s (both paying Triton's
# first compile of each kernel and dtype; the cache is shared between the parts), bench 66-80 s (14 torch.compile
# builds), the sweep's ~130 cases 69 s, the whole-model row 25-28 s. The env part first builds the CPU kernels for
# the machine's torch (9 C++ files, ~2 min on 2 cores, 21 s on the GPU machine's 16), so that no later part's
# `import gradops` builds them inside its own limit; in the dry run they are built already (the test command's
# set-up).
# per-call: ~30 cases x 30 rounds x 100 calls of 10-300 µs (~10 s); cuda-graphs: 8 captures of a 4-layer step
# (seconds each) and one reduce-overhead compile of it (tens of seconds; its row is written last, so a limit reached
# there keeps the captures).
if [ "$DRY" = 1 ]; then
  limits=(40 40 40 60 0 50 50 0 20)
else
  limits=(60 45 45 95 25 85 40 60 15)
fi
L_ENV=${GPU_CHECK_LIMIT_ENV:-${limits[0]}}
L_GPU_TIER=${GPU_CHECK_LIMIT_GPU_TIER:-${limits[1]}}
L_CHECK=${GPU_CHECK_LIMIT_CHECK:-${limits[2]}}
L_BENCH=${GPU_CHECK_LIMIT_BENCH:-${limits[3]}}
L_PER_CALL=${GPU_CHECK_LIMIT_PER_CALL:-${limits[4]}}
L_SWEEP=${GPU_CHECK_LIMIT_SWEEP:-${limits[5]}}
L_MODELS=${GPU_CHECK_LIMIT_MODELS:-${limits[6]}}
L_GRAPHS=${GPU_CHECK_LIMIT_GRAPHS:-${limits[7]}}
L_SUMMARY=${GPU_CHECK_LIMIT_SUMMARY:-${limits[8]}}

# gradops from this tree; what the machine lacks of the vendored pure-Python wheels, unpacked beside it.
WHEELS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_wheels.XXXXXX")"
trap 'rm -rf "$WHEELS"' EXIT
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
has() {  # has MODULE: whether python finds MODULE (found, not imported: transformers takes seconds to import)
  "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1
}
vendor() {  # vendor MODULE WHEEL-GLOB...: unpack the wheels unless MODULE imports already
  local module="$1"; shift
  has "$module" && return 0
  local wheel
  for wheel in "$@"; do
    for w in $ROOT/third_party/wheels/$wheel; do
      [ -f "$w" ] && "$PYTHON" -m zipfile -e "$w" "$WHEELS" && echo "using vendored $(basename "$w")"
    done
  done
}
export PYTHONPATH="$PYTHONPATH:$WHEELS"
vendor liger_kernel 'liger_kernel-*.whl'
vendor pytest 'pytest-*.whl' 'pluggy-*.whl' 'iniconfig-*.whl' 'packaging-*.whl'
"$PYTHON" -c "import sys; sys.exit(sys.version_info >= (3, 11))" && vendor tomli 'tomli-*.whl'
"$PYTHON" -c "import sys; sys.exit(sys.version_info >= (3, 11))" && vendor exceptiongroup 'exceptiongroup-*.whl'

if [ "$DRY" = 1 ]; then
  # The flow on the CPU: Triton's interpreter runs the kernels (set before triton is imported), every record says
  # dry_run, nothing is timed.
  export TRITON_INTERPRET=1 GRADOPS_BACKEND=triton GRADOPS_DRY_RUN=1
  DEVICE=cpu
else
  unset TRITON_INTERPRET GRADOPS_DRY_RUN
  DEVICE=cuda
fi

part() {  # part NAME LIMIT COMMAND...: run COMMAND under LIMIT seconds; log to OUT/NAME.log; a line in parts.tsv
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS rc
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$OUT/parts.tsv"
  tail -n 4 "$OUT/$name.log"
  return 0
}
skip() {  # skip NAME REASON
  printf '%s\tskip\t0\t0\t%s\n' "$1" "$2" >> "$OUT/parts.tsv"
  echo "== $1: skipped ($2)"
}

# 0. the CPU kernels for this torch (a failed build is noted beside them: later imports say so once and go on),
# then env.json, whatever the build gave
part env "$L_ENV" bash -c '"$1" -m gradops.native; shift; exec "$@"' _ "$PYTHON" \
  "$PYTHON" -m gradops.bench.gpu_check env "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)

# 1. the GPU tier; the sm_90 builds need no device and run in the CPU suite, so not here
if has pytest; then
  part gpu-tier "$L_GPU_TIER" "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu -k "not sm90_build and not missing_ptxas" \
    --junitxml="$OUT/gpu-tier.xml"
else
  skip gpu-tier "pytest is not importable and third_party/wheels has none"
fi

# 2. every op and dtype against the float64 references (every backend usable on the device)
if [ "$DRY" = 1 ]; then
  part check "$L_CHECK" "$PYTHON" -m gradops check --device cpu --backend triton --rows 8 --cols 64 --seed 1 \
    --results "$OUT"
else
  part check "$L_CHECK" "$PYTHON" -m gradops check --device cuda --seed 1 --results "$OUT"
fi

# 3. backward ops against eager, torch.compile and Liger-Kernel: GB/s on the byte floor, % of copy_
if [ "$DRY" = 1 ]; then
  part bench "$L_BENCH" "$PYTHON" -m gradops bench --dry-run --device cpu --no-compile --dtype bf16 --dtype fp32 \
    --results "$OUT"
else
  part bench "$L_BENCH" "$PYTHON" -m gradops bench --device cuda --shapes gpu-check --dtype bf16 --dtype fp32 \
    --budget 5 --results "$OUT"
fi

# 4. host time per call at 8 x 8: what a step pays per op before the device works (no dry form: it is a time)
if [ "$DRY" = 1 ]; then
  skip per-call "a host time on the device; no dry form"
else
  part per-call "$L_PER_CALL" "$PYTHON" -m gradops bench --per-call --device cuda --results "$OUT"
fi

# 5. the size sweep (modules fwd+bwd, backward functions) and the whole-model row
if [ "$DRY" = 1 ]; then
  part sweep "$L_SWEEP" "$PYTHON" -m gradops bench --sweep --dry-run --device cpu --sizes 8x8 --processes 0 \
    --dtype fp32 --dtype bf16 --results "$OUT"
else
  part sweep "$L_SWEEP" "$PYTHON" -m gradops bench --sweep --device cuda --processes 0 --budget 0.2 --results "$OUT"
fi
if has transformers; then
  if [ "$DRY" = 1 ]; then
    part models "$L_MODELS" "$PYTHON" -m gradops bench --models --dry-run --device cpu --dtype fp32 --results "$OUT"
  else
    part models "$L_MODELS" "$PYTHON" -m gradops bench --models --device cuda --reps 10 --budget 5 --results "$OUT"
  fi
else
  skip models "transformers is not installed on this machine"
fi

# 6. a patched training step captured in a CUDA graph and replayed (CUDA graphs have no CPU form)
if [ "$DRY" = 1 ]; then
  skip cuda-graphs "CUDA graphs need the device; no dry form"
elif has transformers; then
  part cuda-graphs "$L_GRAPHS" "$PYTHON" -m gradops bench --cuda-graphs --device cuda --results "$OUT"
else
  skip cuda-graphs "transformers is not installed on this machine"
fi

# 7. the summary, last: pass / fail per part, the worst ratio per table
timeout -k 5 "$L_SUMMARY" "$PYTHON" -m gradops.bench.gpu_check summary "$OUT"
rc=$?
ls "$OUT"
exit $rc

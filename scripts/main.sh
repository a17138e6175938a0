#!/usr/bin/env bash
# The main job: sets itself up, then trains the demo MoE language model with gradops beside a plain-PyTorch twin
# (extra arguments go to `gradops demo`, e.g. --steps 100 --data my.txt). `gradops check` is the numeric check.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
cd "$ROOT"
exec gradops demo "$@"

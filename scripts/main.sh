#!/usr/bin/env bash
# The main job: sets itself up, then runs gradops' end-to-end check (extra arguments are passed on).
set -euo pipefail
. "$(dirname "$0")/setup.sh"
cd "$ROOT"
exec gradops check "$@"

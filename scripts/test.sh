#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU. The whole suite is what CI runs (.ci/run).
#   bash scripts/test.sh [pytest args...]          # everything (about 15 min on 2 cores)
#   bash scripts/test.sh --fast [pytest args...]   # the fast lane: every module, no test marked slow (< 5 min)
set -euo pipefail
cd "$(dirname "$0")/.."
lane=()
if [ "${1:-}" = "--fast" ]; then
  shift
  lane=(-m "not slow")
fi
bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
# Checkpoints of the real model need room: say how much there is, so a full disk is the first thing a log shows.
df -h "${TMPDIR:-/tmp}" | awk 'NR == 2 {print "disk: " $4 " free under '"${TMPDIR:-/tmp}"' (a full run needs about 3 GB)"}'
exec python -m pytest -q --durations=15 "${lane[@]}" "$@"  # the 15 slowest, so a slower CI says where

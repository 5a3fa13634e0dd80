#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU. This is what CI runs (.ci/run).
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
exec python -m pytest -q --durations=15 "$@"  # the 15 slowest, so a slower CI says where

#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU. This is what CI runs (.ci/run).
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HOME="$PWD/.cache/hf" TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q --durations=15 "$@"  # the 15 slowest, so a slower CI says where

#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded tiny world, on CPU: the README's first command.
#   bash scripts/tiny.sh                                   # the run: 12.4 min on 2 cores; report in runs/xecomla_tiny/eval/
#   bash scripts/tiny.sh --set output_dir=runs/mine        # any `ecomla run` option is passed on
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Everything stays in the checkout and offline: the zoo, tasks and corpus generator are all local.
. scripts/env.sh
exec .venv/bin/ecomla run recipes/xecomla_tiny.yaml "$@"

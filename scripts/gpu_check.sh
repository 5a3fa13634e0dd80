#!/usr/bin/env bash
# The prepared GPU check: one script, run once on a lent GPU machine (no network), at most 9 minutes on one H200.
#   OUT=/path bash scripts/gpu_check.sh          # GPU: installs the carried wheels offline, then measures
#   OUT=/path bash scripts/gpu_check.sh --cpu    # CPU mode: tiny shapes, installs nothing (CI runs this)
# It measures, writing JSON under $OUT:
#   distill.json  `ecomla distill` through the deepspeed launcher at Llama-3.2-1B shapes (random weights, the student
#                 converted by ecomla convert), ZeRO-2 and ZeRO-3, bf16, seq 2048, and at SmolLM2 shapes:
#                 tokens/s, MFU and peak memory (scripts/bench_gpu.py)
#   decode.json   scripts/bench_decode.py on the device: base against stock and absorbed MLA, 1k to 128k context
# Carried wheels (GPU mode): put them in ./wheels (transformers 5.24, datasets, the deepspeed sdist) and pass the
# folder with `carry`; without ./wheels the machine's own packages are used.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the JSON goes to}"
mode=gpu
[ "${1:-}" = "--cpu" ] && mode=cpu
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}" HF_HOME="${HF_HOME:-$PWD/.cache/hf}"
PY=${PYTHON:-python3}
if [ "$mode" = gpu ] && [ -d wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links wheels "transformers==5.24.*" datasets
  "$PY" -m pip install --quiet --no-index --no-build-isolation --find-links wheels wheels/deepspeed-*.tar.gz
fi
start=$(date +%s)
if [ "$mode" = gpu ]; then
  "$PY" scripts/bench_gpu.py --out "$OUT/distill.json" --workdir "$OUT/work"
  "$PY" scripts/bench_decode.py --device cuda --dtype bfloat16 --layers 16 --batch 16 \
      --contexts 1024,4096,16384,32768,65536,131072 --max-prefill 4096 --out "$OUT/decode.json"
else
  "$PY" scripts/bench_gpu.py --cpu --out "$OUT/distill.json" --workdir "$OUT/work"
  "$PY" scripts/bench_decode.py --device cpu --dtype float32 --layers 1 --batch 1 --contexts 64,128 --steps 1 --vocab 2048 \
      --max-prefill 128 --out "$OUT/decode.json"
fi
rm -rf "$OUT/work"
echo "gpu_check ($mode): $(( $(date +%s) - start )) s; JSON in $OUT"

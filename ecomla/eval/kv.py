"""KV-cache size of a checkpoint, measured from a real generate cache.

The formula it is checked against is the converter's own
(`ecomla.mla.budget.kv_elements_per_token`). The measurement runs `generate`
on a short prompt and adds up the bytes of every tensor the returned cache
holds, so a cache that stored more than the design needs would show up as a
mismatch instead of being hidden by the formula.
"""

from __future__ import annotations

import torch

from ecomla.compat import output_cache


def cache_tensor_bytes(cache) -> int:
    """Bytes of every tensor a transformers Cache holds (each layer's keys and values)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def measured_kv_bytes_per_token(model, prompt_len: int = 16, new_tokens: int = 4) -> float:
    """Bytes per token of the cache that `model.generate` returns, for one sequence of prompt_len + new tokens."""
    ids = torch.arange(2, 2 + prompt_len, device=model.device)[None] % model.config.vocab_size
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=model.config.pad_token_id or 0)
    cache = output_cache(out)
    if cache is None:
        raise ValueError(f"{type(model).__name__}.generate returned no cache; cannot measure KV bytes")
    return cache_tensor_bytes(cache) / cache.get_seq_length()

"""KV-cache size of a checkpoint: by formula from its config, and measured from a real generate cache.

The formula is the converter's own (ecomla.mla.budget): a Llama/Mistral/Qwen2
model caches 2·n_kv·d_h numbers per token and layer, a stock DeepSeek-V3 (MLA)
model caches kv_lora_rank + qk_rope_head_dim, an LRKV model 2·(d_h + n_h·r)
(ecomla.lrkv.configuration). The measurement runs `generate`
on a short prompt and adds up the bytes of every tensor the returned cache
holds, so a cache that stored more than the design needs would show up as a
mismatch instead of being hidden by the formula.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ecomla.mla.budget import AttentionShape, mla_elements

MLA_TYPES = ("deepseek_v3",)


def kv_elements_per_token(cfg: Mapping) -> int:
    """Numbers cached per token, summed over layers, for a config dict (Llama-family or DeepSeek-V3)."""
    if cfg.get("model_type") in MLA_TYPES:
        return int(cfg["num_hidden_layers"]) * mla_elements(int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"]))
    if cfg.get("model_type") == "lrkv":
        from ecomla.lrkv.configuration import LrkvConfig, lrkv_kv_elements

        return lrkv_kv_elements(LrkvConfig.from_dict({k: v for k, v in cfg.items() if k != "model_type"}))
    shape = AttentionShape.from_config(cfg)
    return shape.num_layers * shape.kv_elements


def compression_vs(cfg: Mapping, reference: Mapping) -> float:
    """KV compression ratio of `cfg` against `reference` (the base model): elements per token, reference / cfg."""
    return kv_elements_per_token(reference) / kv_elements_per_token(cfg)


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
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)  # renamed in transformers 5.24
    if cache is None:
        raise ValueError(f"{type(model).__name__}.generate returned no cache; cannot measure KV bytes")
    return cache_tensor_bytes(cache) / cache.get_seq_length()

"""LRKV attention (arXiv 2601.11471) as a transformers model: shared K/V projections plus per-head low-rank residuals.

Importing this package registers model_type "lrkv" with `AutoConfig` and
`AutoModelForCausalLM` through their public `register` calls, so LRKV
checkpoints load with `AutoModelForCausalLM.from_pretrained(path)` after
`import ecomla.lrkv`, without trust_remote_code. ecomla's own loaders (distill, eval,
variants, the yardstick) import it before they load a model by path.

  configuration  LrkvConfig and lrkv_kv_elements (the cache-size formula, derived there)
  modeling       LrkvForCausalLM, one file: attention, decoder layer, model, LM head
  cache          LrkvCache: 2·(d_h + n_h·r) cached numbers per token and layer
  convert        shared + truncated-SVD residual init from per-head weights, and the output config

KV elements per token (all layers) = num_hidden_layers · 2 · (d_h + n_h·r): per layer the
rotated shared key and the shared value (d_h each) plus n_h latents of width r for keys and
for values; B_h and the residual's RoPE are applied when attention reads the cache.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from ecomla.lrkv.cache import LrkvCache
from ecomla.lrkv.configuration import LrkvConfig, lrkv_kv_elements
from ecomla.lrkv.modeling import LrkvForCausalLM, LrkvModel

AutoConfig.register("lrkv", LrkvConfig)
AutoModelForCausalLM.register(LrkvConfig, LrkvForCausalLM)

__all__ = ["LrkvCache", "LrkvConfig", "LrkvForCausalLM", "LrkvModel", "lrkv_kv_elements"]

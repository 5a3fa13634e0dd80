"""ecomla: upcycle pretrained LLMs into stock DeepSeek-V3 Multi-head Latent Attention, then distill.

Subpackages:
  mla      the math (SVD/PCA latents, RoPE dims, KV budgets); tensors in, tensors out
  convert  checkpoint conversion to stock DeepseekV3ForCausalLM (`ecomla convert`)
  analyze  analyses such as reconstruction error against calibration tokens (`ecomla analyze`)
  recipe   typed YAML recipes
  lrkv     LRKV attention (shared K/V + per-head low-rank residuals) as a transformers model
  io, data checkpoint and text plumbing
"""

import ecomla.lrkv  # noqa: F401  (registers model_type "lrkv" with the Auto classes)

__version__ = "0.1.0"

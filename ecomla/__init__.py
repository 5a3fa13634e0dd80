"""ecomla: upcycle pretrained LLMs into stock DeepSeek-V3 Multi-head Latent Attention, then distill.

Subpackages:
  mla      the math (SVD/PCA latents, RoPE dims, KV budgets); tensors in, tensors out
  convert  checkpoint conversion to stock DeepseekV3ForCausalLM (`ecomla convert`)
  analyze  analyses such as reconstruction error against calibration tokens (`ecomla analyze`)
  recipe   typed YAML recipes
  io, data checkpoint and text plumbing
"""

__version__ = "0.1.0"

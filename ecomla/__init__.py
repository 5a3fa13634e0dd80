"""ecomla: upcycle pretrained LLMs into stock DeepSeek-V3 Multi-head Latent Attention, then distill.

Subpackages:
  mla      the math (SVD/PCA latents, RoPE dims, KV budgets); tensors in, tensors out
  convert  checkpoint conversion to stock DeepseekV3ForCausalLM (`ecomla convert`)
  analyze  analyses such as reconstruction error against calibration tokens (`ecomla analyze`)
  recipe   typed YAML recipes
  lrkv     LRKV attention (shared K/V + per-head low-rank residuals) as a transformers model;
           `import ecomla.lrkv` registers model_type "lrkv" with the Auto classes
  io, data checkpoint and text plumbing

Importing the package loads nothing heavy: each command imports what it needs when it runs, so
`ecomla convert --help` does not wait for torch, transformers, DeepSpeed or lm-eval.
"""

__version__ = "0.1.0"

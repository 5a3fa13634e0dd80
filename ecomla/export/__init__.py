"""Exports of ecomla checkpoints to serving engines' own formats (llama.cpp's GGUF)."""

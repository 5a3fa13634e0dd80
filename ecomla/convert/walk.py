"""Walking a source model layer by layer on calibration tokens.

Shared by `ecomla convert` and `ecomla analyze`: token blocks for fitting and
held-out measurement, a layer's tensors from the checkpoint, and the normalized
attention input y that every latent fit works on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ecomla.convert.recipe import CalibrationConfig
from ecomla.convert.to_mla import SourceAttention
from ecomla.data.text import token_blocks
from ecomla.io.checkpoint import CheckpointReader


@dataclass
class Calibration:
    """Token blocks for fitting and for held-out measurement."""

    fit: torch.Tensor  # (n_fit, T) token ids
    heldout: torch.Tensor | None  # (n_held, T) token ids


def load_calibration(cfg: CalibrationConfig, tokenizer) -> Calibration:
    n_fit = cfg.num_tokens // cfg.seq_len
    n_held = cfg.heldout_tokens // cfg.seq_len
    texts = cfg.texts()
    if cfg.heldout is None:
        blocks = token_blocks(texts, tokenizer, cfg.seq_len, n_fit + n_held)
        return Calibration(blocks[:n_fit], blocks[n_fit:] if n_held else None)
    fit = token_blocks(texts, tokenizer, cfg.seq_len, n_fit)
    held = None
    if n_held:
        held = token_blocks(cfg.heldout.texts(), tokenizer, cfg.seq_len, n_held)
    return Calibration(fit, held)


def normalized_input(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """y = RMSNorm(h) without its gain, flattened to (N·T, d), float32."""
    h = hidden.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).reshape(-1, h.shape[-1])


def layer_tensors(reader: CheckpointReader, i: int, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """All source tensors of layer i, names relative to the layer, in `dtype` (None: as stored)."""
    prefix = f"model.layers.{i}."
    return {name[len(prefix) :]: reader.get(name, dtype) for name in sorted(reader.names()) if name.startswith(prefix)}


def embed(reader: CheckpointReader, ids: torch.Tensor) -> torch.Tensor:
    """Input embeddings (N, T, d) float32 for token blocks (N, T)."""
    return reader.get("model.embed_tokens.weight", dtype=None)[ids].float()


def source_attention(t: dict[str, torch.Tensor]) -> SourceAttention:
    return SourceAttention.fold_gain(
        t["input_layernorm.weight"],
        q_w=t["self_attn.q_proj.weight"],
        k_w=t["self_attn.k_proj.weight"],
        v_w=t["self_attn.v_proj.weight"],
        o_w=t["self_attn.o_proj.weight"],
        q_b=t.get("self_attn.q_proj.bias"),
        k_b=t.get("self_attn.k_proj.bias"),
        v_b=t.get("self_attn.v_proj.bias"),
        o_b=t.get("self_attn.o_proj.bias"),
    )

"""Tiny LRKV and Llama models and a left-padded batch, shared by the tests/lrkv modules."""

from __future__ import annotations

import torch

from ecomla.lrkv import LrkvConfig, LrkvForCausalLM

TINY_LRKV = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    lrkv_rank=4,
    max_position_embeddings=256,
    initializer_range=0.1,
    pad_token_id=0,
)


def tiny_lrkv(seed: int = 0, **overrides) -> LrkvForCausalLM:
    """A random tiny LrkvForCausalLM in eval mode, with norm gains away from 1."""
    torch.manual_seed(seed)
    model = LrkvForCausalLM(LrkvConfig(**{**TINY_LRKV, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def padded_batch(vocab: int = 128, seed: int = 0, T: int = 10, pad: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ids in [1, vocab), the second left-padded by `pad` zeros; (ids, attention_mask), both (2, T)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate builds them from a left-padded mask: cumsum − 1, pads at 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)

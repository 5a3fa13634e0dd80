"""LrkvCache: the generate cache of an LRKV model, 2·(d_h + n_h·r) numbers per token and layer.

Notation: B batch, S cached tokens, n_h heads, d_h head width, r = lrkv_rank,
p_s the RoPE position of cached token s, R_p the RoPE rotation at position p.

What one layer stores (a stock transformers `DynamicLayer`, grown along dim -2):

    keys   (B, 1, S, d_h + n_h·r) = [ R_p·(x·W_K) | x·A^K_1 | … | x·A^K_{n_h} ]
    values (B, 1, S, d_h + n_h·r) = [ x·W_V       | x·A^V_1 | … | x·A^V_{n_h} ]

so `cache.layers[i].keys` and `.values` hold exactly 2·(d_h + n_h·r) numbers per
token, and `ecomla.eval.kv.cache_tensor_bytes` measures that and nothing else.

Why the key residual is cached unrotated. RoPE is linear, so for head h

    R_p·K_h = R_p·(x·W_K) + R_p·(x·A^K_h·B^K_h).

The first term is the same for every head: it is rotated once, when the token
is written, and cached (d_h numbers). The second cannot be cached as is without
storing n_h·d_h numbers; instead the cache keeps the latent x·A^K_h (r numbers
per head) and attention recomputes (x·A^K_h)·B^K_h and rotates it at each
cached token's own position p_s when it rebuilds the keys. Values have no RoPE,
so V_h = x·W_V + (x·A^V_h)·B^V_h is rebuilt the same way without a rotation.

That rotation needs p_s, which is not recoverable from the latents: with left
padding, p_s differs between rows. The cache therefore also keeps `positions`
(B, S) int64 once for all layers. It is bookkeeping, not key/value state (a
serving engine knows every token's position from its block table), it does not
grow with the number of layers, and it is deliberately not part of
`layers[*].keys/values`.

Use: `LrkvForCausalLM` builds an `LrkvCache` itself on the first forward with
`use_cache=True`, so `model.generate(...)` needs nothing special; pass
`past_key_values=LrkvCache(model.config)` to manage one by hand.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class LrkvCache(Cache):
    """One `DynamicLayer` per decoder layer holding the packed LRKV state, plus the cached tokens' RoPE positions."""

    def __init__(self, config):
        super().__init__(layers=[DynamicLayer() for _ in range(config.num_hidden_layers)])
        self.positions: torch.Tensor | None = None  # (B, S) int64: RoPE position of every cached token

    def append_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Record the positions (B, T) of the tokens about to be written; return those of all keys, (B, S + T).

        Called once per forward, before the layers write their states, so layer i's keys and these
        positions always describe the same tokens after the forward.
        """
        if self.positions is None:
            self.positions = position_ids
        else:
            self.positions = torch.cat([self.positions, position_ids.to(self.positions.device)], dim=-1)
        return self.positions

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.positions is not None:
            self.positions = self.positions[:, :tokens_to_remove]

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices, ...]

"""Absorbed MLA decoding for stock DeepSeek-V3 checkpoints: attention runs on the cached latent.

    from ecomla.decode import AbsorbedDeepseekV3ForCausalLM
    model = AbsorbedDeepseekV3ForCausalLM.from_pretrained(converted_dir)   # the same stock weights
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)  # HF generate, greedy or sampling

Why. The stock attention up-projects the whole cached latent to per-head keys
and values at every step: O(S·r·H·(nope + v)) work and memory traffic per token
at context S. Absorption folds W_UK into the query and W_UV after the
attention-weighted sum, so scores and outputs are computed against the latent
c (S × r) and the shared RoPE key (S × d_r) directly:

  score_hs = (q_nope,h · W_UK,h) · c_s  +  q_rope,h · k_rope,s        per head h, cached token s
  out_h    = W_UV,h · Σ_s softmax(score)_hs · c_s

Notation: B batch, T new tokens, S cached tokens, H heads, r kv_lora_rank,
n qk_nope_head_dim, d_r qk_rope_head_dim, v v_head_dim. W_UK,h (n × r) and
W_UV,h (v × r) are the key and value rows of head h in kv_b_proj.

Prefill (T > 1) keeps the stock expanded attention, which is cheaper when many
queries share the expansion (DeepSeek does the same); decoding steps (T = 1)
use the absorbed form. Both read and write the same cache (the normalized
latent and the rotated RoPE key), so the checkpoint, the cache layout and the
outputs are the stock model's. Nothing in transformers is patched: this class
only adds its own forward over the stock modules' weights.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3ForCausalLM
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from ecomla.compat import cache_argument, cache_field


def padding_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, dtype, device) -> torch.Tensor:
    """(B, 1, T, S) additive mask: causal over the last T of S positions, and 2D padding zeros masked out."""
    neg = torch.finfo(dtype).min
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    allowed = torch.arange(kv_len, device=device)[None, :] <= q_pos  # (T, S)
    allowed = allowed[None, None].expand(batch, 1, q_len, kv_len)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, neg)


def absorbed_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask_2d: torch.Tensor | None,
                       cache: Cache | None, layer_idx: int) -> torch.Tensor:
    """One stock DeepseekV3Attention's output for hidden states x (B, T, d), computed on the latent."""
    B, T, _ = x.shape
    H, n, d_r, v, r = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(B, T, H, n + d_r).transpose(1, 2)  # (B, H, T, n + d_r)
    q_nope, q_rope = q.split([n, d_r], dim=-1)

    kv = attn.kv_a_proj_with_mqa(x)  # (B, T, r + d_r)
    latent, k_rope = kv.split([r, d_r], dim=-1)
    latent = attn.kv_a_layernorm(latent).view(B, 1, T, r)  # the cached, normalized latent
    k_rope = k_rope.view(B, 1, T, d_r)
    rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
    q_rope, k_rope = rotate(q_rope, k_rope, cos, sin)
    if cache is not None:
        latent, k_rope = cache.update(latent, k_rope, layer_idx)  # (B, 1, S, r), (B, 1, S, d_r)
    S = latent.shape[2]

    w = attn.kv_b_proj.weight.view(H, n + v, r)
    w_uk, w_uv = w[:, :n], w[:, n:]  # (H, n, r), (H, v, r)
    q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # W_UK absorbed into the query
    c = latent[:, 0]  # (B, S, r)
    scores = torch.einsum("bhtr,bsr->bhts", q_lat, c) + torch.einsum("bhtd,bsd->bhts", q_rope, k_rope[:, 0])
    scores = scores * attn.scaling + padding_mask(mask_2d, B, T, S, scores.dtype, x.device)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, T, S)
    o_lat = torch.einsum("bhts,bsr->bhtr", probs, c)  # attention output, still in latent space
    out = torch.einsum("bhtr,hvr->bthv", o_lat, w_uv).reshape(B, T, H * v)  # W_UV applied once per head
    return attn.o_proj(out)


_OUT_CACHE = cache_field(CausalLMOutputWithPast)  # past_key_values or cache, as this transformers names it


class AbsorbedDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """A stock DeepseekV3ForCausalLM whose decoding steps run absorbed attention (see the module docstring)."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        base = self.model
        past_key_values = kwargs.pop("cache", None) or past_key_values
        h = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = h.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=h.device)[None]
        cos, sin = base.rotary_emb(h, position_ids)
        if T == 1:
            # Decode: absorbed attention; the 2D padding mask is all it needs (one query sees every cached token).
            mask_2d = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
            for i, layer in enumerate(base.layers):
                x = absorbed_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, mask_2d, past_key_values, i)
                h = h + x
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            # Prefill: the stock expanded path, through the stock model.
            h = base(inputs_embeds=h, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=use_cache, **{cache_argument(base.forward): past_key_values}).last_hidden_state
            logits = self.lm_head(h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) and logits_to_keep else h)
            return CausalLMOutputWithPast(logits=logits, **{_OUT_CACHE: past_key_values})
        h = base.norm(h)
        logits = self.lm_head(h)
        return CausalLMOutputWithPast(logits=logits, **{_OUT_CACHE: past_key_values})

"""LrkvForCausalLM: a Llama decoder whose keys and values are one shared projection plus a rank-r residual per head.

    import ecomla                                   # registers model_type "lrkv" with the Auto classes
    from ecomla.lrkv import LrkvConfig, LrkvForCausalLM
    model = LrkvForCausalLM(LrkvConfig(hidden_size=64, num_attention_heads=4, lrkv_rank=4, ...))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=32, return_dict_in_generate=True)
    out.past_key_values                             # LrkvCache: 2·(d_h + n_h·r) numbers per token and layer
    model.save_pretrained(path); AutoModelForCausalLM.from_pretrained(path)   # no trust_remote_code

Notation (LRKV, arXiv 2601.11471):
  B batch, T new tokens, S keys (cached + new), D d_model, n_h heads, d_h head width, r lrkv_rank
  x (B, T, D)        the attention input (after input_layernorm)
  W_K, W_V (D, d_h)  k_shared, v_shared: one full-rank key and value projection for all heads
  A^K_h (D, r)       head h's slice of k_down = Linear(D, n_h·r): all heads' A^K in one matmul
  B^K_h (r, d_h)     k_up[h], a Parameter (n_h, r, d_h): all heads' B^K in one batched einsum
  A^V_h, B^V_h       the same for values (v_down, v_up)
  R_p                RoPE rotation at position p (Llama's, any rope_type LlamaRotaryEmbedding supports)

  K_h = R_p·(x·W_K) + R_p·(x·A^K_h·B^K_h)        V_h = x·W_V + x·A^V_h·B^V_h

Queries (q_proj, n_h heads of d_h), o_proj, the SwiGLU MLP and the RMSNorms are Llama's,
under Llama's module names, so everything but attention loads from a Llama state dict.

Attention runs one code path with or without a cache:
  1. project the new tokens into the cached form (ecomla/lrkv/cache.py): keys
     [R_p·(x·W_K) | x·A^K_1..n_h], values [x·W_V | x·A^V_1..n_h], each (B, 1, T, d_h + n_h·r);
  2. append them to the cache, if any, and read back all S tokens;
  3. rebuild per-head keys and values (B, n_h, S, d_h): multiply each head's latents by B_h,
     and rotate the key residual at each key's own position (positions kept by LrkvCache);
  4. ordinary multi-head attention: eager below, or sdpa through transformers' attention interface.
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

from ecomla.compat import cache_argument, cache_field, output_cache
from ecomla.lrkv.cache import LrkvCache
from ecomla.lrkv.configuration import LrkvConfig


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (B, positions, d_h)


def eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0):
    """Softmax attention, additive mask; query (B, n_h, T, d_h), key/value (B, n_h, S, d_h) -> (B, T, n_h, d_h)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, n_h, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (B, n_h, T, d_h)
    return out.transpose(1, 2).contiguous(), probs


class LrkvAttention(nn.Module):
    """LRKV self-attention: shared K/V projection plus per-head rank-r residuals (module docstring)."""

    def __init__(self, config: LrkvConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.rank = config.lrkv_rank
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.num_key_value_groups = 1  # keys/values are rebuilt per query head; transformers' sdpa reads this
        D, n_h, d_h, r, bias = config.hidden_size, self.num_heads, self.head_dim, self.rank, config.attention_bias

        self.q_proj = nn.Linear(D, n_h * d_h, bias=bias)
        self.k_shared = nn.Linear(D, d_h, bias=bias)  # W_K
        self.v_shared = nn.Linear(D, d_h, bias=bias)  # W_V
        self.k_down = nn.Linear(D, n_h * r, bias=False)  # [A^K_1 .. A^K_{n_h}], head-major output
        self.v_down = nn.Linear(D, n_h * r, bias=False)  # [A^V_1 .. A^V_{n_h}]
        self.k_up = nn.Parameter(torch.empty(n_h, r, d_h))  # B^K_h = k_up[h]
        self.v_up = nn.Parameter(torch.empty(n_h, r, d_h))  # B^V_h = v_up[h]
        self.o_proj = nn.Linear(n_h * d_h, D, bias=bias)

    def forward(self, x: torch.Tensor, query_rope: Rope, key_rope: Rope, attention_mask: torch.Tensor | None,
                past_key_values: LrkvCache | None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). query_rope: cos/sin of the T new tokens; key_rope: of all S keys."""
        B, T, _ = x.shape
        n_h, d_h, r = self.num_heads, self.head_dim, self.rank

        # 1. The new tokens' queries and cache entries.
        q = self.q_proj(x).view(B, T, n_h, d_h).transpose(1, 2)  # (B, n_h, T, d_h)
        k_shared = self.k_shared(x).view(B, 1, T, d_h)  # one key for every head
        q, k_shared = apply_rotary_pos_emb(q, k_shared, *query_rope)
        keys = torch.cat([k_shared, self.k_down(x).view(B, 1, T, n_h * r)], dim=-1)  # (B, 1, T, d_h + n_h·r)
        values = torch.cat([self.v_shared(x), self.v_down(x)], dim=-1).view(B, 1, T, d_h + n_h * r)  # same layout

        # 2. All S tokens' entries.
        if past_key_values is not None:
            keys, values = past_key_values.update(keys, values, self.layer_idx)  # (B, 1, S, d_h + n_h·r)

        # 3. Per-head keys and values, 4. attention.
        k, v = self.expand(keys, values, key_rope)  # (B, n_h, S, d_h) each
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                           dropout=self.attention_dropout if self.training else 0.0)
        return self.o_proj(out.reshape(B, T, n_h * d_h))

    def expand(self, keys: torch.Tensor, values: torch.Tensor, key_rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K and V (B, n_h, S, d_h) from the packed cache entries (B, 1, S, d_h + n_h·r).

        K_h = R_p·k_shared + R_p·(c^K_h·B^K_h) with the shared key already rotated in the cache,
        V_h = v_shared + c^V_h·B^V_h, where c_h = x·A_h are the cached latents.
        """
        B, _, S, _ = keys.shape
        n_h, d_h, r = self.num_heads, self.head_dim, self.rank
        k_shared, k_latent = keys[:, 0].split([d_h, n_h * r], dim=-1)  # (B, S, d_h), (B, S, n_h·r)
        v_shared, v_latent = values[:, 0].split([d_h, n_h * r], dim=-1)
        k_res = torch.einsum("bshr,hrd->bhsd", k_latent.view(B, S, n_h, r), self.k_up)  # (B, n_h, S, d_h)
        v_res = torch.einsum("bshr,hrd->bhsd", v_latent.view(B, S, n_h, r), self.v_up)  # (B, n_h, S, d_h)
        cos, sin = (t.unsqueeze(1) for t in key_rope)  # (B, 1, S, d_h): each key's own position
        k_res = k_res * cos + rotate_half(k_res) * sin  # R_{p_s} applied to the residual, as Llama's RoPE
        return k_shared.unsqueeze(1) + k_res, v_shared.unsqueeze(1) + v_res


class LrkvDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), exactly as LlamaDecoderLayer."""

    def __init__(self, config: LrkvConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LrkvAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, query_rope: Rope, key_rope: Rope,
                attention_mask: torch.Tensor | None = None, past_key_values: LrkvCache | None = None) -> torch.Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), query_rope, key_rope,
                                           attention_mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class LrkvPreTrainedModel(PreTrainedModel):
    """Shared transformers plumbing: config class, weight init (incl. k_up/v_up), sdpa and checkpointing support."""

    config_class = LrkvConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LrkvDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)  # Linear, Embedding, RMSNorm, rotary buffers
        if isinstance(module, LrkvAttention):
            init.normal_(module.k_up, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.v_up, mean=0.0, std=self.config.initializer_range)


class LrkvModel(LrkvPreTrainedModel):
    """Embeddings, LRKV decoder layers and the final norm; returns hidden states and the LrkvCache."""

    def __init__(self, config: LrkvConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LrkvDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: LrkvCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if past_key_values is not None and not isinstance(past_key_values, LrkvCache):
            raise TypeError(f"an LRKV model caches latents and needs an LrkvCache (ecomla.lrkv.LrkvCache), "
                            f"got {type(past_key_values).__name__}")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = h.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            if past_key_values is not None:
                raise ValueError("gradient checkpointing replays layers, which would write past_key_values twice")
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = LrkvCache(self.config)

        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=h.device)[None]
        position_ids = position_ids.expand(B, T)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                  position_ids=position_ids, **{cache_argument(create_causal_mask): past_key_values})
        # RoPE of every key (cached + new, (B, S)); the new tokens are the last T keys, and the queries.
        key_positions = position_ids if past_key_values is None else past_key_values.append_positions(position_ids)
        key_rope = self.rotary_emb(h, key_positions)  # cos, sin: (B, S, d_h)
        query_rope = (key_rope[0][:, -T:], key_rope[1][:, -T:])  # (B, T, d_h)

        hidden_states = (h,) if output_hidden_states else None
        for layer in self.layers:
            h = layer(h, query_rope, key_rope, attention_mask=mask, past_key_values=past_key_values)
            if output_hidden_states:
                hidden_states += (h,)
        h = self.norm(h)
        if output_hidden_states:
            hidden_states = hidden_states[:-1] + (h,)  # as Llama: the last entry is after the final norm
        return BaseModelOutputWithPast(last_hidden_state=h, hidden_states=hidden_states,
                                       **{cache_field(BaseModelOutputWithPast): past_key_values})


class LrkvForCausalLM(LrkvPreTrainedModel, GenerationMixin):
    """LrkvModel plus the LM head. `generate` works as for any transformers causal LM and returns an LrkvCache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LrkvConfig):
        super().__init__(config)
        self.model = LrkvModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Tells generate() not to build a DynamicCache (whose layers would not carry RoPE positions): our first
        # forward creates the LrkvCache instead, and generate carries it from step to step and returns it.
        return False

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: LrkvCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: LrkvCache | None = None,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits (B, T, vocab) (or the last `logits_to_keep`), loss if `labels`, and the LrkvCache.

        `cache` is the name transformers >= 5.24 uses for `past_key_values`; either is accepted.
        """
        if output_attentions:
            raise NotImplementedError("LrkvForCausalLM does not return attention probabilities (output_attentions)")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache if cache is not None else past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        **{cache_field(CausalLMOutputWithPast): output_cache(out)})
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()

"""LrkvConfig: a Llama-shaped config plus the LRKV residual rank, and the KV-cache size it implies.

LRKV (arXiv 2601.11471) replaces per-head key/value projections with one shared
full-rank projection plus a rank-r residual per head:

    K_h = x·W_K + x·A^K_h·B^K_h        V_h = x·W_V + x·A^V_h·B^V_h

with W_K, W_V (d_model × d_h) shared by all heads, A_h (d_model × r) and
B_h (r × d_h) per head. Queries, output projection, MLP, norms and RoPE are
Llama's; RoPE parameters are stored exactly as `LlamaConfig` stores them
(`rope_parameters`, with `rope_theta=` / `rope_scaling=` accepted as legacy
keywords), so transformers' `LlamaRotaryEmbedding` works on this config as is.

KV cache per token and layer (see ecomla/lrkv/cache.py). Keys: the shared key,
already rotated (d_h numbers), and the per-head residual latents x·A^K_h
(n_h·r numbers); B^K_h and RoPE are applied when attention reads the cache.
Values: the shared value (d_h) and the latents x·A^V_h (n_h·r). So

    elements per token = num_hidden_layers · 2 · (d_h + n_h·r)

against 2·n_kv·d_h per layer for a Llama with n_kv key/value heads.
"""

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import RopeParameters


@strict
class LrkvConfig(PretrainedConfig):
    """Configuration of `LrkvForCausalLM`. Every field but `lrkv_rank` means what it means in `LlamaConfig`."""

    model_type = "lrkv"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    """Tokens in the vocabulary: rows of `model.embed_tokens` and of `lm_head`."""
    hidden_size: int = 4096
    """d_model, the width of the residual stream."""
    intermediate_size: int = 11008
    """Width of the SwiGLU MLP's gate and up projections."""
    num_hidden_layers: int = 32
    """Decoder layers L."""
    num_attention_heads: int = 32
    """Query heads n_h; LRKV also builds one key and one value per query head (no GQA grouping)."""
    head_dim: int | None = None
    """Per-head width d_h of queries, keys and values; None means hidden_size // num_attention_heads."""
    lrkv_rank: int = 8
    """Rank r of each head's key and value residual A_h·B_h; the cache holds n_h·r latents per token for each."""
    hidden_act: str = "silu"
    """Activation of the MLP gate (Llama: silu)."""
    max_position_embeddings: int = 2048
    """Longest sequence the RoPE was trained for; also the `original_max_position_embeddings` default of scaled RoPE."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of every projection, embedding and B_h."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    use_cache: bool = True
    """Whether forward builds and returns an LrkvCache by default."""
    pad_token_id: int | None = None
    """Padding token id (row of embed_tokens kept at zero at init), or None."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = 2
    """End-of-sequence token id(s)."""
    tie_word_embeddings: bool = False
    """Whether lm_head shares its weight with model.embed_tokens."""
    rope_parameters: RopeParameters | dict | None = None
    """RoPE settings as in LlamaConfig: {'rope_type': 'default' | 'llama3' | 'yarn' | ..., 'rope_theta': ..., ...}."""
    attention_bias: bool = False
    """Whether q_proj, k_shared, v_shared and o_proj carry biases (the low-rank residual paths never do)."""
    attention_dropout: int | float = 0.0
    """Dropout on attention probabilities during training."""
    mlp_bias: bool = False
    """Whether the MLP projections carry biases."""

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_lrkv_rank(self):
        """The residual of a (d_h × d_model) head has rank at most min(d_model, d_h); a larger r only adds cache."""
        limit = min(self.hidden_size, self.head_dim)
        if not 1 <= self.lrkv_rank <= limit:
            raise ValueError(
                f"lrkv_rank must be in [1, min(hidden_size, head_dim)] = [1, {limit}], got lrkv_rank={self.lrkv_rank}"
            )


def lrkv_kv_elements(config: LrkvConfig) -> int:
    """Numbers an LRKV model caches per token, summed over layers: L · 2 · (d_h + n_h·r) (module docstring)."""
    per_layer = 2 * (config.head_dim + config.num_attention_heads * config.lrkv_rank)
    return config.num_hidden_layers * per_layer

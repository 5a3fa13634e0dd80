"""Initialize LRKV key/value projections from per-head weights: shared = mean head, residuals = truncated SVD.

    from ecomla.lrkv.convert import lrkv_config_from_llama, shared_lowrank
    split = shared_lowrank(heads, rank=8)                # tensors in, tensors out
    config = lrkv_config_from_llama(llama_config, rank=8)

Notation: n_h heads, d_h head width, D d_model, r rank. A head's key projection in
nn.Linear layout is W_h (d_h × D), k_h = x·W_hᵀ. LRKV writes it as

    W_hᵀ ≈ W_Kᵀ + A_h·B_h          W_K (d_h × D) shared,  A_h (D × r),  B_h (r × d_h).

Shared part. W_K = mean_h W_h minimizes Σ_h ‖W_h − W_K‖²_F, the energy left for the
residuals. Residuals. R_h = (W_h − W_K)ᵀ (D × d_h) has rank ≤ min(D, d_h); its top-r SVD
U_r·Σ_r·V_rᵀ is the best rank-r fit (Eckart–Young), so the error is the discarded σ² and
vanishes at r = min(D, d_h). The singular values are split evenly, A_h = U_r·Σ_r^½ and
B_h = Σ_r^½·V_rᵀ, so neither factor dwarfs the other when training continues.

GQA sources: LRKV has a key and a value per query head, so a Llama K/V Linear of
n_kv·d_h rows is first expanded to n_h heads (query head h reads kv head h // (n_h/n_kv),
as transformers' repeat_kv). With full-rank residuals the LRKV model then computes
exactly the Llama's keys and values, which tests/lrkv/test_convert.py checks on logits.

`shared_lowrank` and `expand_kv_heads` are pure tensor math (no transformers);
`lrkv_config_from_llama` is the output config. The one converter is `ecomla convert` with
`target: lrkv` (ecomla/convert/targets.py), from a checkpoint on disk, one layer at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ecomla.lrkv.configuration import LrkvConfig


@dataclass
class SharedLowRank:
    """Per-head weights split as W_hᵀ ≈ sharedᵀ + down[h]·up[h] (module docstring)."""

    shared: torch.Tensor  # (d_h, D) W_K, nn.Linear layout: the mean head
    down: torch.Tensor  # (n_h, D, r) A_h
    up: torch.Tensor  # (n_h, r, d_h) B_h
    energy_kept: float  # share of the residuals' Σσ² inside the kept rank (1.0 at full rank)

    def heads(self) -> torch.Tensor:
        """The reconstructed per-head weights (n_h, d_h, D)."""
        return self.shared + (self.down @ self.up).transpose(1, 2)

    def down_weight(self) -> torch.Tensor:
        """All A_h as one nn.Linear(D, n_h·r) weight (n_h·r, D), head-major: row h·r + j is column j of A_h."""
        _, D, _ = self.down.shape
        return self.down.transpose(1, 2).reshape(-1, D)  # (n_h, r, D) -> (n_h·r, D)


def expand_kv_heads(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """A K or V nn.Linear weight (n_kv·d_h, D) as per-query-head weights (n_h, d_h, D), GQA groups repeated."""
    rows, D = weight.shape
    if rows % head_dim:
        raise ValueError(f"weight has {rows} rows, not a multiple of head_dim={head_dim}")
    n_kv = rows // head_dim
    if num_heads % n_kv:
        raise ValueError(f"num_heads={num_heads} is not a multiple of the {n_kv} key/value heads")
    heads = weight.view(n_kv, head_dim, D)  # (n_kv, d_h, D)
    return heads.repeat_interleave(num_heads // n_kv, dim=0)  # (n_h, d_h, D)


def shared_lowrank(heads: torch.Tensor, rank: int) -> SharedLowRank:
    """Split per-head weights (n_h, d_h, D) into the mean head plus rank-`rank` residual factors per head."""
    n_h, d_h, D = heads.shape
    if not 1 <= rank <= min(D, d_h):
        raise ValueError(f"rank must be in [1, min(d_model, head_dim)] = [1, {min(D, d_h)}], got {rank}")
    W = heads.double()
    shared = W.mean(dim=0)  # (d_h, D)
    residual = (W - shared).transpose(1, 2)  # (n_h, D, d_h): x·residual[h] is head h's residual key
    U, S, Vh = torch.linalg.svd(residual, full_matrices=False)  # (n_h, D, k), (n_h, k), (n_h, k, d_h)
    root = S[:, :rank].sqrt()  # (n_h, r)
    down = U[:, :, :rank] * root[:, None, :]  # (n_h, D, r)
    up = root[:, :, None] * Vh[:, :rank]  # (n_h, r, d_h)
    total = float(S.square().sum())
    energy = float(S[:, :rank].square().sum()) / total if total > 0 else 1.0
    dtype = heads.dtype
    return SharedLowRank(shared=shared.to(dtype), down=down.to(dtype), up=up.to(dtype), energy_kept=energy)


def lrkv_config_from_llama(llama_config, rank: int) -> LrkvConfig:
    """The LrkvConfig with a Llama-shaped config's shapes, RoPE and token ids, and residual rank `rank`.

    Llama-shaped: a LlamaConfig, or a MistralConfig without a sliding window (same layers; Mistral has
    no `mlp_bias` and may leave `head_dim` unset, hence the defaults read below).
    """
    if getattr(llama_config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported: per-head key/value biases have no place in the "
                         "bias-free low-rank residual, so the conversion would not be exact")
    heads = llama_config.num_attention_heads
    return LrkvConfig(
        vocab_size=llama_config.vocab_size,
        hidden_size=llama_config.hidden_size,
        intermediate_size=llama_config.intermediate_size,
        num_hidden_layers=llama_config.num_hidden_layers,
        num_attention_heads=heads,
        head_dim=getattr(llama_config, "head_dim", None) or llama_config.hidden_size // heads,
        lrkv_rank=rank,
        hidden_act=llama_config.hidden_act,
        max_position_embeddings=llama_config.max_position_embeddings,
        initializer_range=getattr(llama_config, "initializer_range", 0.02),
        rms_norm_eps=llama_config.rms_norm_eps,
        pad_token_id=getattr(llama_config, "pad_token_id", None),
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        tie_word_embeddings=bool(getattr(llama_config, "tie_word_embeddings", False)),
        rope_parameters=copy.deepcopy(llama_config.rope_parameters),
        attention_bias=False,
        attention_dropout=getattr(llama_config, "attention_dropout", 0.0),
        mlp_bias=bool(getattr(llama_config, "mlp_bias", False)),
    )

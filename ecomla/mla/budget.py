"""KV-cache budgets: compression ratios and per-layer latent ranks.

Pure math on numbers and tensors (no transformers, no files), so that the same
formulas serve the converter, its reports and the eval tables.

Notation (per layer l):
  n_kv   number of KV heads of the source model
  d_h    source head dim
  r_l    MLA latent width of layer l (kv_lora_rank)
  d_r    width of the shared RoPE key (qk_rope_head_dim)

The source caches 2·n_kv·d_h numbers per token and layer (keys and values);
MLA caches r_l + d_r (the latent and the shared RoPE key). X-EcoMLA's
compression ratio is Σ_l 2·n_kv·d_h / Σ_l (r_l + d_r).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of a source checkpoint, read from its config dict."""

    num_layers: int  # L
    hidden_size: int  # d
    num_heads: int  # n_h, query heads
    num_kv_heads: int  # n_kv
    head_dim: int  # d_h

    @classmethod
    def from_config(cls, cfg: Mapping) -> AttentionShape:
        """Read a Hugging Face Llama/Mistral/Qwen2 `config.json` dict."""
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
        )

    @property
    def kv_elements(self) -> int:
        """Numbers cached per token and layer by the source: 2·n_kv·d_h."""
        return 2 * self.num_kv_heads * self.head_dim


def parse_budget(text: str) -> tuple[int, int]:
    """'64+32' -> (kv_lora_rank, qk_rope_head_dim); a ValueError that says the format otherwise."""
    try:
        r_kv, d_r = (int(x) for x in text.split("+"))
    except ValueError:
        raise ValueError(f"{text!r}: a budget is R_KV+D_R, e.g. 64+32") from None
    return r_kv, d_r


def mla_elements(kv_lora_rank: int, rope_dim: int) -> int:
    """Numbers cached per token and layer by MLA: r + d_r."""
    return kv_lora_rank + rope_dim


MLA_TYPES = ("deepseek_v3",)


def kv_elements_per_token(cfg: Mapping) -> int:
    """Numbers cached per token, summed over layers, for a config dict: Llama-family (2·n_kv·d_h per layer),
    stock DeepSeek-V3 (kv_lora_rank + qk_rope_head_dim) or LRKV (2·(d_h + n_h·r), `ecomla.lrkv.configuration`)."""
    if cfg.get("model_type") in MLA_TYPES:
        return int(cfg["num_hidden_layers"]) * mla_elements(int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"]))
    if cfg.get("model_type") == "lrkv":
        from ecomla.lrkv.configuration import LrkvConfig, lrkv_kv_elements

        return lrkv_kv_elements(LrkvConfig.from_dict({k: v for k, v in cfg.items() if k != "model_type"}))
    shape = AttentionShape.from_config(cfg)
    return shape.num_layers * shape.kv_elements


def compression_vs(cfg: Mapping, reference: Mapping) -> float:
    """KV compression ratio of `cfg` against `reference` (the base model): elements per token, reference / cfg."""
    return kv_elements_per_token(reference) / kv_elements_per_token(cfg)


def compression_ratio(shape: AttentionShape, ranks: int | Sequence[int], rope_dim: int) -> float:
    """Σ_l 2·n_kv·d_h / Σ_l (r_l + d_r); `ranks` is one width for all layers or one per layer."""
    per_layer = [ranks] * shape.num_layers if isinstance(ranks, int) else list(ranks)
    if len(per_layer) != shape.num_layers:
        raise ValueError(f"got {len(per_layer)} ranks for {shape.num_layers} layers")
    return shape.kv_elements * shape.num_layers / sum(mla_elements(r, rope_dim) for r in per_layer)


def rank_for_ratio(shape: AttentionShape, target: float, rope_dim: int) -> int:
    """The uniform r_kv whose ratio is nearest to `target` (e.g. 10.67 -> 64 for Llama-3.2-1B, d_r=32)."""
    if target <= 0:
        raise ValueError(f"target compression must be positive, got {target}")
    rank = round(shape.kv_elements / target - rope_dim)
    if rank < 1:
        raise ValueError(
            f"target compression {target}x leaves no room for a latent: 2·n_kv·d_h = {shape.kv_elements} "
            f"numbers per token and layer, and the RoPE key alone takes {rope_dim} "
            f"(the most this source allows is {shape.kv_elements / (rope_dim + 1):.2f}x)"
        )
    return rank


def allocate_ranks(
    spectra: Sequence[torch.Tensor],
    total: int,
    *,
    multiple: int = 8,
    min_rank: int = 8,
    max_rank: int | None = None,
) -> list[int]:
    """Spend a total latent budget across layers by singular-value energy.

    Each layer's spectrum (σ², descending) is normalised by its own total energy,
    so a layer earns width by the *share* of its energy a block of `multiple`
    more directions would keep. Greedy water-filling on blocks is optimal here
    because each normalised spectrum is non-increasing. Ranks are multiples of
    `multiple` (X-EcoMLA rounds to 8) except that the last block may be partial
    so that Σ r_l == total exactly.
    """
    n = len(spectra)
    if n == 0:
        raise ValueError("no layers to allocate")
    # A layer may hold up to max_rank (the hidden size) even where its spectrum is shorter.
    caps = [max_rank if max_rank is not None else s.numel() for s in spectra]
    floor = [min(min_rank, c) for c in caps]
    if sum(floor) > total:
        raise ValueError(f"a budget of {total} cannot give every one of {n} layers {min_rank} dims")
    if sum(caps) < total:
        raise ValueError(f"a budget of {total} exceeds what the layers can hold ({sum(caps)})")
    shares = []
    for s in spectra:
        s = s.double().clamp_min(0)
        tot = float(s.sum())
        shares.append((s / tot) if tot > 0 else torch.zeros_like(s))

    def gain(layer: int, start: int, width: int) -> float:
        sh = shares[layer]
        return float(sh[start : start + width].sum()) if start < sh.numel() else 0.0

    ranks = list(floor)
    left = total - sum(ranks)
    heap = [(-gain(i, ranks[i], multiple), i) for i in range(n) if ranks[i] < caps[i]]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        step = min(multiple, left, caps[i] - ranks[i])
        ranks[i] += step
        left -= step
        if ranks[i] < caps[i]:
            heapq.heappush(heap, (-gain(i, ranks[i], multiple), i))
    assert left == 0, "budget not spent; caps were checked above"
    return ranks


def energy_kept(spectrum: torch.Tensor, rank: int) -> float:
    """Share of Σσ² kept by the top `rank` directions (1.0 for an empty spectrum)."""
    s = spectrum.double().clamp_min(0)
    tot = float(s.sum())
    return 1.0 if tot == 0 else float(s[:rank].sum()) / tot


def format_ratio(ratio: float) -> str:
    """6.4 -> '6.4x', 10.666 -> '10.67x'."""
    return f"{math.floor(ratio * 100 + 0.5) / 100:g}x"

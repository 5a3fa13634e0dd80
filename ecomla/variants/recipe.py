"""The `ecomla variants` recipe: attention variants trained from scratch at equal parameters and tokens.

Each variant is one way to cache K/V: mha (every head its own K/V), gqa
(kv_heads shared groups), mqa (one K/V head), mla (a stock DeepSeek-V3 latent of
kv_lora_rank plus a shared RoPE key of rope_dim), lrkv (a shared K/V plus
per-head rank-r residuals). Every variant is built on each model size's
geometry; with match_params the MLP width is adjusted so that every variant has
as many parameters as that size's MHA model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ecomla.recipe.schema import knob


@dataclass
class SizeSpec:
    """One model size: the MHA geometry every variant starts from."""

    hidden_size: int = knob(help="d_model")
    num_hidden_layers: int = knob(help="Decoder layers")
    num_attention_heads: int = knob(help="Query heads (MHA has as many K/V heads)")
    head_dim: int = knob(help="Width of each head")
    intermediate_size: int = knob(help="SwiGLU width of the MHA model (other variants adjust it with match_params)")


# Each kind-specific key: the kind that reads it, and whether that kind requires it.
_KIND_KEYS = {"kv_heads": ("gqa", True), "kv_lora_rank": ("mla", True), "rope_dim": ("mla", False),
              "rank": ("lrkv", True)}


@dataclass
class VariantSpec:
    """One attention variant."""

    name: str = knob(help="Short name for tables and charts (e.g. gqa-2, mla-r64, lrkv-r8)")
    kind: Literal["mha", "gqa", "mqa", "mla", "lrkv"] = knob(help="The attention design")
    kv_heads: int | None = knob(None, help="gqa: number of K/V heads (must divide the query heads)")
    kv_lora_rank: int | None = knob(None, help="mla: latent width r_kv")
    rope_dim: int | None = knob(None, help="mla: width of the shared RoPE key d_r (even; null: half the head dim)")
    rank: int | None = knob(None, help="lrkv: rank r of each head's residual")

    def check(self) -> list[str]:
        problems = [f"{key}: required for kind {kind}" for key, (kind, required) in _KIND_KEYS.items()
                    if kind == self.kind and required and getattr(self, key) is None]
        problems += [f"{key}: only used by kind {kind}" for key, (kind, _) in _KIND_KEYS.items()
                     if kind != self.kind and getattr(self, key) is not None]
        return problems


@dataclass
class SweepRecipe:
    """`ecomla variants`: pretrain every variant at every size on the same data and tokens, then report."""

    output_dir: str = knob(help="Run directory: one stage directory per (size, variant), report.md and charts")
    tokenizer: str = knob(
        help="Tokenizer directory, or `tinyworld` to train the tiny world's BPE into <output_dir>/tokenizer"
    )
    sizes: dict[str, SizeSpec] = knob(help="Model sizes by name; the first is the main one (every variant runs)")
    variants: list[VariantSpec] = knob(help="The attention variants; the first must be kind mha (the reference)")
    pretrain: dict[str, Any] = knob(
        help="An `ecomla pretrain` recipe without student_config, tokenizer and output_dir (data, train, log...)"
    )
    curves: list[str] | None = knob(
        None, help="Variants trained at every size (for the CE-vs-tokens chart); null: all. Others: main size only"
    )
    match_params: bool = knob(True, help="Adjust each variant's MLP width to the MHA model's parameter count")
    max_position_embeddings: int = knob(2048, help="RoPE table size of every model")
    jobs: int = knob(2, help="Runs in parallel, one CPU thread each (set 1 on a GPU machine)")

    def check(self) -> list[str]:
        problems = []
        if not self.sizes:
            problems.append("sizes: name at least one model size")
        if not self.variants or self.variants[0].kind != "mha":
            problems.append("variants: the first variant must be kind mha (the reference for KV %)")
        names = [v.name for v in self.variants]
        problems += [f"variants: name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        problems += [f"curves: {c!r} is not a variant name" for c in (self.curves or []) if c not in names]
        if self.jobs < 1:
            problems.append("jobs: must be >= 1")
        for key in ("student", "student_config", "tokenizer", "output_dir"):
            if key in self.pretrain:
                problems.append(f"pretrain.{key}: set by `ecomla variants` for each run; remove it")
        return problems

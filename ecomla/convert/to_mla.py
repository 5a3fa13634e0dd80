"""One source attention layer (Llama/Mistral/Qwen2 names) -> stock DeepSeek-V3 MLA tensors.

Tensor plumbing only: the factorizations live in `ecomla.mla.latent`, the RoPE
dim choice in `ecomla.mla.rope`. Everything here is in float64/float32 and is
exercised by the exact-equivalence tests.

Per layer, with gain g of `input_layernorm` folded into the projections (the
output keeps a unit gain, so the attention input is y = RMSNorm(h) without
gain, ‖y‖² ≈ d):

  q_proj             rows of W_q·diag(g) per head, reordered [nope rows; RoPE rows],
                     times s_src/s_out when the softmax scales differ
  kv_a_proj_with_mqa [Q (latent rows, r × d); the shared RoPE key (mean over KV heads, or RoRoPE)]
  kv_a_layernorm     ones (the up-projection absorbs the norm, see `ecomla.mla.latent`)
  kv_b_proj          B: per query head h, [k_nope_h; v_h] (GQA heads repeated)
  o_proj             unchanged; bias += W_o·b_v (exact: softmax rows sum to one)

Biases (Qwen2): a key bias on the no-RoPE rows only adds q·b_k to every score of a
query, which softmax ignores, so it is dropped exactly; on the RoPE rows it goes
to the kv_a_proj_with_mqa bias. A query bias needs `q_lora_rank` (the stock full
q_proj has no bias): it rides as an extra input coordinate fixed at 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ecomla.mla.latent import Basis
from ecomla.mla.rope import RopeSplit
from ecomla.mla.rope_key import RopeKey, SharedRopeKey, shared_rope_key


@dataclass(frozen=True)
class MLAGeometry:
    """Shapes shared by every layer of one conversion."""

    hidden: int  # d
    n_heads: int  # n_h
    n_kv: int  # n_kv of the source
    head_dim: int  # d_h (also v_head_dim of the output)
    rope_dim: int  # d_r (qk_rope_head_dim)
    kv_width: int  # kv_lora_rank of the output (max over layers)
    q_rank: int | None  # q_lora_rank (None: full q_proj)
    query_scale: float  # s_src / s_out, folded into the query rows
    attention_bias: bool  # output's attention_bias
    rope_key: RopeKey = "mean"  # how the shared RoPE key is built from the KV heads (ecomla.mla.rope_key)
    interleave: bool = True  # output RoPE layout: interleaved pairs, or half-wise

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv


@dataclass
class SourceAttention:
    """One layer's source attention weights in float64, gain already folded."""

    q_w: torch.Tensor  # (n_h·d_h, d)
    k_w: torch.Tensor  # (n_kv·d_h, d)
    v_w: torch.Tensor  # (n_kv·d_h, d)
    o_w: torch.Tensor  # (d, n_h·d_h)
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    o_b: torch.Tensor | None = None

    @classmethod
    def fold_gain(cls, gain: torch.Tensor, **tensors: torch.Tensor | None) -> SourceAttention:
        g = gain.double()
        out = {k: (None if v is None else v.double()) for k, v in tensors.items()}
        for name in ("q_w", "k_w", "v_w"):
            out[name] = out[name] * g[None, :]
        return cls(**out)


def _head_rows(n: int, head_dim: int, rows: torch.Tensor) -> torch.Tensor:
    """Flat row indices of `rows` inside each of n heads: (n·len(rows),)."""
    return (torch.arange(n)[:, None] * head_dim + rows[None, :]).reshape(-1)


def query_rows(
    geo: MLAGeometry, split: RopeSplit, src: SourceAttention, rope_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output query rows (n_h·(nope + d_r), d) and bias, per head [nope; RoPE], scale folded.

    rope_scale (n_kv, d_r): a factor on the RoPE rows of every query head of each KV group (RoRoPE).
    """
    idx = _head_rows(geo.n_heads, geo.head_dim, torch.cat([split.nope_rows, split.rope_rows]))
    factor = torch.full((geo.n_heads, geo.nope_dim + geo.rope_dim), geo.query_scale, dtype=torch.float64)
    if rope_scale is not None:
        factor[:, geo.nope_dim :] *= rope_scale.repeat_interleave(geo.n_rep, dim=0)
    factor = factor.reshape(-1)
    w = src.q_w[idx] * factor[:, None]
    b = None if src.q_b is None else src.q_b.double()[idx] * factor
    return w, b


def kv_rows(geo: MLAGeometry, split: RopeSplit, src: SourceAttention, *, repeat: bool) -> torch.Tensor:
    """Rows the latent must reproduce: per head [k_nope; v], as (n·(nope + d_h), d).

    repeat=True gives one block per query head (kv_b_proj's layout); False one
    per KV head, which spans the same row space for fitting the basis.
    """
    n = geo.n_heads if repeat else geo.n_kv
    kv_of = torch.arange(n) // (geo.n_rep if repeat else 1)
    d_h = geo.head_dim
    k_nope = src.k_w.view(geo.n_kv, d_h, -1)[:, split.nope_rows][kv_of]  # (n, nope, d)
    v = src.v_w.view(geo.n_kv, d_h, -1)[kv_of]  # (n, d_h, d)
    return torch.cat([k_nope, v], dim=1).reshape(n * (geo.nope_dim + d_h), -1)


def output_pairs(geo: MLAGeometry) -> list[tuple[int, int]]:
    """Row pairs (a, b) inside the d_r RoPE rows that rotate together, in the output layout."""
    half = geo.rope_dim // 2
    return [(2 * i, 2 * i + 1) for i in range(half)] if geo.interleave else [(i, i + half) for i in range(half)]


def rope_key(geo: MLAGeometry, split: RopeSplit, src: SourceAttention, cov: torch.Tensor | None = None) -> SharedRopeKey:
    """The shared RoPE key (d_r, d) and bias, and the query-side factors, per `geo.rope_key`."""
    rows = src.k_w.view(geo.n_kv, geo.head_dim, -1)[:, split.rope_rows]  # (n_kv, d_r, d)
    bias = None if src.k_b is None else src.k_b.double().view(geo.n_kv, geo.head_dim)[:, split.rope_rows]
    return shared_rope_key(rows, bias, output_pairs(geo), geo.rope_key, cov)


def o_bias(geo: MLAGeometry, src: SourceAttention) -> torch.Tensor | None:
    """o_proj bias with the value bias folded in (Σ_j softmax_ij = 1 makes this exact)."""
    bias = None if src.o_b is None else src.o_b.double().clone()
    if src.v_b is not None:
        v_b = src.v_b.double().view(geo.n_kv, geo.head_dim).repeat_interleave(geo.n_rep, dim=0).reshape(-1)
        folded = src.o_w @ v_b
        bias = folded if bias is None else bias + folded
    return bias


# A fitter turns the rows a latent must reproduce into (down rows, up-projection).
# It gets M (m, d_in) and the latent width, and returns (Basis, up (m, width)).
LatentFit = Callable[[torch.Tensor, int, int], tuple[Basis, torch.Tensor]]


def pad_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Zero rows appended so a layer of rank r fits the model-wide latent width."""
    if rows.shape[0] == width:
        return rows
    return torch.cat([rows, rows.new_zeros(width - rows.shape[0], rows.shape[1])], dim=0)


def pad_cols(up: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns appended to an up-projection for the padded latent rows."""
    if up.shape[1] == width:
        return up
    return torch.cat([up, up.new_zeros(up.shape[0], width - up.shape[1])], dim=1)


@dataclass
class LayerResult:
    """Output tensors of one layer (names relative to `model.layers.{i}.self_attn.`)."""

    tensors: dict[str, torch.Tensor]
    kv_basis: Basis
    q_basis: Basis | None
    rope: SharedRopeKey


def convert_attention(
    geo: MLAGeometry,
    split: RopeSplit,
    src: SourceAttention,
    kv_rank: int,
    fit_kv: LatentFit,
    fit_q: LatentFit | None,
    rope_cov: torch.Tensor | None = None,
) -> LayerResult:
    """Build the stock DeepSeek-V3 attention tensors of one layer."""
    out: dict[str, torch.Tensor] = {}
    d = geo.hidden

    # Keys and values through the latent.
    M_kv = kv_rows(geo, split, src, repeat=True)
    kv_basis, kv_up = fit_kv(M_kv, kv_rank, geo.kv_width)
    rope = rope_key(geo, split, src, rope_cov)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([pad_rows(kv_basis.rows, geo.kv_width), rope.weight], dim=0)
    if geo.attention_bias:
        rope_b = rope.bias if rope.bias is not None else torch.zeros(geo.rope_dim, dtype=torch.float64)
        out["kv_a_proj_with_mqa.bias"] = torch.cat([torch.zeros(geo.kv_width, dtype=torch.float64), rope_b])
    out["kv_a_layernorm.weight"] = torch.ones(geo.kv_width, dtype=torch.float64)
    out["kv_b_proj.weight"] = kv_up

    # Queries: full, or through their own normalized latent.
    q_w, q_b = query_rows(geo, split, src, rope.head_scale)
    q_basis = None
    if geo.q_rank is None:
        if q_b is not None:
            raise ValueError("a query bias needs mla.q_lora_rank (the stock full q_proj has no bias)")
        out["q_proj.weight"] = q_w
    else:
        assert fit_q is not None
        # With a bias, the input gains a constant coordinate 1: [y; 1], ‖·‖² = d + 1.
        M_q = q_w if q_b is None else torch.cat([q_w, q_b[:, None]], dim=1)
        q_basis, q_up = fit_q(M_q, geo.q_rank, geo.q_rank)
        out["q_a_proj.weight"] = q_basis.rows[:, :d]
        if geo.attention_bias:
            out["q_a_proj.bias"] = (
                q_basis.rows[:, d] if q_b is not None else torch.zeros(geo.q_rank, dtype=torch.float64)
            )
        out["q_a_layernorm.weight"] = torch.ones(geo.q_rank, dtype=torch.float64)
        out["q_b_proj.weight"] = q_up

    out["o_proj.weight"] = src.o_w
    if geo.attention_bias:
        bias = o_bias(geo, src)
        out["o_proj.bias"] = bias if bias is not None else torch.zeros(d, dtype=torch.float64)
    return LayerResult(tensors=out, kv_basis=kv_basis, q_basis=q_basis, rope=rope)

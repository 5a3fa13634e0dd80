"""One source attention layer (Llama/Mistral/Qwen2 names) -> stock DeepSeek-V3 MLA tensors.

Tensor plumbing only: the factorizations live in `ecomla.mla.latent`, the RoPE
dim choice in `ecomla.mla.rope`. Everything here is in float64/float32 and is
exercised by the exact-equivalence tests.

Per layer, with gain g of `input_layernorm` folded into the projections (the
output keeps a unit gain, so the attention input is y = RMSNorm(h) without
gain, ‖y‖² ≈ d):

  q_proj             rows of W_q·diag(g) per head, reordered [nope rows; (residual rows); RoPE rows],
                     times s_src/s_out when the softmax scales differ
  kv_a_proj_with_mqa [Q (latent rows, r × d); the shared RoPE key (mean over KV heads, or RoRoPE)]
  kv_a_layernorm     ones (the up-projection absorbs the norm, see `ecomla.mla.latent`)
  kv_b_proj          B: per query head h, [k_nope_h; (k_res_h); v_h] (GQA heads repeated)
  o_proj             unchanged; bias += W_o·b_v (exact: softmax rows sum to one)

With `rope_residual: latent | latent_mean`, a RoRoPE key and more than one KV
head, the RoPE key part the shared key does not carry (`ecomla.mla.rope_key`)
becomes d_r extra no-RoPE dims per head: key rows k_res through the latent,
query rows the head's own RoPE rows without the RoRoPE factor (latent_mean:
turned by each pair's mean rotation), so qk_nope_head_dim = d_h − d_r + d_r.

Biases (Qwen2): a key bias on the no-RoPE rows only adds q·b_k to every score of a
query, which softmax ignores, so it is dropped exactly; on the RoPE rows it goes
to the kv_a_proj_with_mqa bias. A query bias needs `q_lora_rank` (the stock full
q_proj has no bias): it rides as an extra input coordinate fixed at 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ecomla.mla import latent
from ecomla.mla.latent import Basis
from ecomla.mla.rope import RopeSplit
from ecomla.mla.rope_key import (
    RopeKey,
    attention_distances,
    causal_probs,
    received_attention,
    RopeResidual,
    SharedRopeKey,
    fold_rotation,
    pair_spectra,
    residual_fold,
    shared_rope_key,
)


@dataclass(frozen=True)
class MLAGeometry:
    """Shapes shared by every layer of one conversion."""

    hidden: int  # d
    n_heads: int  # n_h
    n_kv: int  # n_kv of the source
    head_dim: int  # d_h (also v_head_dim of the output)
    qk_rope_head_dim: int  # d_r
    kv_lora_rank: int  # the output's latent width (the largest layer's rank; smaller layers are zero-padded)
    q_lora_rank: int | None  # None: full q_proj
    query_scale: float  # s_src / s_out, folded into the query rows
    attention_bias: bool  # output's attention_bias
    rope_key: RopeKey = "mean"  # how the shared RoPE key is built from the KV heads (ecomla.mla.rope_key)
    interleave: bool = True  # output RoPE layout: interleaved pairs, or half-wise
    rope_residual: RopeResidual = "drop"  # the RoPE key part the shared key does not carry: dropped, or no-RoPE dims
    latent_scale: float = 1.0  # a: the latent rows are a·Q for orthonormal Q (latent_norm=linear: a ≪ 1)
    input_gain: float = 1.0  # γ: the output's input_layernorm gain; every projection reading the input is divided by it

    @property
    def nope_dim(self) -> int:
        """Source rows per head that lose RoPE (d_h − d_r)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def residual_dim(self) -> int:
        return residual_dim(self.rope_residual, self.rope_key, self.n_kv, self.qk_rope_head_dim)

    @property
    def qk_nope_head_dim(self) -> int:
        """The output's no-RoPE query/key dims per head: the source rows that lose RoPE, plus the residual's."""
        return self.nope_dim + self.residual_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

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


def residual_dim(rope_residual: RopeResidual, rope_key: RopeKey, n_kv: int, qk_rope_head_dim: int) -> int:
    """Extra no-RoPE dims per head for the residual RoPE key: d_r under latent/latent_mean with a RoRoPE key.

    0 for one KV head (no residual) and for `mean`, which stays X-EcoMLA as published.
    """
    return qk_rope_head_dim if rope_residual != "drop" and rope_key != "mean" and n_kv > 1 else 0


def _head_rows(n: int, head_dim: int, rows: torch.Tensor) -> torch.Tensor:
    """Flat row indices of `rows` inside each of n heads: (n·len(rows),)."""
    return (torch.arange(n)[:, None] * head_dim + rows[None, :]).reshape(-1)


def query_rows(
    geo: MLAGeometry,
    split: RopeSplit,
    src: SourceAttention,
    rope_scale: torch.Tensor | None = None,
    residual_rotation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output query rows (n_h·(qk_nope + d_r), d) and bias, per head [nope; residual; RoPE], scale folded.

    rope_scale (n_kv, d_r): a factor on the RoPE rows of every query head of each KV group (RoRoPE).
    The residual rows (only with `geo.residual_dim`) are the RoPE rows again, without that factor:
    they meet the head's own residual key, unrotated. residual_rotation ((n_h,) d_r/2, 2, 2): each
    pair's mean-rotation map (`residual_rotation`), folded into those rows; None keeps them as they
    are (the rotation ignored).
    """
    res_rows = split.rope_rows if geo.residual_dim else split.rope_rows[:0]
    idx = _head_rows(geo.n_heads, geo.head_dim, torch.cat([split.nope_rows, res_rows, split.rope_rows]))
    factor = torch.full((geo.n_heads, geo.qk_nope_head_dim + geo.qk_rope_head_dim), geo.query_scale,
                        dtype=torch.float64)
    if rope_scale is not None:
        factor[:, geo.qk_nope_head_dim :] *= rope_scale.repeat_interleave(geo.n_rep, dim=0)
    factor = factor.reshape(-1)
    w = src.q_w[idx] * factor[:, None]
    b = None if src.q_b is None else src.q_b.double()[idx] * factor
    if geo.residual_dim and residual_rotation is not None:
        per_head = geo.qk_nope_head_dim + geo.qk_rope_head_dim
        res = slice(geo.nope_dim, geo.qk_nope_head_dim)
        pairs, fold = output_pairs(geo), residual_rotation.double()
        w = w.view(geo.n_heads, per_head, -1).clone()  # (n_h, qk_nope + d_r, d)
        w[:, res] = fold_rotation(w[:, res], pairs, fold)
        w = w.reshape(-1, w.shape[-1])
        if b is not None:
            b = b.view(geo.n_heads, per_head, 1).clone()
            b[:, res] = fold_rotation(b[:, res], pairs, fold)
            b = b.reshape(-1)
    return w, b


def kv_rows(
    geo: MLAGeometry, split: RopeSplit, src: SourceAttention, *, repeat: bool, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows the latent must reproduce: per head [k_nope; k_res; v], as (n·(qk_nope + d_h), d).

    repeat=True gives one block per query head (kv_b_proj's layout); False one
    per KV head, which spans the same row space for fitting the basis.
    residual (n_kv, d_r, d): the RoPE key part not kept (`SharedRopeKey.residual`),
    required when `geo.residual_dim` is nonzero.
    """
    n = geo.n_heads if repeat else geo.n_kv
    kv_of = torch.arange(n) // (geo.n_rep if repeat else 1)
    d_h = geo.head_dim
    k_nope = src.k_w.view(geo.n_kv, d_h, -1)[:, split.nope_rows][kv_of]  # (n, nope, d)
    v = src.v_w.view(geo.n_kv, d_h, -1)[kv_of]  # (n, d_h, d)
    parts = [k_nope]
    if geo.residual_dim:
        if residual is None:
            raise ValueError("rope_residual latent/latent_mean needs the residual RoPE rows (SharedRopeKey.residual)")
        parts.append(residual.to(k_nope.dtype)[kv_of])  # (n, d_r, d)
    return torch.cat(parts + [v], dim=1).reshape(n * (geo.qk_nope_head_dim + d_h), -1)


def key_rows(geo: MLAGeometry, n: int) -> torch.Tensor:
    """(n·(qk_nope + d_h),) bool: which rows of `kv_rows` for n heads are key rows (k_nope and k_res)."""
    per_head = torch.cat([torch.ones(geo.qk_nope_head_dim, dtype=torch.bool), torch.zeros(geo.head_dim, dtype=torch.bool)])
    return per_head.repeat(n)


def output_pairs(geo: MLAGeometry) -> list[tuple[int, int]]:
    """Row pairs (a, b) inside the d_r RoPE rows that rotate together, in the output layout."""
    half = geo.qk_rope_head_dim // 2
    return [(2 * i, 2 * i + 1) for i in range(half)] if geo.interleave else [(i, i + half) for i in range(half)]


def rope_key(geo: MLAGeometry, split: RopeSplit, src: SourceAttention, cov: torch.Tensor | None = None) -> SharedRopeKey:
    """The shared RoPE key (d_r, d) and bias, and the query-side factors, per `geo.rope_key`."""
    rows = src.k_w.view(geo.n_kv, geo.head_dim, -1)[:, split.rope_rows]  # (n_kv, d_r, d)
    bias = None if src.k_b is None else src.k_b.double().view(geo.n_kv, geo.head_dim)[:, split.rope_rows]
    return shared_rope_key(rows, bias, output_pairs(geo), geo.rope_key, cov)


def residual_rotation(geo: MLAGeometry, split: RopeSplit, inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """latent_mean: (d_r/2, 2, 2) maps for the residual query rows, the source's rotation averaged over the causal
    distances of `context` tokens (weight T − Δ). inv_freq (d_h/2,): the source's per-pair frequencies."""
    weights = torch.arange(context, 0, -1, dtype=torch.float64)
    return residual_fold(split.rope_rows, output_pairs(geo), geo.head_dim, inv_freq, weights)


# rope_residual_distances=attention reads the distances on at most this many calibration tokens (the first
# blocks): past it the full attention matrices it needs cost more than the rest of a `best` layer's fit
# (docs/convert.md, "What a calibration token costs").
DISTANCE_TOKENS = 16384
PROBS_PER_BATCH = 2 ** 26  # float32 attention probabilities held at a time by `source_probs`: 256 MB


def source_probs(geo: MLAGeometry, src: SourceAttention, y: torch.Tensor, seq_len: int, inv_freq: torch.Tensor,
                 n_blocks: int, max_probs: int = PROBS_PER_BATCH) -> Iterator[torch.Tensor]:
    """The source layer's causal attention probabilities (`causal_probs`) on the first n_blocks blocks of y
    ((N·seq_len, d), unit gain), a few blocks at a time."""
    d_h = geo.head_dim
    per_batch = max(1, max_probs // (geo.n_heads * seq_len * seq_len))  # whole blocks, ≤ max_probs at a time
    for start in range(0, n_blocks, per_batch):
        yb = y[start * seq_len:min(start + per_batch, n_blocks) * seq_len].float()  # float32, as causal_probs reads
        q = yb @ src.q_w.T.float() + (0 if src.q_b is None else src.q_b.float())
        k = yb @ src.k_w.T.float() + (0 if src.k_b is None else src.k_b.float())
        yield causal_probs(q.view(-1, seq_len, geo.n_heads, d_h), k.view(-1, seq_len, geo.n_kv, d_h), inv_freq,
                           d_h ** -0.5)


@dataclass
class AttentionReading:
    """What the source layer's attention does on the calibration blocks, read in one pass (`read_attention`)."""

    distances: torch.Tensor | None  # (n_h, seq_len): rope_residual_distances=attention's histogram
    received: torch.Tensor | None  # (N·seq_len,): init.token_weights=attention's per-token mass (mean 1)


def read_attention(geo: MLAGeometry, src: SourceAttention, y: torch.Tensor, seq_len: int, inv_freq: torch.Tensor, *,
                   distance_tokens: int = 0, received: bool = False,
                   max_probs: int = PROBS_PER_BATCH) -> AttentionReading:
    """One pass of the source layer's attention over the calibration blocks y ((N·seq_len, d), unit gain).

    distance_tokens > 0: the mass each query head puts at each distance (`attention_distances`), on the first
    distance_tokens tokens (whole blocks, at least one; DISTANCE_TOKENS in a conversion). received: the mass each
    token receives in its block, averaged over the query heads (`received_attention`), on every block: one weight
    per row of y, so y must be whole blocks. max_probs: attention probabilities held at a time."""
    n_all = y.shape[0] // seq_len
    if n_all == 0 or (received and y.shape[0] % seq_len):
        raise ValueError(f"read_attention: {y.shape[0]} calibration rows are not whole blocks of seq_len {seq_len}")
    n_dist = min(n_all, max(1, distance_tokens // seq_len)) if distance_tokens > 0 else 0
    distances, masses, done = None, [], 0
    for probs in source_probs(geo, src, y, seq_len, inv_freq, n_all if received else n_dist, max_probs):
        if done < n_dist:
            part = attention_distances(probs[: n_dist - done])
            distances = part if distances is None else distances + part
        if received:
            masses.append(received_attention(probs).reshape(-1))
        done += probs.shape[0]
    return AttentionReading(distances, torch.cat(masses) if received else None)


def attention_rotation(geo: MLAGeometry, split: RopeSplit, distances: torch.Tensor,
                       inv_freq: torch.Tensor) -> torch.Tensor:
    """rope_residual_distances=attention: (n_h, d_r/2, 2, 2), each query head's residual rotation averaged over
    the distances its source attention reads (`read_attention`'s (n_h, seq_len) histogram)."""
    return torch.stack([residual_fold(split.rope_rows, output_pairs(geo), geo.head_dim, inv_freq, w)
                        for w in distances])


def source_pair_spectra(geo: MLAGeometry, src: SourceAttention, cov: torch.Tensor | None = None) -> torch.Tensor:
    """(d_h/2, n_kv): key energy of every virtual head of every source pair (`ecomla.mla.rope_key.pair_spectra`).

    Source pair j is rows (j, j + d_h/2) of each head (the half-wise layout); cov is the
    input second moment (rorope_act) or None (weights only).
    """
    half = geo.head_dim // 2
    k = src.k_w.view(geo.n_kv, 2, half, -1).transpose(1, 2)  # (n_kv, d_h/2, 2, d): [row j, row j + d_h/2]
    bias = None if src.k_b is None else src.k_b.double().view(geo.n_kv, 2, half).transpose(1, 2)
    return pair_spectra(k, bias, cov)


def o_bias(geo: MLAGeometry, src: SourceAttention) -> torch.Tensor | None:
    """o_proj bias with the value bias folded in (Σ_j softmax_ij = 1 makes this exact)."""
    bias = None if src.o_b is None else src.o_b.double().clone()
    if src.v_b is not None:
        v_b = src.v_b.double().view(geo.n_kv, geo.head_dim).repeat_interleave(geo.n_rep, dim=0).reshape(-1)
        folded = src.o_w @ v_b
        bias = folded if bias is None else bias + folded
    return bias


# A fitter turns the rows a latent must reproduce into (down rows, up-projection).
# It gets M (m, d_in), the latent's rank and its padded width, and optionally the rows its basis is fitted to
# (BasisRows: init.kv_balance, init.objective=attention), and returns (Basis, up (m, width)).
LatentFit = Callable[..., tuple[Basis, torch.Tensor]]
# The rows the latent's basis is fitted to, given the inputs' second moment (None for the weights-only fit):
# M re-weighted so that the basis keeps what matters; the up-projection still reproduces M itself.
BasisRows = Callable[[torch.Tensor | None], torch.Tensor]


def balance_scale(M: torch.Tensor, key_rows: torch.Tensor, cov: torch.Tensor | None) -> torch.Tensor:
    """(m,) row factors that give M's key rows the same total energy as its value rows (TransMLA's balanced
    K/V PCA): energy under the inputs' second moment cov, or the weights' squared norm when cov is None.
    Keys keep factor 1 when either part has no energy."""
    M = M.double()
    per_row = (M @ cov.double() * M).sum(1) if cov is not None else M.square().sum(1)
    e_k, e_v = float(per_row[key_rows].sum()), float(per_row[~key_rows].sum())
    scale = torch.ones(M.shape[0], dtype=torch.float64)
    if e_k > 0 and e_v > 0:
        scale[key_rows] = (e_v / e_k) ** 0.5
    return scale


def make_fitter(method: str, y: torch.Tensor | None, ridge: float, gen: torch.Generator, std: float,
                latent_scale: float = 1.0, y_cov: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> LatentFit:
    """The latent fit of one layer (`init.method`; the math is `ecomla.mla.latent`'s).

    svd: the weights' top singular directions; activation: the top directions of M under the inputs'
    second moment (y: the layer's normalized inputs, (N, d)), with a ridge-fitted up-projection; random:
    the stock initializer, N(0, std), for both projections. A query bias rides as a constant-1 input
    coordinate when M has d + 1 columns. basis_rows (optional, `BasisRows`): the rows the basis is
    fitted to, the up-projection still to M itself. latent_scale a: the basis rows are a·Q (the
    up-projection fitted to what the norm makes of them). y_cov: y's second moment when the caller has it (under
    the weights, if any). weights (N,): each input's weight in the activation fit (init.token_weights).
    """

    def fit(M: torch.Tensor, rank: int, width: int, basis_rows: BasisRows | None = None) -> tuple[Basis, torch.Tensor]:
        if method == "svd":
            basis = latent.weight_basis(M if basis_rows is None else basis_rows(None), rank)
            basis = scaled(basis, latent_scale)
            return basis, pad_cols(latent.up_from_weights(M, basis.rows, width, latent_scale), width)
        if method == "activation":
            plain = y.shape[1] == M.shape[1]
            ya = y if plain else torch.cat([y, torch.ones(y.shape[0], 1, dtype=y.dtype)], dim=1)
            ya = ya.double()
            cov = y_cov if plain and y_cov is not None else latent.second_moment(ya, weights)
            basis = latent.activation_basis(M if basis_rows is None else basis_rows(cov), cov, rank)
            basis = scaled(basis, latent_scale)
            return basis, latent.up_from_activations(M, pad_rows(basis.rows, width), ya, ridge=ridge, weights=weights)
        rows = torch.randn(rank, M.shape[1], generator=gen, dtype=torch.float64) * std
        up = torch.randn(M.shape[0], width, generator=gen, dtype=torch.float64) * std
        return Basis(rows=rows, spectrum=torch.zeros(0), energy_kept=float("nan")), up

    return fit


def scaled(basis: Basis, a: float) -> Basis:
    """The basis with its rows times a (latent_norm=linear)."""
    return basis if a == 1.0 else Basis(rows=basis.rows * a, spectrum=basis.spectrum, energy_kept=basis.energy_kept)


def balanced_rows(M: torch.Tensor, key_rows: torch.Tensor) -> BasisRows:
    """init.kv_balance: M with its key rows scaled to the value rows' energy (`balance_scale`)."""
    return lambda cov: M.double() * balance_scale(M, key_rows, cov)[:, None]


def attention_rows(geo: MLAGeometry, M: torch.Tensor, q_w: torch.Tensor, o_w: torch.Tensor,
                   key_weight: float, query_cov: torch.Tensor | None = None) -> BasisRows:
    """init.objective=attention: M's rows as the layer's output sees their errors.

    M is kv_rows' layout (per query head h: qk_nope key rows K_h, then d_h value rows V_h), q_w the
    output's query rows (per head: qk_nope rows meeting K_h, then d_r RoPE rows), o_w the source o_proj.
    With C the inputs' second moment (identity for the weights-only fit), a score error is
    s·q·δk (s the output's softmax scale), so key rows get A_h^½ with A_h = s²·Q_h·C·Q_hᵀ; a value error
    reaches the output as W_o,h·δv, so value rows get (W_o,hᵀ·W_o,h)^½. A score error δ moves the output
    by about δ times the spread of W_o,h·v over the attended tokens, so keys are also scaled by
    (key_weight·E‖W_o,h·V_h·y‖²)^½. Any square root gives the same basis (it is fitted to the rows'
    Gram matrix under C). query_cov: the queries' own second moment in A_h, where C weighs the key tokens
    (init.query_moment=uniform under init.token_weights); None: C.
    """
    d, nope, d_h = M.shape[1], geo.qk_nope_head_dim, geo.head_dim
    Mh = M.double().view(geo.n_heads, nope + d_h, d)
    Qh = q_w.double().view(geo.n_heads, nope + geo.qk_rope_head_dim, -1)[:, :nope, :d]
    s2 = (geo.head_dim ** -0.5 / geo.query_scale) ** 2  # the output's softmax scale, squared

    def rows(cov: torch.Tensor | None) -> torch.Tensor:
        C = torch.eye(d, dtype=torch.float64) if cov is None else cov.double()[:d, :d]
        Cq = C if query_cov is None else query_cov.double()[:d, :d]
        out = torch.empty_like(Mh)
        for h in range(geo.n_heads):
            K, V = Mh[h, :nope], Mh[h, nope:]
            Wo = o_w.double()[:, h * d_h:(h + 1) * d_h]  # (d, d_h): head h's columns of o_proj
            WoV = Wo @ V
            value_energy = float(torch.trace(WoV @ C @ WoV.T))
            out[h, :nope] = (key_weight * value_energy) ** 0.5 * latent.psd_sqrt(s2 * Qh[h] @ Cq @ Qh[h].T) @ K
            out[h, nope:] = latent.psd_sqrt(Wo.T @ Wo) @ V
        return out.reshape(-1, d)

    return rows


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


@dataclass(frozen=True)
class LatentObjective:
    """What the key/value latent's basis keeps (`init.objective`, `init.key_weight`, `init.kv_balance`,
    `init.query_moment`)."""

    objective: str = "kv"  # kv: the rows themselves; attention: `attention_rows`
    key_weight: float = 1.0
    kv_balance: bool = False
    query_cov: torch.Tensor | None = None  # attention: the queries' second moment, where the fit's weighs tokens

    def basis_rows(self, geo: MLAGeometry, M: torch.Tensor, q_w: torch.Tensor, o_w: torch.Tensor) -> BasisRows | None:
        if self.objective == "attention":
            return attention_rows(geo, M, q_w, o_w, self.key_weight, self.query_cov)
        if self.kv_balance:
            return balanced_rows(M, key_rows(geo, geo.n_heads))
        return None


def convert_attention(
    geo: MLAGeometry,
    split: RopeSplit,
    src: SourceAttention,
    kv_lora_rank: int,
    fit_kv: LatentFit,
    fit_q: LatentFit | None,
    rope_cov: torch.Tensor | None = None,
    residual_rotation: torch.Tensor | None = None,
    objective: LatentObjective = LatentObjective(),
) -> LayerResult:
    """The stock DeepSeek-V3 attention tensors of one layer, its latent of rank kv_lora_rank zero-padded to
    geo.kv_lora_rank (residual_rotation: see `query_rows`).

    Everything is fitted on the unit-gain input y; the projections that read the output's input (gain
    geo.input_gain) are divided by that gain when written.
    """
    out: dict[str, torch.Tensor] = {}
    d, gain = geo.hidden, geo.input_gain

    # Keys and values through the latent (with the residual RoPE key part, under rope_residual=latent).
    rope = rope_key(geo, split, src, rope_cov)
    q_w, q_b = query_rows(geo, split, src, rope.head_scale, residual_rotation)
    M_kv = kv_rows(geo, split, src, repeat=True, residual=rope.residual)
    kv_basis, kv_up = fit_kv(M_kv, kv_lora_rank, geo.kv_lora_rank, objective.basis_rows(geo, M_kv, q_w, src.o_w))
    out["kv_a_proj_with_mqa.weight"] = torch.cat([pad_rows(kv_basis.rows, geo.kv_lora_rank), rope.weight], dim=0) / gain
    if geo.attention_bias:
        rope_b = rope.bias if rope.bias is not None else torch.zeros(geo.qk_rope_head_dim, dtype=torch.float64)
        out["kv_a_proj_with_mqa.bias"] = torch.cat([torch.zeros(geo.kv_lora_rank, dtype=torch.float64), rope_b])
    out["kv_a_layernorm.weight"] = torch.ones(geo.kv_lora_rank, dtype=torch.float64)
    out["kv_b_proj.weight"] = kv_up

    # Queries: full, or through their own normalized latent.
    q_basis = None
    if geo.q_lora_rank is None:
        if q_b is not None:
            raise ValueError("a query bias needs mla.q_lora_rank (the stock full q_proj has no bias)")
        out["q_proj.weight"] = q_w / gain
    else:
        assert fit_q is not None
        # With a bias, the input gains a constant coordinate 1: [y; 1], ‖·‖² = d + 1.
        M_q = q_w if q_b is None else torch.cat([q_w, q_b[:, None]], dim=1)
        q_basis, q_up = fit_q(M_q, geo.q_lora_rank, geo.q_lora_rank)
        out["q_a_proj.weight"] = q_basis.rows[:, :d] / gain
        if geo.attention_bias:
            out["q_a_proj.bias"] = (
                q_basis.rows[:, d] if q_b is not None else torch.zeros(geo.q_lora_rank, dtype=torch.float64)
            )
        out["q_a_layernorm.weight"] = torch.ones(geo.q_lora_rank, dtype=torch.float64)
        out["q_b_proj.weight"] = q_up

    out["o_proj.weight"] = src.o_w
    if geo.attention_bias:
        bias = o_bias(geo, src)
        out["o_proj.bias"] = bias if bias is not None else torch.zeros(d, dtype=torch.float64)
    return LayerResult(tensors=out, kv_basis=kv_basis, q_basis=q_basis, rope=rope)

"""The shared RoPE key of MLA, built from several KV heads: mean (X-EcoMLA) or RoRoPE-style head mixing.

Pure tensor math: no transformers, no files.

In MLA every query head meets one shared RoPE key. A GQA source has n_kv
different RoPE keys. RoPE rotates each frequency pair of every head by the same
angle, so it commutes with any mixing across heads done pair by pair
(TransMLA's observation). Per kept pair j, with X_j (n_kv × 2·d_in) holding each
head's two key rows for that pair side by side:

  mean          k_shared = mean_g X_j[g];  queries unchanged.
  rorope        u = the top left singular vector of X_j (unit, n_kv); the shared
                key is uᵀ·X_j (the "virtual head" holding the most key energy),
                and head g's key is approximated by u_g·k_shared, so each query
                head h of KV group g gets its pair-j rows scaled by u_g.
                Exact when X_j has rank one, e.g. a single KV head (u = ±1, and
                the sign is fixed so u sums to a positive number).
  rorope_act    the same with u fitted to calibration key activations: the top
                eigenvector of X_j·C·X_jᵀ, C the input second moment (a PCA of the
                pair's keys across heads, per pair).

A key bias rides as an extra input coordinate fixed at 1.

The part not kept (`mla.rope_residual`). Head g's pair-j key is
k_g = u_g·k_shared + r_g, with residual rows R_j[g] = X_j[g] − u_g·(uᵀ·X_j) (for
rorope: the other virtual heads, (I − u·uᵀ)·X_j). Its score term for query head h
is q_hᵀ·Rot(−Δθ_j)·r_g, Δ the query's position minus the key's.
  drop         leave it out (X-EcoMLA and TransMLA do).
  latent       keep it without its rotation, q_hᵀ·r_g: d_r more no-RoPE key dims per
               head, whose key rows R[g] go through the latent with the other no-RoPE
               rows and whose query rows are head h's own pair rows, without the
               RoRoPE factor. This is the approximation partial RoPE makes for every
               pair it does not keep (MHA2MLA): exact at Δ = 0 and for pairs that turn
               slowly over the context, wrong by the whole rotation for fast ones.
  latent_mean  the same dims, with the query rows turned into Aᵀ·q, A = E_Δ[Rot(−Δθ_j)]
               over the causal distances of a T-token context (weight T − Δ), at the
               source's frequency θ_j: the least-squares position-free stand-in for the
               source's rotated term. A ≈ I for slow pairs (as latent) and A ≈ 0 for
               fast ones (as drop). (rope_dims=last re-pairs rows of different source
               pairs; there each row keeps its own E[cos Δθ], see `residual_fold`.)
Both cost no cache (still r_kv + d_r numbers per token); they add n_h·d_r query
rows and kv_b_proj rows. `mean` stays X-EcoMLA as published and always drops.
latent_mean is the default: fast pairs fade out of it instead of hurting, which
`latent` lets them do (the measurements behind this: docs/convert.md).
A residual key bias only adds a per-query constant to the scores, which softmax
ignores, so it is dropped exactly (as for the other no-RoPE rows).

Several components per pair (`mla.rope_allocation`). Per source pair j the
eigenvalues λ_j1 ≥ … ≥ λ_j,n_kv of X_j·M·X_jᵀ (M = I, or C for rorope_act) are the
key energy of its virtual heads; they sum, over pairs, to the whole key energy.
  fixed   `mla.rope_dims` picks d_r/2 pairs and each keeps its top component.
  energy  the d_r/2 slots go to the largest λ_jc over all pairs and components
          (greedy), which may give one pair two components and skip others.
Stock DeepSeek-V3 RoPE, as `ecomla.mla.rope.fit_frequencies` writes it, turns
output pair i at θ'^(-2i/d_r)/factor, with one rope_theta θ' and one linear
factor for all layers. These frequencies are pairwise distinct unless θ' = 1,
when all are equal. Every component of source pair j must turn at pair j's
frequency, so an allocation is written exactly only if
  (a) it keeps one component of each of its pairs, the same pairs j_0 < … in every
      layer, with j_i = j_0 + s·i (a geometric run: θ' = θ^(s·d_r/d_h), factor =
      θ^(2·j_0/d_h); j_0 = 0 where the source's own scaling leaves no room for a
      linear factor, e.g. Llama-3 scaling), or
  (b) all d_r/2 slots sit on one pair (θ' = 1; needs n_kv ≥ d_r/2).
Nothing else: the other scalings (YaRN, Llama-3, dynamic) also give strictly
decreasing lists, so none repeats a frequency, and ecomla fits none of them.
(transformers' generic `longrope` per-pair factors could give any list, but vLLM's
DeepSeek model code reads every rope_type other than `default` as its DeepSeek
YaRN; so there even the linear factor of (a) is lost, and only runs from j_0 = 0,
e.g. rope_dims high or uniform, stay exact.) On the trained model
above, `energy` keeps one mixture per pair (the second mixture of 2 KV heads is
weak) but picks other pairs in every layer, none a run (e.g. d_r = 8, rorope:
[0,4,5,8], [0,1,3,5], [0,1,2,14], [0,1,2,17]): never case (a). It would keep
0.105 of the key energy rotated against 0.097 for `high` (rorope_act: 0.163 vs
0.128; d_r = 16: 0.189 vs 0.180, rorope_act 0.284 vs 0.236). So `energy` is a
report: every rorope/rorope_act conversion reports, per layer, the share of the
key energy its own pairs and the energy allocation keep rotated, and asking for
`energy` stops with an error naming the reason unless the allocation is case (a)
(then it is written: the same model as a fixed run on those pairs); case (b) is
not written either (it would need several virtual heads per output pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ecomla.mla.rope import fit_frequencies

RopeKey = Literal["mean", "rorope", "rorope_act"]
RopeResidual = Literal["drop", "latent", "latent_mean"]
RopeAllocation = Literal["fixed", "energy"]


@dataclass
class SharedRopeKey:
    weight: torch.Tensor  # (d_r, d_in) shared RoPE key rows
    bias: torch.Tensor | None  # (d_r,)
    head_scale: torch.Tensor  # (n_kv, d_r): factor on each KV group's query RoPE rows
    energy_kept: float  # share of the pairs' key energy carried by the shared key (weights, or activations)
    residual: torch.Tensor  # (n_kv, d_r, d_in): each KV head's RoPE rows minus head_scale·shared (the part not kept)
    pair_energy: float  # the kept pairs' key energy over all KV heads, under the fit's metric


def shared_rope_key(
    rows: torch.Tensor,
    bias: torch.Tensor | None,
    pairs: list[tuple[int, int]],
    mode: RopeKey,
    cov: torch.Tensor | None = None,
) -> SharedRopeKey:
    """Build the shared key from per-head RoPE rows.

    rows (n_kv, d_r, d_in): each KV head's RoPE rows, already in the output layout;
    bias (n_kv, d_r) or None; pairs: the (a, b) row indices (into d_r) of each
    output frequency pair; cov: E[y·yᵀ], required by rorope_act, (d_in, d_in) or, with a bias,
    the moment of [y; 1] (d_in + 1, d_in + 1) (a (d_in, d_in) one is taken as uncorrelated with the 1).
    """
    n_kv, d_r, d_in = rows.shape
    rows = rows.double()
    if bias is not None:  # the bias is a weight on a constant input 1
        rows = torch.cat([rows, bias.double()[:, :, None]], dim=2)
    cov = None if cov is None else _with_bias_input(cov.double(), rows.shape[2])
    weight = rows.new_zeros(d_r, rows.shape[2])
    scale = rows.new_ones(n_kv, d_r)
    # Energies are measured under the inputs the fit assumes: isotropic, or the calibration second moment.
    metric = cov if mode == "rorope_act" else None

    def energy(Z: torch.Tensor) -> float:  # Σ over heads of ‖z‖² under the metric; Z (n_kv, d_in')
        return float(Z.square().sum()) if metric is None else float(((Z @ metric) * Z).sum())

    kept = total = 0.0
    for a, b in pairs:
        Xa, Xb = rows[:, a], rows[:, b]  # (n_kv, d_in') each: the pair's two key rows per head
        if mode == "mean":
            u = torch.full((n_kv,), 1.0 / n_kv, dtype=torch.float64)
            g = torch.ones(n_kv, dtype=torch.float64)  # every head's key is approximated by the mean itself
        elif mode in ("rorope", "rorope_act"):
            if mode == "rorope_act" and cov is None:
                raise ValueError("rorope_act needs the calibration second moment (cov)")
            u = torch.linalg.eigh(pair_gram(Xa, Xb, metric)).eigenvectors[:, -1]
            u = -u if u.sum() < 0 else u
            g = u  # head g's key ≈ u_g · shared
        else:
            raise ValueError(f"unknown rope_key mode {mode!r}")
        shared_a, shared_b = u @ Xa, u @ Xb
        weight[a], weight[b] = shared_a, shared_b
        scale[:, a], scale[:, b] = g, g
        tot = energy(Xa) + energy(Xb)
        err = energy(Xa - g[:, None] * shared_a) + energy(Xb - g[:, None] * shared_b)
        total += tot
        kept += tot - err
    residual = (rows - scale[:, :, None] * weight[None])[:, :, :d_in]  # (n_kv, d_r, d_in); its bias part is dropped
    w, bvec = weight[:, :d_in], (weight[:, d_in] if bias is not None else None)
    return SharedRopeKey(w, bvec, scale, kept / total if total > 0 else 1.0, residual, total)


def _with_bias_input(cov: torch.Tensor, width: int) -> torch.Tensor:
    """cov as the second moment of the inputs the rows see: a (width − 1)-square one gains the bias's constant 1."""
    if cov.shape[0] == width:
        return cov
    if cov.shape[0] + 1 == width:
        return torch.block_diag(cov, torch.ones(1, 1, dtype=cov.dtype))
    raise ValueError(f"cov is {tuple(cov.shape)}, but the key rows have {width} inputs")


def rotation_mean(inv_freq: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """E_Δ[(cos Δθ_i, sin Δθ_i)] per output pair: (P, 2), for relative distances Δ = 0, 1, … weighted by `weights`.

    inv_freq (P,): each output pair's θ_i; weights (T,): how much each distance Δ = query − key
    position counts (need not sum to one).
    """
    w = weights.double() / weights.double().sum()
    angle = torch.arange(len(w), dtype=torch.float64)[:, None] * inv_freq.double()[None, :]  # (T, P)
    return torch.stack([(w[:, None] * angle.cos()).sum(0), (w[:, None] * angle.sin()).sum(0)], dim=1)


def causal_probs(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """(N, n_h, T, T): each query head's causal attention probabilities over the keys of its block.

    q (N, T, n_h, d_h), k (N, T, n_kv, d_h): pre-RoPE queries and keys in the half-wise layout (pair j
    is dims j and j + d_h/2, turned by inv_freq[j] per position); scale: the softmax scale. GQA key
    heads serve n_h/n_kv consecutive query heads.
    """
    N, T, n_h, d_h = q.shape
    half = d_h // 2
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq.double()[None]  # (T, d_h/2)
    cos, sin = angle.cos().repeat(1, 2).float(), angle.sin().repeat(1, 2).float()

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (N, T, heads, d_h), RoPE at each position
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[None, :, None] + turned * sin[None, :, None]

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    qr = rotate(q.float()).transpose(1, 2)  # (N, n_h, T, d_h)
    kr = rotate(k.float()).transpose(1, 2).repeat_interleave(n_h // k.shape[2], dim=1)
    return (qr @ kr.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)


def attention_distances(probs: torch.Tensor) -> torch.Tensor:
    """(n_h, T): the causal attention mass each query head puts at each distance Δ = query − key position,
    summed over the blocks of `causal_probs`' (N, n_h, T, T) probabilities (rope_residual_distances=attention)."""
    n_h, T = probs.shape[1], probs.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :])[causal]
    summed = probs.sum(0)
    return torch.stack([torch.bincount(distance, weights=summed[h][causal].double(), minlength=T) for h in range(n_h)])


def received_attention(probs: torch.Tensor) -> torch.Tensor:
    """(N, T): the attention mass each key position receives from the queries of its block, averaged over the
    query heads, from `causal_probs`' (N, n_h, T, T). Every query gives away 1, so a block's masses sum to T
    (mean 1 per token); a first token that serves as the heads' sink receives a large share of them."""
    return probs.sum(2, dtype=torch.float64).mean(1)  # float64 sums without a float64 copy of every probability


def residual_fold(
    rope_rows: torch.Tensor, pairs: list[tuple[int, int]], head_dim: int, inv_freq: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Per output pair, the 2×2 map F that latent_mean applies to a head's residual query rows: (P, 2, 2).

    The residual stands in for the source's own score term on those rows, so the rotation
    averaged is the source's. rope_rows (d_r,): each output RoPE row's source row; pairs: the
    output pairs (a, b); inv_freq (d_h/2,): the source's per-pair frequencies; weights over Δ as
    in `rotation_mean`. When rows (a, b) are a source pair (j, j + d_h/2), F = Aᵀ =
    [[c̄, −s̄], [s̄, c̄]] at θ_j. Otherwise (rope_dims=last re-pairs rows whose partners are
    in the no-RoPE part) only each row's own term q_r·k_r·cos(Δθ) is in the residual:
    F = diag(c̄ at row a's pair, c̄ at row b's pair).
    """
    half = head_dim // 2
    mean = rotation_mean(inv_freq, weights)  # (d_h/2, 2)
    out = torch.zeros(len(pairs), 2, 2, dtype=torch.float64)
    for i, (a, b) in enumerate(pairs):
        ra, rb = int(rope_rows[a]), int(rope_rows[b])
        if ra < half and rb == ra + half:
            c, s = mean[ra]
            out[i] = torch.stack([torch.stack([c, -s]), torch.stack([s, c])])
        else:
            out[i, 0, 0], out[i, 1, 1] = mean[ra % half, 0], mean[rb % half, 0]
    return out


def fold_rotation(rows: torch.Tensor, pairs: list[tuple[int, int]], fold: torch.Tensor) -> torch.Tensor:
    """Query rows that meet an unrotated key as the rotated query would on average.

    RoPE turns both sides, so a score is qᵀ·Rot(−Δθ)·k with Rot(φ) = [[cos φ, −sin φ], [sin φ, cos φ]]
    on (a, b) and Δ the query's position minus the key's. Its best position-free stand-in (least
    squares over Δ) is qᵀ·A·k with A = E[Rot(−Δθ)], i.e. query rows Aᵀ·(a, b) =
    (c̄·a − s̄·b, s̄·a + c̄·b). rows (…, d_r, d_in); pairs as in `shared_rope_key`; fold (P, 2, 2)
    (from `residual_fold`), or (…, P, 2, 2) matching the leading dims of rows (e.g. one per head):
    new (a, b) = fold[i] · (a, b).
    """
    out = rows.clone()
    for i, (a, b) in enumerate(pairs):
        F = fold[..., i, :, :, None]  # (…, 2, 2, 1): broadcasts over the input dim
        out[..., a, :] = F[..., 0, 0, :] * rows[..., a, :] + F[..., 0, 1, :] * rows[..., b, :]
        out[..., b, :] = F[..., 1, 0, :] * rows[..., a, :] + F[..., 1, 1, :] * rows[..., b, :]
    return out


def pair_gram(Xa: torch.Tensor, Xb: torch.Tensor, metric: torch.Tensor | None = None) -> torch.Tensor:
    """(n_kv, n_kv): one pair's key covariance across heads, Xa·M·Xaᵀ + Xb·M·Xbᵀ (M = I when metric is None)."""
    if metric is None:
        return Xa @ Xa.T + Xb @ Xb.T
    return Xa @ metric @ Xa.T + Xb @ metric @ Xb.T


def pair_spectra(rows: torch.Tensor, bias: torch.Tensor | None = None, cov: torch.Tensor | None = None) -> torch.Tensor:
    """Key energy of every virtual head of every source pair: (P, n_kv), each row descending.

    rows (n_kv, P, 2, d_in): each KV head's two key rows of each of the P pairs; bias
    (n_kv, P, 2) or None; cov (d_in, d_in) the input second moment (None: isotropic
    inputs, the weights-only measure; with a bias, as in `shared_rope_key`). Row j holds the
    eigenvalues of pair j's cross-head Gram matrix; all entries sum to the whole key energy.
    """
    rows = rows.double()
    if bias is not None:
        rows = torch.cat([rows, bias.double()[..., None]], dim=3)
    metric = None if cov is None else _with_bias_input(cov.double(), rows.shape[3])
    out = [torch.linalg.eigvalsh(pair_gram(rows[:, j, 0], rows[:, j, 1], metric)).flip(0) for j in range(rows.shape[1])]
    return torch.stack(out).clamp_min(0)


def allocate_slots(spectra: torch.Tensor, slots: int) -> torch.Tensor:
    """Greedy slot allocation: (P,) how many components of each pair keep RoPE, summing to `slots`.

    spectra (P, n_kv), rows descending (from `pair_spectra`). Each step takes the
    largest energy not yet taken; since a pair's components come in descending
    order, this is the top `slots` entries overall, and it keeps a prefix of each
    pair's components. Ties go to the lower pair index (the faster pair).
    """
    P, n_kv = spectra.shape
    if not 1 <= slots <= P * n_kv:
        raise ValueError(f"slots must be in [1, {P * n_kv}], got {slots}")
    counts = torch.zeros(P, dtype=torch.long)
    for _ in range(slots):
        nxt = torch.full((P,), float("-inf"), dtype=torch.float64)
        open_ = counts < n_kv
        nxt[open_] = spectra.double()[open_, counts[open_]]
        counts[int(torch.argmax(nxt))] += 1  # argmax returns the first maximum
    return counts


def kept_energy(spectra: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the whole key energy carried by the kept components (the first counts[j] of pair j)."""
    total = float(spectra.sum())
    if total <= 0:
        return 1.0
    mask = torch.arange(spectra.shape[1])[None, :] < counts[:, None]
    return float(spectra[mask].sum()) / total


def inexpressible_reason(
    counts_per_layer: list[torch.Tensor], head_dim: int, rope_dim: int, theta: float, *, allow_linear: bool
) -> str | None:
    """Why stock DeepSeek-V3 RoPE cannot rotate these allocations exactly (None: it can, as case (a)).

    counts_per_layer: one (d_h/2,) allocation per layer (from `allocate_slots`).
    Case (b) of the module docstring, every slot on one pair, is reported as a
    reason too: it is expressible (θ' = 1) but not written.
    """
    for i, counts in enumerate(counts_per_layer):
        multi = [int(j) for j in torch.nonzero(counts > 1).flatten()]
        if multi:
            return (
                f"layer {i} keeps {int(counts[multi[0]])} components of pair {multi[0]}; each needs its own "
                f"RoPE pair at that one frequency, and stock DeepSeek-V3 frequencies θ'^(-2i/d_r)/factor are "
                f"all distinct unless θ' = 1"
            )
    pairs = [sorted(int(j) for j in torch.nonzero(c).flatten()) for c in counts_per_layer]
    if any(p != pairs[0] for p in pairs):
        first = next(i for i, p in enumerate(pairs) if p != pairs[0])
        return f"layers 0 and {first} keep different pairs ({pairs[0]} vs {pairs[first]}), but stock RoPE has one frequency list"
    fit = fit_frequencies(pairs, head_dim, rope_dim, theta, allow_linear=allow_linear)
    if fit.max_log_error > 1e-9:
        return (
            f"pairs {pairs[0]} are not a run j_0 + s·i"
            + ("" if allow_linear else " from j_0 = 0 (this source's RoPE scaling leaves no room for a linear factor)")
            + f": the best stock fit misses a frequency by a factor {float(torch.tensor(fit.max_log_error).exp()):.3g}"
        )
    return None

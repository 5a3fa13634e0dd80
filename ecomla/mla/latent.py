"""Low-rank latent factorizations for MLA, built around the stock latent RMSNorm.

Pure tensor math: no transformers, no files.

Notation:
  d      hidden size
  y      (d,)   the attention input with its RMSNorm gain folded away, so ‖y‖² ≈ d
  M      (m, d) the stacked projection rows the latent must reproduce, e.g. for
                keys and values [k_nope_h; v_h] for every head h (gain folded in)
  r      latent width (kv_lora_rank or q_lora_rank)
  Q      (r, d) orthonormal rows; the latent is c = Q·y   (kv_a_proj_with_mqa)
  B      (m, r) up-projection applied to RMSNorm(c)       (kv_b_proj)

Why orthonormal rows. Stock DeepSeek-V3 always normalizes the latent:
n = c / sqrt(mean(c²) + ε). If Q is a full orthogonal matrix (r = d), then
‖c‖ = ‖y‖ ≈ √d for every token, the norm is a constant scale, and B = M·Qᵀ
reproduces M·y exactly (up to the RMSNorm ε of the source, see README). Below
full rank ‖Q·y‖ varies from token to token; the weights-only fit assumes an
isotropic y (E‖Q·y‖² = r, so the scale is 1), while the activation fit
regresses B on the normalized latents of real calibration inputs.

X-EcoMLA splits the SVD as down = Σ·Vᵀ, up = U. We keep the same subspace but
put Σ on the up-projection (down = Vᵀ, up = U·Σ), because only an isometric
down-projection survives the latent RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default eps, which kv_a_layernorm / q_a_layernorm use
LINEAR_HEADROOM = 1e-3  # latent_norm=linear: the latent's mean square stays below this share of eps


@dataclass
class Basis:
    """An orthonormal latent basis and the spectrum it was cut from."""

    rows: torch.Tensor  # (r, d) orthonormal rows: the down-projection Q
    spectrum: torch.Tensor  # (k,) σ² (weights) or PCA eigenvalues (activations), descending
    energy_kept: float  # share of the spectrum's energy inside the basis


def _complete_rows(rows: torch.Tensor, rank: int, candidates: torch.Tensor) -> torch.Tensor:
    """Extend orthonormal `rows` (k, d) to `rank` rows using `candidates` (c, d) in order.

    Extra rows carry nothing the up-projection needs, but they make ‖Q·y‖ closer
    to ‖y‖, so the latent RMSNorm scales more uniformly.
    """
    d = candidates.shape[1]
    if rows.shape[0] >= rank:
        return rows[:rank]
    basis = rows
    for cand in candidates:
        v = cand - basis.T @ (basis @ cand) if basis.numel() else cand.clone()
        norm = v.norm()
        if norm > 1e-8:
            basis = torch.cat([basis, (v / norm)[None]], dim=0)
        if basis.shape[0] == rank:
            return basis
    raise ValueError(f"cannot build {rank} orthonormal rows in dimension {d}")


def weight_basis(M: torch.Tensor, rank: int) -> Basis:
    """Top-`rank` right singular directions of M (X-EcoMLA's SVD, no data)."""
    M = M.double()
    d = M.shape[1]
    if not 1 <= rank <= d:
        raise ValueError(f"rank must be in [1, {d}], got {rank}")
    _, S, Vh = torch.linalg.svd(M, full_matrices=True)  # Vh: (d, d)
    spectrum = S.square()
    energy = float(spectrum[:rank].sum() / spectrum.sum()) if spectrum.sum() > 0 else 1.0
    return Basis(rows=Vh[:rank].contiguous(), spectrum=spectrum, energy_kept=energy)


def activation_basis(M: torch.Tensor, cov: torch.Tensor, rank: int) -> Basis:
    """The `rank`-dim input subspace that best reconstructs Z = M·y under E[y·yᵀ] = cov.

    PCA of the outputs: eigenvectors U_k of M·C·Mᵀ. The best rank-k map is
    U_k·U_kᵀ·M, whose row space in input space is span(Mᵀ·U_k); its orthonormal
    basis is the latent. Past rank(M), the basis is completed with the input's
    own principal directions.
    """
    M, cov = M.double(), cov.double()
    d = M.shape[1]
    if not 1 <= rank <= d:
        raise ValueError(f"rank must be in [1, {d}], got {rank}")
    evals, evecs = torch.linalg.eigh(M @ cov @ M.T)  # ascending
    evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
    useful = int((evals > evals[0] * 1e-10).sum()) if evals[0] > 0 else 0
    k = min(rank, useful)
    rows = torch.empty(0, d, dtype=M.dtype)
    if k:
        q, _ = torch.linalg.qr(M.T @ evecs[:, :k])  # (d, k), orthonormal columns
        rows = q.T
    if rows.shape[0] < rank:
        cvals, cvecs = torch.linalg.eigh(cov)
        candidates = torch.cat([cvecs.flip(1).T, torch.eye(d, dtype=M.dtype)], dim=0)
        rows = _complete_rows(rows, rank, candidates)
    energy = float(evals[:rank].sum() / evals.sum()) if evals.sum() > 0 else 1.0
    return Basis(rows=rows.contiguous(), spectrum=evals, energy_kept=energy)


def rms_normalize(x: torch.Tensor, eps: float = LATENT_NORM_EPS) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) over the last dim, as DeepseekV3RMSNorm with weight 1."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def up_from_weights(M: torch.Tensor, rows: torch.Tensor, latent_width: int | None = None,
                    latent_scale: float = 1.0, eps: float = LATENT_NORM_EPS) -> torch.Tensor:
    """B = M·Qᵀ·s: exact at full rank, and the isotropic-input estimate below it.

    When the layer's r rows sit in a wider zero-padded latent (per-layer ranks in
    one stock `kv_lora_rank`), the norm divides by the padded width, so
    E[mean(c²)] = r / width and B is scaled by s = sqrt(r / width) to match.
    rows = a·Q with a ≠ 1 (latent_norm=linear, a = `linear_latent_scale`): the norm
    divides by sqrt(a²·r/width + eps), so B = M·Qᵀ·sqrt(a²·r/width + eps)/a.
    """
    width = latent_width or rows.shape[0]
    if latent_scale == 1.0:
        return M.double() @ rows.double().T * (rows.shape[0] / width) ** 0.5
    a = latent_scale
    return M.double() @ rows.double().T / a * ((a * a * rows.shape[0] / width + eps) ** 0.5 / a)


def linear_latent_scale(width: int, hidden: int, eps: float = LATENT_NORM_EPS,
                        headroom: float = LINEAR_HEADROOM) -> float:
    """a such that c = a·Q·y keeps mean(c²) ≤ headroom·eps for every input, so RMSNorm(c) = c/sqrt(eps) within
    headroom/2: a fixed scale, not a per-token one.

    Q has orthonormal rows and ‖y‖² ≤ d (y = RMSNorm(h) without gain), so ‖c‖² ≤ a²·d and
    mean(c²) ≤ a²·d/width over the latent's (padded) width.
    """
    return (headroom * eps * width / hidden) ** 0.5


def linear_input_gain(width: int, hidden: int) -> float:
    """γ, the input_layernorm gain of a linear-latent layer: a = `linear_latent_scale` is split between γ and the
    latent rows (a/γ)·Q so that a typical input entry (γ) and a typical row entry (a/γ/√d) are equal, which
    keeps both in float16's normal range. Every projection that reads the input is stored divided by γ."""
    return linear_latent_scale(width, hidden) ** 0.5 / hidden ** 0.25


def psd_sqrt(A: torch.Tensor) -> torch.Tensor:
    """The symmetric square root of a positive semi-definite matrix (negative eigenvalues clipped to 0)."""
    w, U = torch.linalg.eigh(A.double())
    return (U * w.clamp_min(0).sqrt()) @ U.T


def up_from_activations(
    M: torch.Tensor,
    rows: torch.Tensor,
    y: torch.Tensor,
    *,
    eps: float = LATENT_NORM_EPS,
    ridge: float = 1e-6,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Least-squares B minimizing Σ w·‖M·y − B·RMSNorm(Q·y)‖² over calibration inputs y (N, d), each token
    weighted by w (N,; all 1 when None).

    This fits the up-projection to what the stock model will actually see after
    the latent norm, so the norm's token-to-token scale is absorbed as well as a
    linear map can. `ridge` is relative to the mean eigenvalue of the Gram matrix.
    """
    M, rows, y = M.double(), rows.double(), y.double()
    _check_weights(weights, y)
    n = rms_normalize(y @ rows.T, eps)  # (N, r)
    wn = n if weights is None else n * weights.double()[:, None]
    gram = n.T @ wn  # (r, r)
    cross = y.T @ wn  # (d, r)
    reg = ridge * float(gram.diagonal().mean()) * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + reg, (M @ cross).T).T


def second_moment(y: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """E[y·yᵀ] (d, d) in float64; with weights w (N,), the w-weighted mean Σ w·y·yᵀ / Σ w."""
    y = y.double()
    if weights is None:
        return y.T @ y / max(1, y.shape[0])
    _check_weights(weights, y)
    w = weights.double()
    return (y * w[:, None]).T @ y / float(w.sum())


def _check_weights(weights: torch.Tensor | None, y: torch.Tensor) -> None:
    """Token weights, when given, are one per row of y."""
    if weights is not None and tuple(weights.shape) != (y.shape[0],):
        raise ValueError(f"token weights of shape {tuple(weights.shape)} for {y.shape[0]} calibration rows; give "
                         "one weight per row")


def relative_error(true: torch.Tensor, approx: torch.Tensor) -> float:
    """‖true − approx‖_F / ‖true‖_F (0.0 when both are zero)."""
    true, approx = true.double(), approx.double()
    denom = float(true.norm())
    return float((true - approx).norm()) / denom if denom > 0 else float(approx.norm())


def reconstruct(M_rows_up: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, eps: float = LATENT_NORM_EPS) -> torch.Tensor:
    """What the stock MLA produces for inputs y (N, d): B·RMSNorm(Q·y), as (N, m)."""
    return rms_normalize(y.double() @ rows.double().T, eps) @ M_rows_up.double().T

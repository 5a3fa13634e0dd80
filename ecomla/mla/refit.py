"""Closed-form refit of MLA's value path (`init.refit: values`).

Pure tensor math: no transformers, no files.

Notation, for one layer with n_h query heads, latent width r, value width d_v, hidden d:
  n_t      (r,)       the normalized latent of token t (what kv_a_layernorm writes, what the cache holds)
  p_h,ij              head h's attention probability from query i to key j
  z_h,i    (r,)       Σ_j p_h,ij·n_j: the latent head h reads at query i
  out_i    (d,)       Σ_h W_o,h·W_UV,h·z_h,i, with W_o,h (d, d_v) head h's columns of o_proj and
                      W_UV,h (d_v, r) its value rows of kv_b_proj

With the attention probabilities fixed, the output is linear in G_h = W_o,h·W_UV,h, so the G that best
reproduces a target output (least squares over calibration queries) is one ridge solve over the
n_h·r features z_i = [z_1,i; …; z_n_h,i]. Each G_h is then cut to rank d_v and split back into the
two stock matrices by an SVD of G_h under the features' own second moment (the cut that loses the
least output on the calibration data, head by head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ecomla.mla.latent import psd_sqrt


@dataclass
class ValueMoments:
    """Least-squares statistics over calibration queries: Σ z·zᵀ and Σ z·targetᵀ, summed in float64.

    Each `add` forms its chunk's products in the chunk's own dtype (float32 from a float32 conversion: half
    the time of float64 on a CPU, the rounding of one chunk's sum, about 1e-7 relative) and adds them to the
    float64 totals, so chunks never round against the running sum."""

    features: int  # n_h·r
    hidden: int  # d
    gram: torch.Tensor = field(init=False)  # (n_h·r, n_h·r)
    cross: torch.Tensor = field(init=False)  # (n_h·r, d)
    target_energy: float = field(init=False)  # Σ‖target‖²

    def __post_init__(self):
        self.gram = torch.zeros(self.features, self.features, dtype=torch.float64)
        self.cross = torch.zeros(self.features, self.hidden, dtype=torch.float64)
        self.target_energy = 0.0

    def add(self, z: torch.Tensor, target: torch.Tensor) -> None:
        """z (M, n_h·r) the latents each head reads, target (M, d) the output wanted, for M queries."""
        target = target.to(z.dtype)
        self.gram += (z.T @ z).double()
        self.cross += (z.T @ target).double()
        self.target_energy += float(target.double().square().sum())


def value_map(o_w: torch.Tensor, uv: torch.Tensor) -> torch.Tensor:
    """G = [W_o,1·W_UV,1, …, W_o,n_h·W_UV,n_h]: (d, n_h·r), the value path as one map from what the heads read."""
    n_heads, v_dim, _ = uv.shape
    return torch.cat([o_w.double()[:, h * v_dim:(h + 1) * v_dim] @ uv[h].double() for h in range(n_heads)], dim=1)


def solve_value_path(moments: ValueMoments, n_heads: int, v_dim: int, ridge: float,
                     prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The refitted (o_proj weight (d, n_h·d_v), value rows (n_h, d_v, r)).

    ridge, relative to the mean diagonal of the Gram matrix, pulls G toward prior ((d, n_h·r), the
    value path before the refit, `value_map`; zero when None): G = argmin Σ‖t − G·z‖² + λ‖G − prior‖².
    So a value path that already reproduces the target is kept as it is. Per head, G_h·S_h^½ = U·Σ·Vᵀ with
    S_h = Σ z_h·z_hᵀ; the best rank-d_v G_h is U_k·Σ_k·V_kᵀ·S_h^-½, written as W_o,h = U_k·Σ_k^½ and
    W_UV,h = Σ_k^½·V_kᵀ·S_h^-½ (balanced, so neither matrix carries the whole scale). Heads whose latent
    is narrower than d_v (r < d_v) get zero rows and columns past rank r.
    """
    gram, F = moments.gram, moments.features
    r = F // n_heads
    reg = ridge * float(gram.diagonal().mean()) * torch.eye(F, dtype=torch.float64)
    rhs = moments.cross if prior is None else moments.cross + reg @ prior.double().T
    G = torch.linalg.solve(gram + reg, rhs).T  # (d, n_h·r)
    o_w = torch.zeros(moments.hidden, n_heads * v_dim, dtype=torch.float64)
    uv = torch.zeros(n_heads, v_dim, r, dtype=torch.float64)
    k = min(v_dim, r)
    for h in range(n_heads):
        block = slice(h * r, (h + 1) * r)
        S = gram[block, block] + reg[block, block]
        w, E = torch.linalg.eigh(S)
        inv_half = (E / w.clamp_min(1e-30).sqrt()) @ E.T
        U, sig, Vh = torch.linalg.svd(G[:, block] @ psd_sqrt(S), full_matrices=False)
        root = sig[:k].sqrt()
        o_w[:, h * v_dim:h * v_dim + k] = U[:, :k] * root
        uv[h, :k] = root[:, None] * Vh[:k] @ inv_half
    return o_w, uv


def value_path_error(moments: ValueMoments, o_w: torch.Tensor, uv: torch.Tensor) -> float:
    """Relative squared error Σ‖target − out‖²/Σ‖target‖² of a value path (o_w, uv) on the calibration data,
    from the moments alone."""
    G = value_map(o_w, uv)
    total = moments.target_energy
    err = total - 2 * float((G * moments.cross.T).sum()) + float(((G @ moments.gram) * G).sum())
    return err / total if total > 0 else 0.0

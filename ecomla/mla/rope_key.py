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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

RopeKey = Literal["mean", "rorope", "rorope_act"]


@dataclass
class SharedRopeKey:
    weight: torch.Tensor  # (d_r, d_in) shared RoPE key rows
    bias: torch.Tensor | None  # (d_r,)
    head_scale: torch.Tensor  # (n_kv, d_r): factor on each KV group's query RoPE rows
    energy_kept: float  # share of the pairs' key energy carried by the shared key (weights, or activations)


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
    output frequency pair; cov (d_in, d_in): E[y·yᵀ], required by rorope_act.
    """
    n_kv, d_r, d_in = rows.shape
    rows = rows.double()
    cov = None if cov is None else cov.double()
    if bias is not None:  # the bias is a weight on a constant input 1
        rows = torch.cat([rows, bias.double()[:, :, None]], dim=2)
        if cov is not None:
            cov = torch.block_diag(cov, torch.ones(1, 1, dtype=torch.float64))
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
            M = torch.eye(Xa.shape[1], dtype=torch.float64) if cov is None or mode == "rorope" else cov
            gram = Xa @ M @ Xa.T + Xb @ M @ Xb.T  # (n_kv, n_kv): the pair's key covariance across heads
            u = torch.linalg.eigh(gram).eigenvectors[:, -1]
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
    w, bvec = weight[:, :d_in], (weight[:, d_in] if bias is not None else None)
    return SharedRopeKey(w, bvec, scale, kept / total if total > 0 else 1.0)

"""Latent fitters: how one layer's latent basis and up-projection are initialized.

A fitter maps (M, rank, width) to (Basis, up-projection), where M holds the rows
the latent must reproduce; see `ecomla.mla.latent` for the math.
"""

from __future__ import annotations

import torch

from ecomla.convert.to_mla import pad_cols, pad_rows
from ecomla.mla import latent


def _augment(y: torch.Tensor, d_in: int) -> torch.Tensor:
    """Append the constant-1 coordinate that carries a query bias when M has d + 1 columns."""
    return y if y.shape[1] == d_in else torch.cat([y, torch.ones(y.shape[0], 1, dtype=y.dtype)], dim=1)


def make_fitter(method: str, y: torch.Tensor | None, ridge: float, gen: torch.Generator, std: float):
    """The latent fit of one layer: (M, rank, width) -> (Basis, up)."""

    def fit(M: torch.Tensor, rank: int, width: int):
        if method == "svd":
            basis = latent.weight_basis(M, rank)
            return basis, pad_cols(latent.up_from_weights(M, basis.rows, width), width)
        if method == "activation":
            ya = _augment(y, M.shape[1]).double()
            basis = latent.activation_basis(M, latent.second_moment(ya), rank)
            return basis, latent.up_from_activations(M, pad_rows(basis.rows, width), ya, ridge=ridge)
        # random: the stock initializer, N(0, initializer_range), for both projections
        rows = torch.randn(rank, M.shape[1], generator=gen, dtype=torch.float64) * std
        up = torch.randn(M.shape[0], width, generator=gen, dtype=torch.float64) * std
        return latent.Basis(rows=rows, spectrum=torch.zeros(0), energy_kept=float("nan")), up

    return fit

"""`ecomla.mla.latent`: orthonormal latent bases and up-projections around the stock latent RMSNorm.

Proves: the weight basis is orthonormal and, at full rank, reproduces M·y exactly for
inputs with ‖y‖² = d (the isometry claim of the module docstring); below full rank the
error falls monotonically with rank; on anisotropic inputs the activation fit beats the
weights-only fit on held-out data; the activation basis is completed to the requested
rank; and the sqrt(r/width) scale of `up_from_weights` exactly undoes zero-padding of
the latent under the RMSNorm.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ecomla.convert.to_mla import pad_rows
from ecomla.mla.latent import (
    LATENT_NORM_EPS,
    activation_basis,
    reconstruct,
    relative_error,
    rms_normalize,
    second_moment,
    up_from_activations,
    up_from_weights,
    weight_basis,
)

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def _on_sphere(y: torch.Tensor) -> torch.Tensor:
    """Scale every row to norm sqrt(d), as the gain-free output of an RMSNorm is."""
    return y / y.norm(dim=-1, keepdim=True) * y.shape[-1] ** 0.5


def _assert_orthonormal_rows(rows: torch.Tensor) -> None:
    eye = torch.eye(rows.shape[0], dtype=F64)
    assert_close(rows.double() @ rows.double().T, eye, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- weight basis


@pytest.mark.parametrize(("m", "d", "r"), [(48, 32, 5), (48, 32, 32), (12, 32, 20), (12, 32, 32)])
def test_weight_basis_rows_orthonormal(m, d, r):
    M = _randn(m, d, g=_gen(1))
    b = weight_basis(M, r)
    assert b.rows.shape == (r, d)
    _assert_orthonormal_rows(b.rows)
    # The spectrum is σ² of M, descending, and energy_kept its top-r share.
    S = torch.linalg.svdvals(M)
    assert_close(b.spectrum, S.square())
    assert b.energy_kept == pytest.approx(float(S[:r].square().sum() / S.square().sum()))


def test_weight_basis_top_directions_capture_best_rank_r_approximation():
    M = _randn(40, 24, g=_gen(2))
    r = 6
    Q = weight_basis(M, r).rows
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    best = (U[:, :r] * S[:r]) @ Vh[:r]
    assert_close(M @ Q.T @ Q, best, atol=1e-10, rtol=0)  # Eckart–Young: same subspace


@pytest.mark.parametrize("bad", [0, 33])
def test_weight_basis_rank_out_of_range(bad):
    with pytest.raises(ValueError, match="rank must be in"):
        weight_basis(_randn(8, 32, g=_gen(0)), bad)


@pytest.mark.parametrize(("m", "d"), [(48, 32), (12, 32)])
def test_full_rank_is_exact_for_inputs_on_the_sqrt_d_sphere(m, d):
    g = _gen(3)
    M = _randn(m, d, g=g)
    y = _on_sphere(_randn(500, d, g=g))
    assert_close((y * y).sum(-1), torch.full((500,), float(d), dtype=F64))
    rows = weight_basis(M, d).rows
    out = reconstruct(up_from_weights(M, rows), rows, y)
    true = y @ M.T
    # Q is orthogonal, so mean((Q·y)²) = 1 for every token; the only deviation is the
    # RMSNorm eps: a uniform factor 1/sqrt(1 + 1e-6) ≈ 1 - 5e-7.
    assert_close(out, true, rtol=1e-6, atol=0)
    assert relative_error(true, out) < 1e-6
    assert relative_error(true, out) == pytest.approx(1 - (1 + LATENT_NORM_EPS) ** -0.5, rel=1e-3)


def test_error_falls_monotonically_with_rank_on_isotropic_inputs():
    g = _gen(4)
    d, m = 32, 48
    M = _randn(m, d, g=g)
    y = _randn(4000, d, g=g)
    true = y @ M.T
    errs = []
    for r in range(1, d + 1):
        rows = weight_basis(M, r).rows
        errs.append(relative_error(true, reconstruct(up_from_weights(M, rows), rows, y)))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] > 0.9 and errs[-1] < 0.2


# ---------------------------------------------------------------- activation basis


def _anisotropic_sampler(d: int, k: int, g: torch.Generator):
    """y from a random k-dim subspace (unequal scales) plus small isotropic noise, on the sqrt(d) sphere."""
    A = torch.linalg.qr(_randn(d, k, g=g))[0].T  # (k, d) orthonormal
    scales = torch.linspace(3.0, 1.0, k, dtype=F64)

    def sample(n: int) -> torch.Tensor:
        z = _randn(n, k, g=g) * scales
        return _on_sphere(z @ A + 0.05 * _randn(n, d, g=g))

    return sample


@pytest.mark.parametrize("r", [2, 4, 8])
def test_activation_basis_beats_weight_basis_on_held_out_anisotropic_inputs(r):
    g = _gen(5)
    d, m, k = 32, 48, 4
    M = _randn(m, d, g=g)
    sample = _anisotropic_sampler(d, k, g)
    y_fit, y_test = sample(3000), sample(3000)
    true = y_test @ M.T

    qw = weight_basis(M, r).rows
    err_w = relative_error(true, reconstruct(up_from_weights(M, qw), qw, y_test))

    b = activation_basis(M, second_moment(y_fit), r)
    _assert_orthonormal_rows(b.rows)
    err_a = relative_error(true, reconstruct(up_from_activations(M, b.rows, y_fit), b.rows, y_test))

    assert err_a < 0.75 * err_w, (err_a, err_w)
    if r >= k:  # the whole signal subspace fits: only the 5% noise is lost
        assert err_a < 0.2


def test_activation_basis_spans_row_space_and_is_completed_past_rank_of_M():
    g = _gen(6)
    d, true_rank, r = 16, 3, 10
    M = _randn(20, true_rank, g=g) @ _randn(true_rank, d, g=g)  # rank 3
    cov = second_moment(_randn(2000, d, g=g))
    b = activation_basis(M, cov, r)
    assert b.rows.shape == (r, d)
    _assert_orthonormal_rows(b.rows)
    # The first rank(M) rows span M's row space, so M is reproduced exactly.
    head = b.rows[:true_rank]
    assert_close(M @ head.T @ head, M, atol=1e-9, rtol=0)
    assert b.energy_kept == pytest.approx(1.0)
    # Full rank works too, even with a singular covariance (identity candidates finish the job).
    cov_singular = second_moment(_randn(5, d, g=g))
    full = activation_basis(M, cov_singular, d)
    _assert_orthonormal_rows(full.rows)
    assert full.rows.shape == (d, d)


def test_activation_basis_zero_matrix_falls_back_to_input_directions():
    g = _gen(7)
    d = 8
    cov = torch.diag(torch.tensor([1.0, 9.0, 4.0, 0.5, 0.1, 2.0, 3.0, 7.0], dtype=F64))
    b = activation_basis(torch.zeros(5, d, dtype=F64), cov, 3)
    _assert_orthonormal_rows(b.rows)
    # The input's own top principal directions: axes 1, 7, 2 (variances 9, 7, 4).
    assert sorted(b.rows.abs().argmax(dim=1).tolist()) == [1, 2, 7]
    del g


@pytest.mark.parametrize("bad", [0, 17])
def test_activation_basis_rank_out_of_range(bad):
    with pytest.raises(ValueError, match="rank must be in"):
        activation_basis(_randn(4, 16, g=_gen(0)), torch.eye(16, dtype=F64), bad)


def test_up_from_activations_at_full_rank_recovers_the_exact_map():
    g = _gen(8)
    d, m = 16, 24
    M = _randn(m, d, g=g)
    y = _on_sphere(_randn(400, d, g=g))
    rows = weight_basis(M, d).rows
    B = up_from_activations(M, rows, y, ridge=0.0)
    # On the sphere the normalized latent is Q·y / sqrt(1 + eps): B = M·Qᵀ·sqrt(1 + eps).
    assert_close(B, up_from_weights(M, rows) * (1 + LATENT_NORM_EPS) ** 0.5, atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------- zero-padded latent


def test_padded_latent_scale_matches_unpadded_and_beats_no_scale():
    g = _gen(9)
    d, m, r, width = 32, 48, 8, 32
    M = _randn(m, d, g=g)
    y = _randn(4000, d, g=g)  # isotropic
    true = y @ M.T
    rows = weight_basis(M, r).rows
    padded = pad_rows(rows, width)
    assert padded.shape == (width, d)
    assert torch.equal(padded[r:], torch.zeros(width - r, d, dtype=F64))

    def pad_cols(B: torch.Tensor) -> torch.Tensor:
        return torch.cat([B, B.new_zeros(B.shape[0], width - r)], dim=1)

    err_unpadded = relative_error(true, reconstruct(up_from_weights(M, rows), rows, y))
    scaled = reconstruct(pad_cols(up_from_weights(M, rows, latent_width=width)), padded, y)
    unscaled = reconstruct(pad_cols(up_from_weights(M, rows)), padded, y)
    err_scaled = relative_error(true, scaled)
    err_unscaled = relative_error(true, unscaled)

    # Bound: the zero rows only change the RMSNorm denominator from sqrt(‖c‖²/r + eps)
    # to sqrt(‖c‖²/width + eps), i.e. by sqrt(width/r) up to eps, and the scale sqrt(r/width)
    # undoes it. So the padded output is the unpadded one up to O(eps·width/‖c‖²) per token;
    # 1e-4 covers tokens whose ‖c‖² ~ χ²_8 is as small as 0.05 (probability ~1e-9 per token).
    assert abs(err_scaled - err_unpadded) < 1e-4
    assert_close(scaled, reconstruct(up_from_weights(M, rows), rows, y), rtol=1e-4, atol=1e-6)
    # Without the scale every output is sqrt(width/r) = 2x too large. Writing the scaled output
    # as a, with ‖t − a‖ = e_s·‖t‖, the unscaled one is 2a and ‖t − 2a‖ ≥ 2‖t − a‖ − ‖t‖, so
    # e_u ≥ 2·e_s − 1; here e_s ≈ 0.70 (rank 8 of 32) and the overshoot pushes e_u past 1.
    assert err_unscaled > 1.0 > err_unpadded
    assert err_unscaled >= 2 * err_scaled - 1 - 1e-12
    assert err_scaled < err_unscaled - 0.25
    # And the unscaled padded output is exactly sqrt(width/r) times the scaled one (up to eps).
    assert_close(unscaled, scaled * (width / r) ** 0.5, rtol=1e-4, atol=1e-6)


def test_up_from_weights_default_width_is_unscaled():
    M = _randn(10, 12, g=_gen(10))
    rows = weight_basis(M, 5).rows
    assert_close(up_from_weights(M, rows), M @ rows.T)
    assert_close(up_from_weights(M, rows, latent_width=5), M @ rows.T)
    assert_close(up_from_weights(M, rows, latent_width=20), M @ rows.T * 0.5)


# ---------------------------------------------------------------- helpers


def test_relative_error_basics():
    t = torch.tensor([[3.0, 4.0]])
    assert relative_error(t, t) == 0.0
    assert relative_error(t, torch.zeros_like(t)) == pytest.approx(1.0)
    assert relative_error(t, 1.1 * t) == pytest.approx(0.1)
    assert relative_error(t, torch.tensor([[3.0, 0.0]])) == pytest.approx(0.8)  # 4 / 5
    assert relative_error(torch.zeros(2, 2), torch.zeros(2, 2)) == 0.0
    assert relative_error(torch.zeros(2), torch.tensor([3.0, 4.0])) == pytest.approx(5.0)
    # float32 inputs are promoted: a 1e-9 difference is still seen.
    a = torch.ones(4, dtype=torch.float32)
    assert relative_error(a.double(), a.double() + 1e-9) == pytest.approx(1e-9 / 1.0, rel=1e-3)


@pytest.mark.parametrize("eps", [LATENT_NORM_EPS, 1e-2, 0.0])
def test_rms_normalize_matches_direct_formula(eps):
    x = _randn(5, 3, 7, g=_gen(11))
    expected = torch.empty_like(x)
    for idx in torch.cartesian_prod(torch.arange(5), torch.arange(3)).tolist():
        v = x[idx[0], idx[1]]
        ms = sum(float(e) ** 2 for e in v) / v.numel()
        expected[idx[0], idx[1]] = v / (ms + eps) ** 0.5
    got = rms_normalize(x, eps) if eps != LATENT_NORM_EPS else rms_normalize(x)
    assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if eps == 0.0:
        assert_close(got.square().mean(-1), torch.ones(5, 3, dtype=F64))


def test_second_moment():
    y = _randn(300, 6, g=_gen(12))
    expected = sum(torch.outer(v, v) for v in y) / 300
    assert_close(second_moment(y.float()), expected, rtol=1e-5, atol=1e-6)
    assert second_moment(y.float()).dtype == F64


def test_token_weights_count_as_repeated_tokens():
    """init.token_weights: an integer weight w counts a token as w copies of it, in the second moment and in the
    up-projection's least squares (below full rank, where the weights change the fit)."""
    g = _gen(13)
    d, m, r = 12, 20, 4
    M, y = _randn(m, d, g=g), _randn(60, d, g=g)
    w = torch.randint(1, 5, (60,), generator=g).double()
    repeated = y.repeat_interleave(w.long(), dim=0)
    assert_close(second_moment(y, w), second_moment(repeated), rtol=1e-10, atol=1e-12)
    rows = activation_basis(M, second_moment(y, w), r).rows
    assert_close(up_from_activations(M, rows, y, weights=w), up_from_activations(M, rows, repeated),
                 rtol=1e-8, atol=1e-10)
    assert not torch.allclose(up_from_activations(M, rows, y, weights=w), up_from_activations(M, rows, y), rtol=1e-3)

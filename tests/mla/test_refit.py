"""The closed-form value-path refit (ecomla/mla/refit.py)."""

from __future__ import annotations

import torch

from ecomla.mla.refit import ValueMoments, solve_value_path, value_path_error


def _data(n_heads=3, r=6, d_v=4, d=10, tokens=2000, seed=0, rank_ok=True):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, n_heads * r, generator=g, dtype=torch.float64)
    heads = []
    for h in range(n_heads):
        k = d_v if rank_ok else r
        heads.append(torch.randn(d, k, generator=g, dtype=torch.float64) @ torch.randn(k, r, generator=g, dtype=torch.float64))
    G = torch.cat(heads, dim=1)
    return z, z @ G.T, G


def _moments(z, target):
    m = ValueMoments(z.shape[1], target.shape[1])
    for zc, tc in zip(z.split(500), target.split(500)):
        m.add(zc, tc)
    return m


def test_recovers_an_exact_rank_dv_value_path():
    z, target, G = _data()
    m = _moments(z, target)
    o_w, uv = solve_value_path(m, 3, 4, ridge=0.0)
    G_hat = torch.cat([o_w[:, h * 4:(h + 1) * 4] @ uv[h] for h in range(3)], dim=1)
    torch.testing.assert_close(G_hat, G, rtol=1e-8, atol=1e-8)
    assert value_path_error(m, o_w, uv) < 1e-12


def test_error_matches_direct_computation_and_the_cut_costs_what_rank_costs():
    z, target, _ = _data(rank_ok=False)  # each head's map has full rank r > d_v: the rank-d_v cut loses something
    m = _moments(z, target)
    o_w, uv = solve_value_path(m, 3, 4, ridge=0.0)
    out = sum(z[:, h * 6:(h + 1) * 6] @ uv[h].T @ o_w[:, h * 4:(h + 1) * 4].T for h in range(3))
    direct = float((target - out).square().sum() / target.square().sum())
    assert abs(value_path_error(m, o_w, uv) - direct) < 1e-9
    assert 0.0 < direct < 1.0
    wider = solve_value_path(m, 3, 6, ridge=0.0)  # d_v = r: no cut
    assert value_path_error(m, *wider) < 1e-12


def test_latent_narrower_than_value_dim_pads_with_zeros():
    z, target, _ = _data(r=2, d_v=4)
    o_w, uv = solve_value_path(_moments(z, target), 3, 4, ridge=0.0)
    assert uv.shape == (3, 4, 2)
    assert torch.all(uv[:, 2:] == 0) and torch.all(o_w.view(10, 3, 4)[:, :, 2:] == 0)
    assert value_path_error(_moments(z, target), o_w, uv) < 1e-12


def test_ridge_shrinks_the_fit():
    z, target, _ = _data()
    m = _moments(z, target)
    plain, shrunk = solve_value_path(m, 3, 4, 0.0), solve_value_path(m, 3, 4, 10.0)
    assert value_path_error(m, *shrunk) > value_path_error(m, *plain)
    assert float(shrunk[0].norm() * shrunk[1].norm()) < float(plain[0].norm() * plain[1].norm())

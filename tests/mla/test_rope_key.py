"""`ecomla.mla.rope_key`: the residual of the shared RoPE key, per-pair spectra, slot allocation, rotation means.

Proves: every head's RoPE rows are exactly head_scale·shared + residual, for every mode, and the
residual's energy is what `energy_kept` says was lost; the per-pair spectra sum to the whole key energy
(weights and activations) and their top entries are rorope's kept energy; the greedy allocation is the
top-k of all components, a prefix per pair, and can give one pair two components; the stock-RoPE
expressibility check accepts exactly the geometric runs of distinct pairs; and the folded query rows
reproduce the distance-averaged RoPE score of a hand-written rotation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from ecomla.mla.rope_key import (
    allocate_slots,
    fold_rotation,
    inexpressible_reason,
    kept_energy,
    pair_spectra,
    residual_fold,
    rotation_mean,
    shared_rope_key,
)

N_KV, D_R, D_IN = 3, 8, 12
PAIRS = [(2 * i, 2 * i + 1) for i in range(D_R // 2)]  # interleaved output layout


def _rows(seed: int = 0, n_kv: int = N_KV) -> torch.Tensor:
    return torch.randn(n_kv, D_R, D_IN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cov(seed: int = 1, d: int = D_IN) -> torch.Tensor:
    A = torch.randn(4 * d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return A.T @ A / (4 * d)


@pytest.mark.parametrize("mode", ["mean", "rorope", "rorope_act"])
def test_residual_completes_every_head(mode):
    rows, bias = _rows(), torch.randn(N_KV, D_R, dtype=torch.float64)
    key = shared_rope_key(rows, bias, PAIRS, mode, _cov())
    assert key.residual.shape == rows.shape
    assert_close(key.head_scale[:, :, None] * key.weight[None] + key.residual, rows, rtol=0, atol=1e-12)


def test_residual_energy_is_what_rorope_drops():
    rows = _rows()
    key = shared_rope_key(rows, None, PAIRS, "rorope")
    assert key.pair_energy == pytest.approx(float(rows.square().sum()))
    assert 1 - float(key.residual.square().sum()) / key.pair_energy == pytest.approx(key.energy_kept)


@pytest.mark.parametrize("mode", ["mean", "rorope"])
def test_single_kv_head_leaves_no_residual(mode):
    key = shared_rope_key(_rows(n_kv=1), None, PAIRS, mode)
    assert float(key.residual.abs().max()) < 1e-12
    assert key.energy_kept == pytest.approx(1.0)


def _pair_rows(rows: torch.Tensor) -> torch.Tensor:
    """(n_kv, d_r, d) in the interleaved layout -> (n_kv, d_r/2, 2, d)."""
    return rows.view(rows.shape[0], D_R // 2, 2, -1)


def test_pair_spectra_sum_to_key_energy_and_top_is_rorope():
    rows, cov = _rows(), _cov()
    spec = pair_spectra(_pair_rows(rows))
    assert spec.shape == (D_R // 2, N_KV)
    assert torch.all(spec[:, :-1] >= spec[:, 1:])  # descending per pair
    assert float(spec.sum()) == pytest.approx(float(rows.square().sum()))
    one_each = torch.ones(D_R // 2, dtype=torch.long)
    for mode, c in (("rorope", None), ("rorope_act", cov)):
        key = shared_rope_key(rows, None, PAIRS, mode, c)
        s = pair_spectra(_pair_rows(rows), None, c)
        assert kept_energy(s, one_each) == pytest.approx(key.energy_kept)
    # Under activations the total is E‖K·y‖² = tr(K·C·Kᵀ).
    K = rows.reshape(-1, D_IN)
    assert float(pair_spectra(_pair_rows(rows), None, cov).sum()) == pytest.approx(float(torch.trace(K @ cov @ K.T)))


def test_pair_spectra_bias_is_a_constant_input():
    rows, bias = _rows(), torch.randn(N_KV, D_R, dtype=torch.float64)
    aug = torch.cat([rows, bias[:, :, None]], dim=2)
    assert_close(pair_spectra(_pair_rows(rows), bias.view(N_KV, D_R // 2, 2)), pair_spectra(_pair_rows(aug)))
    # A (d, d) moment gains the 1; a (d + 1, d + 1) one is used as given.
    cov = _cov()
    full = torch.block_diag(cov, torch.ones(1, 1, dtype=torch.float64))
    assert_close(pair_spectra(_pair_rows(rows), bias.view(N_KV, D_R // 2, 2), cov),
                 pair_spectra(_pair_rows(rows), bias.view(N_KV, D_R // 2, 2), full))


def test_allocate_slots_is_top_k_and_prefix():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        spec = torch.rand(6, 3, generator=g, dtype=torch.float64).sort(dim=1, descending=True).values
        for slots in (1, 4, 9, 18):
            counts = allocate_slots(spec, slots)
            assert int(counts.sum()) == slots
            brute = torch.zeros(6, dtype=torch.long)
            for flat in torch.topk(spec.flatten(), slots).indices.tolist():
                brute[flat // 3] += 1
            assert torch.equal(counts, brute)
            assert kept_energy(spec, counts) == pytest.approx(float(spec.flatten().topk(slots).values.sum() / spec.sum()))


def test_allocate_slots_gives_a_strong_pair_two_components():
    spec = torch.tensor([[10.0, 6.0], [5.0, 0.1], [4.0, 0.0], [0.5, 0.2]], dtype=torch.float64)
    assert allocate_slots(spec, 2).tolist() == [2, 0, 0, 0]
    assert allocate_slots(spec, 3).tolist() == [2, 1, 0, 0]
    fixed = torch.tensor([1, 1, 0, 0])  # one component of the two strongest pairs
    assert kept_energy(spec, allocate_slots(spec, 2)) > kept_energy(spec, fixed)
    assert allocate_slots(torch.ones(3, 2), 2).tolist() == [2, 0, 0]  # ties: lower pair index first
    with pytest.raises(ValueError, match="slots"):
        allocate_slots(spec, 9)


def _counts(pairs, half=32, multi=None):
    c = torch.zeros(half, dtype=torch.long)
    c[list(pairs)] = 1
    if multi is not None:
        c[multi] = 2
    return c


@pytest.mark.parametrize(
    ("pairs", "allow_linear"),
    [(range(8), False), (range(0, 32, 4), False), (range(24, 32), True), (range(3, 27, 3), True)],
)
def test_geometric_runs_are_expressible(pairs, allow_linear):
    layers = [_counts(pairs)] * 3
    assert inexpressible_reason(layers, 64, 16, 10000.0, allow_linear=allow_linear) is None


def test_inexpressible_allocations_say_why():
    def why(layers, allow_linear=True):
        return inexpressible_reason(layers, 64, 16, 10000.0, allow_linear=allow_linear)

    assert "components of pair 5" in why([_counts(range(6), multi=5)])  # two virtual heads at one frequency
    assert "different pairs" in why([_counts(range(8)), _counts(range(1, 9))])
    assert "not a run" in why([_counts([0, 1, 2, 3, 4, 5, 6, 9])])
    assert "j_0 = 0" in why([_counts(range(24, 32))], allow_linear=False)  # e.g. Llama-3 scaling


def _rot(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Hugging Face RoPE on one pair (a, b): x·cos + rotate_half(x)·sin, rotate_half(a, b) = (−b, a)."""
    a, b = x[..., 0], x[..., 1]
    c, s = math.cos(angle), math.sin(angle)
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1)


def _fold_of(mean: torch.Tensor) -> torch.Tensor:
    """(P, 2) (c̄, s̄) -> (P, 2, 2) Aᵀ = [[c̄, −s̄], [s̄, c̄]]."""
    c, s = mean[:, 0], mean[:, 1]
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)


def test_folded_query_gives_the_distance_averaged_score():
    g = torch.Generator().manual_seed(5)
    inv_freq = torch.tensor([1.0, 0.3, 0.02, 1e-4], dtype=torch.float64)
    weights = torch.rand(40, generator=g, dtype=torch.float64)
    q, k = torch.randn(4, 2, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)
    mean = rotation_mean(inv_freq, weights)
    # A query at position m = 50 + Δ meets a key at n = 50: score Σ_pairs rot(q, m·θ)·rot(k, n·θ).
    target = torch.zeros((), dtype=torch.float64)
    for delta, w in enumerate(weights.tolist()):
        for i, theta in enumerate(inv_freq.tolist()):
            target = target + w * (_rot(q[i], (50 + delta) * theta) * _rot(k[i], 50 * theta)).sum()
    target = target / weights.sum()
    rows = q.reshape(8, 1)  # each pair's (a, b) as rows, laid out interleaved
    folded = fold_rotation(rows, PAIRS, _fold_of(mean)).reshape(4, 2)
    assert_close((folded * k).sum(), target, rtol=1e-10, atol=1e-12)
    # All weight at Δ = 0: the fold is the identity; a slow pair is nearly untouched, a fast one shrinks.
    assert_close(fold_rotation(rows, PAIRS, _fold_of(rotation_mean(inv_freq, torch.tensor([1.0])))), rows)
    assert mean[3, 0] > 0.99 and float(mean[0].norm()) < 0.2


def test_residual_fold_follows_the_source_pairs():
    """Rows that are a source pair (j, j + d_h/2) get the full mean rotation at θ_j; re-paired rows (rope_dims=last)
    keep only each row's own E[cos Δθ] at its source pair."""
    d_h, half = 16, 8
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    weights = torch.arange(32, 0, -1, dtype=torch.float64)
    mean = rotation_mean(inv_freq, weights)
    pairs = [(0, 1), (2, 3)]
    high = torch.tensor([0, 8, 1, 9])  # source pairs 0 and 1, interleaved
    assert_close(residual_fold(high, pairs, d_h, inv_freq, weights), _fold_of(mean[:2]))
    last = torch.tensor([12, 14, 13, 15])  # rows of source pairs 4, 6, 5, 7: no two of one pair
    fold = residual_fold(last, pairs, d_h, inv_freq, weights)
    assert_close(fold, torch.diag_embed(torch.stack([mean[[4, 5], 0], mean[[6, 7], 0]], -1)))


def test_fold_rotation_per_head():
    rows = torch.randn(3, D_R, D_IN, dtype=torch.float64)
    folds = torch.randn(3, D_R // 2, 2, 2, dtype=torch.float64)
    per_head = fold_rotation(rows, PAIRS, folds)
    for h, (a, b) in itertools.product(range(3), PAIRS):
        F = folds[h, a // 2]
        assert_close(per_head[h, a], F[0, 0] * rows[h, a] + F[0, 1] * rows[h, b])
        assert_close(per_head[h, b], F[1, 0] * rows[h, a] + F[1, 1] * rows[h, b])

"""`ecomla.mla.rope`: which head dims keep RoPE, their row layouts, and the stock frequencies.

Proves: the MHA2MLA pair strategies pick the documented pairs; the no-RoPE / RoPE rows
partition each head in the documented half-wise and interleaved orders; `fit_frequencies`
is exact for high (θ' = θ^(d_r/d_h)), low-with-linear-factor and uniform (θ' = θ), and
says so (max_log_error) when it is not; numerically, the fitted stock frequencies
θ'^(-2i/d_r)/factor equal the source's θ^(-2j/d_h) at the kept pairs; and the 2-norm
pair scores match a direct loop (with GQA) and are invariant under RoPE rotation.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ecomla.mla.rope import fit_frequencies, pair_norm_scores, rope_split, select_pairs

D_H, D_R = 64, 16  # 32 source pairs, 8 kept
HALF, KEEP = D_H // 2, D_R // 2
THETA = 10000.0


# ---------------------------------------------------------------- select_pairs


def test_select_pairs_high_low_uniform():
    assert select_pairs("high", D_H, D_R) == list(range(8))
    assert select_pairs("low", D_H, D_R) == list(range(24, 32))
    assert select_pairs("uniform", D_H, D_R) == [0, 4, 8, 12, 16, 20, 24, 28]
    # Degenerate ends: keeping every pair, and keeping one.
    assert select_pairs("uniform", D_H, D_H) == list(range(HALF))
    assert select_pairs("high", D_H, 2) == [0]
    assert select_pairs("low", D_H, 2) == [HALF - 1]
    assert select_pairs("uniform", D_H, 2) == [0]


def test_select_pairs_norm_takes_top_scores_sorted():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(HALF, generator=g)
    chosen = select_pairs("norm", D_H, D_R, scores)
    expected = sorted(torch.argsort(scores, descending=True)[:KEEP].tolist())
    assert chosen == expected
    assert len(chosen) == KEEP and chosen == sorted(chosen)
    # A hand-made score vector.
    s = torch.zeros(HALF)
    s[[3, 30, 7, 11, 19, 0, 25, 14]] = torch.arange(1.0, 9.0)
    assert select_pairs("norm", D_H, D_R, s) == [0, 3, 7, 11, 14, 19, 25, 30]


def test_select_pairs_errors():
    with pytest.raises(ValueError, match="divide"):
        select_pairs("uniform", D_H, 24)  # 12 does not divide 32
    with pytest.raises(ValueError, match="one score per frequency pair"):
        select_pairs("norm", D_H, D_R)
    with pytest.raises(ValueError, match="one score per frequency pair"):
        select_pairs("norm", D_H, D_R, torch.ones(HALF + 1))
    with pytest.raises(ValueError, match="does not select pairs"):
        select_pairs("last", D_H, D_R)


# ---------------------------------------------------------------- rope_split


def _all_splits():
    scores = torch.linspace(0.0, 1.0, HALF).flip(0) + torch.tensor([0.0, 5.0] * (HALF // 2))
    for strategy in ("high", "low", "uniform", "norm", "last"):
        for interleave in (False, True):
            yield strategy, interleave, rope_split(strategy, D_H, D_R, interleave=interleave, scores=scores)


@pytest.mark.parametrize(("strategy", "interleave", "split"), list(_all_splits()))
def test_rope_split_partitions_the_head(strategy, interleave, split):
    nope, rope = split.nope_rows.tolist(), split.rope_rows.tolist()
    assert len(rope) == D_R and len(nope) == D_H - D_R
    assert sorted(nope + rope) == list(range(D_H))
    assert nope == sorted(nope)
    assert split.nope_rows.dtype == split.rope_rows.dtype == torch.long


@pytest.mark.parametrize("strategy", ["high", "low", "uniform", "norm"])
def test_rope_split_layouts_of_pair_strategies(strategy):
    scores = torch.arange(HALF, dtype=torch.float64) % 7  # ties broken deterministically by topk
    pairs = select_pairs(strategy, D_H, D_R, scores)
    half_wise = rope_split(strategy, D_H, D_R, interleave=False, scores=scores)
    inter = rope_split(strategy, D_H, D_R, interleave=True, scores=scores)
    a, b = pairs, [j + HALF for j in pairs]
    assert half_wise.rope_rows.tolist() == a + b  # dims i and i + d_r/2 form output pair i
    assert inter.rope_rows.tolist() == [x for i in range(KEEP) for x in (a[i], b[i])]  # dims 2i, 2i+1
    assert half_wise.pairs == inter.pairs == tuple(pairs)
    assert torch.equal(half_wise.nope_rows, inter.nope_rows)
    assert sorted(half_wise.rope_rows.tolist()) == sorted(inter.rope_rows.tolist())


def test_rope_split_high_explicit_rows():
    s = rope_split("high", D_H, D_R, interleave=False)
    assert s.rope_rows.tolist() == list(range(8)) + list(range(32, 40))
    assert s.nope_rows.tolist() == list(range(8, 32)) + list(range(40, 64))
    s = rope_split("high", D_H, D_R, interleave=True)
    assert s.rope_rows.tolist() == [0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39]


def test_rope_split_last():
    s = rope_split("last", D_H, D_R, interleave=False)
    assert s.pairs is None
    assert s.rope_rows.tolist() == list(range(48, 56)) + list(range(56, 64))
    assert s.nope_rows.tolist() == list(range(48))
    s = rope_split("last", D_H, D_R, interleave=True)
    assert s.rope_rows.tolist() == [x for i in range(8) for x in (48 + i, 56 + i)]
    # With d_r = d_h the half-wise layout is the source head unchanged: [0..d/2-1] then [d/2..d-1].
    full = rope_split("last", D_H, D_H, interleave=False)
    assert full.rope_rows.tolist() == list(range(HALF)) + list(range(HALF, D_H))
    assert full.nope_rows.numel() == 0
    # ...and interleaved it pairs dim j with dim j + d/2, the source's own pairs.
    full_i = rope_split("last", D_H, D_H, interleave=True)
    assert full_i.rope_rows.tolist() == [x for j in range(HALF) for x in (j, j + HALF)]


# ---------------------------------------------------------------- fit_frequencies


@pytest.mark.parametrize("allow_linear", [False, True])
def test_fit_high_is_exact_with_scaled_theta(allow_linear):
    fit = fit_frequencies([select_pairs("high", D_H, D_R)] * 3, D_H, D_R, THETA, allow_linear=allow_linear)
    assert fit.theta == pytest.approx(THETA ** (D_R / D_H), rel=1e-12)  # 10000^(1/4) = 10
    assert fit.theta == pytest.approx(10.0, rel=1e-12)
    assert fit.linear_factor == pytest.approx(1.0, abs=1e-12)
    assert fit.max_log_error < 1e-12


def test_fit_low_with_linear_factor_is_exact():
    o = HALF - KEEP  # 24: the first kept pair
    fit = fit_frequencies([select_pairs("low", D_H, D_R)], D_H, D_R, THETA, allow_linear=True)
    assert fit.max_log_error < 1e-9
    assert fit.theta == pytest.approx(THETA ** (D_R / D_H), rel=1e-10)
    assert fit.linear_factor == pytest.approx(THETA ** (2 * o / D_H), rel=1e-10)  # 10000^(3/4) = 1000
    assert fit.linear_factor == pytest.approx(1000.0, rel=1e-10)


def test_fit_low_without_linear_factor_is_not_exact():
    fit = fit_frequencies([select_pairs("low", D_H, D_R)], D_H, D_R, THETA, allow_linear=False)
    assert fit.max_log_error > 0.1
    assert fit.linear_factor == 1.0


@pytest.mark.parametrize("allow_linear", [False, True])
def test_fit_uniform_keeps_theta(allow_linear):
    fit = fit_frequencies([select_pairs("uniform", D_H, D_R)], D_H, D_R, THETA, allow_linear=allow_linear)
    assert fit.theta == pytest.approx(THETA, rel=1e-10)
    assert fit.linear_factor == pytest.approx(1.0, abs=1e-10)
    assert fit.max_log_error < 1e-9


def test_fit_norm_like_pairs_are_not_exact():
    irregular = [0, 1, 2, 5, 9, 17, 20, 31]
    for allow_linear in (False, True):
        fit = fit_frequencies([irregular], D_H, D_R, THETA, allow_linear=allow_linear)
        assert fit.max_log_error > 0.1
    # Different layers choosing different (each exact) runs cannot share one stock RoPE.
    mixed = [select_pairs("high", D_H, D_R), select_pairs("low", D_H, D_R)]
    assert fit_frequencies(mixed, D_H, D_R, THETA, allow_linear=True).max_log_error > 0.1
    # A geometric run found by 'norm' that happens to be shifted is exact with a factor.
    shifted = list(range(5, 5 + KEEP))
    fit = fit_frequencies([shifted, shifted], D_H, D_R, THETA, allow_linear=True)
    assert fit.max_log_error < 1e-9
    assert fit.linear_factor == pytest.approx(THETA ** (2 * 5 / D_H), rel=1e-10)


def test_fit_single_pair():
    fit = fit_frequencies([[7]], D_H, 2, THETA, allow_linear=True)
    assert fit.theta == pytest.approx(THETA, rel=1e-12)  # exp(log θ), so round-off only
    assert fit.linear_factor == pytest.approx(THETA ** (14 / D_H), rel=1e-12)
    assert fit.max_log_error < 1e-12
    fit = fit_frequencies([[7]], D_H, 2, THETA, allow_linear=False)
    assert fit.linear_factor == 1.0
    assert fit.max_log_error == pytest.approx(14 / D_H * math.log(THETA), rel=1e-12)
    assert fit_frequencies([[0]], D_H, 2, THETA, allow_linear=False).max_log_error == 0.0


# ---------------------------------------------------------------- the RoPE claim, numerically


@pytest.mark.parametrize(
    ("strategy", "allow_linear", "d_h", "d_r", "theta"),
    [
        ("high", False, 64, 16, 10000.0),
        ("high", True, 64, 16, 10000.0),
        ("high", False, 128, 64, 500000.0),  # Llama-3 head and base
        ("high", False, 64, 32, 500000.0),  # Llama-3.2-1B with X-EcoMLA's d_r = 32
        ("low", True, 64, 16, 10000.0),
        ("low", True, 128, 32, 1000000.0),  # Qwen2-style base
        ("uniform", False, 64, 16, 10000.0),
        ("uniform", True, 128, 32, 500000.0),
    ],
)
def test_fitted_stock_frequencies_equal_source_frequencies(strategy, allow_linear, d_h, d_r, theta):
    half, keep = d_h // 2, d_r // 2
    j = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / d_h)  # source, pair j = dims (j, j + d_h/2)
    pairs = select_pairs(strategy, d_h, d_r)
    fit = fit_frequencies([pairs], d_h, d_r, theta, allow_linear=allow_linear)
    i = torch.arange(keep, dtype=torch.float64)
    stock = fit.theta ** (-2.0 * i / d_r) / fit.linear_factor  # DeepSeek-V3 RoPE on d_r dims
    assert_close(stock, inv_freq[pairs], rtol=1e-12, atol=0)


def test_rotated_scores_match_between_source_pairs_and_stock_rope():
    """The full statement: source q·k restricted to the kept rows, with source RoPE, equals the
    same rows laid out half-wise under stock RoPE with the fitted frequencies, at every offset."""
    g = torch.Generator().manual_seed(1)
    theta = 10000.0
    pairs = select_pairs("high", D_H, D_R)
    fit = fit_frequencies([pairs], D_H, D_R, theta, allow_linear=False)
    rows = rope_split("high", D_H, D_R, interleave=False).rope_rows
    src_freq = theta ** (-2.0 * torch.arange(HALF, dtype=torch.float64) / D_H)
    out_freq = fit.theta ** (-2.0 * torch.arange(KEEP, dtype=torch.float64) / D_R) / fit.linear_factor

    def rotate_half_wise(x: torch.Tensor, freq: torch.Tensor, pos: float) -> torch.Tensor:
        h = x.shape[-1] // 2
        ang = torch.cat([freq, freq]) * pos
        rot = torch.cat([-x[h:], x[:h]])
        return x * torch.cos(ang) + rot * torch.sin(ang)

    q = torch.randn(D_H, generator=g, dtype=torch.float64)
    k = torch.randn(D_H, generator=g, dtype=torch.float64)
    for m, n in [(0, 0), (5, 2), (1000, 17), (4095, 3)]:
        src = rotate_half_wise(q, src_freq, m)[rows] @ rotate_half_wise(k, src_freq, n)[rows]
        out = rotate_half_wise(q[rows], out_freq, m) @ rotate_half_wise(k[rows], out_freq, n)
        assert out == pytest.approx(float(src), rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------- pair_norm_scores


def test_pair_norm_scores_matches_loop_with_gqa():
    g = torch.Generator().manual_seed(2)
    N, n_h, n_kv, d_h = 5, 4, 2, 8
    half = d_h // 2
    q = torch.randn(N, n_h, d_h, generator=g)
    k = torch.randn(N, n_kv, d_h, generator=g)
    expected = torch.zeros(half, dtype=torch.float64)
    for j in range(half):
        total = 0.0
        for t in range(N):
            for h in range(n_h):
                kv = h // (n_h // n_kv)  # heads 0,1 -> KV head 0; heads 2,3 -> KV head 1
                qn = math.hypot(float(q[t, h, j]), float(q[t, h, j + half]))
                kn = math.hypot(float(k[t, kv, j]), float(k[t, kv, j + half]))
                total += qn * kn
        expected[j] = total / N
    got = pair_norm_scores(q, k)
    assert got.shape == (half,) and got.dtype == torch.float64
    assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_pair_norm_scores_ignore_rope_rotation():
    g = torch.Generator().manual_seed(3)
    N, n_h, n_kv, d_h = 6, 4, 2, 8
    half = d_h // 2
    q = torch.randn(N, n_h, d_h, generator=g, dtype=torch.float64)
    k = torch.randn(N, n_kv, d_h, generator=g, dtype=torch.float64)
    ang = torch.rand(N, 1, half, generator=g, dtype=torch.float64) * 6.3

    def rot(x):
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], dim=-1)

    assert_close(pair_norm_scores(rot(q), rot(k)), pair_norm_scores(q, k), rtol=1e-12, atol=1e-12)
    # And the score really depends on which KV head each query head uses.
    swapped = k.flip(1)
    assert not torch.allclose(pair_norm_scores(q, swapped), pair_norm_scores(q, k))

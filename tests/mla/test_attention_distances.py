"""Where source attention looks: the per-head mass at each relative distance (rope_residual_distances=attention)."""

from __future__ import annotations

import torch

from ecomla.mla.rope_key import attention_distances, causal_probs, received_attention, residual_fold, rotation_mean


def test_uniform_attention_spreads_each_query_evenly():
    N, T, d_h = 2, 8, 8
    q = torch.zeros(N, T, 2, d_h)
    k = torch.randn(N, T, 1, d_h)
    w = attention_distances(causal_probs(q, k, torch.ones(d_h // 2), 0.125))
    # query i gives 1/(i+1) to each distance 0..i; summed over i >= Δ and over N blocks
    expected = torch.tensor([N * sum(1 / (i + 1) for i in range(delta, T)) for delta in range(T)], dtype=torch.float64)
    assert w.shape == (2, T)
    torch.testing.assert_close(w[0], expected)
    torch.testing.assert_close(w[1], expected)
    torch.testing.assert_close(w.sum(1), torch.full((2,), float(N * T), dtype=torch.float64))


def test_a_head_that_reads_its_own_token_puts_all_mass_at_distance_zero():
    T, d_h = 6, 4
    q = torch.zeros(1, T, 1, d_h)
    k = torch.zeros(1, T, 1, d_h)
    q[..., 0] = 50.0
    k[0, :, 0, 0] = torch.linspace(-1, 1, T)  # a later key always scores higher; the diagonal is the latest allowed
    w = attention_distances(causal_probs(q, k, torch.zeros(d_h // 2), 1.0))  # zero frequencies: no rotation
    assert float(w[0, 0]) > 0.99 * T and float(w[0, 1:].sum()) < 0.01 * T


def test_received_attention_under_uniform_attention():
    N, T, d_h = 2, 8, 8
    q = torch.zeros(N, T, 3, d_h)
    k = torch.randn(N, T, 1, d_h)
    got = received_attention(causal_probs(q, k, torch.ones(d_h // 2), 0.125))
    # key j is read by queries i >= j, each giving it 1/(i+1)
    expected = torch.tensor([sum(1 / (i + 1) for i in range(j, T)) for j in range(T)], dtype=torch.float64)
    assert got.shape == (N, T)
    torch.testing.assert_close(got, expected.expand(N, T))
    torch.testing.assert_close(got.sum(1), torch.full((N,), float(T), dtype=torch.float64))


def test_a_sink_receives_what_its_heads_give_it():
    T, d_h = 6, 4
    q = torch.zeros(1, T, 2, d_h)
    k = torch.zeros(1, T, 1, d_h)
    q[0, :, 0, 0] = 50.0  # head 0 reads the first token only
    k[0, 0, 0, 0] = 1.0
    got = received_attention(causal_probs(q, k, torch.zeros(d_h // 2), 1.0))[0]
    # head 0 gives the first token all T queries' mass; head 1 spreads evenly (1/(i+1)); the mean of the two
    even = torch.tensor([sum(1 / (i + 1) for i in range(j, T)) for j in range(T)], dtype=torch.float64)
    expected = (even + torch.cat([torch.tensor([float(T)]), torch.zeros(T - 1)]).double()) / 2
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_fold_from_attention_weights_is_the_weighted_mean_rotation():
    inv_freq = torch.tensor([1.0, 0.1, 0.001])
    weights = torch.tensor([5.0, 1.0, 0.0, 2.0])
    mean = rotation_mean(inv_freq, weights)
    fold = residual_fold(torch.tensor([0, 3]), [(0, 1)], 6, inv_freq, weights)  # rows 0 and 3: source pair 0
    c, s = mean[0]
    torch.testing.assert_close(fold[0], torch.tensor([[c, -s], [s, c]], dtype=torch.float64))

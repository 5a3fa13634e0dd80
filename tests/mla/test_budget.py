"""`ecomla.mla.budget`: X-EcoMLA compression ratios from public config dicts alone,
the inverse (ratio -> uniform rank), and per-layer rank allocation by spectral energy.

Proves: the published Llama-3.2-1B ratios (6.4x / 10.67x / 12.8x / ~1.9x at d_r=32)
fall out of the formula Σ 2·n_kv·d_h / Σ (r_l + d_r); `allocate_ranks` spends the
budget exactly, in blocks, within bounds, and optimally for the energy it keeps.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ecomla.mla.budget import (
    AttentionShape,
    allocate_ranks,
    compression_ratio,
    energy_kept,
    format_ratio,
    mla_elements,
    rank_for_ratio,
)

# Llama-3.2-1B(-Instruct) config.json (attention fields).
LLAMA_32_1B = {
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}

# Llama-3.1-8B(-Instruct) config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads.
# Its config carries no "head_dim" key in older transformers exports, so d_h = 4096/32 = 128
# must be derived. Per token and layer the source caches 2·8·128 = 2048 numbers.
# With d_r = 64: r_kv = 512 -> 2048/576 = 3.5556x; r_kv = 192 -> 2048/256 = 8.0x.
LLAMA_31_8B = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}

# Llama-2-7B: 32 layers, hidden 4096, 32 heads, plain MHA (no num_key_value_heads key),
# so n_kv = 32 and 2·32·128 = 8192 numbers per token and layer.
LLAMA_2_7B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32}


# ---------------------------------------------------------------- shapes and ratios


def test_shape_from_llama_32_1b_config():
    s = AttentionShape.from_config(LLAMA_32_1B)
    assert s == AttentionShape(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64)
    assert s.kv_elements == 1024
    assert mla_elements(128, 32) == 160


def test_shape_derives_head_dim_and_kv_heads_when_missing():
    s8 = AttentionShape.from_config(LLAMA_31_8B)
    assert (s8.head_dim, s8.num_kv_heads, s8.kv_elements) == (128, 8, 2048)
    s2 = AttentionShape.from_config(LLAMA_2_7B)
    assert (s2.head_dim, s2.num_kv_heads, s2.kv_elements) == (128, 32, 8192)
    # An explicit null (as some configs write) falls back the same way.
    s_null = AttentionShape.from_config({**LLAMA_2_7B, "num_key_value_heads": None, "head_dim": None})
    assert s_null == s2


@pytest.mark.parametrize(
    ("rank", "expected", "label"),
    [
        (128, 6.4, "6.4x"),
        (64, 32 / 3, "10.67x"),  # the paper writes 10.6x
        (48, 12.8, "12.8x"),
        (512, 1024 / 544, "1.88x"),  # 1.882...; the paper rounds to 1.9x
    ],
)
def test_llama_32_1b_published_ratios(rank, expected, label):
    s = AttentionShape.from_config(LLAMA_32_1B)
    ratio = compression_ratio(s, rank, rope_dim=32)
    assert ratio == pytest.approx(expected, rel=1e-12)
    assert format_ratio(ratio) == label


def test_llama_32_1b_r512_is_about_1_9x():
    ratio = compression_ratio(AttentionShape.from_config(LLAMA_32_1B), 512, rope_dim=32)
    assert 1.85 < ratio < 1.95
    assert round(ratio, 1) == 1.9


@pytest.mark.parametrize(("target", "rank"), [(6.4, 128), (10.67, 64), (10.6, 65), (12.8, 48), (1.9, 507)])
def test_rank_for_ratio_llama_32_1b(target, rank):
    # 10.6 (the paper's rounding) gives 1024/10.6 - 32 = 64.6 -> 65; 1.9 -> 506.9 -> 507.
    s = AttentionShape.from_config(LLAMA_32_1B)
    assert rank_for_ratio(s, target, rope_dim=32) == rank


def test_llama_31_8b_ratios_round_trip():
    s = AttentionShape.from_config(LLAMA_31_8B)
    assert compression_ratio(s, 512, rope_dim=64) == pytest.approx(2048 / 576)
    assert compression_ratio(s, 192, rope_dim=64) == pytest.approx(8.0)
    assert rank_for_ratio(s, 8.0, rope_dim=64) == 192
    for r in (64, 128, 256, 448, 512):
        assert rank_for_ratio(s, compression_ratio(s, r, rope_dim=64), rope_dim=64) == r


def test_per_layer_ranks_use_the_sum_formula():
    s = AttentionShape.from_config(LLAMA_32_1B)
    ranks = [64] * 8 + [128] * 8
    # 16·1024 / (8·96 + 8·160) = 16384 / 2048
    assert compression_ratio(s, ranks, rope_dim=32) == pytest.approx(8.0)
    mixed = list(range(40, 40 + 16 * 8, 8))
    expected = 16 * 1024 / sum(r + 32 for r in mixed)
    assert compression_ratio(s, mixed, rope_dim=32) == pytest.approx(expected)
    # A list of equal ranks (and a tuple) agree with the scalar form.
    assert compression_ratio(s, [64] * 16, rope_dim=32) == compression_ratio(s, 64, rope_dim=32)
    assert compression_ratio(s, tuple([64] * 16), rope_dim=32) == compression_ratio(s, 64, rope_dim=32)


@pytest.mark.parametrize("n", [0, 15, 17])
def test_per_layer_ranks_wrong_length_raises(n):
    s = AttentionShape.from_config(LLAMA_32_1B)
    with pytest.raises(ValueError, match="16 layers"):
        compression_ratio(s, [64] * n, rope_dim=32)


def test_rank_for_ratio_no_room_raises_clearly():
    s = AttentionShape.from_config(LLAMA_32_1B)
    # The RoPE key alone takes 32 of 1024 numbers: at most 1024/33 = 31.03x.
    with pytest.raises(ValueError, match="leaves no room") as info:
        rank_for_ratio(s, 40.0, rope_dim=32)
    assert "31.03x" in str(info.value)
    with pytest.raises(ValueError, match="no room"):
        rank_for_ratio(s, 1024 / 32, rope_dim=32)  # rank 0
    assert rank_for_ratio(s, 1024 / 33, rope_dim=32) == 1  # the limit itself still fits
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="positive"):
            rank_for_ratio(s, bad, rope_dim=32)


# ---------------------------------------------------------------- allocate_ranks


def _flat(n: int) -> torch.Tensor:
    return torch.ones(n)


def _concentrated(n: int) -> torch.Tensor:
    s = torch.full((n,), 1e-4)
    s[0] = 100.0
    return s


def _decay(n: int, rate: float) -> torch.Tensor:
    return torch.exp(-rate * torch.arange(n, dtype=torch.float64))


@pytest.mark.parametrize("total", [16, 24, 29, 64, 101, 200])
def test_allocate_sum_exact_and_block_multiples(total):
    spectra = [_decay(64, 0.02), _decay(64, 0.1), _flat(64), _concentrated(64)]
    ranks = allocate_ranks(spectra, total, multiple=8, min_rank=4)
    assert sum(ranks) == total
    assert all(4 <= r <= 64 for r in ranks)
    # Every layer starts at min_rank and grows in blocks of 8; at most one block is partial,
    # apart from a layer that stops at its cap (64 - 4 is not a multiple of 8).
    partial = [r for r in ranks if (r - 4) % 8 and r != 64]
    assert len(partial) <= 1


def test_allocate_multiples_with_default_min_rank():
    spectra = [_decay(128, 0.05), _decay(128, 0.01), _decay(128, 0.2)]
    ranks = allocate_ranks(spectra, 8 * 3 + 8 * 17 + 5)  # defaults: multiple=8, min_rank=8
    assert sum(ranks) == 8 * 20 + 5
    assert sum(r % 8 != 0 for r in ranks) == 1


def test_concentrated_layer_gets_less_than_flat_layer():
    spectra = [_concentrated(64), _flat(64)]
    ranks = allocate_ranks(spectra, 64, multiple=8, min_rank=8)
    assert ranks == [8, 56]
    # Slower decay (flatter) earns more width than faster decay.
    ranks = allocate_ranks([_decay(64, 0.3), _decay(64, 0.01)], 64)
    assert ranks[0] < ranks[1]


def test_allocation_ignores_overall_scale_of_each_layer():
    # Shares, not absolute energies: scaling a layer's spectrum does not change its rank.
    a, b = _decay(64, 0.1), _decay(64, 0.03)
    assert allocate_ranks([a, b], 72) == allocate_ranks([a * 1e6, b * 1e-6], 72)


def test_allocation_maximizes_kept_energy_over_block_allocations():
    # Greedy water-filling on non-increasing shares is optimal: compare with brute force.
    g = torch.Generator().manual_seed(3)
    spectra = [torch.rand(40, generator=g, dtype=torch.float64).sort(descending=True).values ** p for p in (1, 4, 12)]
    total = 8 * 9

    def score(ranks):
        return sum(energy_kept(s, r) for s, r in zip(spectra, ranks))

    best = max(
        score(c)
        for c in itertools.product(range(8, 41, 8), repeat=3)
        if sum(c) == total
    )
    got = allocate_ranks(spectra, total)
    assert sum(got) == total
    assert score(got) == pytest.approx(best, abs=1e-12)


def test_allocate_respects_min_and_max_rank():
    spectra = [_concentrated(64), _flat(64), _flat(64)]
    ranks = allocate_ranks(spectra, 96, multiple=8, min_rank=16)
    assert min(ranks) >= 16 and sum(ranks) == 96
    assert ranks[0] == 16  # the concentrated layer stays at the floor
    ranks = allocate_ranks(spectra, 96, multiple=8, min_rank=8, max_rank=40)
    assert max(ranks) <= 40 and sum(ranks) == 96
    assert ranks[1] == ranks[2] == 40 and ranks[0] == 16
    # max_rank may exceed a short spectrum (the hidden size is the real cap).
    ranks = allocate_ranks([_flat(8), _flat(8)], 48, multiple=8, min_rank=8, max_rank=32)
    assert sum(ranks) == 48 and max(ranks) <= 32


def test_allocate_impossible_budgets_raise():
    spectra = [_flat(32), _flat(32)]
    with pytest.raises(ValueError, match="cannot give every one of 2 layers 8 dims"):
        allocate_ranks(spectra, 15, min_rank=8)
    with pytest.raises(ValueError, match="exceeds"):
        allocate_ranks(spectra, 65)
    with pytest.raises(ValueError, match="exceeds"):
        allocate_ranks(spectra, 41, max_rank=20)
    with pytest.raises(ValueError, match="no layers"):
        allocate_ranks([], 8)
    assert allocate_ranks(spectra, 64) == [32, 32]  # the exact cap still fits
    assert allocate_ranks(spectra, 16) == [8, 8]  # the exact floor still fits


def test_allocate_handles_zero_spectrum():
    ranks = allocate_ranks([torch.zeros(32), _flat(32)], 40)
    assert ranks == [8, 32]


# ---------------------------------------------------------------- energy_kept, format_ratio


def test_energy_kept_values():
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert energy_kept(s, 0) == 0.0
    assert energy_kept(s, 1) == pytest.approx(0.4)
    assert energy_kept(s, 2) == pytest.approx(0.7)
    assert energy_kept(s, 4) == pytest.approx(1.0)
    assert energy_kept(s, 10) == pytest.approx(1.0)
    assert energy_kept(torch.zeros(5), 2) == 1.0
    assert energy_kept(torch.tensor([]), 3) == 1.0
    assert energy_kept(torch.tensor([3.0, 1.0, -1.0]), 1) == pytest.approx(0.75)  # negatives clamp to 0


@pytest.mark.parametrize(
    ("ratio", "text"),
    [(10.666, "10.67x"), (32 / 3, "10.67x"), (6.4, "6.4x"), (12.8, "12.8x"), (2.0, "2x"), (1.0049, "1x"), (3.555, "3.56x")],
)
def test_format_ratio(ratio, text):
    assert format_ratio(ratio) == text

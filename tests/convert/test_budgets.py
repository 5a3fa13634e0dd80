"""Rank budgets end to end: target_compression, energy allocation, and the report's ratios."""

from __future__ import annotations

from tests.convert.helpers import convert, load, make_layer0_low_rank


def test_target_compression_derives_rank(source_factory, tmp_path):
    # 2 KV heads x 16 dims x 2 = 64 numbers per token and layer; d_r = 8 -> ratio 64 / (r + 8); 4x -> r = 8
    src = source_factory("llama", num_key_value_heads=2)
    rep = convert(src, tmp_path / "out", mla={"target_compression": 4.0, "qk_rope_head_dim": 8})
    assert rep["kv_lora_rank"] == 8
    assert rep["compression_ratio"] == 4.0
    assert rep["kv_elements_per_token_per_layer"] == {"before": 64, "after": [16, 16]}
    assert load(tmp_path / "out").config.kv_lora_rank == 8


def test_energy_allocation_keeps_budget_and_reports_both_ratios(source_factory, tmp_path):
    src = source_factory("llama", num_hidden_layers=4, num_key_value_heads=4)
    make_layer0_low_rank(src)
    rep = convert(src, tmp_path / "out", mla={"kv_lora_rank": 24, "qk_rope_head_dim": 8, "rank_allocation": "energy"})
    ranks = [layer["kv_lora_rank"] for layer in rep["layers"]]
    assert sum(ranks) == 4 * 24
    assert ranks[0] == min(ranks) and ranks[0] < 24
    assert all(r % 8 == 0 for r in ranks)
    width = max(ranks)
    assert rep["kv_lora_rank"] == width
    # X-EcoMLA's formula over the per-layer ranks, and the stock cache's (padded) ratio
    assert abs(rep["compression_ratio"] - 4 * 128 / sum(r + 8 for r in ranks)) < 1e-12
    assert abs(rep["stock_cache_compression_ratio"] - 128 / (width + 8)) < 1e-12
    model = load(tmp_path / "out")
    assert model.config.kv_lora_rank == width
    # narrow layers are zero-padded: their extra latent rows carry nothing
    kv_a = model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert kv_a[ranks[0] : width].abs().max() == 0

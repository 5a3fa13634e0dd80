"""LrkvConfig: Llama-style RoPE storage, a rank check that names the flag, and the cache-size formula."""

from __future__ import annotations

import pytest

from ecomla.lrkv import LrkvConfig, lrkv_kv_elements
from tests.lrkv.helpers import TINY_LRKV


def test_rope_is_stored_like_llama():
    cfg = LrkvConfig(**TINY_LRKV, rope_theta=500000.0)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    scaled = LrkvConfig(**TINY_LRKV, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert scaled.rope_parameters["factor"] == 2.0


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = LrkvConfig(**{**TINY_LRKV, "head_dim": None})
    assert cfg.head_dim == TINY_LRKV["hidden_size"] // TINY_LRKV["num_attention_heads"]


@pytest.mark.parametrize("rank", [0, 17])
def test_rank_out_of_range_names_the_flag(rank):
    with pytest.raises(Exception, match=f"lrkv_rank={rank}"):
        LrkvConfig(**{**TINY_LRKV, "lrkv_rank": rank})


def test_kv_elements_formula():
    cfg = LrkvConfig(**TINY_LRKV)  # L=2, d_h=16, n_h=4, r=4
    assert lrkv_kv_elements(cfg) == 2 * 2 * (16 + 4 * 4)
